"""Decoder-only transformer for in-context regression, built on transformer_lens (method §4).

TransformerLens 4.x dropped `HookedTransformer`; its `TransformerBridge` wraps token-vocabulary
language models, while this task feeds real-valued (x, y) tokens. The library's supported path
for custom models is `HookedRootModule` + `HookPoint`, used here: every activation a probe needs
has a hook point (`run_with_hooks`, `run_with_cache` work as usual) and an unhooked HookPoint is
an identity module, so training pays almost nothing for them (measured in bench/).

Inputs are interleaved tokens x_1, y_1, ..., x_K, y_K in R^(D+1): x-tokens carry (x_k, 0),
y-tokens (0, y_k). A linear map embeds them, learned positional embeddings are added, pre-LN
blocks follow, and the prediction for y_k is a linear readout at the x_k position.

`arch: dtransformer` builds instead the network of Raventós et al. and Hoogland et al. (their
`DTransformer`, timaeus-research/icl), parameter for parameter (52 741 at D 4, K 16, d 64, 2 layers,
4 heads, MLP 64): tokens x (0, x_k) and y (y_k, 0); embedding, positional map and Q, K, V, O without
biases; ReLU MLP; each block's output added to the stream it already added its input to
(h ← h + block(h), block(h) = h + attn + mlp); readout Linear(d → D+1) with bias, y_k read from
component 0 at the x_k position; every weight initialised as PyTorch initialises their layers
(U(±1/√fan_in); the positional map is their Linear(2K → d), fan_in 2K).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

ARCHS = ("default", "dtransformer")


@dataclass(frozen=True)
class ModelConfig:
    D: int = 4
    K: int = 8
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_mlp: int = 64
    layer_norm: bool = True
    attn_init: str = "fan_in"   # attention weights ~ N(0, 1/d_model), or "gpt2": N(0, 0.02²) (default arch)
    arch: str = "default"       # "default", or "dtransformer": Raventós/Hoogland's network (module docstring)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch = {self.arch!r}; allowed: {', '.join(ARCHS)}")

    @property
    def theirs(self) -> bool:
        return self.arch == "dtransformer"

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


def per_run(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Parameter v viewed to broadcast against activations x (b, n, d) of one model, or, stacked, v (R, ...)
    against x (R, b, n, d): run r's slice meets run r's activations."""
    return v if x.dim() == 3 else v.reshape(v.shape[0], *[1] * (x.dim() - v.dim()), *v.shape[1:])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) that also runs R stacked copies: weight (R, out, in) on
    x (R, ..., in) is one batched matmul per step instead of a vmap over R calls."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 2:
            return F.linear(x, self.weight, self.bias)
        R, o, i = self.weight.shape
        x2, w = x.reshape(R, -1, i), self.weight
        if R == 1 and o == 1:   # one run's one-column bmm takes the gemv kernel, which rounds otherwise: run it as
            x2, w = x2.expand(2, -1, -1), w.expand(2, -1, -1)   # two, so a run has the same bits alone as in ensembles
        y = torch.bmm(x2, w.transpose(1, 2))[:R].view(*x.shape[:-1], o)
        return y if self.bias is None else y + per_run(self.bias, y)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that also runs R stacked copies (weight and bias (R, d))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 1:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        return torch.addcmul(per_run(self.bias, y), y, per_run(self.weight, y))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, dh, d = cfg.n_heads, cfg.d_head, cfg.d_model
        self.W_Q = nn.Parameter(torch.empty(h, d, dh))
        self.W_K = nn.Parameter(torch.empty(h, d, dh))
        self.W_V = nn.Parameter(torch.empty(h, d, dh))
        self.W_O = nn.Parameter(torch.empty(h, dh, d))
        self.bias = not cfg.theirs
        if self.bias:
            self.b_Q = nn.Parameter(torch.zeros(h, dh))
            self.b_K = nn.Parameter(torch.zeros(h, dh))
            self.b_V = nn.Parameter(torch.zeros(h, dh))
            self.b_O = nn.Parameter(torch.zeros(d))
        n = 2 * cfg.K
        self.register_buffer("mask", torch.triu(torch.ones(n, n, dtype=torch.bool), 1), persistent=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern = HookPoint(), HookPoint()
        self.hook_z = HookPoint()  # (batch, pos, head, d_head): zero it to ablate a head
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One (d, 3·h·d_head) matmul for q, k, v and batched matmuls for the pattern: the same maths as
        # einsum("bpd,hde->bphe") per head, 2-4x faster on small CPU tensors (bench/). x is (*L, b, n, d)
        # with L = () for one model or (R,) for R stacked runs (parameters with a leading run axis).
        *lead, b, n, d = x.shape
        h, e = self.W_Q.shape[-3], self.W_Q.shape[-1]
        W = torch.cat([w.transpose(-3, -2).reshape(*lead, d, h * e) for w in (self.W_Q, self.W_K, self.W_V)], -1)
        qkv = torch.matmul(x.reshape(*lead, b * n, d), W)
        if self.bias:
            qkv = qkv + torch.cat([c.reshape(*lead, 1, h * e) for c in (self.b_Q, self.b_K, self.b_V)], -1)
        q, k, v = qkv.view(*lead, b, n, 3, h, e).unbind(-3)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        scores = torch.matmul(q.transpose(-3, -2), k.transpose(-3, -2).transpose(-1, -2)) * self.scale
        scores = self.hook_attn_scores(scores.masked_fill(self.mask[:n, :n], float("-inf")))
        pattern = self.hook_pattern(F.softmax(scores, dim=-1))
        z = self.hook_z(torch.matmul(pattern, v.transpose(-3, -2)).transpose(-3, -2))
        out = torch.matmul(z.reshape(*lead, b * n, h * e), self.W_O.reshape(*lead, h * e, d)).view(*lead, b, n, d)
        return out + per_run(self.b_O, x) if self.bias else out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc_in = Linear(cfg.d_model, cfg.d_mlp)
        self.fc_out = Linear(cfg.d_mlp, cfg.d_model)
        self.hook_post = HookPoint()
        self.act = F.relu if cfg.theirs else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.hook_post(self.act(self.fc_in(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = (lambda: LayerNorm(cfg.d_model)) if cfg.layer_norm else nn.Identity
        self.ln1, self.ln2 = norm(), norm()
        self.attn, self.mlp = Attention(cfg), MLP(cfg)
        self.hook_resid_pre, self.hook_attn_out = HookPoint(), HookPoint()
        self.hook_resid_mid, self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.attn(self.ln1(x))))
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))


def encode(xs: torch.Tensor, ys: torch.Tensor, y_first: bool = False) -> torch.Tensor:
    """(*L, B, K, D), (*L, B, K) → interleaved tokens (*L, B, 2K, D+1): x-token (x_k, 0), y-token (0, y_k);
    with `y_first` (the dtransformer layout) x-token (0, x_k), y-token (y_k, 0).

    Written without in-place writes so that it works under torch.func transforms."""
    *lead, K, D = xs.shape
    zero, y = xs.new_zeros(*lead, K, 1), ys.unsqueeze(-1)
    x_tok = torch.cat([zero, xs] if y_first else [xs, zero], -1)
    y_tok = torch.cat([y, torch.zeros_like(xs)] if y_first else [torch.zeros_like(xs), y], -1)
    return torch.stack([x_tok, y_tok], -2).reshape(*lead, 2 * K, D + 1)


class ICLTransformer(HookedRootModule):
    """f(xs, ys) → predictions (B, K); prediction k is read at the x_k token (causal).

    Stacked runs: called (`torch.func.functional_call`) with every parameter given a leading run axis R and
    xs (R, B, K, D), ys (R, B, K), it returns (R, B, K), run r computed with run r's parameters alone."""

    stacks_runs = True  # callers (training, LLC chains) batch R parameter sets this way instead of a vmap

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Linear(cfg.D + 1, cfg.d_model, bias=not cfg.theirs)
        self.pos_embed = nn.Parameter(torch.empty(2 * cfg.K, cfg.d_model))
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg.d_model) if cfg.layer_norm else nn.Identity()
        # theirs predicts a whole next token (D+1 outputs, bias) and reads y from component 0
        self.unembed = Linear(cfg.d_model, cfg.D + 1, bias=True) if cfg.theirs else Linear(cfg.d_model, 1, bias=False)
        self.hook_embed, self.hook_resid_final = HookPoint(), HookPoint()
        self._init_weights()
        self.setup()

    def _init_weights(self) -> None:
        attn = [p for name, p in self.named_parameters() if name.endswith(("W_Q", "W_K", "W_V", "W_O"))]
        if self.cfg.theirs:  # PyTorch's nn.Linear init of their Linear(d, 3d), Linear(d, d), Linear(2K, d)
            for p in attn:
                nn.init.uniform_(p, -self.cfg.d_model ** -0.5, self.cfg.d_model ** -0.5)
            nn.init.uniform_(self.pos_embed, -(2 * self.cfg.K) ** -0.5, (2 * self.cfg.K) ** -0.5)
            return
        std = 0.02 if self.cfg.attn_init == "gpt2" else self.cfg.d_model ** -0.5
        for p in attn:
            nn.init.normal_(p, std=std)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        n = 2 * xs.shape[-2]
        x = encode(xs, ys, y_first=self.cfg.theirs)
        h = self.hook_embed(self.embed(x) + per_run(self.pos_embed[..., :n, :], x))
        for block in self.blocks:
            h = h + block(h) if self.cfg.theirs else block(h)
        h = self.hook_resid_final(self.ln_final(h))
        return self.unembed(h[..., 0::2, :])[..., 0]


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> ICLTransformer:
    """Deterministic initialisation from `seed` (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ICLTransformer(cfg)
    return model.to(device)


LossFn = Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]   # (model, xs, ys) → loss, as mse_loss


def mse_loss(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The training objective: mean over sequences and tokens of (f − y)², divided by D; one per run for
    stacked runs (xs (R, B, K, D) → (R,))."""
    return (model(xs, ys) - ys).square().flatten(-2).mean(-1) / xs.shape[-1]
