"""AdamW's step as a differentiable map and a run's metrics as a function of its parameters (method §13, "A
first-order pathwise estimator"): what iclnoise.run.pathwise carries tangents through.

- The update map (`adamw_map`) is AdamW's step on the whole state x = (θ, m, v), so its tangent map is AdamW's
  Jacobian in (θ, m, v) (tests/test_linearised.py: against central differences of torch's AdamW) and a perturbation
  renormalises through v as AdamW does, to first order. Held: the clip factor c_t (its dependence on ‖g‖ dropped);
  a = 0 on the round-off coordinates where the step's a is (iclnoise.core.adam; AdamW moves them by round-off).
- The gradient a caller gives it is the recorded one (the injected gradient noise in) plus the change of the
  gradient on a sub-batch (iclnoise.run.pathwise: the first `jac_batch` sequences of the step's batch, whose
  curvature stands for the batch's), so the map passes through the recorded state.
- `metric_fn`: METRICS of iclnoise.run.evaluate as a differentiable function of the flat θ.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.func import functional_call

from ..core.predictors import token_losses
from ..noise.cnr import Map
from ..noise.exposure import AdamState, preconditioner

METRICS = ("ood_loss", "r", "delta_dmmse", "delta_ridge", "ood_delta_dmmse", "ood_delta_ridge")   # metric_fn's order


def adamw_map(g: Map, lr: float, wd: float, betas: tuple[float, float], eps: float, n: int, clip: float,
              live: torch.Tensor):
    """AdamW's update `n` (0-based: bias corrections 1 − βⁿ⁺¹) as a map of the state x = (θ, m, v) and a gradient
    input u (None: none), the gradient c (g(θ) + u) with c held:

        m' = β1 m + (1 − β1) c (g + u),   v' = β2 v + (1 − β2) c² (g + u)²,
        θ' = θ (1 − η λ) − η a(v') m' / (1 − β1ⁿ⁺¹),   a(v') = 1 / (√(v' / (1 − β2ⁿ⁺¹)) + ε)   (torch's AdamW);

    `live` masks a to 0 where the recorded step's a is (iclnoise.core.adam: round-off coordinates), so the map is smooth
    on every coordinate (its derivative in v, a³-like, would otherwise divide by √v' = 0)."""
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** (n + 1), 1 - b2 ** (n + 1)

    def phi(x: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        theta, m, v = x.chunk(3)
        gt = clip * (g(theta) if u is None else g(theta) + u)
        m2, v2 = b1 * m + (1 - b1) * gt, b2 * v + (1 - b2) * gt * gt
        a = torch.where(live, 1.0 / ((torch.where(live, v2, 1.0) / bc2).sqrt() + eps), 0.0)
        return torch.cat([theta * (1 - lr * wd) - lr * a * m2 / bc1, m2, v2])
    return phi


def step_preconditioner(adam: AdamState) -> torch.Tensor:
    """The A an AdamW step used, read after it: v̂ with the step's own bias correction (`adam.step` is the count
    before the step; before the first, v̂_1 = g²)."""
    if adam.exp_avg_sq is None:
        return preconditioner(adam).detach().clone()
    return preconditioner(dataclasses.replace(adam, step=(adam.step or 0) + 1)).detach().clone()


def flat_params(model: torch.nn.Module):
    """(θ ↦ parameter dict, flat θ of the model) for torch.func over a flat parameter vector."""
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]

    def unflat(theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(p.shape) for (n, p), t in zip(named, theta.split(sizes))}
    return unflat, torch.cat([p.detach().reshape(-1) for _, p in named])


def metric_fn(model: torch.nn.Module, evaluator) -> callable:
    """θ ↦ the METRICS of iclnoise.run.evaluate as a differentiable tensor (Δ(f, g) = mean token loss of f against
    g)."""
    unflat, _ = flat_params(model)
    s, D = evaluator.splits, evaluator.D
    nan = torch.tensor(math.nan)

    def f(theta: torch.Tensor) -> torch.Tensor:
        p = {k: functional_call(model, unflat(theta), (s[k].batch.xs, s[k].batch.ys)) for k in ("id", "ood")}

        def dist(split, ref):
            return nan.to(theta) if ref is None else token_losses(p[split], ref, D).mean()
        dd, dr = dist("id", s["id"].dmmse), dist("id", s["id"].ridge)
        return torch.stack([token_losses(p["ood"], s["ood"].batch.ys, D).mean(), dd / (dd + dr), dd, dr,
                            dist("ood", s["ood"].dmmse), dist("ood", s["ood"].ridge)])
    return f
