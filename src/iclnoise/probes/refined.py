"""Refined LLC and susceptibilities (method §7): λ̂ and χ per component of the network, every component of a
checkpoint in one batched SGLD pass (iclnoise.probes.sgld.sgld_chains with one mask per row group).

Weight-restricted ("refined") LLC of a component C (Wang et al. 2024): SGLD moves C's coordinates only and holds
the rest at w*, with the ε, γ, nβ, chains and draws of the whole-network estimate,

    λ̂_C(w*) = nβ (E_C[L_n(w)] − L_n(w*)),   E_C over p(w_C) ∝ exp(−nβ L_n(w_C, w*_¬C) − (γ/2)‖w_C − w*_C‖²).

Data-restricted: L_n is whatever (loss_fn, xs, ys) say: `position_loss` keeps some token positions; another
sampling set (new tasks) is another (xs, ys). Component "all" moves every coordinate: the unrestricted λ̂.

Susceptibility of C to a data perturbation q → q' (Baker et al. 2025, app. C.4), from the draws of the same
C-restricted chains:

    χ_C = −Cov_C(φ_C, n (ℓ_q'(w) − ℓ_q(w))),   φ_C(w) = ℓ_q(w) − ℓ_q(w*),

ℓ_q, ℓ_q' the losses on fixed sets of q and q' sequences of equal size, read at every post-burn-in draw. φ_C is
devinterp 2.0.1's observable (`compute_susceptibilities`: the loss on a fixed set of sampling-task sequences read at
each draw of the restricted chains, minus the loss at w*; the constant drops out of a covariance). Normalisation:
devinterp reports per q'-token E[φ (ℓ_q − ℓ_q',token)] − E[φ] E_full[ℓ_q − ℓ_q',token], without the factor n and
centred on the unrestricted chains' mean; averaged over tokens that is χ_C / n up to the centring. Here, as method §7
writes it, n = cfg.n (the sampling set's size, the n of the posterior); the covariance is taken per chain (about
that chain's means, ddof 1), χ_C is the mean over chains and its s.e. their standard deviation / √chains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from ..core.model import LossFn
from ..core.runspec import KEY_FIELDS
from .llc import (
    SAMPLER_FIELDS,
    LLCConfig,
    LLCResult,
    center_loss,
    check_sampling_set,
    llc_result,
    sampler_columns,
    stability_ratio,
    top_eigenvalue,
    trivial_loss,
)
from .sgld import sgld_chains

HEAD_PARAMS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")   # sliced at the head on dim 0, as devinterp's


def components(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor | None]]:
    """Components of an ICLTransformer, name → mask dict (iclnoise.probes.sgld.restriction), in this order: per layer i
    every head h "l{i}h{h}" (W_Q, W_K, W_V, W_O, b_Q, b_K, b_V at head h: devinterp's head restriction) and
    "l{i}mlp" (the block's MLP); "embed" (token and positional embedding), "unembed" (readout) and "all" (every
    parameter). Layer norms and the attention output bias b_O, shared by the heads, move only in "all"."""
    params = dict(model.named_parameters())
    out = {}
    for i in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            masks = {}
            for w in HEAD_PARAMS:
                if (name := f"blocks.{i}.attn.{w}") in params:
                    masks[name] = torch.zeros(params[name].shape, dtype=torch.bool, device=params[name].device)
                    masks[name][h] = True
            out[f"l{i}h{h}"] = masks
        out[f"l{i}mlp"] = {k: None for k in params if k.startswith(f"blocks.{i}.mlp.")}
    out["embed"] = {k: None for k in params if k.startswith("embed.") or k == "pos_embed"}
    out["unembed"] = {k: None for k in params if k.startswith("unembed.")}
    out["all"] = {k: None for k in params}
    return out


def layer_head(component: str) -> tuple[int, int]:
    """(layer, head) of a component name, −1 where it has none: "l1h0" → (1, 0), "l1mlp" → (1, −1)."""
    if not component.startswith("l") or component == "all":
        return -1, -1
    layer, _, head = component[1:].partition("h")
    return (int(layer), int(head)) if head else (int(layer.removesuffix("mlp")), -1)


def n_moving(model: torch.nn.Module, masks: dict[str, torch.Tensor | None]) -> int:
    params = dict(model.named_parameters())
    return sum(params[k].numel() if m is None else int(m.count_nonzero()) for k, m in masks.items())


def position_loss(positions: Sequence[int]) -> LossFn:
    """The training loss (iclnoise.core.model.mse_loss) restricted to the predictions of y_k at the given k (0-based):
    mean over sequences and those positions of (f − y)², divided by D; one per run for stacked runs."""
    idx = list(positions)

    def loss(model, xs, ys):
        return (model(xs, ys) - ys)[..., idx].square().flatten(-2).mean(-1) / xs.shape[-1]
    return loss


def susceptibility(phi: np.ndarray, delta: np.ndarray, n: int) -> np.ndarray:
    """χ per chain, −n Cov(φ, Δ) over each chain's draws (φ, Δ: (chains, draws); covariance about the chain's own
    means, ddof 1)."""
    cov = ((phi - phi.mean(1, keepdims=True)) * (delta - delta.mean(1, keepdims=True))).sum(1) / (phi.shape[1] - 1)
    return -n * cov


@dataclass
class RefinedResult:
    llc: dict[str, LLCResult]                   # component → restricted λ̂
    chi: dict[tuple[str, str], np.ndarray]      # (component, perturbation) → χ per chain
    n_params: dict[str, int]                    # component → coordinates it moves
    lambda_bound: dict[str, bool] | None = None  # component → its λ_max is the whole network's (an upper bound)


def block_eigenvalues(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, cfg: LLCConfig,
                      comps: dict[str, dict], center: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """λ_max per component for its stability ratio, and whether it is a bound. The top eigenvalue of a block of H is
    at most H's (Cauchy interlacing), so where the whole network's ratio is ≤ 1 every component is stable and records
    the whole network's λ_max as an upper bound (one Lanczos per checkpoint; one per component, 13, made the default
    model's refined job 68.6 CPU s against 45.6 without); where it exceeds 1, each component's own block is computed."""
    whole = top_eigenvalue(model, loss_fn, xs, ys, center, None, cfg.seed)
    exact = stability_ratio(whole, cfg.epsilon, cfg.gamma, cfg.resolved_nbeta()) > 1
    total = sum(p.numel() for p in model.parameters())
    lam, bound = {}, {}
    for name, m in comps.items():
        everything = n_moving(model, m) == total
        lam[name] = top_eigenvalue(model, loss_fn, xs, ys, center, m, cfg.seed) if exact and not everything else whole
        bound[name] = not exact and not everything
    return lam, bound


def refined_llcs(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, cfg: LLCConfig,
                 comps: dict[str, dict] | None = None, center: dict[str, torch.Tensor] | None = None,
                 perturbations: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]
                 | None = None, vectorize: bool = True, progress: bool = False) -> RefinedResult:
    """λ̂_C for each of `comps` (default `components(model)`) at `center` (default: the model's parameters) on the
    sampling set (xs, ys) of size n, and χ_C for each perturbation name → ((x_q, y_q), (x_q', y_q')), all in one
    batched SGLD pass: rows component-major, chain c of every component with the generator chain c has alone."""
    check_sampling_set(xs, cfg)
    comps = components(model) if comps is None else comps
    center = center or {k: v.detach() for k, v in model.named_parameters()}
    perturbations = perturbations or {}
    for name, (q, q2) in perturbations.items():
        if q[0].shape[0] != q2[0].shape[0]:
            raise ValueError(f"perturbation {name}: q has {q[0].shape[0]} sequences, q' {q2[0].shape[0]}")
    init = center_loss(model, loss_fn, xs, ys, center)
    trivial = trivial_loss(loss_fn, xs, ys)
    lam, bound = block_eigenvalues(model, loss_fn, xs, ys, cfg, comps, center)
    observe = [d for q, q2 in perturbations.values() for d in (q, q2)]
    ch = sgld_chains(model, loss_fn, xs, ys, cfg, vectorize=vectorize, progress=progress,
                     centers=[center] * len(comps), masks=list(comps.values()), observe=observe or None)
    C, llcs, chi = cfg.chains, {}, {}
    for j, name in enumerate(comps):
        rows = slice(j * C, (j + 1) * C)
        llcs[name] = llc_result(ch.loss[rows], ch.accept[rows], init, cfg, lam[name], trivial)
        for i, pert in enumerate(perturbations):
            lq, lq2 = ch.obs[2 * i, rows], ch.obs[2 * i + 1, rows]
            chi[name, pert] = susceptibility(lq, lq2 - lq, cfg.n)
    return RefinedResult(llcs, chi, {k: n_moving(model, m) for k, m in comps.items()}, bound)


# ---------------------------------------------------------------- per-run tables

RLLC_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("component", pa.string()), pa.field("layer", pa.int64()),
    pa.field("head", pa.int64()), pa.field("data", pa.string()), pa.field("n_params", pa.int64()),
    pa.field("llc_mean", pa.float64()), pa.field("llc_std", pa.float64()), pa.field("llc_se", pa.float64()),
    pa.field("init_loss", pa.float64()), pa.field("mala_accept", pa.float64()),
    pa.field("mean_sampling_loss", pa.float64()), *SAMPLER_FIELDS,
    pa.field("lambda_max_bound", pa.bool_()),   # lambda_max is the whole network's, an upper bound of the block's
    pa.field("diverged", pa.bool_()), pa.field("negative", pa.bool_()), pa.field("not_levelled", pa.bool_()),
    pa.field("unstable", pa.bool_()), pa.field("escaped", pa.bool_()),
    pa.field("chains", pa.int64()), pa.field("draws", pa.int64()),
])
SUSCEPTIBILITY_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("component", pa.string()), pa.field("layer", pa.int64()),
    pa.field("head", pa.int64()), pa.field("data", pa.string()), pa.field("perturbation", pa.string()),
    pa.field("chi", pa.float64()), pa.field("chi_se", pa.float64()),
    pa.field("chains", pa.int64()), pa.field("draws", pa.int64()),
])


def tables(keys: dict, step: int, data: str, r: RefinedResult, cfg: LLCConfig) -> tuple[list[dict], list[dict]]:
    """RLLC_SCHEMA and SUSCEPTIBILITY_SCHEMA rows of one checkpoint's `RefinedResult`."""
    base = {"chains": cfg.chains, "draws": cfg.draws}
    rllc = [{**keys, "step": step, "component": c, "layer": layer_head(c)[0], "head": layer_head(c)[1],
             "data": data, "n_params": r.n_params[c], "llc_mean": x.llc_mean, "llc_std": x.llc_std,
             "llc_se": x.llc_std / math.sqrt(cfg.chains), "init_loss": x.init_loss, "mala_accept": x.mala_accept,
             **sampler_columns(x), "lambda_max_bound": bool((r.lambda_bound or {}).get(c, False)), **x.flags, **base}
            for c, x in r.llc.items()]
    sus = [{**keys, "step": step, "component": c, "layer": layer_head(c)[0], "head": layer_head(c)[1],
            "data": data, "perturbation": p, "chi": float(v.mean()),
            "chi_se": float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan"), **base}
           for (c, p), v in r.chi.items()]
    return rllc, sus
