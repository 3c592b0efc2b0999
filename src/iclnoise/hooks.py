"""Stateful training hooks: noise injection and exposure logging (SPEC §5, §6).

The trainer calls, for every step of every run, `on_grads` of each hook in list order after the
backward pass and before clipping, then clips, steps the optimizer, and calls `on_update` of each
hook in *reverse* order (hooks unwind like a stack). `build_hooks` orders them [logger, injector]:

- on_grads:  the logger measures (group gradients, A, diag Ĥ on held-out data) on due steps, then the
             injector sets its scale from Curv = Σ a² diag Ĥ at this step's own A and adds ε to the gradient;
- on_update: the injector records the step's realised (post-clip) injected exposure, then the logger
             writes its row from the exact per-step sums of the interval.

The maths lives in iclnoise.noise (covariances, schedules, controller) and iclnoise.exposure (P-NE);
this module only keeps state between steps. The logger and the injector share one `ExposureState`. Every
state is in `state_dict`, so a killed run resumes to identical numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import pyarrow as pa
import torch
from torch import nn

from .exposure import (
    EXPOSURE_SCHEMA,
    Curvature,
    GradNoise,
    b_simple,
    budget_scale,
    calibrated_kappa,
    ggn_curvature,
    grad_noise,
    group_grads,
    hessian_curvature,
    kappa,
    leading_eigs,
    ne_unit,
    pne_columns,
    preconditioner,
    update_innovation_variance,
)
from .noise import CovModel, PIController, shaped_covariance, target_at, window
from .sections import Exposure, NoiseCondition, enabled
from .tasks import Batch, _seed_mix

_NOISE, _PROBE = 0x7015E, 0xC0A7
MAX_LOG_SCALE = 30.0  # bounds the controller's log-scale
SATURATION = 9.0      # under clipping at G, s ≤ SATURATION·max(|g|², G²/10)/Tr R' reaches 90 % of the most injected
                      # exposure there is, ∝ G²/Tr R' (more noise only replaces the gradient: exposure.budget_scale);
                      # with |g|² < G²/10 that is s = 0.9·G²/Tr R', where the step is not clipped yet


@dataclass
class StepContext:
    step: int                      # 0-based index of the update being made
    total_steps: int
    model: nn.Module               # the run's hooked model (its parameters alias the ensemble's)
    optimizer: object              # the run's AdamW (or a view of its slice of the ensemble's AdamW)
    batch: Batch                   # the full effective batch of this step
    micro_batch: int
    lr: float                      # η_t used by this update
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    heldout: Callable[[int, int], Batch]   # heldout(step, size): q_M batch never used for training
    grad_norm: float | None = None # pre-clip global gradient norm (set by the trainer after on_grads)
    clip_coef: float = 1.0         # factor clipping applied to the gradient


class StepHook(Protocol):
    name: str
    schema: pa.Schema

    def on_grads(self, ctx: StepContext) -> None: ...
    def on_update(self, ctx: StepContext) -> None: ...
    def rows(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class ExposureState:
    """What the exposure logger measures and the injector reads, and the injector's sums the logger's next
    row reports: one per run."""

    curv_diag: torch.Tensor | None = None  # diag Ĥ of the latest measurement: Curv(A) = Σ a² diag Ĥ
    curv_step: int = -1                    # the step it was measured at
    kappa: float | None = None             # calibrated κ (None: the configured one)
    pne_postclip: float | None = None      # the latest row's P-NE* after clipping, until the controller reads it
    ne_injected: float = 0.0               # Σ over the steps since the last row: injected NE (pre-clip)
    pne_injected: float = 0.0              # ... and realised injected P-NE* after clipping

    def take_interval(self) -> tuple[float, float]:
        out = self.ne_injected, self.pne_injected
        self.ne_injected = self.pne_injected = 0.0
        return out


class NoiseMeter:
    """When exposure is measured, and the group gradients of that step, shared by the hooks.

    Due steps: step 0 (so Curv is known before any injection), the end of each interval of `every`
    steps, the last step, and the last step before each injection window opens or closes, so that no
    logged row stands for steps in which a schedule was in another state (SPEC §6)."""

    def __init__(self, cfg: Exposure, total: int, boundaries: tuple[int, ...] = ()):
        self.every, self.total = cfg.every, total
        self.groups, self.per_example = cfg.groups, cfg.per_example
        self.extra = {b - 1 for b in boundaries if 0 < b <= total} | {0, total - 1}
        self._step, self._noise, self.G = -1, None, None

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or step in self.extra

    def measure(self, ctx: StepContext) -> GradNoise:
        if self._step != ctx.step:
            B = len(ctx.batch)
            K = B if self.per_example else min(self.groups, B)
            self.G = group_grads(ctx.model, ctx.loss_fn, ctx.batch.xs, ctx.batch.ys, K)
            self._noise, self._step = grad_noise(self.G, B // K), ctx.step
        return self._noise


INJECTION_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("step", pa.int64()), pa.field("active", pa.bool_()),
    pa.field("scale", pa.float64()),            # s_t multiplying R'
    pa.field("ne_injected", pa.float64()),      # η_t κ Σ a_i² s R'_ii (a before this update), pre-clip
    pa.field("clip_coef", pa.float64()),        # c² multiplies the injected noise (grad source); 1 for param
    pa.field("curv", pa.float64()),             # max(floor, Σ a² diag Ĥ): this step's A, the latest Ĥ (NaN off-window)
    pa.field("pne_injected", pa.float64()),     # realised injected P-NE* after clipping: c² · ne_injected / curv
    pa.field("trace_injected", pa.float64()),   # Tr(s R')
    pa.field("clipped_trace", pa.float64()),    # s · trace removed by PSD clipping (what could not be matched)
    pa.field("clipped_frac", pa.float64()),     # clipped / (clipped + injected) trace
])


class NoiseInjector:
    """Adds N(0, s_t R') to the gradient (source grad) or η A N(0, s_t R') to the weights (source param).

    Levels (SPEC §5): `emulate_batch` (s = 1, R' = (1/B_t − 1/B) Ĉ); `budget` E with schedule constant,
    early or late: s_t is set each step so that the *realised* injected P-NE* after clipping over the
    window adds up to E (closed loop on the cumulative integral: the per-step target is what remains of
    E over the steps that remain, solved for s through the clipping, iclnoise.exposure.budget_scale);
    `controlled`: a PI controller on log P-NE* after clipping, started from the open-loop estimate.
    Each step's P-NE* divides its NE by Curv_t = Σ a_t² diag Ĥ, both with this step's A (SPEC §6)."""

    name, schema = "injection", INJECTION_SCHEMA

    def __init__(self, spec: dict, noise: NoiseCondition, exposure: Exposure, meter: NoiseMeter,
                 state: ExposureState, device: torch.device):
        n, t = noise, spec["train"]
        self.run_id, self.seed = spec["keys"]["run_id"], spec["keys"]["seed"]
        self.batch, self.total, self.clip = spec["keys"]["batch"], t["steps"], t["grad_clip"]
        self.source, self.shape, self.rank, self.schedule = n.source, n.shape, n.rank, n.schedule
        self.start, self.stop = window(self.schedule, self.total, n.window_fraction)
        self.emulate = n.emulate_batch
        self.coef = (1.0 / self.emulate - 1.0 / self.batch) if self.emulate else 1.0
        self.budget = n.budget
        self.kappa, self.floor = kappa(exposure.kappa, t["optimizer"]["betas"][0]), exposure.floor
        self.ctl = (PIController(n.target, n.controller.kp, n.controller.ki)
                    if self.schedule == "controlled" else None)
        self.ctl_started = False
        self.meter, self.state, self.device = meter, state, device
        self.cov: CovModel | None = None
        self.clipped = 0.0
        self._cached: tuple[CovModel | None, torch.Tensor | None] = (None, None)
        self.realised = 0.0                     # Σ injected P-NE* after clipping so far
        self._rows: list[dict] = []
        self._eps: torch.Tensor | None = None
        self._pending: dict | None = None
        self._plist: list[torch.Tensor] | None = None

    @property
    def _diag(self) -> torch.Tensor:
        """diag(R') of the current covariance (cached per covariance)."""
        if self._cached[0] is not self.cov:
            self._cached = (self.cov, self.cov.diag())
        return self._cached[1]

    @property
    def _trace(self) -> float:
        return float(self._diag.sum())

    def _refresh(self, ctx: StepContext) -> None:
        self.cov, self.clipped = shaped_covariance(self.meter.measure(ctx), self.coef, self.shape, self.rank)

    def _kappa(self) -> float:
        return self.kappa if self.state.kappa is None else self.state.kappa

    def _curv(self, a: torch.Tensor) -> float:
        """Curv_t = max(floor, Tr(A_t Ĥ A_t)) with this step's A_t (SPEC §6), Ĥ's diagonal from the latest row;
        NaN before any measurement."""
        if self.state.curv_diag is None:
            return math.nan
        return max(self.floor, float((a.square() * self.state.curv_diag).sum()))

    def _scale(self, ctx: StepContext, a: torch.Tensor, curv: float) -> float:
        unit = ne_unit(ctx.lr, self._kappa(), a, self._diag)
        if self.ctl is not None:
            pne, self.state.pne_postclip = self.state.pne_postclip, None
            if not self.ctl_started:  # open-loop start: the scale that reaches the target by itself
                s0 = budget_scale(target_at(self.ctl.target, ctx.step / self.total), curv, unit,
                                  self._grad_sq(ctx), self._trace, self.clip)
                self.ctl.u = self.ctl.log_s = min(MAX_LOG_SCALE, math.log(s0)) if 0 < s0 else -MAX_LOG_SCALE
                self.ctl_started = True
                return math.exp(self.ctl.log_s)
            return self.ctl.update(pne, ctx.step / self.total) if pne is not None else math.exp(self.ctl.log_s)
        if self.budget is None:
            return 1.0
        left, g2 = self.stop - ctx.step, self._grad_sq(ctx)
        s = budget_scale(max(0.0, self.budget - self.realised) / left, curv, unit, g2, self._trace, self.clip)
        if self.clip is not None and self._trace > 0:  # an unreachable target saturates, it does not explode
            s = min(s, SATURATION * max(g2, self.clip ** 2 / (1 + SATURATION)) / self._trace)
        return min(s, math.exp(MAX_LOG_SCALE))

    def _params(self, ctx: StepContext) -> list[torch.Tensor]:
        """The run's parameters, listed once (a hooked model's `parameters()` walks every hook point)."""
        if self._plist is None:
            self._plist = list(ctx.model.parameters())
        return self._plist

    def _grad_sq(self, ctx: StepContext) -> float:
        return float(torch.stack(torch._foreach_norm([p.grad for p in self._params(ctx)])).square().sum())

    def on_grads(self, ctx: StepContext) -> None:
        if self.meter.due(ctx.step) or self.cov is None:
            self._refresh(ctx)
        active = self.start <= ctx.step < self.stop
        a = preconditioner(ctx.optimizer) if active else None   # outside the window: nothing to scale
        curv = self._curv(a) if active else math.nan
        s = self._scale(ctx, a, curv) if active else 0.0
        ne = s * ne_unit(ctx.lr, self._kappa(), a, self._diag) if s > 0 else 0.0
        self._pending = {"run_id": self.run_id, "step": ctx.step, "active": active, "scale": s, "ne_injected": ne,
                         "curv": curv, "trace_injected": s * self._trace, "clipped_trace": s * self.clipped}
        self._eps = None
        if s <= 0:
            return
        gen = torch.Generator(device=self.device).manual_seed(_seed_mix(_NOISE, self.seed, ctx.step))
        eps = self.cov.sample(gen) * math.sqrt(s)
        params = self._params(ctx)
        if self.source == "grad":
            for p, e in zip(params, eps.split([p.numel() for p in params])):
                p.grad.add_(e.view_as(p))
        elif self.shape == "isotropic":  # isotropic in parameter space: τ² I with τ² P = η² Tr(A sR' A) (SPEC §5)
            tau2 = ctx.lr ** 2 * float((a.square() * self._diag).sum()) * s / a.numel()
            z = torch.randn(a.numel(), generator=gen, device=a.device, dtype=a.dtype)
            self._eps = z * math.sqrt(tau2)
        else:
            self._eps = ctx.lr * a * eps

    def on_update(self, ctx: StepContext) -> None:
        row, self._pending = self._pending, None
        c2 = ctx.clip_coef ** 2 if self.source == "grad" else 1.0
        pne = c2 * row["ne_injected"] / row["curv"] if row["ne_injected"] > 0 and row["curv"] > 0 else 0.0
        self.realised += pne
        tr, clip = row["trace_injected"], row["clipped_trace"]
        self._rows.append({**row, "clip_coef": c2, "pne_injected": pne,
                           "clipped_frac": clip / (clip + tr) if clip + tr > 0 else 0.0})
        self.state.ne_injected += row["ne_injected"]
        self.state.pne_injected += pne
        if self._eps is not None:
            params = self._params(ctx)
            with torch.no_grad():
                for p, z in zip(params, self._eps.split([p.numel() for p in params])):
                    p.add_(z.view_as(p))
            self._eps = None

    def rows(self) -> list[dict]:
        return self._rows

    def state_dict(self) -> dict:
        return {"cov": None if self.cov is None else self.cov.state_dict(), "clipped": self.clipped,
                "rows": list(self._rows), "realised": self.realised, "ctl_started": self.ctl_started,
                "ctl": None if self.ctl is None else (self.ctl.u, self.ctl.log_s)}

    def load_state_dict(self, state: dict) -> None:
        self.cov = None if state["cov"] is None else CovModel(**{k: v.to(self.device) for k, v in state["cov"].items()})
        self.clipped, self._rows, self.realised = state["clipped"], list(state["rows"]), state["realised"]
        self.ctl_started = state["ctl_started"]
        if self.ctl is not None:
            self.ctl.u, self.ctl.log_s = state["ctl"]


class ExposureLogger:
    """On due steps: the exposure row of EXPOSURE_SCHEMA (iclnoise.exposure). One A per row: the
    preconditioner before this update (v̂ of the previous steps; at step 0 the v̂_1 = g² the first update
    uses) enters NE and Curv alike; the injected columns are sums of per-step values, each with its own A.

    With an injector it also measures diag Ĥ alone (no row) every `curvature_every` steps inside the
    injection window, and whenever none has been measured yet (a resume state written before the state kept
    diag Ĥ): the closed loop's divisor Σ a_t² diag Ĥ then follows Ĥ as well as A."""

    name, schema = "exposure", EXPOSURE_SCHEMA

    def __init__(self, spec: dict, cfg: Exposure, meter: NoiseMeter, state: ExposureState,
                 window: tuple[int, int] | None, device: torch.device):
        self.keys, self.batch, self.total = spec["keys"], spec["keys"]["batch"], spec["train"]["steps"]
        self.beta1 = spec["train"]["optimizer"]["betas"][0]
        self.kappa, self.calibrate = kappa(cfg.kappa, self.beta1), cfg.kappa == "calibrated"
        self.probes, self.n_heldout = cfg.curvature_probes, cfg.heldout
        self.floor, self.rank = cfg.floor, cfg.eig_rank
        self.curvature, self.curv_every, self.D = cfg.curvature, cfg.curvature_every, spec["data"]["D"]
        self.meter, self.state, self.window, self.device = meter, state, window, device
        self._rows: list[dict] = []
        self._m: dict | None = None
        self._last, self._clipped_steps, self._steps = -1, 0, 0

    def _refresh_due(self, step: int) -> bool:
        """diag Ĥ alone is due: none measured yet, or `curvature_every` steps old inside the injection window."""
        if self.window is None:
            return False
        st, (start, stop) = self.state, self.window
        return st.curv_diag is None or (start <= step < stop and step - st.curv_step >= self.curv_every)

    def _measure_curvature(self, ctx: StepContext) -> Curvature:
        """Hutchinson diag Ĥ on this step's held-out batch, kept in the shared state."""
        gen = torch.Generator(device=self.device).manual_seed(_seed_mix(_PROBE, self.keys["seed"], ctx.step))
        held = ctx.heldout(ctx.step, self.n_heldout)
        if self.curvature == "ggn":  # the MSE objective: loss_scale 1/D (iclnoise.model.mse_loss)
            hess = ggn_curvature(ctx.model, held.xs, held.ys, self.probes, gen, 1.0 / self.D)
        else:
            hess = hessian_curvature(ctx.model, ctx.loss_fn, held.xs, held.ys, self.probes, gen)
        self.state.curv_diag, self.state.curv_step = hess.diag, ctx.step
        return hess

    def on_grads(self, ctx: StepContext) -> None:
        self._m = None
        if not self.meter.due(ctx.step):
            if self._refresh_due(ctx.step):
                self._measure_curvature(ctx)
            return
        noise = self.meter.measure(ctx)
        a = preconditioner(ctx.optimizer)
        upd_var = update_innovation_variance(ctx.optimizer, self.meter.G, self.batch)
        a_state = preconditioner(ctx.optimizer, fallback_grads=False)
        upd_pred = (ctx.lr ** 2 * float((a_state.square() * noise.diag).sum()) / self.batch
                    if a_state is not None else math.nan)
        if self.calibrate:
            k = calibrated_kappa([r["update_var"] for r in self._rows] + [upd_var],
                                 [r["update_var_pred"] for r in self._rows] + [upd_pred], self.beta1)
            if math.isfinite(k):
                self.kappa = self.state.kappa = k
        curv, curv_se = self._measure_curvature(ctx).at(a)
        self._m = {"noise": noise, "a": a, "curv": curv, "curv_se": curv_se, "upd_var": upd_var,
                   "upd_pred": upd_pred}

    def on_update(self, ctx: StepContext) -> None:
        self._steps += 1
        self._clipped_steps += ctx.clip_coef < 1.0
        if self._m is None:
            return
        m, B, lr = self._m, self.batch, ctx.lr
        noise, a = m["noise"], m["a"]
        interval = ctx.step - self._last
        ne_inj, pne_inj = self.state.take_interval()
        cols = pne_columns(lr, self.kappa, B, a, noise.diag, m["curv"], self.floor, ctx.clip_coef,
                           ne_inj / interval, pne_inj / interval)  # exact interval means
        lam, alpha, pr = leading_eigs(noise.factor, a, self.rank)
        self._rows.append({
            **self.keys, "step": ctx.step, "interval": interval, "lr": lr,
            "kappa": self.kappa, "update_var": m["upd_var"], "update_var_pred": m["upd_pred"],
            "groups": noise.factor.shape[0], "group_size": noise.m,
            "grad_norm": float(noise.mean.norm()), "trace_c": noise.trace,
            "b_simple": b_simple(noise, B), "curv": m["curv"], "curv_se": m["curv_se"],
            "clip_coef": ctx.clip_coef, "clip_frac": self._clipped_steps / max(1, self._steps), **cols,
            "aca_eigs": lam.tolist(), "tail_index": alpha, "participation_ratio": pr})
        self.state.pne_postclip = cols["pne_postclip"]
        self._last, self._m = ctx.step, None
        self._clipped_steps = self._steps = 0

    def rows(self) -> list[dict]:
        return self._rows

    def state_dict(self) -> dict:
        return {"rows": list(self._rows), "counts": (self._clipped_steps, self._steps), "last": self._last,
                "state": asdict(self.state)}

    def load_state_dict(self, state: dict) -> None:
        self._rows = list(state["rows"])
        self._clipped_steps, self._steps = state["counts"]
        self._last = state["last"]
        if "state" in state:
            vars(self.state).update(state["state"])
        else:  # written before ExposureState: no diag Ĥ (on_grads measures it again) and no interval sums
            old = state["shared"]
            vars(self.state).update(kappa=old.get("kappa"), pne_postclip=old.get("pne_postclip"))
        if self.calibrate and self.state.kappa is not None:
            self.kappa = self.state.kappa


def build_hooks(spec: dict, device: torch.device) -> list[StepHook]:
    """The step hooks of one run, [exposure logger, injector] (either may be absent); injected noise
    needs the exposure section, which measures the covariance it is shaped from (validated). The spec's
    `exposure` and `noise` dicts become typed sections here, once."""
    noise = NoiseCondition.of_spec(spec)
    log_exposure = enabled(spec.get("exposure"))
    if noise.source == "none" and not log_exposure:
        return []
    cfg, total = Exposure.from_dict(spec["exposure"]), spec["train"]["steps"]
    bounds = window(noise.schedule, total, noise.window_fraction) if noise.source != "none" else ()
    meter, state = NoiseMeter(cfg, total, tuple(bounds)), ExposureState()
    injector = NoiseInjector(spec, noise, cfg, meter, state, device) if noise.source != "none" else None
    hooks: list[StepHook] = []
    if log_exposure or injector is not None:  # injection needs Curv and the covariance: the logger measures
        hooks.append(ExposureLogger(spec, cfg, meter, state, tuple(bounds) or None, device))
    if injector is not None:
        hooks.append(injector)
    return hooks
