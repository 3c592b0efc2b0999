"""Noise injection (method §5): the step hook that adds N(0, s_t R') to a run's gradient or weights, with its level
set open loop (emulate_batch), by a closed loop on the realised exposure (budget) or by a PI controller (target).
The maths lives in iclnoise.noise and iclnoise.noise.exposure; iclnoise.noise.hooks has the step protocol and the
exposure state this hook shares with the exposure logger.

Two paths, one set of numbers: an ensemble (iclnoise.run.ensemble) runs its injectors of every shape and level (a
budget's closed loop, emulate_batch's scale 1, the PI controller) for all their runs at once (BatchedInjection: no
host read on the step); sgd_momentum's and an injector beside another hook run per run (NoiseInjector.on_grads /
on_update). The log says which path an ensemble's condition takes. Both draw each
run's noise from its own stream and book its rows with NoiseInjector.book.
"""
from __future__ import annotations

import math

import pyarrow as pa
import torch

from ..core import rng
from ..core.runspec import RunSpec
from ..core.tasks import seed_mix
from .covariance import CovModel, PIController, shaped_covariance, target_at
from .exposure import AdamState, budget_scale, kappa, ne_unit, preconditioner
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
        self._pending: dict | None = None
        self._plist: list[torch.Tensor] | None = None
        self.nap = (NapEstimator(n.shape, n.rank, n.nap_tasks, n.nap_per_task, n.nap_memory, spec.data.K,
                                 spec.data.noise_var, self.seed) if n.shape in NAP_SHAPES else None)
        self.alignment = math.nan

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
        if self.nap is not None:   # its own measurement: per-task gradients of the batch's tasks (iclnoise.noise.nap)
            self.cov, self.alignment = self.nap.refresh(ctx.model, ctx.loss_fn, ctx.batch.tasks, ctx.step)
            return
        self.cov, self.clipped = shaped_covariance(self.meter.measure(ctx), self.coef, self.shape, self.rank)

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
            return eps, w[0, P:2 * P] if iso else None
        gen = torch.Generator(device=self.device).manual_seed(seed_mix(_NOISE, *self.keys[:1], step, *self.keys[1:]))
        eps = cov.sample(gen)
        return eps, torch.randn(eps.numel(), generator=gen, device=eps.device, dtype=eps.dtype) if iso else None

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
        self._eps = None
        if s <= 0:
            return
        eps, z = self.draw(ctx.step)
        eps = eps * math.sqrt(s)
        params = self._params(ctx)
        if self.source == "grad":
            for p, e in zip(params, eps.split([p.numel() for p in params])):
                p.grad.add_(e.view_as(p))
        elif z is not None:  # isotropic in parameter space: τ² I with τ² P = η² Tr(A sR' A) (method §5)
            tau2 = ctx.lr ** 2 * float((a.square() * self._diag).sum()) * s / a.numel()
            self._eps = z * math.sqrt(tau2)
        else:
            self._eps = ctx.lr * a * eps

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


class BatchedInjection:
    """An ensemble's injectors (NoiseInjector.batched) for all their runs at once (issue 41 item 3, issue 66). On the
    step path everything is an (n,) float64 tensor over the runs, with no host read and no copy to the device: this
    step's a from the stacked AdamW state (exposure.preconditioner), Curv_t = max(floor, Σ a² diag Ĥ), the NE unit
    (exposure.ne_unit), |g|², the scale s_t (closed_loop_scale at a budget, 1 for emulate_batch) and, after the update,
    c² and the realised P-NE* after clipping. Each run's noise is drawn from its own stream (NoiseInjector.draw's
    values: on the counter stream all runs in one call, R' = U diag(lam) Uᵀ + diag(d) with each run's rank padded),
    scaled, and added to the stacked gradients or weights in one call per parameter tensor.

    The step's values stay on the device until `flush` books them into each run's NoiseInjector (NoiseInjector.book,
    the per-run path's bookkeeping: its rows, realised budget and the exposure state's sums). The ensemble flushes
    whenever a batched run's exposure logger acts (it reads those sums and may measure R', κ or diag Ĥ anew) and
    before each commit, so between two flushes every host value a row carries (R' and its trace, diag Ĥ's step and
    error) is constant. A frozen run (on the device, whether or not the host has looked) gets no noise and no row,
    as the per-run path never calls a frozen run's hooks."""

    def __init__(self, runs: list[int], injectors: list[NoiseInjector], loggers: list, R: int, device: torch.device):
        self.runs, self.inj, self.loggers = runs, injectors, loggers
        self.counter = injectors[0].counter   # one train section per ensemble
        self.keys = torch.tensor([i.noise_key for i in injectors], device=device)
        self.any_iso = any(i.source == "param" and i.shape == "isotropic" for i in injectors)
        self.whole = runs == list(range(R))   # every run of the ensemble, in order: no gather
        f64 = {"dtype": torch.float64, "device": device}
        self.idx = torch.tensor(runs, device=device)
        self.budget = torch.tensor([i.budget or 0.0 for i in injectors], **f64)
        self.fixed = torch.tensor([i.budget is None and i.ctl is None for i in injectors], device=device)  # s = 1
        self.ctl = torch.tensor([i.ctl is not None for i in injectors], device=device)   # the PI controller's s
        self.ctl_runs = [k for k, i in enumerate(injectors) if i.ctl is not None]
        self.log_s = torch.tensor([i.ctl.log_s if i.ctl else 0.0 for i in injectors], **f64)
        self.start = torch.tensor([i.start for i in injectors], **f64)
        self.stop = torch.tensor([i.stop for i in injectors], **f64)
        self.floor = torch.tensor([i.floor for i in injectors], **f64)
        self.clip = torch.tensor([i.clip if i.source == "grad" and i.clip is not None else math.inf
                                  for i in injectors], **f64)   # the param source's noise is not clipped
        self.grad = torch.tensor([i.source == "grad" for i in injectors], device=device)
        self.iso = torch.tensor([i.source == "param" and i.shape == "isotropic" for i in injectors], device=device)
        self.realised = torch.tensor([i.realised for i in injectors], **f64)
        self.rows = {src: torch.tensor([k for k, i in enumerate(injectors) if i.source == src], device=device,
                                       dtype=torch.long) for src in ("grad", "param")}
        self.f64 = f64
        self.diag = self.curv_diag = None   # (n, P): R' and diag Ĥ of each run, copied when they change (_sync)
        self.sqrt_d = self.U = self.sqrt_lam = None   # R' = U diag(lam) Uᵀ + diag(d): (n, P), (n, P, r), (n, r)
        self._seen: list[tuple] = [(None, None)] * len(runs)
        self._buf: list[tuple[int, torch.Tensor]] = []   # (step, (n, 6) values of the step) until flushed
        self._step: tuple | None = None
        self._noise: torch.Tensor | None = None

    def acting(self, step: int, ctxs: dict) -> bool:
        """A live run's exposure logger acts at this step (so the host looks: ensemble._looks; the ensemble makes a
        context for exactly the live runs whose hooks act)."""
        return any(r in ctxs for r in self.runs)

    def _sync(self, P: int, dtype: torch.dtype) -> None:
        """Copy each run's R' diagonal, trace, clipped trace, κ and diag Ĥ to the device where they changed."""
        n, dev = len(self.runs), self.f64["device"]
        if self.diag is None:
            self.diag = torch.zeros(n, P, dtype=dtype, device=dev)
            self.curv_diag = torch.full((n, P), math.nan, dtype=dtype, device=dev)
            self.sqrt_d = torch.zeros(n, P, dtype=dtype, device=dev)
        r = max((i.cov.U.shape[1] for i in self.inj if i.cov is not None), default=0)   # padded: lam 0 beyond a
        if self.U is None or self.U.shape[2] != r:                                       # run's own rank
            self.U, self.sqrt_lam = torch.zeros(n, P, r, dtype=dtype, device=dev), torch.zeros(n, r, dtype=dtype,
                                                                                              device=dev)
            self._seen = [(None, s[1]) for s in self._seen]
        for k, i in enumerate(self.inj):
            cov, curv = self._seen[k]
            if i.cov is not None and i.cov is not cov:
                rk = i.cov.U.shape[1]
                self.diag[k], self.sqrt_d[k] = i._diag, i.cov.d.sqrt()
                self.U[k].zero_(), self.sqrt_lam[k].zero_()
                self.U[k, :, :rk], self.sqrt_lam[k, :rk] = i.cov.U, i.cov.lam.sqrt()
            if i.state.curv_diag is not None and i.state.curv_diag is not curv:
                self.curv_diag[k] = i.state.curv_diag
            self._seen[k] = (i.cov, i.state.curv_diag)
        self.trace = torch.tensor([i._trace if i.cov is not None else 0.0 for i in self.inj], **self.f64)
        self.clipped = torch.tensor([i.clipped for i in self.inj], **self.f64)
        self.kappa = torch.tensor([i._kappa() for i in self.inj], **self.f64)

    def on_grads(self, step: int, lr: float, live: set[int], ctxs: dict, adam: AdamState, frozen: torch.Tensor,
                 acting: bool) -> None:
        """NoiseInjector.on_grads of every live run at once (R' refreshed per run on its due steps, as there: a due
        run's logger acts, so it has a context in `ctxs`)."""
        live = [k for k, r in enumerate(self.runs) if r in live]
        due = [k for k in live if self.inj[k].meter.due(step) or self.inj[k].cov is None]
        if due:
            self.flush()   # the rows so far carry the R' they used
        for k in due:
            self.inj[k]._refresh(ctxs[self.runs[k]])
        grads = adam.grads
        R, P = grads[0].shape[0], sum(g[0].numel() for g in grads)
        if acting or due or self.diag is None:
            self._sync(P, grads[0].dtype)
        ok = ~frozen[self.idx]
        act = [k for k in live if self.inj[k].start <= step < self.inj[k].stop]
        self._noise = None
        if not act:
            zero = torch.zeros(len(self.runs), **self.f64)
            self._step = (step, ok, zero, zero, torch.full_like(zero, math.nan))
            return
        sub = (lambda t: t) if self.whole else (lambda t: t[self.idx])  # noqa: E731
        a = sub(preconditioner(adam))
        on = (self.start <= step) & (self.stop > step)
        curv = torch.where(on, torch.maximum(self.floor, (a.square() * self.curv_diag).sum(-1).double()), math.nan)
        unit = ne_unit(lr, self.kappa, a, self.diag)
        g2 = sub(torch.stack([g.reshape(R, -1).norm(dim=1) for g in grads], 1).square().sum(1)).double()  # _grad_sq
        s = closed_loop_scale(self.budget - self.realised, self.stop - step, curv, unit, g2, self.trace, self.clip)
        if self.ctl_runs:
            s = torch.where(self.ctl, self._controlled(step, curv, unit, g2), s)
        s = torch.where(on & ok, torch.where(self.fixed, 1.0, s), 0.0)
        ne = torch.where(s > 0, s * unit, 0.0)
        self._step = (step, ok, s, ne, curv)
        self._add_noise(step, lr, set(act), a, s, grads)

    def _controlled(self, step: int, curv: torch.Tensor, unit: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """The PI controllers' scales exp(log s) (NoiseInjector._scale's): each controller takes the P-NE* after
        clipping of a row its logger wrote since the last step (on the host: no read); on a controller's first step
        its open-loop estimate, the scale that reaches the target by itself (budget_scale), read to start it there."""
        changed = False
        for k in self.ctl_runs:
            i = self.inj[k]
            pne, i.state.pne_postclip = i.state.pne_postclip, None
            if i.ctl_started and pne is not None:
                i.ctl.update(pne, step / i.total)
                changed = True
        new = [k for k in self.ctl_runs if not self.inj[k].ctl_started]
        if new:
            target = torch.tensor([target_at(i.ctl.target, step / i.total) if i.ctl else 0.0 for i in self.inj],
                                  **self.f64)
            s0 = budget_scale(target, curv, unit, g2, self.trace, self.clip).tolist()   # a controller's first step
            for k in new:
                i = self.inj[k]
                i.ctl.u = i.ctl.log_s = min(MAX_LOG_SCALE, math.log(s0[k])) if 0 < s0[k] else -MAX_LOG_SCALE
                i.ctl_started = changed = True
        if changed:
            self.log_s.copy_(torch.tensor([i.ctl.log_s if i.ctl else 0.0 for i in self.inj], dtype=torch.float64))
        return self.log_s.exp()

    def _add_noise(self, step: int, lr: float, act: set[int], a: torch.Tensor, s: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        """Each active run's draws (its own stream; zeros for the others), scaled by sqrt(s): the grad source's added
        to the stacked gradients now, the param source's kept for on_update (η a ε; isotropic z·τ, τ² P = η² Σ a² sR'_ii
        as NoiseInjector.on_grads)."""
        P = a.shape[1]
        if self.counter:   # every run's words at once, in NoiseInjector.draw's layout
            r = self.U.shape[2]
            w = rng.normal(rng.bits(self.keys, step, 2 * P + r if r else 2 * P if self.any_iso else P), a.dtype)
            eps, zs = counter_noise(self.sqrt_d, self.U, self.sqrt_lam, w), w[:, P:2 * P]
        else:
            zero = a.new_zeros(P)
            draws = [self.inj[k].draw(step) if k in act else (zero, None) for k in range(len(self.runs))]
            eps = torch.stack([e for e, _ in draws])
            zs = torch.stack([zero if z is None else z for _, z in draws]) if self.any_iso else None
        eps = eps * s.sqrt().float()[:, None]
        if len(self.rows["grad"]):
            self._scatter(grads, eps[self.rows["grad"]], self.rows["grad"])
        if not len(self.rows["param"]):
            return
        noise = lr * a * eps
        if self.any_iso:
            tau2 = lr ** 2 * (a.square() * self.diag).sum(-1).double() * s / a.shape[1]
            noise = torch.where(self.iso[:, None], zs * tau2.sqrt().float()[:, None], noise)
        self._noise = noise[self.rows["param"]]

    def _scatter(self, stacked: list[torch.Tensor], flat: torch.Tensor, rows: torch.Tensor) -> None:
        """Add flat (m, P) rows to the stacked tensors (R, ...) at the runs of `rows` (indices into self.runs)."""
        at = self.idx[rows]
        for x, part in zip(stacked, flat.split([x[0].numel() for x in stacked], 1)):
            x.index_add_(0, at, part.view(-1, *x.shape[1:]))

    def on_update(self, coefs: torch.Tensor, params: list[torch.Tensor], acting: bool) -> None:
        """NoiseInjector.on_update of every live run at once: c², the realised P-NE* after clipping, the realised
        budget; the param source's noise added to the updated weights. Flushed when `acting`."""
        step, ok, s, ne, curv = self._step
        c2 = torch.where(self.grad, coefs[self.idx].double().square(), 1.0)
        pne = torch.where(ok & (ne > 0) & (curv > 0), c2 * ne / curv, 0.0)
        self.realised += pne
        self._buf.append((step, torch.stack([s, ne, curv, c2, pne, ok.double()], 1)))
        if self._noise is not None:
            with torch.no_grad():
                self._scatter([p.detach() for p in params], self._noise, self.rows["param"])
            self._noise = None
        if acting:
            self.flush()

    def flush(self) -> None:
        """Book the steps since the last flush into each run's NoiseInjector (one device-to-host read)."""
        if not self._buf:
            return
        vals = torch.stack([v for _, v in self._buf]).cpu().tolist()
        for (step, _), rows in zip(self._buf, vals):
            for inj, (s, ne, curv, c2, pne, ok) in zip(self.inj, rows):
                if ok:
                    inj.book(inj.pending(step, inj.start <= step < inj.stop, s, ne, curv), c2, pne)
        self._buf = []


