"""Noise injection (method §5): the step hook that adds N(0, s_t R') to a run's gradient or weights, with its level
set open loop (emulate_batch), by a closed loop on the realised exposure (budget) or by a PI controller (target).
The maths lives in iclnoise.noise and iclnoise.noise.exposure; iclnoise.noise.hooks has the step protocol and the
exposure state this hook shares with the exposure logger.

Two paths, one set of numbers: an ensemble (iclnoise.run.ensemble) runs its injectors of every shape and level (a
budget's closed loop, emulate_batch's scale 1, the PI controller) for all their runs at once
(iclnoise.noise.batched: no host read on the step); sgd_momentum's and an injector beside another hook run per run
(NoiseInjector.on_grads / on_update). The log says which path an ensemble's condition takes. Both draw each run's
noise from its own stream and book its rows with NoiseInjector.book.
"""
from __future__ import annotations

import math

import pyarrow as pa
import torch

from ..core import rng
from ..core.runspec import RunSpec
from ..core.tasks import seed_mix
from .covariance import CovModel, PIController, parameter_mask, restricted, shaped_covariance, target_at
from .exposure import budget_scale, kappa, ne_unit, preconditioner
from .hooks import ExposureState, NoiseMeter, StepContext
from .nap import NAP_SHAPES, NapEstimator

_NOISE, _NOISE_SEED = 0x7015E, 0x5EED   # the injected noise's stream; its noise_seed's tag
MAX_LOG_SCALE = 30.0  # bounds the controller's log-scale
SATURATION = 9.0      # under clipping at G, s ≤ SATURATION·max(|g|², G²/10)/Tr R' reaches 90 % of the most injected
                      # exposure there is, ∝ G²/Tr R' (more noise only replaces the gradient: exposure.budget_scale);
                      # with |g|² < G²/10 that is s = 0.9·G²/Tr R', where the step is not clipped yet


INJECTION_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("step", pa.int64()), pa.field("active", pa.bool_()),
    pa.field("scale", pa.float64()),            # s_t multiplying R'
    pa.field("ne_injected", pa.float64()),      # η_t κ Σ a_i² s R'_ii (a before this update), pre-clip
    pa.field("clip_coef", pa.float64()),        # c² multiplies the injected noise (grad source); 1 for param
    pa.field("curv", pa.float64()),             # max(floor, Σ a² diag Ĥ): this step's A, the latest Ĥ (NaN off-window)
    pa.field("pne_injected", pa.float64()),     # realised injected P-NE* after clipping: c² · ne_injected / curv
    pa.field("pne_injected_se", pa.float64()),  # its standard error from diag Ĥ's Hutchinson error: pne · rse(Ĥ)
    pa.field("curv_step", pa.int64()),          # the step diag Ĥ was measured at (steps sharing it share its error)
    pa.field("trace_injected", pa.float64()),   # Tr(s R')
    pa.field("clipped_trace", pa.float64()),    # s · trace removed by PSD clipping (what could not be matched)
    pa.field("clipped_frac", pa.float64()),     # clipped / (clipped + injected) trace
    pa.field("alignment", pa.float64()),        # NAP shapes: cos_F(R', Σ̂_b) with the latest refresh's between-task
])                                              # gradient covariance (iclnoise.noise.nap); NaN for the other shapes


def closed_loop_scale(left: float | torch.Tensor, steps_left: int | torch.Tensor, curv: float | torch.Tensor,
                      unit: float | torch.Tensor, grad_sq: float | torch.Tensor, trace: float | torch.Tensor,
                      clip: float | torch.Tensor | None) -> torch.Tensor:
    """s_t of a budget injector (method §5): what is left of the budget, max(0, E − realised), over the steps left in
    the window is this step's target, solved for s through the clipping (exposure.budget_scale); under clipping s is
    capped at SATURATION·max(|g|², G²/(1 + SATURATION))/Tr R' (an unreachable target saturates, it does not
    explode), and always at e^MAX_LOG_SCALE. Floats give a 0-d tensor, (R,) tensors the R runs' scales (float64);
    clip None or ∞: not clipped."""
    f64 = torch.float64
    left, trace, grad_sq = (torch.as_tensor(x, dtype=f64) for x in (left, trace, grad_sq))
    s = budget_scale(left.clamp(min=0.0) / steps_left, curv, unit, grad_sq, trace, clip)
    clip = torch.as_tensor(math.inf if clip is None else clip, dtype=f64)
    bound = SATURATION * torch.maximum(grad_sq, clip ** 2 / (1 + SATURATION)) / trace
    s = torch.where(clip.isfinite() & (trace > 0), torch.minimum(s, bound), s)
    return s.clamp(max=math.exp(MAX_LOG_SCALE))


def counter_noise(sqrt_d: torch.Tensor, U: torch.Tensor, sqrt_lam: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """n runs' ε ~ N(0, R'), R' = U diag(lam) Uᵀ + diag(d), from their counter-stream normals w (n, 2P + r):
    ε = √d ⊙ w[:, :P] + U (√lam ⊙ w[:, 2P:]) (words [P, 2P) are isotropic noise's z). sqrt_d (n, P), U (n, P, r),
    sqrt_lam (n, r). The product U v is a product and a sum along r, whose rounding does not depend on n (a batched
    matmul's does: the per-run and batched paths parted by 3e-7 within two steps, which NAP's eigenbases amplified)."""
    P, r = U.shape[1:]
    eps = sqrt_d * w[:, :P]
    return eps + (U * (sqrt_lam * w[:, 2 * P:2 * P + r])[:, None, :]).sum(-1) if r else eps


class NoiseInjector:
    """Adds N(0, s_t R') to the gradient (source grad) or η A N(0, s_t R') to the weights (source param).

    Levels (method §5): `emulate_batch` (s = 1, R' = (1/B_t − 1/B) Ĉ); `budget` E with schedule constant,
    early or late: s_t is set each step so that the *realised* injected P-NE* after clipping over the
    window adds up to E (closed loop on the cumulative integral: the per-step target is what remains of
    E over the steps that remain, solved for s through the clipping, iclnoise.noise.exposure.budget_scale);
    `controlled`: a PI controller on log P-NE* after clipping, started from the open-loop estimate.
    Each step's P-NE* divides its NE by Curv_t = Σ a_t² diag Ĥ, both with this step's A (method §6)."""

    name, schema = "injection", INJECTION_SCHEMA

    def __init__(self, spec: RunSpec, meter: NoiseMeter, state: ExposureState, device: torch.device):
        n, t, exposure = spec.noise, spec.train, spec.exposure
        self.run_id, self.seed = spec.keys.run_id, spec.keys.seed
        self.counter = t.rng == "counter"   # draws from the counter-based stream (iclnoise.core.rng), keyed noise_key
        self.keys = (self.seed,) if n.noise_seed is None else (self.seed, _NOISE_SEED, n.noise_seed)
        self.noise_key = seed_mix(_NOISE, *self.keys)
        self.batch, self.total, self.clip = spec.keys.batch, t.steps, t.grad_clip
        self.source, self.shape, self.rank, self.schedule = n.source, n.shape, n.rank, n.schedule
        self.start, self.stop = spec.window
        self.emulate = n.emulate_batch
        self.coef = (1.0 / self.emulate - 1.0 / self.batch) if self.emulate else 1.0
        self.budget = n.budget
        self.kappa, self.floor = kappa(exposure.kappa, t.optimizer.momentum, t.optimizer.KIND), exposure.floor
        self.ctl = (PIController(n.target, n.controller.kp, n.controller.ki)
                    if self.schedule == "controlled" else None)
        self.ctl_started = False
        self.meter, self.state, self.device = meter, state, device
        self.cov: CovModel | None = None
        self.clipped = 0.0
        self._cached: tuple[CovModel | None, torch.Tensor | None, float | None] = (None, None, None)
        self.realised = 0.0                     # Σ injected P-NE* after clipping so far
        self._rows: list[dict] = []
        self._eps: torch.Tensor | None = None
        self.keep_draw = False   # keep each step's injected draw as `drawn` (iclnoise.run.pathwise reads it)
        self.drawn: torch.Tensor | None = None
        self._pending: dict | None = None
        self._plist: list[torch.Tensor] | None = None
        self.nap = (NapEstimator(n.shape, n.rank, n.nap_tasks, n.nap_per_task, n.nap_memory, spec.data.K,
                                 spec.data.noise_var, self.seed) if n.shape in NAP_SHAPES else None)
        self.alignment = math.nan
        self.layers = n.layers
        self.mask: torch.Tensor | None = None   # noise.layers' 0/1 mask over the flat parameters (`restrict`)
        self.support: int | None = None         # the number of coordinates it is on (None: all)

    def restrict(self, model: torch.nn.Module) -> None:
        """Build noise.layers' mask from the run's model (before training: a layer that names no parameter is an error
        then, not at step 0 of an ensemble); nothing without noise.layers."""
        if self.layers:
            names = [(n, p.numel()) for n, p in model.named_parameters()]
            mask = parameter_mask(names, self.layers)
            self.mask, self.support = mask.to(self.device), int(mask.sum())

    @property
    def _diag(self) -> torch.Tensor:
        """diag(R') of the current covariance (cached per covariance)."""
        if self._cached[0] is not self.cov:
            self._cached = (self.cov, self.cov.diag(), None)
        return self._cached[1]

    @property
    def _trace(self) -> float:
        """Tr R' of the current covariance, read once per covariance."""
        diag = self._diag
        if self._cached[2] is None:
            self._cached = (self.cov, diag, float(diag.sum()))
        return self._cached[2]

    def _refresh(self, ctx: StepContext) -> None:
        """R' anew from this step's measurement, restricted to noise.layers' parameters where it names some (the
        clipped trace and a NAP shape's alignment stay the whole R''s)."""
        if self.nap is not None:   # its own measurement: per-task gradients of the batch's tasks (iclnoise.noise.nap)
            self.cov, self.alignment = self.nap.refresh(ctx.model, ctx.loss_fn, ctx.batch.tasks, ctx.step)
        else:
            self.cov, self.clipped = shaped_covariance(self.meter.measure(ctx), self.coef, self.shape, self.rank)
        if self.mask is not None:
            self.cov = restricted(self.cov, self.mask)

    def _kappa(self) -> float:
        return self.kappa if self.state.kappa is None else self.state.kappa

    def _curv(self, a: torch.Tensor) -> float:
        """Curv_t = max(floor, Tr(A_t Ĥ A_t)) with this step's A_t (method §6), Ĥ's diagonal from the latest row;
        NaN before any measurement."""
        if self.state.curv_diag is None:
            return math.nan
        return max(self.floor, float((a.square() * self.state.curv_diag).sum()))

    def _scale(self, ctx: StepContext, a: torch.Tensor, curv: float) -> float:
        """s_t of this step. Only the grad source's noise is clipped with the gradient: the param source's enters the
        weights after the update, so its scale is solved without the clipping factor or the saturation bound."""
        unit = ne_unit(ctx.lr, self._kappa(), a, self._diag)
        clip = self.clip if self.source == "grad" else None
        if self.ctl is not None:
            pne, self.state.pne_postclip = self.state.pne_postclip, None
            if not self.ctl_started:  # open-loop start: the scale that reaches the target by itself
                s0 = float(budget_scale(target_at(self.ctl.target, ctx.step / self.total), curv, unit,
                                        self._grad_sq(ctx), self._trace, clip))
                self.ctl.u = self.ctl.log_s = min(MAX_LOG_SCALE, math.log(s0)) if 0 < s0 else -MAX_LOG_SCALE
                self.ctl_started = True
                return math.exp(self.ctl.log_s)
            return self.ctl.update(pne, ctx.step / self.total) if pne is not None else math.exp(self.ctl.log_s)
        if self.budget is None:
            return 1.0
        return float(closed_loop_scale(self.budget - self.realised, self.stop - ctx.step, curv, unit,
                                       self._grad_sq(ctx), self._trace, clip))

    def _params(self, ctx: StepContext) -> list[torch.Tensor]:
        """The run's parameters, listed once (a hooked model's `parameters()` walks every hook point)."""
        if self._plist is None:
            self._plist = list(ctx.model.parameters())
        return self._plist

    def _grad_sq(self, ctx: StepContext) -> float:
        return float(torch.stack(torch._foreach_norm([p.grad for p in self._params(ctx)])).square().sum())

    def acts(self, step: int) -> bool:
        return True   # a row every step

    @property
    def batched(self) -> bool:
        """BatchedInjection runs it for a whole ensemble: every shape and level (budget, emulate_batch, the PI
        controller)."""
        return True

    def draw(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step `step`'s unscaled draws from the run's own stream: ε₁ ~ N(0, R') and, for isotropic parameter
        noise, z ~ N(0, I) after it. Counter stream: words [0, P) are ε₁'s diagonal part, [P, 2P) z, [2P, 2P + r)
        its low-rank part (BatchedInjection draws the first 2P of many runs at once)."""
        iso = self.source == "param" and self.shape == "isotropic"
        cov = self.cov
        if self.counter:
            P, r = cov.U.shape
            w = rng.normal(rng.bits(torch.tensor([self.noise_key], device=self.device), step, 2 * P + r), cov.d.dtype)
            eps = counter_noise(cov.d.sqrt()[None], cov.U[None], cov.lam.sqrt()[None], w)[0]
            return eps, self._masked(w[0, P:2 * P]) if iso else None
        gen = torch.Generator(device=self.device).manual_seed(seed_mix(_NOISE, *self.keys[:1], step, *self.keys[1:]))
        eps = cov.sample(gen)
        return eps, self._masked(torch.randn(eps.numel(), generator=gen, device=eps.device, dtype=eps.dtype)) \
            if iso else None

    def _masked(self, z: torch.Tensor) -> torch.Tensor:
        """Isotropic noise's z on noise.layers' coordinates only (R' is restricted where it is measured)."""
        return z if self.mask is None else z * self.mask.to(z)

    def pending(self, step: int, active: bool, s: float, ne: float, curv: float) -> dict:
        """The step's row as on_grads knows it (on_update completes it: `book`)."""
        return {"run_id": self.run_id, "step": step, "active": active, "scale": s, "ne_injected": ne, "curv": curv,
                "trace_injected": s * self._trace, "clipped_trace": s * self.clipped,
                "curv_step": self.state.curv_step, "curv_rse": self.state.curv_rse, "alignment": self.alignment}

    def on_grads(self, ctx: StepContext) -> None:
        if self.meter.due(ctx.step) or self.cov is None:
            self._refresh(ctx)
        active = self.start <= ctx.step < self.stop
        a = preconditioner(ctx.adam) if active else None   # outside the window: nothing to scale
        curv = self._curv(a) if active else math.nan
        s = self._scale(ctx, a, curv) if active else 0.0
        ne = s * ne_unit(ctx.lr, self._kappa(), a, self._diag) if s > 0 else 0.0
        self._pending = self.pending(ctx.step, active, s, ne, curv)
        self._eps = self.drawn = None
        if s <= 0:
            return
        eps, z = self.draw(ctx.step)
        eps = eps * math.sqrt(s)
        params = self._params(ctx)
        if self.source == "grad":
            for p, e in zip(params, eps.split([p.numel() for p in params])):
                p.grad.add_(e.view_as(p))
            self.drawn = eps if self.keep_draw else None
        elif z is not None:  # isotropic in parameter space: τ² I with τ² P = η² Tr(A sR' A) (method §5), P the
            tau2 = ctx.lr ** 2 * float((a.square() * self._diag).sum()) * s / (self.support or a.numel())  # support
            self._eps = z * math.sqrt(tau2)
        else:
            self._eps = ctx.lr * a * eps
        if self.keep_draw and self.source == "param":
            self.drawn = self._eps

    def book(self, row: dict, c2: float, pne: float) -> None:
        """Complete the step's row with its clipping factor c² and realised P-NE* after clipping, and add them to
        the run's sums (the realised budget, the exposure state's interval sums)."""
        self.realised += pne
        tr, clip = row["trace_injected"], row["clipped_trace"]
        rse = row.pop("curv_rse")
        self._rows.append({**row, "clip_coef": c2, "pne_injected": pne, "pne_injected_se": pne * rse if pne else 0.0,
                           "clipped_frac": clip / (clip + tr) if clip + tr > 0 else 0.0})
        self.state.ne_injected += row["ne_injected"]
        self.state.pne_injected += pne
        self.state.dose_open += self._rows[-1]["pne_injected_se"]

    def on_update(self, ctx: StepContext) -> None:
        row, self._pending = self._pending, None
        c2 = float(ctx.clip_coef) ** 2 if self.source == "grad" else 1.0
        pne = c2 * row["ne_injected"] / row["curv"] if row["ne_injected"] > 0 and row["curv"] > 0 else 0.0
        self.book(row, c2, pne)
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
                "ctl": None if self.ctl is None else (self.ctl.u, self.ctl.log_s),
                "nap": None if self.nap is None else {**self.nap.state_dict(), "alignment": self.alignment}}

    def load_state_dict(self, state: dict) -> None:
        self.cov = None if state["cov"] is None else CovModel(**{k: v.to(self.device) for k, v in state["cov"].items()})
        self.clipped, self._rows, self.realised = state["clipped"], list(state["rows"]), state["realised"]
        self.ctl_started = state["ctl_started"]
        if self.ctl is not None:
            self.ctl.u, self.ctl.log_s = state["ctl"]
        if self.nap is not None:
            self.nap.load_state_dict(state["nap"], self.device)
            self.alignment = state["nap"]["alignment"]
