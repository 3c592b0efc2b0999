"""Mechanistic probes with transformer_lens hooks (SPEC §10), per checkpoint.

- attention: mean attention mass from prediction (x_k) positions to earlier y-tokens, earlier
  x-tokens and itself, per layer and head (from `blocks.{l}.attn.hook_pattern`);
- ablation: change in OOD loss and ICL score when one head's output `hook_z` is zeroed;
- layer-norm collapse: fraction of LayerNorm weights with |w| < threshold, per norm;
- linear probes: ridge regression (closed form, 50/50 held-out split) reading the task vector t
  and the ridge estimate t̂ from the residual stream after each block at each token; R².
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from .io import KEY_FIELDS, read_json, read_parquet, write_parquet
from .predictors import icl_score, token_losses

MECH_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("probe", pa.string()), pa.field("layer", pa.int64()),
    pa.field("head", pa.int64()), pa.field("position", pa.int64()), pa.field("value", pa.float64()),
])


@torch.no_grad()
def attention_masses(model, xs: torch.Tensor, ys: torch.Tensor) -> dict[tuple[int, int], dict[str, float]]:
    """Per (layer, head): mean mass from x-token queries k ≥ 2 to earlier y-tokens, earlier x-tokens, self."""
    _, cache = model.run_with_cache(xs, ys, names_filter=lambda n: n.endswith("hook_pattern"))
    out = {}
    for layer in range(model.cfg.n_layers):
        pat = cache[f"blocks.{layer}.attn.hook_pattern"]          # (batch, head, q, k)
        n = pat.shape[-1]
        q = torch.arange(2, n, 2)                                   # x_2, x_3, ... (x_1 sees only itself)
        keys = torch.arange(n)
        earlier = keys[None, :] < q[:, None]
        is_y = (keys % 2 == 1)[None, :]
        p = pat[:, :, q, :]
        for h in range(pat.shape[1]):
            ph = p[:, h]
            out[(layer, h)] = {"attn_to_y": float((ph * (earlier & is_y)).sum(-1).mean()),
                               "attn_to_x": float((ph * (earlier & ~is_y)).sum(-1).mean()),
                               "attn_to_self": float(ph[:, torch.arange(len(q)), q].mean())}
    return out


def ablate_head_hook(head: int):
    def hook(z: torch.Tensor, hook=None) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return hook


@torch.no_grad()
def head_ablation(model, xs: torch.Tensor, ys: torch.Tensor, icl_tokens: tuple[int, int]) -> dict:
    """Per (layer, head): Δ OOD loss and Δ ICL score when the head's z is zero-ablated."""
    D = xs.shape[-1]
    base = token_losses(model(xs, ys), ys, D)
    out = {}
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            pred = model.run_with_hooks(xs, ys, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate_head_hook(h))])
            tok = token_losses(pred, ys, D)
            out[(layer, h)] = {"ablation_delta_ood_loss": float(tok.mean() - base.mean()),
                               "ablation_delta_icl_score": icl_score(tok, *icl_tokens) - icl_score(base, *icl_tokens)}
    return out


def layernorm_collapse(model, threshold: float = 0.05) -> dict[str, float]:
    """Fraction of LayerNorm weights with |w| < threshold, per norm (e.g. 'blocks.0.ln1')."""
    return {name: float((m.weight.abs() < threshold).float().mean())
            for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}


def ridge_probe_r2(feats: torch.Tensor, target: torch.Tensor, lam: float = 1e-2, seed: int = 0) -> float:
    """Fit target ≈ [feats, 1] W by ridge on a random half, return pooled R² on the other half."""
    n = feats.shape[0]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    tr, te = perm[: n // 2], perm[n // 2:]
    X = torch.cat([feats, torch.ones(n, 1, dtype=feats.dtype)], 1).double()
    Y = target.double()
    mu, sd = X[tr, :-1].mean(0), X[tr, :-1].std(0).clamp_min(1e-8)
    X[:, :-1] = (X[:, :-1] - mu) / sd
    A = X[tr].T @ X[tr] + lam * len(tr) * torch.eye(X.shape[1], dtype=X.dtype)
    W = torch.linalg.solve(A, X[tr].T @ Y[tr])
    resid = Y[te] - X[te] @ W
    sst = ((Y[te] - Y[tr].mean(0)) ** 2).sum()
    return float(1 - (resid ** 2).sum() / sst)


def ridge_estimates(xs: torch.Tensor, ys: torch.Tensor, noise_var: float) -> torch.Tensor:
    """t̂_k = (X_{<k}ᵀX_{<k} + σ²I)⁻¹ X_{<k}ᵀ y_{<k} for every k: (B, K, D)."""
    x, y = xs.double(), ys.double()
    A = (x.unsqueeze(-1) * x.unsqueeze(-2)).cumsum(1) - x.unsqueeze(-1) * x.unsqueeze(-2)
    A = A + noise_var * torch.eye(x.shape[-1], dtype=x.dtype)
    b = (x * y.unsqueeze(-1)).cumsum(1) - x * y.unsqueeze(-1)
    return torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def probes(model, batch, noise_var: float, lam: float = 1e-2) -> dict[tuple[str, int, int], float]:
    """R² of linear probes for the task t and for the ridge estimate from the pairs seen so far,
    at each layer (0 = embedding, l = after block l) and token position j = 1..2K (odd: x_k,
    even: y_k; at token j the context holds ⌊j/2⌋ complete pairs)."""
    names = ["hook_embed"] + [f"blocks.{l}.hook_resid_post" for l in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(batch.xs, batch.ys, names_filter=lambda n: n in names)
    t_hat = ridge_estimates(batch.xs, batch.ys, noise_var)        # t_hat[:, k] uses the first k pairs
    K = batch.xs.shape[1]
    out = {}
    for layer, name in enumerate(names):
        resid = cache[name]
        for j in range(resid.shape[1]):
            pairs = (j + 1) // 2
            out[("probe_task_r2", layer, j + 1)] = ridge_probe_r2(resid[:, j], batch.tasks, lam)
            if 0 < pairs < K:
                out[("probe_ridge_r2", layer, j + 1)] = ridge_probe_r2(resid[:, j], t_hat[:, pairs], lam)
    return out


def mech_for_run(run_dir: str | Path, cfg: dict, every: int = 1) -> pd.DataFrame:
    from .llc import load_checkpoint_model, select_steps
    from .tasks import M_INF, BatchSampler, eval_set, task_pool

    run_dir = Path(run_dir)
    spec = read_json(run_dir / "run.json")
    d, k, e = spec["data"], spec["keys"], spec["eval"]
    ood = eval_set("ood", k["M"], cfg.get("n_sequences", 512), d["K"], d["D"], d["noise_var"], d["pool_seed"], e["eval_seed"])
    pool = None if k["M"] == M_INF else task_pool(d["pool_seed"], k["M"], d["D"])
    probe_batch = BatchSampler(pool, d["K"], d["D"], d["noise_var"], k["seed"], "cpu", stream=4).batch(0, cfg.get("n_probe", 1024))
    rows = []
    for step in select_steps(read_parquet(run_dir / "metrics.parquet").step.tolist(), every):
        model = load_checkpoint_model(run_dir, step).eval()
        base = {**k, "step": step}
        for (layer, h), vals in attention_masses(model, ood.xs, ood.ys).items():
            rows += [{**base, "probe": p, "layer": layer, "head": h, "position": -1, "value": v} for p, v in vals.items()]
        for (layer, h), vals in head_ablation(model, ood.xs, ood.ys, tuple(e["icl_tokens"])).items():
            rows += [{**base, "probe": p, "layer": layer, "head": h, "position": -1, "value": v} for p, v in vals.items()]
        for name, frac in layernorm_collapse(model, cfg.get("ln_threshold", 0.05)).items():
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else model.cfg.n_layers
            rows.append({**base, "probe": f"ln_collapse_{name.split('.')[-1]}", "layer": layer, "head": -1,
                         "position": -1, "value": frac})
        for (p, layer, pos), v in probes(model, probe_batch, d["noise_var"], cfg.get("probe_ridge", 1e-2)).items():
            rows.append({**base, "probe": p, "layer": layer, "head": -1, "position": pos, "value": v})
    df = pd.DataFrame(rows)
    write_parquet(df, run_dir / "mech.parquet", MECH_SCHEMA)
    return df


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise mech", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--cfg", default="{}", help="JSON: n_sequences, n_probe, ln_threshold, probe_ridge")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--figure", default=None, help="write the per-run head figure here (stem)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    df = mech_for_run(a.run_dir, json.loads(a.cfg), a.every)
    if a.figure:
        from .figures.probes import fig_heads
        fig_heads(df, a.figure)
    last = df[df.step == df.step.max()]
    print(last[last.probe.str.startswith(("attn_to_y", "ablation_delta_ood"))].to_string(index=False))
    print(f"{df.step.nunique()} checkpoints in {time.time() - t0:.1f}s")
