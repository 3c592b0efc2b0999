"""Noise as a controlled variable (SPEC §5): injection, shapes, schedules, closed-loop control, and the
training hooks that inject it and log exposure (iclnoise.exposure).

Every injected noise is described by R', its *gradient-space equivalent* covariance, R' = U Λ Uᵀ + diag(d):

- source `grad`: ε ~ N(0, s·R') is added to the gradient before clipping and the Adam preconditioner, the
  same path batch noise takes (momentum included), so emulating batch B_t at batch B uses
  R' = C/B_t − C/B (SPEC §5) with no further factor;
- source `param`: ζ = η_t · A_t ε, ε ~ N(0, s·R'), is added to the parameters after the update, so
  Cov ζ = η_t² A R' A. PyTorch's AdamW keeps an EMA of gradients whose weights sum to one, so batch
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
  fraction f) the scale is set per step so that the injected NE_t = η_t κ Σ a_i² R'_ii equals E / W
  (W = window length): every schedule with the same E has integrated injected exposure E by construction;
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
import pyarrow as pa
import torch

from .exposure import (EXPOSURE_SCHEMA, GradNoise, b_simple, calibrated_kappa, grad_noise, group_grads, kappa,
                       leading_eigs, precond_ggn_trace, precond_hessian_trace, preconditioner,
                       update_innovation_variance)
from .tasks import _seed_mix

_NOISE, _PROBE = 0x7015E, 0xC0A7


# ---------------------------------------------------------------- covariance models
@dataclass
class CovModel:
    """R' = U diag(lam) Uᵀ + diag(d) with lam, d ≥ 0; U (P, r) orthonormal columns (r may be 0)."""

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


def psd_clip(lam: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Zero the negative eigenvalues of the low-rank part and the negative diagonal entries.

    Both parts are eigen-decompositions (U orthonormal; a diagonal is its own), so this removes exactly
    their negative directions; returns the clipped parts and the trace removed (≥ 0)."""
    removed = -float(lam.clamp(max=0).sum() + d.clamp(max=0).sum())
    return lam.clamp(min=0), d.clamp(min=0), max(0.0, removed)


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
    else:
        raise ValueError(f"unknown noise shape {shape!r}; allowed: {', '.join(SHAPES)}")
    lam, d, clipped = psd_clip(lam, d)
    return CovModel(U, lam, d), clipped


# ---------------------------------------------------------------- schedules and control
SCHEDULES = ("constant", "early", "late", "controlled")


def window(schedule: str, total: int, fraction: float) -> tuple[int, int]:
    """[start, stop) of the steps that receive noise."""
    w = max(1, int(round(fraction * total)))
    return {"early": (0, w), "late": (total - w, total)}.get(schedule, (0, total))


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


# ---------------------------------------------------------------- the hooks
class NoiseMeter:
    """Group gradients and their covariance, measured once per logged step and shared by the hooks."""

    def __init__(self, cfg: dict):
        self.every = cfg.get("every", 100)
        self.groups, self.per_example = cfg.get("groups", 8), cfg.get("per_example", False)
        self._step, self._noise = -1, None

    def due(self, step: int) -> bool:
        """Measured at the end of each interval of `every` steps, once Adam's v̂ averages many gradients
        (at step 0 v̂ = g² and A = 1/|g| is dominated by chance near-zero gradients)."""
        return (step + 1) % self.every == 0

    def measure(self, ctx) -> GradNoise:
        if self._step != ctx.step:
            B = len(ctx.batch)
            K = B if self.per_example else min(self.groups, B)
            self.G = group_grads(ctx.model, ctx.loss_fn, ctx.batch.xs, ctx.batch.ys, K)
            self._noise, self._step = grad_noise(self.G, B // K), ctx.step
        return self._noise


INJECTION_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("step", pa.int64()), pa.field("active", pa.bool_()),
    pa.field("scale", pa.float64()),            # s_t multiplying R'
    pa.field("ne_injected", pa.float64()),      # η_t κ Σ a_i² s R'_ii, a before this update (NaN on steps that
                                                # need no A: emulated batch between exposure logs)
    pa.field("trace_injected", pa.float64()),   # Tr(s R')
    pa.field("clipped_trace", pa.float64()),    # s · trace removed by PSD clipping (what could not be matched)
    pa.field("clipped_frac", pa.float64()),     # clipped / (clipped + injected) trace
])


class NoiseInjector:
    name, schema = "injection", INJECTION_SCHEMA

    def __init__(self, spec: dict, meter: NoiseMeter, shared: dict, device: torch.device):
        n = spec["noise"]
        self.run_id, self.seed = spec["keys"]["run_id"], spec["keys"]["seed"]
        self.batch, self.total = spec["keys"]["batch"], spec["train"]["steps"]
        self.source, self.shape, self.rank = n["source"], n.get("shape", "diagonal"), n.get("rank", 8)
        self.schedule = n.get("schedule", "constant")
        self.start, self.stop = window(self.schedule, self.total, n.get("fraction", 1.0))
        self.emulate = n.get("emulate_batch")
        self.coef = (1.0 / self.emulate - 1.0 / self.batch) if self.emulate else 1.0
        self.budget = n.get("budget")
        self.kappa = kappa(spec.get("exposure") or {}, spec["train"]["optimizer"]["betas"][0])
        c = n.get("controller") or {}
        self.ctl = (PIController(n["target"], c.get("kp", 0.5), c.get("ki", 0.3),
                                 u=math.log(c.get("initial_scale", 1.0 / self.batch)),
                                 log_s=math.log(c.get("initial_scale", 1.0 / self.batch)))
                    if self.schedule == "controlled" else None)
        self.meter, self.shared, self.device = meter, shared, device
        self.cov: CovModel | None = None
        self.clipped, self._diag, self._trace = 0.0, None, 0.0
        self._rows: list[dict] = []
        self._eps: torch.Tensor | None = None

    def _scale(self, ctx, a: torch.Tensor | None) -> float:
        if self.ctl is not None:
            pne = self.shared.pop("pne_postclip", None)
            return self.ctl.update(pne, ctx.step / self.total) if pne is not None else math.exp(self.ctl.log_s)
        if self.budget is None:
            return 1.0
        per_step = self.budget / (self.stop - self.start)
        unit = self._ne_unit(ctx, a)
        return per_step / unit if unit > 0 else 0.0

    def _ne_unit(self, ctx, a: torch.Tensor | None) -> float:
        """Injected NE at scale 1: η κ Σ a_i² R'_ii (0 without A)."""
        k = self.shared.get("kappa", self.kappa)
        return ctx.lr * k * float((a.square() * self._diag).sum()) if a is not None else 0.0

    def on_grads(self, ctx) -> None:
        due = self.meter.due(ctx.step)
        if due or self.cov is None:
            self.cov, self.clipped = shaped_covariance(self.meter.measure(ctx), self.coef, self.shape, self.rank)
            self._diag = self.cov.diag()
            self._trace = float(self._diag.sum())
        active = self.start <= ctx.step < self.stop
        # A is read only where it is needed: budget scaling, and the steps the exposure logger records
        a = preconditioner(ctx.optimizer) if active and (self.budget is not None or due) else None
        s = self._scale(ctx, a) if active else 0.0
        ne = 0.0 if s <= 0 else math.nan if a is None else s * self._ne_unit(ctx, a)
        tr, clip = s * self._trace, s * self.clipped
        self.shared["ne_injected"] = ne
        self._rows.append({"run_id": self.run_id, "step": ctx.step, "active": active, "scale": s, "ne_injected": ne,
                           "trace_injected": tr, "clipped_trace": clip,
                           "clipped_frac": clip / (clip + tr) if clip + tr > 0 else 0.0})
        self._eps = None
        if s <= 0:
            return
        gen = torch.Generator(device=self.device).manual_seed(_seed_mix(_NOISE, self.seed, ctx.step))
        eps = math.sqrt(s) * self.cov.sample(gen)
        if self.source == "grad":
            for p, e in zip(ctx.model.parameters(), eps.split([p.numel() for p in ctx.model.parameters()])):
                p.grad.add_(e.view_as(p))
        else:
            self._eps = eps

    def on_update(self, ctx) -> None:
        if self._eps is None:
            return
        zeta = ctx.lr * preconditioner(ctx.optimizer) * self._eps
        with torch.no_grad():
            for p, z in zip(ctx.model.parameters(), zeta.split([p.numel() for p in ctx.model.parameters()])):
                p.add_(z.view_as(p))

    @property
    def clipped_with_grads(self) -> bool:
        return self.source == "grad"

    def rows(self) -> list[dict]:
        return self._rows

    def state_dict(self) -> dict:
        return {"cov": None if self.cov is None else self.cov.state_dict(), "clipped": self.clipped,
                "rows": list(self._rows), "ctl": None if self.ctl is None else (self.ctl.u, self.ctl.log_s)}

    def load_state_dict(self, state: dict) -> None:
        self.cov = None if state["cov"] is None else CovModel(**{k: v.to(self.device) for k, v in state["cov"].items()})
        if self.cov is not None:
            self._diag = self.cov.diag()
            self._trace = float(self._diag.sum())
        self.clipped, self._rows = state["clipped"], list(state["rows"])
        if self.ctl is not None:
            self.ctl.u, self.ctl.log_s = state["ctl"]


class ExposureLogger:
    """Every `every` steps: the exposure row of EXPOSURE_SCHEMA (see iclnoise.exposure)."""

    name, schema = "exposure", EXPOSURE_SCHEMA

    def __init__(self, spec: dict, meter: NoiseMeter, shared: dict, injector: NoiseInjector | None,
                 device: torch.device):
        cfg = spec.get("exposure") or {}
        self.keys, self.batch, self.total = spec["keys"], spec["keys"]["batch"], spec["train"]["steps"]
        self.beta1 = spec["train"]["optimizer"]["betas"][0]
        self.kappa, self.calibrate = kappa(cfg, self.beta1), cfg.get("kappa") == "calibrated"
        self.probes, self.n_heldout = cfg.get("curvature_probes", 8), cfg.get("heldout", 64)
        self.floor, self.rank = cfg.get("floor", 1e-12), cfg.get("eig_rank", 8)
        self.curvature, self.D = cfg.get("curvature", "ggn"), spec["data"]["D"]
        self.meter, self.shared, self.injector, self.device = meter, shared, injector, device
        self._rows: list[dict] = []
        self._noise: GradNoise | None = None
        self._clipped_steps, self._steps = 0, 0

    def on_grads(self, ctx) -> None:
        self._noise = self.meter.measure(ctx) if self.meter.due(ctx.step) else None
        if self._noise is not None:  # the optimizer state before this update
            self._upd_var = update_innovation_variance(ctx.optimizer, self.meter.G, self.batch)
            a = preconditioner(ctx.optimizer, fallback_grads=False)
            self._upd_pred = (ctx.lr ** 2 * float((a.square() * self._noise.diag).sum()) / self.batch
                              if a is not None else math.nan)
            if self.calibrate:
                k = calibrated_kappa([r["update_var"] for r in self._rows] + [self._upd_var],
                                     [r["update_var_pred"] for r in self._rows] + [self._upd_pred], self.beta1)
                if math.isfinite(k):
                    self.kappa = self.shared["kappa"] = k

    def on_update(self, ctx) -> None:
        self._steps += 1
        self._clipped_steps += ctx.clip_coef < 1.0
        if self._noise is None:
            return
        noise, B, lr = self._noise, self.batch, ctx.lr
        a = preconditioner(ctx.optimizer)
        tr_aca = float((a.square() * noise.diag).sum())
        ne = lr * self.kappa * tr_aca / B
        ne_inj = self.shared.get("ne_injected", 0.0) if self.injector is not None else 0.0
        gen = torch.Generator(device=self.device).manual_seed(_seed_mix(_PROBE, self.keys["seed"], ctx.step))
        held = ctx.heldout(ctx.step, self.n_heldout)
        if self.curvature == "ggn":  # the MSE objective: loss_scale 1/D (iclnoise.model.mse_loss)
            curv, curv_se = precond_ggn_trace(ctx.model, held.xs, held.ys, a, self.probes, gen, 1.0 / self.D)
        else:
            curv, curv_se = precond_hessian_trace(ctx.model, ctx.loss_fn, held.xs, held.ys, a, self.probes, gen)
        c2 = ctx.clip_coef ** 2
        inj_c2 = c2 if (self.injector is None or self.injector.clipped_with_grads) else 1.0
        ne_total, ne_post = ne + ne_inj, c2 * ne + inj_c2 * ne_inj
        den = max(self.floor, curv)
        simple = lr / self.kappa  # η² Σ a²(C/B + R') = (η/κ) · NE
        lam, alpha, pr = leading_eigs(noise.factor, a, self.rank)
        self._rows.append({
            **self.keys, "step": ctx.step, "interval": self.meter.every, "lr": lr,
            "kappa": self.kappa, "update_var": self._upd_var, "update_var_pred": self._upd_pred,
            "groups": noise.factor.shape[0], "group_size": noise.m,
            "grad_norm": float(noise.mean.norm()), "trace_c": noise.trace, "trace_aca": tr_aca,
            "b_simple": b_simple(noise, B), "ne": ne, "ne_injected": ne_inj, "ne_total": ne_total,
            "ne_simple": simple * ne_total, "curv": curv, "curv_se": curv_se, "pne": ne_total / den,
            "clip_coef": ctx.clip_coef, "clip_frac": self._clipped_steps / max(1, self._steps),
            "ne_postclip": ne_post, "pne_postclip": ne_post / den, "ne_simple_postclip": simple * ne_post,
            "aca_eigs": lam.tolist(), "tail_index": alpha, "participation_ratio": pr})
        self.shared["pne_postclip"] = ne_post / den
        self._clipped_steps = self._steps = 0

    def rows(self) -> list[dict]:
        return self._rows

    def state_dict(self) -> dict:
        return {"rows": list(self._rows), "counts": (self._clipped_steps, self._steps),
                "pne": self.shared.get("pne_postclip")}

    def load_state_dict(self, state: dict) -> None:
        self._rows = list(state["rows"])
        self._clipped_steps, self._steps = state["counts"]
        if self.calibrate and self._rows:
            self.kappa = self.shared["kappa"] = self._rows[-1]["kappa"]
        if state["pne"] is not None:
            self.shared["pne_postclip"] = state["pne"]


def build_hooks(spec: dict, device: torch.device) -> list:
    """The step hooks of one run: the injector (if the condition injects) before the exposure logger."""
    cfg = spec.get("exposure") or {}
    meter, shared = NoiseMeter(cfg), {}
    hooks: list = []
    injector = None
    if (spec.get("noise") or {}).get("source", "none") != "none":
        injector = NoiseInjector(spec, meter, shared, device)
        hooks.append(injector)
    if cfg.get("enabled", False):
        hooks.append(ExposureLogger(spec, meter, shared, injector, device))
    return hooks


__all__ = ["CovModel", "psd_clip", "shaped_covariance", "window", "target_at", "PIController", "NoiseMeter", "NoiseInjector",
           "ExposureLogger", "build_hooks", "SHAPES", "SCHEDULES", "INJECTION_SCHEMA"]
