"""Noise as a controlled variable (method §5): injected covariances, their shapes, PSD clipping, schedules and
the controller, as pure functions and small value types (the stateful hook that injects is
iclnoise.noise.injection).

Every injected noise is described by R', its *gradient-space equivalent* covariance, R' = U Λ Uᵀ + diag(d):

- source `grad`: ε ~ N(0, s·R') is added to the gradient before clipping and the Adam preconditioner, the
  same path batch noise takes (momentum included), so emulating batch B_t at batch B uses
  R' = C/B_t − C/B (method §5) with no further factor;
- source `param`: ζ = η_t · A_t ε, ε ~ N(0, s·R'), is added to the parameters after the update, so
  Cov ζ = η_t² A R' A; a shape is a shape in the space where the noise is added, so `isotropic`
  parameter-space noise is τ²·I in parameter space with τ² P = η² Tr(A sR' A). PyTorch's AdamW keeps an
  EMA of gradients whose weights sum to one, so batch
  noise diffuses as η² A C A / B per step over times ≫ 1/(1 − β1): ζ matches it in the long run, not
  step by step (per step, momentum smooths batch noise by (1 − β1)/(1 + β1); ζ is not smoothed).

Shapes of R' (from the per-example covariance Ĉ of the latest measurement, refreshed every
`exposure.every` steps): `isotropic` (σ² I with σ² = Tr/P), `diagonal`, `lowrank` (top-r eigenpairs
from the K × P group-gradient factor plus the diagonal correction diag(Ĉ) − diag(U Λ Uᵀ)).
Negative parts (a target batch above the current one, or a diagonal correction that the low-rank part
overshoots) are clipped to zero and the clipped trace is logged per step: exact matching is impossible
there.

Levels and schedules (noise.conditions.<name> in params.yaml):
- `emulate_batch: B_t` (schedule constant): R' = (1/B_t − 1/B)·Ĉ, the physical emulation of batch B_t;
- `budget: E` (schedules constant, early, late): within the window (all steps; the first or last
  fraction f) the scale is set per step, in closed loop on the cumulative integral, so that the realised
  injected P-NE* after gradient clipping adds up to E: early and late with the same E reach equal
  realised exposure (method §5), whatever curvature and clipping do in their windows;
- `schedule: controlled`, `target: P` (or a trajectory [[fraction, P], ...], log-interpolated): a PI
  controller on log P-NE* (measured after clipping, at every logged step) sets log s so the total
  P-NE* follows the target. Under gradient clipping the post-clip
  P-NE* of grad-space noise saturates as s grows (c² ∝ 1/s), so a target above that is not reachable:
  the exposure log shows the gap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .exposure import GradNoise


# ---------------------------------------------------------------- covariance models
@dataclass
class CovModel:
    """R' = U diag(lam) Uᵀ + diag(d) with lam, d ≥ 0; U (P, r) orthonormal columns (r may be 0; restricted to some
    parameters, M U: `restricted`)."""

    U: torch.Tensor
    lam: torch.Tensor
    d: torch.Tensor

    def diag(self) -> torch.Tensor:
        return (self.U.square() * self.lam).sum(1) + self.d

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """One draw ε ~ N(0, R')."""
        P, r = self.U.shape
        e = self.d.sqrt() * torch.randn(P, generator=generator, device=self.d.device, dtype=self.d.dtype)
        if r:
            e = e + self.U @ (self.lam.sqrt() * torch.randn(r, generator=generator, device=self.d.device,
                                                              dtype=self.d.dtype))
        return e

    def dense(self) -> torch.Tensor:
        """The P × P matrix (tests and small models only)."""
        return (self.U * self.lam) @ self.U.T + torch.diag(self.d)

    def state_dict(self) -> dict:
        return {"U": self.U, "lam": self.lam, "d": self.d}


def parameter_mask(names: list[tuple[str, int]], prefixes: list[str]) -> torch.Tensor:
    """The 0/1 diagonal of M (method §5, "Noise on some layers"): 1 on every coordinate of a parameter whose dotted
    name is one of `prefixes` or starts with one and a dot, 0 elsewhere. `names`: (name, numel) in the order the
    run's flat parameter vector takes (the model's named_parameters). A prefix that names no parameter is an error."""
    hits = {q: [n for n, _ in names if n == q or n.startswith(q + ".")] for q in prefixes}
    missing = [q for q, h in hits.items() if not h]
    if missing:
        tops = sorted({n.split(".")[0] if not n.startswith("blocks.") else ".".join(n.split(".")[:2])
                       for n, _ in names})
        raise ValueError(f"noise.layers: {', '.join(missing)} names no parameter of the model; its parameters are "
                         f"under {', '.join(tops)} (a dotted prefix of a name, e.g. blocks.0.attn)")
    on = {n for h in hits.values() for n in h}
    return torch.cat([torch.full((k,), float(n in on)) for n, k in names])


def restricted(cov: CovModel, mask: torch.Tensor) -> CovModel:
    """M R' M for the 0/1 diagonal M = diag(mask): the covariance of M ε, ε ~ N(0, R'). Its U is M U (orthonormal
    columns only before the mask), so a draw from it (`CovModel.sample`, injection.counter_noise) is the unrestricted
    draw from the same words with the coordinates outside the mask zeroed, and diag and trace count the mask's
    coordinates alone."""
    mask = mask.to(cov.d)
    return CovModel(cov.U * mask[:, None], cov.lam, cov.d * mask)


DENSE_CLIP_MAX = 4096  # exact PSD projection of the whole R' by a dense eigh up to this many parameters


def psd_clip(U: torch.Tensor, lam: torch.Tensor, d: torch.Tensor) -> tuple[CovModel, float]:
    """The PSD part of R' = U diag(lam) Uᵀ + diag(d); returns it and the trace removed (≥ 0).

    Nothing is removed when both parts are PSD (then R' is). Otherwise the whole matrix is projected: a dense
    eigendecomposition (exact) up to DENSE_CLIP_MAX parameters; above that each part is clipped separately,
    which is exact when both parts are PSD or both negative (emulating a larger batch: R' = coef·Ĉ with
    coef < 0) and removes too much otherwise (logged as removed)."""
    if (lam >= 0).all() and (d >= 0).all():
        return CovModel(U, lam, d), 0.0
    if (lam <= 0).all() and (d <= 0).all():
        return CovModel(U, torch.zeros_like(lam), torch.zeros_like(d)), -float(lam.sum() + d.sum())
    P = d.numel()
    if P <= DENSE_CLIP_MAX:
        ev, V = torch.linalg.eigh((U * lam) @ U.T + torch.diag(d))
        keep = ev > 0
        removed = -float(ev[~keep].sum())
        return CovModel(V[:, keep], ev[keep], torch.zeros_like(d)), max(0.0, removed)
    removed = -float(lam.clamp(max=0).sum() + d.clamp(max=0).sum())
    return CovModel(U, lam.clamp(min=0), d.clamp(min=0)), max(0.0, removed)


SHAPES = ("isotropic", "diagonal", "lowrank")


def shaped_covariance(noise: GradNoise, coef: float, shape: str, rank: int = 8) -> tuple[CovModel, float]:
    """coef · Ĉ in the requested shape, PSD-clipped; returns (model, clipped trace)."""
    P = noise.diag.numel()
    empty_u = noise.diag.new_zeros(P, 0)
    if shape == "isotropic":
        lam, d = noise.diag.new_zeros(0), torch.full_like(noise.diag, coef * noise.trace / P)
        U = empty_u
    elif shape == "diagonal":
        lam, d, U = noise.diag.new_zeros(0), coef * noise.diag, empty_u
    elif shape == "lowrank":
        _, s, Vh = torch.linalg.svd(noise.factor, full_matrices=False)
        r = min(rank, int((s > s[0] * 1e-6).sum()) if len(s) and s[0] > 0 else 0)
        U, lam = Vh[:r].T.contiguous(), coef * s[:r].square()
        d = coef * noise.diag - (U.square() * lam).sum(1)
        if coef >= 0:  # diag(Ĉ) ≥ diag of its top-r part exactly: a negative d here is round-off
            d = d.clamp(min=0)
    else:
        raise ValueError(f"unknown noise shape {shape!r}; allowed: {', '.join(SHAPES)}")
    return psd_clip(U, lam, d)


# ---------------------------------------------------------------- schedules and control
SCHEDULES = ("constant", "early", "late", "controlled")


def target_at(target: float | list, progress: float) -> float:
    """A constant target, or a trajectory [[fraction of training, P-NE*], ...] interpolated in log P-NE*."""
    if isinstance(target, (int, float)):
        return float(target)
    fr, val = zip(*sorted(target))
    return float(np.exp(np.interp(progress, fr, np.log(val))))


@dataclass
class PIController:
    """log s_t = u + kp·e, u ← u + ki·e, with e = log(target_t) − log(measured P-NE*) at each measurement."""

    target: float | list
    kp: float = 0.5
    ki: float = 0.3
    u: float = 0.0
    log_s: float = 0.0

    def update(self, measured: float, progress: float = 0.0) -> float:
        if measured > 0 and math.isfinite(measured):
            e = math.log(target_at(self.target, progress)) - math.log(measured)
            self.u = min(30.0, max(-30.0, self.u + self.ki * e))  # bounded integral: no wind-up
            self.log_s = min(30.0, max(-30.0, self.u + self.kp * e))
        return math.exp(self.log_s)


__all__ = ["CovModel", "psd_clip", "shaped_covariance", "target_at", "PIController", "SHAPES", "SCHEDULES"]
