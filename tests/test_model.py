"""The model on stacked parameters (a leading run axis) is R independent models, each computed alone."""
import pytest
import torch
from torch.func import functional_call, stack_module_state

from iclnoise.core.model import ModelConfig, build_model, mse_loss

pytestmark = [pytest.mark.unit, pytest.mark.numerics]


@pytest.mark.parametrize("layer_norm", [True, False])
def test_stacked_runs_equal_each_model_alone(layer_norm):
    cfg = ModelConfig(D=3, K=5, d_model=16, n_layers=2, n_heads=2, d_mlp=24, layer_norm=layer_norm)
    # float64: stacked (bmm) and alone (F.linear) are different kernels, whose float32 round-off depends on the CPU
    models = [build_model(cfg, s).double() for s in range(3)]
    params, _ = stack_module_state(models)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    buffers = dict(models[0].named_buffers())
    xs, ys = torch.randn(3, 7, cfg.K, cfg.D, dtype=torch.float64), torch.randn(3, 7, cfg.K, dtype=torch.float64)

    def stacked(a, b):
        return functional_call(models[0], (params, buffers), (a, b))

    out = stacked(xs, ys)
    assert out.shape == (3, 7, cfg.K)
    # values and gradients O(1), each from ≲ 1e3 roundings: ≲ 1e3·ε64 ≈ 2e-13; another run's parameters are O(1) off
    for r, m in enumerate(models):
        torch.testing.assert_close(out[r], m(xs[r], ys[r]), rtol=1e-12, atol=1e-12)
    losses = mse_loss(stacked, xs, ys)
    alone = [mse_loss(m, xs[r], ys[r]) for r, m in enumerate(models)]
    torch.testing.assert_close(losses, torch.stack(alone).detach(), rtol=1e-12, atol=1e-12)
    # gradients: run r's loss moves only run r's slice, and equals the model's own gradient
    grads = torch.autograd.grad(losses.sum(), list(params.values()))
    for r, m in enumerate(models):
        own = torch.autograd.grad(alone[r], list(m.parameters()))
        for g, o in zip(grads, own):
            torch.testing.assert_close(g[r], o, rtol=1e-12, atol=1e-12)   # b_K's are round-off about 0: atol


def test_a_different_input_for_one_run_changes_only_that_run():
    cfg = ModelConfig(D=2, K=4, d_model=8, n_layers=1, n_heads=2, d_mlp=8)
    models = [build_model(cfg, s) for s in range(4)]
    params, _ = stack_module_state(models)
    buffers = dict(models[0].named_buffers())
    xs, ys = torch.randn(4, 3, cfg.K, cfg.D), torch.randn(4, 3, cfg.K)
    a = functional_call(models[0], (params, buffers), (xs, ys))
    xs2 = xs.clone()
    xs2[2] += 1.0
    b = functional_call(models[0], (params, buffers), (xs2, ys))
    changed = (a - b).abs().flatten(1).amax(1) > 0   # same code path, same machine: bitwise for untouched runs
    assert changed.tolist() == [False, False, True, False]


# ---------------------------------------------------------------- arch: dtransformer (Hoogland et al., issue 29)
HOOGLAND = dict(D=4, K=16, d_model=64, n_layers=2, n_heads=4, d_mlp=64, arch="dtransformer")


def test_dtransformer_has_their_parameter_count():
    # counted from their dtransformer.py (L2H4, include_output): token embedding 5·64, positional 32·64,
    # per layer QKV 64·192 + output 64·64 + MLP 2·(64·64 + 64) + 2 LayerNorms 2·128, final LN 128 + readout 64·5 + 5
    m = build_model(ModelConfig(**HOOGLAND), 0)
    assert sum(p.numel() for p in m.parameters()) == 52_741
    # their released runs (configs/hoogland.yaml) have K = 8: the positional map is 16·64, 1024 fewer
    assert sum(p.numel() for p in build_model(ModelConfig(**{**HOOGLAND, "K": 8}), 0).parameters()) == 51_717
    assert sum(p.numel() for p in build_model(ModelConfig(**{**HOOGLAND, "arch": "default"}), 0).parameters()) != 52_741


def their_forward(w: dict, xs: torch.Tensor, ys: torch.Tensor, H: int) -> torch.Tensor:
    """Their network from their equations, written out plainly: weights in their layout (nn.Linear (out, in)).

    tokens t_2k = (0, x_k), t_2k+1 = (y_k, 0); h = t E + P[:T]; per layer h ← h + (h + a + m) with
    a = O·concat_h softmax(q kᵀ/√c + causal) v of LN(h) (q, k, v interleaved per head in one (3C, C) map),
    m = W2 relu(W1 LN(h + a) + b1) + b2; output LN(h) U + u, y_k read from component 0 at t_2k."""
    B, K, D = xs.shape
    toks = torch.cat([torch.zeros_like(ys[..., None]), xs, ys[..., None], torch.zeros_like(xs)], -1)
    toks = toks.reshape(B, 2 * K, D + 1)
    T = 2 * K
    h = toks @ w["tok"].T + w["pos"].T[:T]
    C = h.shape[-1]
    c = C // H
    causal = torch.full((T, T), float("-inf"), dtype=h.dtype).triu(1)
    for layer in w["layers"]:
        ln = torch.nn.functional.layer_norm
        x = ln(h, (C,), layer["ln0_w"], layer["ln0_b"])
        q, k, v = (x @ layer["qkv"].T).view(B, T, H, 3 * c).transpose(1, 2).split(c, -1)
        p = torch.softmax(q @ k.transpose(-1, -2) / c ** 0.5 + causal, -1)
        a = (p @ v).transpose(1, 2).reshape(B, T, C) @ layer["out"].T
        y = h + a
        y = y + torch.relu(ln(y, (C,), layer["ln1_w"], layer["ln1_b"]) @ layer["w1"].T + layer["b1"]) @ layer["w2"].T \
            + layer["b2"]
        h = h + y
    out = torch.nn.functional.layer_norm(h, (C,), w["lnf_w"], w["lnf_b"]) @ w["unembed"].T + w["unembed_b"]
    return out[:, 0::2, 0]


def to_their_layout(m) -> dict:
    """Our dtransformer's weights rearranged into their modules' layout (a bijection of the same numbers)."""
    C = m.cfg.d_model
    layers = []
    for b in m.blocks:
        a = b.attn
        # their (3C, C) map's row h·3c + j·c + e is head h's q (j 0), k (1), v (2) coordinate e
        qkv = torch.stack([a.W_Q, a.W_K, a.W_V], 1)           # (H, 3, C, c)
        qkv = qkv.permute(0, 1, 3, 2).reshape(3 * C, C)        # rows (h, j, e), columns C
        layers.append({"ln0_w": b.ln1.weight, "ln0_b": b.ln1.bias, "qkv": qkv,
                       "out": a.W_O.reshape(C, C).T,           # their out (C_out, H·c): column h·c + e
                       "ln1_w": b.ln2.weight, "ln1_b": b.ln2.bias,
                       "w1": b.mlp.fc_in.weight, "b1": b.mlp.fc_in.bias,
                       "w2": b.mlp.fc_out.weight, "b2": b.mlp.fc_out.bias})
    return {"tok": m.embed.weight, "pos": m.pos_embed.T, "layers": layers, "lnf_w": m.ln_final.weight,
            "lnf_b": m.ln_final.bias, "unembed": m.unembed.weight, "unembed_b": m.unembed.bias}


def test_dtransformer_forward_equals_their_equations():
    torch.manual_seed(0)
    m = build_model(ModelConfig(**HOOGLAND), 3).double()
    with torch.no_grad():  # LayerNorm and biases away from their init, so every term is exercised
        for name, p in m.named_parameters():
            if name.endswith(("weight", "bias")) and "ln" in name or name.endswith(("fc_in.bias", "fc_out.bias")):
                p.add_(0.3 * torch.randn_like(p))
    xs, ys = torch.randn(5, 16, 4, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    with torch.no_grad():
        theirs = their_forward(to_their_layout(m), xs, ys, H=4)
        ours = m(xs, ys)
    # float64, the same operations in another order: ≲ 1e3 roundings of O(10) values
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert ours.std() > 0.1   # not a degenerate output that any two networks share


def test_dtransformer_stacked_runs_equal_each_model_alone():
    cfg = ModelConfig(D=3, K=5, d_model=16, n_layers=2, n_heads=2, d_mlp=24, arch="dtransformer")
    models = [build_model(cfg, s).double() for s in range(3)]
    params, _ = stack_module_state(models)
    buffers = dict(models[0].named_buffers())
    xs, ys = torch.randn(3, 7, cfg.K, cfg.D, dtype=torch.float64), torch.randn(3, 7, cfg.K, dtype=torch.float64)
    out = functional_call(models[0], (params, buffers), (xs, ys))
    for r, m in enumerate(models):
        torch.testing.assert_close(out[r], m(xs[r], ys[r]), rtol=1e-12, atol=1e-12)


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="model.arch"):
        ModelConfig(arch="gpt")
