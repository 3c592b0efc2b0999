"""Noise injection (SPEC §5): the step hook that adds N(0, s_t R') to a run's gradient or weights, with its level
set open loop (emulate_batch), by a closed loop on the realised exposure (budget) or by a PI controller (target).
The maths lives in iclnoise.noise and iclnoise.exposure; iclnoise.hooks has the step protocol and the exposure
state this hook shares with the exposure logger.
"""
from __future__ import annotations

import math

import pyarrow as pa
import torch

from .exposure import budget_scale, kappa, ne_unit, preconditioner
from .hooks import ExposureState, NoiseMeter, StepContext, Unrecorded
from .nap import NAP_SHAPES, NapEstimator
from .noise import CovModel, PIController, shaped_covariance, target_at
from .sections import RunSpec
from .tasks import seed_mix

_NOISE = 0x7015E
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
])                                              # gradient covariance (iclnoise.nap); NaN for the other shapes


class NoiseInjector:
    """Adds N(0, s_t R') to the gradient (source grad) or η A N(0, s_t R') to the weights (source param).

    Levels (SPEC §5): `emulate_batch` (s = 1, R' = (1/B_t − 1/B) Ĉ); `budget` E with schedule constant,
    early or late: s_t is set each step so that the *realised* injected P-NE* after clipping over the
    window adds up to E (closed loop on the cumulative integral: the per-step target is what remains of
    E over the steps that remain, solved for s through the clipping, iclnoise.exposure.budget_scale);
    `controlled`: a PI controller on log P-NE* after clipping, started from the open-loop estimate.
    Each step's P-NE* divides its NE by Curv_t = Σ a_t² diag Ĥ, both with this step's A (SPEC §6)."""

    name, schema = "injection", INJECTION_SCHEMA

    def __init__(self, spec: RunSpec, meter: NoiseMeter, state: ExposureState, device: torch.device):
        n, t, exposure = spec.noise, spec.train, spec.exposure
        self.run_id, self.seed = spec.keys.run_id, spec.keys.seed
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
        self._cached: tuple[CovModel | None, torch.Tensor | None] = (None, None)
        self.realised = 0.0                     # Σ injected P-NE* after clipping so far
        self._rows: list[dict] = []
        self._eps: torch.Tensor | None = None
        self._pending: dict | None = None
        self._plist: list[torch.Tensor] | None = None
        self.nap = (NapEstimator(n.shape, n.rank, n.nap_tasks, n.nap_per_task, n.nap_memory, spec.data.K,
                                 spec.data.noise_var, self.seed) if n.shape in NAP_SHAPES else None)
        self.alignment = math.nan

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
        if self.nap is not None:   # its own measurement: per-task gradients of the batch's tasks (iclnoise.nap)
            self.cov, self.alignment = self.nap.refresh(ctx.model, ctx.loss_fn, ctx.batch.tasks, ctx.step)
            return
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
        """s_t of this step. Only the grad source's noise is clipped with the gradient: the param source's enters the
        weights after the update, so its scale is solved without the clipping factor or the saturation bound."""
        unit = ne_unit(ctx.lr, self._kappa(), a, self._diag)
        clip = self.clip if self.source == "grad" else None
        if self.ctl is not None:
            pne, self.state.pne_postclip = self.state.pne_postclip, None
            if not self.ctl_started:  # open-loop start: the scale that reaches the target by itself
                s0 = budget_scale(target_at(self.ctl.target, ctx.step / self.total), curv, unit,
                                  self._grad_sq(ctx), self._trace, clip)
                self.ctl.u = self.ctl.log_s = min(MAX_LOG_SCALE, math.log(s0)) if 0 < s0 else -MAX_LOG_SCALE
                self.ctl_started = True
                return math.exp(self.ctl.log_s)
            return self.ctl.update(pne, ctx.step / self.total) if pne is not None else math.exp(self.ctl.log_s)
        if self.budget is None:
            return 1.0
        left, g2 = self.stop - ctx.step, self._grad_sq(ctx)
        s = budget_scale(max(0.0, self.budget - self.realised) / left, curv, unit, g2, self._trace, clip)
        if clip is not None and self._trace > 0:  # an unreachable target saturates, it does not explode
            s = min(s, SATURATION * max(g2, clip ** 2 / (1 + SATURATION)) / self._trace)
        return min(s, math.exp(MAX_LOG_SCALE))

    def _params(self, ctx: StepContext) -> list[torch.Tensor]:
        """The run's parameters, listed once (a hooked model's `parameters()` walks every hook point)."""
        if self._plist is None:
            self._plist = list(ctx.model.parameters())
        return self._plist

    def _grad_sq(self, ctx: StepContext) -> float:
        return float(torch.stack(torch._foreach_norm([p.grad for p in self._params(ctx)])).square().sum())

    def acts(self, step: int) -> bool:
        return True   # a row every step

    def on_grads(self, ctx: StepContext) -> None:
        if self.meter.due(ctx.step) or self.cov is None:
            self._refresh(ctx)
        active = self.start <= ctx.step < self.stop
        a = preconditioner(ctx.adam) if active else None   # outside the window: nothing to scale
        curv = self._curv(a) if active else math.nan
        s = self._scale(ctx, a, curv) if active else 0.0
        ne = s * ne_unit(ctx.lr, self._kappa(), a, self._diag) if s > 0 else 0.0
        self._pending = {"run_id": self.run_id, "step": ctx.step, "active": active, "scale": s, "ne_injected": ne,
                         "curv": curv, "trace_injected": s * self._trace, "clipped_trace": s * self.clipped,
                         "curv_step": self.state.curv_step, "curv_rse": self.state.curv_rse,
                         "alignment": self.alignment}
        self._eps = None
        if s <= 0:
            return
        gen = torch.Generator(device=self.device).manual_seed(seed_mix(_NOISE, self.seed, ctx.step))
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
        c2 = float(ctx.clip_coef) ** 2 if self.source == "grad" else 1.0
        pne = c2 * row["ne_injected"] / row["curv"] if row["ne_injected"] > 0 and row["curv"] > 0 else 0.0
        self.realised += pne
        tr, clip = row["trace_injected"], row["clipped_trace"]
        rse = row.pop("curv_rse")
        self._rows.append({**row, "clip_coef": c2, "pne_injected": pne, "pne_injected_se": pne * rse if pne else 0.0,
                           "clipped_frac": clip / (clip + tr) if clip + tr > 0 else 0.0})
        self.state.ne_injected += row["ne_injected"]
        self.state.pne_injected += pne
        self.state.dose_open += self._rows[-1]["pne_injected_se"]
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


class DoseReference(Unrecorded):
    """SPEC §6's injected P-NE*, recomputed independently beside a run (a check of the closed loop's books, not
    used by it): at every `every`-th injecting step, before the injector acts, this step's A (from the live AdamW)
    and the exact Gauss–Newton diagonal (full Jacobian on `n_heldout` held-out sequences at the current weights);
    after the update, c² · η κ Σ a² s R'_ii / max(floor, Σ a² diag G) with the s, R' and c the step really used.
    `booked` holds the injector's own P-NE* of the same steps. Shares no code with the closed loop but
    `preconditioner`. Insert it before the run's hooks (its on_grads must see the gradient before injection)."""

    name, schema = "reference", pa.schema([pa.field("step", pa.int64())])   # written empty by the trainer

    def __init__(self, injector: NoiseInjector, n_heldout: int, every: int = 1):
        self.inj, self.n, self.every = injector, n_heldout, every
        self.steps: list[int] = []
        self.pne: list[float] = []
        self.booked: list[float] = []
        self.c2: list[float] = []
        self._a: torch.Tensor | None = None

    def acts(self, step: int) -> bool:
        return True

    def on_grads(self, ctx: StepContext) -> None:
        self._a = None
        if not (self.inj.start <= ctx.step < self.inj.stop) or (ctx.step - self.inj.start) % self.every:
            return
        held = ctx.heldout(ctx.step, self.n)
        names = [n for n, _ in ctx.model.named_parameters()]
        params = {n: p.detach() for n, p in ctx.model.named_parameters()}
        J = torch.func.jacrev(lambda p: torch.func.functional_call(ctx.model, p, (held.xs, held.ys)))(params)
        J = torch.cat([J[n].reshape(held.ys.numel(), -1) for n in names], dim=1).double()
        diag_g = J.square().sum(0) * 2 / (held.ys.numel() * held.xs.shape[-1])   # mse_loss = mean (f − y)² / D
        self._a = preconditioner(ctx.adam).double()
        self._g2 = float(sum(p.grad.double().square().sum() for p in ctx.model.parameters()))  # before injection
        self._curv = max(self.inj.floor, float((self._a.square() * diag_g).sum()))

    def on_update(self, ctx: StepContext) -> None:
        if self._a is None:
            return
        row = self.inj.rows()[-1]
        ne = ctx.lr * self.inj.kappa * row["scale"] * float((self._a.square() * self.inj._diag.double()).sum())
        grad = self.inj.source == "grad"
        c2 = float(ctx.clip_coef) ** 2 if grad else 1.0
        free = min(1.0, self.inj.clip ** 2 / self._g2) if grad and self.inj.clip is not None else 1.0
        self.c2.append(c2 / free)   # c² relative to the step without injection
        self.steps.append(ctx.step)
        self.pne.append(c2 * ne / self._curv)
        self.booked.append(row["pne_injected"])
