"""Mechanistic probes with transformer_lens hooks (method §10), per analysis checkpoint.

- attention: mean attention mass from prediction (x_k, k ≥ 2) positions to earlier y-tokens,
  earlier x-tokens and itself, per layer and head (`blocks.{l}.attn.hook_pattern`); the chance
  level (a uniform head) is stored as probe `attn_to_y_chance` (= mean_k (k−1)/(2k−1));
- ablation (the method's sign): `ablation_icl_drop` = ICL score of the model − ICL score with the head's
  `hook_z` zeroed (positive: the head helps in-context learning) and `ablation_ood_loss_increase` =
  ablated − base OOD loss / D (positive: the head helps), each with its paired standard error over
  sequences (`se`), on the OOD evaluation set that `metrics` uses (eval.n_sequences sequences of
  `tasks.eval_set("ood", ...)`, the same as evaluate.Evaluator);
- layer-norm collapse: fraction of LayerNorm weights with |w| < threshold, per norm;
- linear probes: cross-fitted ridge regression (penalty chosen by inner cross-validation) reading
  the task t (`probe_task_r2`; folds split by task, so it measures reading the task vector, not
  recognising a pool task) and the ridge estimate t̂ (`probe_ridge_r2`; folds split by sequence)
  from the residual stream after each block at each token; pooled held-out R².

A value that is undefined is NaN with the reason in `note` (never ±inf): e.g. the task probe at
M < 4, where fewer than two tasks would be left to test on, or a target without variance.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from ..core.probe_sections import Mech
from ..core.runspec import KEY_FIELDS
from ..core.sections import Data, Eval

CIRCUIT_COLUMNS = ["attn_to_y_excess", "icl_drop_max", "probe_ridge_r2_max"]   # run_summary keys H4 tests
MECH_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("probe", pa.string()), pa.field("layer", pa.int64()),
    pa.field("head", pa.int64()), pa.field("position", pa.int64()), pa.field("value", pa.float64()),
    pa.field("se", pa.float64()), pa.field("note", pa.string()),
])
LAMBDAS = np.logspace(-4, 4, 17)   # ridge penalties (× n_train, on standardised features) for the inner CV


def uniform_attention_masses(K: int) -> dict[str, float]:
    """Chance levels: the masses of a head attending uniformly to the 2k − 1 positions up to x_k,
    averaged over k = 2..K: to earlier y-tokens (k − 1), earlier x-tokens (k − 1), itself (1)."""
    k = np.arange(2, K + 1)
    return {"attn_to_y": float(np.mean((k - 1) / (2 * k - 1))), "attn_to_x": float(np.mean((k - 1) / (2 * k - 1))),
            "attn_to_self": float(np.mean(1 / (2 * k - 1)))}


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


def per_sequence_icl(pred: torch.Tensor, ys: torch.Tensor, D: int, k_early: int, k_late: int) -> torch.Tensor:
    """Each sequence's ((ŷ − y)²_{k_early} − (ŷ − y)²_{k_late}) / D: their mean is the ICL score."""
    sq = (pred - ys).square() / D
    return sq[:, k_early - 1] - sq[:, k_late - 1]


def paired_mean_se(diff: torch.Tensor) -> tuple[float, float]:
    """Mean and standard error (sd / √n) of per-sequence paired differences."""
    d = diff.double()
    return float(d.mean()), float(d.std() / math.sqrt(len(d)))


@torch.no_grad()
def head_ablation(model, xs: torch.Tensor, ys: torch.Tensor, icl_tokens: tuple[int, int]) -> dict:
    """Per (layer, head): (mean, paired se) of the ICL-score drop base − ablated and of the OOD-loss
    increase ablated − base (/ D) when the head's z is zero-ablated; positive = the head helps."""
    D = xs.shape[-1]
    base = model(xs, ys)
    base_icl, base_loss = per_sequence_icl(base, ys, D, *icl_tokens), ((base - ys).square() / D).mean(1)
    out = {}
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            pred = model.run_with_hooks(xs, ys, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate_head_hook(h))])
            out[(layer, h)] = {
                "ablation_icl_drop": paired_mean_se(base_icl - per_sequence_icl(pred, ys, D, *icl_tokens)),
                "ablation_ood_loss_increase": paired_mean_se(((pred - ys).square() / D).mean(1) - base_loss)}
    return out


def layernorm_collapse(model, threshold: float) -> dict[str, float]:
    """Fraction of LayerNorm weights with |w| < threshold, per norm (e.g. 'blocks.0.ln1')."""
    return {name: float((m.weight.abs() < threshold).float().mean())
            for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}


def _folds(n: int, k: int, groups: np.ndarray | None, rng: np.random.Generator) -> list[np.ndarray]:
    """k index sets partitioning range(n), by random whole groups when `groups` is given."""
    if groups is None:
        return np.array_split(rng.permutation(n), k)
    uniq = rng.permutation(np.unique(groups))
    return [np.nonzero(np.isin(groups, g))[0] for g in np.array_split(uniq, k)]


def _ridge_fit(X: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, ...]:
    """What ridge on standardised features with intercept needs for every penalty at once: feature mean and
    sd, the training target mean, n, and the eigenpairs of ZᵀZ = V S² Vᵀ (p × p, p = d_model) with VᵀZᵀ(Y − Ȳ).
    W(λ) = (ZᵀZ + λn I)⁻¹ Zᵀ(Y − Ȳ) = V diag(1 / (S² + λn)) VᵀZᵀ(Y − Ȳ): the SVD path of Z at a fraction of its
    cost for n ≫ p."""
    mu, sd = X.mean(0), X.std(0)
    sd = np.where(sd > 1e-12, sd, 1.0)
    Z = (X - mu) / sd
    s2, V = np.linalg.eigh(Z.T @ Z)
    ym = Y.mean(0)
    return mu, sd, ym, len(X), np.clip(s2, 0.0, None), V, V.T @ (Z.T @ (Y - ym))


def _ridge_predict(X: np.ndarray, fit: tuple, lambdas: np.ndarray) -> np.ndarray:
    """Predictions (len(lambdas), n, q) of the ridge fits of `_ridge_fit` with penalties λ·n, one per λ."""
    mu, sd, ym, n, s2, V, VtZtY = fit
    ZV = ((X - mu) / sd) @ V
    return ym + ZV @ (VtZtY / (s2[None, :, None] + lambdas[:, None, None] * n))


def ridge_probe_r2(feats: torch.Tensor, target: torch.Tensor, groups: np.ndarray | None = None, seed: int = 0,
                   n_outer: int = 5, n_inner: int = 3) -> tuple[float, str]:
    """Cross-fitted R² of a linear read-out target ≈ feats·W + b: `n_outer` folds (by group when
    `groups` is given) each serve once as test set; on the rest the ridge penalty is chosen from
    LAMBDAS by `n_inner`-fold CV (same grouping) and the fit is refit on all of it. Pooled R² =
    1 − Σ residual² / Σ (y − training mean)² over every held-out prediction and output.
    Returns (R², note): NaN with the reason when fewer than 2·n_outer groups exist or the target has no
    variance; never ±inf."""
    X, Y = feats.double().cpu().numpy(), target.double().cpu().numpy().reshape(len(feats), -1)
    n_groups = len(np.unique(groups)) if groups is not None else len(X)
    if n_groups < 2 * n_outer:
        return math.nan, f"undefined: {n_groups} task(s), a task-split probe needs ≥ {2 * n_outer}"
    rng = np.random.default_rng(seed)
    sse = sst = 0.0
    for test in _folds(len(X), n_outer, groups, rng):
        train = np.ones(len(X), bool)
        train[test] = False
        Xt, Yt, gt = X[train], Y[train], None if groups is None else groups[train]
        cv = np.zeros(len(LAMBDAS))
        for val in _folds(len(Xt), n_inner, gt, rng):
            fit_idx = np.ones(len(Xt), bool)
            fit_idx[val] = False
            cv += ((Yt[val] - _ridge_predict(Xt[val], _ridge_fit(Xt[fit_idx], Yt[fit_idx]), LAMBDAS)) ** 2).sum((1, 2))
        best = LAMBDAS[[int(np.argmin(cv))]]
        sse += float(((Y[test] - _ridge_predict(X[test], _ridge_fit(Xt, Yt), best)[0]) ** 2).sum())
        sst += float(((Y[test] - Yt.mean(0)) ** 2).sum())
    if sst <= 1e-12 * max(1.0, float((Y ** 2).sum())):
        return math.nan, "undefined: the target has no variance"
    return 1.0 - sse / sst, ""


def ridge_estimates(xs: torch.Tensor, ys: torch.Tensor, noise_var: float) -> torch.Tensor:
    """t̂_k = (X_{<k}ᵀX_{<k} + σ²I)⁻¹ X_{<k}ᵀ y_{<k} for every k: (B, K, D)."""
    x, y = xs.double(), ys.double()
    A = (x.unsqueeze(-1) * x.unsqueeze(-2)).cumsum(1) - x.unsqueeze(-1) * x.unsqueeze(-2)
    A = A + noise_var * torch.eye(x.shape[-1], dtype=x.dtype)
    b = (x * y.unsqueeze(-1)).cumsum(1) - x * y.unsqueeze(-1)
    return torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)


def task_ids(tasks: torch.Tensor) -> np.ndarray:
    """An integer id per sequence for its task vector (equal vectors, equal ids)."""
    return np.unique(tasks.cpu().numpy(), axis=0, return_inverse=True)[1].ravel()


@torch.no_grad()
def probes(model, batch, noise_var: float, seed: int = 0) -> dict[tuple[str, int, int], tuple[float, str]]:
    """(R², note) of linear probes for the task t (split by task) and for the ridge estimate from the
    pairs seen so far (split by sequence), at each layer (0 = embedding, l = after block l) and token
    position j = 1..2K (odd: x_k, even: y_k; at token j the context holds ⌊j/2⌋ complete pairs)."""
    names = ["hook_embed"] + [f"blocks.{i}.hook_resid_post" for i in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(batch.xs, batch.ys, names_filter=lambda n: n in names)
    t_hat = ridge_estimates(batch.xs, batch.ys, noise_var)        # t_hat[:, k] uses the first k pairs
    groups = task_ids(batch.tasks)
    K = batch.xs.shape[1]
    out = {}
    for layer, name in enumerate(names):
        resid = cache[name]
        for j in range(resid.shape[1]):
            pairs = (j + 1) // 2
            out[("probe_task_r2", layer, j + 1)] = ridge_probe_r2(resid[:, j], batch.tasks, groups, seed)
            if 0 < pairs < K:
                out[("probe_ridge_r2", layer, j + 1)] = ridge_probe_r2(resid[:, j], t_hat[:, pairs], None, seed)
    return out


def mech_at(model, ood, probe_batch, d: Data, e: Eval, cfg: Mech) -> list[dict]:
    """The rows of one checkpoint (without keys and step)."""
    rows = []

    def row(probe, layer=-1, head=-1, position=-1, value=math.nan, se=math.nan, note=""):
        rows.append({"probe": probe, "layer": layer, "head": head, "position": position, "value": value, "se": se,
                     "note": note})

    row("attn_to_y_chance", value=uniform_attention_masses(d.K)["attn_to_y"], note="uniform attention")
    for (layer, h), vals in attention_masses(model, ood.xs, ood.ys).items():
        for p, v in vals.items():
            row(p, layer, h, value=v)
    for (layer, h), vals in head_ablation(model, ood.xs, ood.ys, tuple(e.icl_tokens)).items():
        for p, (v, se) in vals.items():
            row(p, layer, h, value=v, se=se)
    for name, frac in layernorm_collapse(model, cfg.ln_threshold).items():
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else model.cfg.n_layers
        row(f"ln_collapse_{name.split('.')[-1]}", layer, value=frac)
    for (p, layer, pos), (v, note) in probes(model, probe_batch, d.noise_var, cfg.seed).items():
        row(p, layer, position=pos, value=v, note=note)
    return rows


def run_summary(mech: pd.DataFrame) -> dict[str, float]:
    """End-of-training circuitry scalars of one run (its last probed step), for H4:
    attn_to_y_max (max over heads), attn_to_y_excess (that minus the uniform-attention chance level),
    icl_drop_max (largest ablation ICL drop over heads, the method's sign), ood_loss_increase_max,
    probe_task_r2_max and probe_ridge_r2_max (best over layers and positions; NaN if all undefined)."""
    last = mech[mech.step == mech.step.max()]

    def top(probe: str) -> float:
        v = last.loc[last.probe == probe, "value"].dropna()
        return float(v.max()) if len(v) else math.nan

    chance = top("attn_to_y_chance")
    return {"attn_to_y_max": top("attn_to_y"), "attn_to_y_excess": top("attn_to_y") - chance,
            "icl_drop_max": top("ablation_icl_drop"), "ood_loss_increase_max": top("ablation_ood_loss_increase"),
            "probe_task_r2_max": top("probe_task_r2"), "probe_ridge_r2_max": top("probe_ridge_r2")}
