"""Stateful training hooks (method §5, §6): the step protocol, the exposure logger and the state it shares with the
noise injector (iclnoise.noise.injection).

The trainer calls, for every step of every run, `on_grads` of each hook in list order after the
backward pass and before clipping, then clips, steps the optimizer, and calls `on_update` of each
hook in *reverse* order (hooks unwind like a stack). `iclnoise.run.member.build_hooks` orders them
[logger, injector]:

- on_grads:  the logger measures (group gradients, A, diag Ĥ on held-out data) on due steps, then the
             injector sets its scale from Curv = Σ a² diag Ĥ at this step's own A and adds ε to the gradient;
- on_update: the injector records the step's realised (post-clip) injected exposure, then the logger
             writes its row from the exact per-step sums of the interval.

The maths lives in iclnoise.noise (covariances, schedules, controller) and iclnoise.noise.exposure (P-NE);
this module only keeps state between steps. The logger and the injector share one `ExposureState`. Every
state is in `state_dict`, so a killed run resumes to identical numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from ..core.runspec import RunSpec
from ..core.sections import Exposure
from ..core.tasks import Batch, seed_mix
from .curvature import Curvature, exact_ggn_curvature, ggn_curvature, hessian_curvature
from .exposure import (
    EXPOSURE_SCHEMA,
    AdamState,
    GradNoise,
    b_simple,
    calibrated_kappa,
    grad_noise,
    group_grads,
    kappa,
    pne_columns,
    preconditioner,
    refresh_interval,
    spectrum_parts,
    spectrum_summary,
    update_innovation_variance,
)

_PROBE = 0xC0A7


@dataclass
class StepContext:
    step: int                      # 0-based index of the update being made
    total_steps: int
    model: nn.Module               # the run's hooked model (its parameters alias the ensemble's)
    adam: AdamState                # the run's AdamW state before this update (views of its ensemble slice)
    batch: Batch                   # the full effective batch of this step
    micro_batch: int
    lr: float                      # η_t used by this update
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    heldout: Callable[[int, int], Batch]   # heldout(step, size): q_M batch never used for training
    # set by the trainer after on_grads; in an ensemble 0-d device tensors (float() them only on steps that log)
    grad_norm: float | torch.Tensor | None = None  # pre-clip global gradient norm
    clip_coef: float | torch.Tensor = 1.0          # factor clipping applied to the gradient
    live: bool | torch.Tensor = True               # the run did not diverge at this step (a frozen run's step is none)
    # measured for this run across the ensemble's runs (iclnoise.run.ensemble), else None: the hooks measure their own
    group_grads: torch.Tensor | None = None  # the meter's group gradients of this step
    curvature: Curvature | None = None       # diag Ĥ's probes of this step


class StepHook(Protocol):
    name: str
    schema: pa.Schema

    def acts(self, step: int) -> bool: ...   # False: this step's calls only count on the device (no host read)
    def on_grads(self, ctx: StepContext) -> None: ...
    def on_update(self, ctx: StepContext) -> None: ...
    def rows(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Unrecorded:
    """A step hook that writes no rows and keeps no resume state (the StepHook protocol's last three calls)."""

    def rows(self) -> list[dict]:
        return []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class ExposureState:
    """What the exposure logger measures and the injector reads, and the injector's sums the logger's next
    row reports: one per run."""

    curv_diag: torch.Tensor | None = None  # diag Ĥ of the latest measurement: Curv(A) = Σ a² diag Ĥ
    curv_step: int = -1                    # the step it was measured at
    curv_rse: float = math.nan             # its Hutchinson relative standard error, at the A of that step
    curv_interval: int = 1                 # steps to the next refresh inside a window (exposure.curvature_tol)
    kappa: float | None = None             # calibrated κ (None: the configured one)
    pne_postclip: float | None = None      # the latest row's P-NE* after clipping, until the controller reads it
    ne_injected: float = 0.0               # Σ over the steps since the last row: injected NE (pre-clip)
    pne_injected: float = 0.0              # ... and realised injected P-NE* after clipping
    dose_var: float = 0.0                  # ... its variance from diag Ĥ's error, Σ_m (Σ_{t uses m} δ_t)² (closed m)
    dose_open: float = 0.0                 # Σ δ_t of the steps using the latest diag Ĥ (open measurement)

    def close_measurement(self) -> None:
        """A new diag Ĥ: the steps that used the previous one share its error (injection.injected_dose_se)."""
        self.dose_var += self.dose_open ** 2
        self.dose_open = 0.0

    def take_interval(self) -> tuple[float, float, float]:
        """(Σ injected NE, Σ injected P-NE*, the variance of that sum) since the last row; a measurement whose steps
        reach into the next row is split there (the row's last step measured it: one step on this side)."""
        self.close_measurement()
        out = self.ne_injected, self.pne_injected, self.dose_var
        self.ne_injected = self.pne_injected = self.dose_var = 0.0
        return out


@dataclass
class Measured:
    """What the exposure logger measured in a due step's on_grads, for its on_update to write as a row (the floats
    once HostReads has read them)."""

    noise: GradNoise
    a: torch.Tensor                 # this step's A (before the update)
    curv: float = math.nan
    curv_se: float = math.nan
    update_var: float = math.nan        # observed update innovation variance (exposure.update_innovation_variance)
    update_var_pred: float = math.nan   # its prediction η² Σ a² C / B


class HostReads:
    """Device values hooks need on the host, read in one device-to-host copy per `read` and handed, in the order asked,
    to the callbacks that asked for them (a 0-d tensor as a float, a 1-d one as a list; other values as they are).
    `eager`: each ask is read at once (a hook outside an ensemble, or beside a per-run hook that reads the shared
    state within the step); an ensemble shares one non-eager instance among its loggers and reads it after their
    on_grads and after their on_update (iclnoise.run.ensemble), so a logging step's host reads do not grow with
    its runs."""

    def __init__(self, eager: bool = True):
        self.eager = eager
        self._asked: list[tuple[list, Callable[[list], None]]] = []

    def ask(self, values: list, then: Callable[[list], None]) -> None:
        self._asked.append((values, then))
        if self.eager:
            self.read()

    def read(self) -> None:
        asked, self._asked = self._asked, []
        ts = [v.detach().double().reshape(-1) for vals, _ in asked for v in vals if isinstance(v, torch.Tensor)]
        flat = torch.cat(ts).tolist() if ts else []   # the one copy
        i = 0
        for vals, then in asked:
            out = []
            for v in vals:
                if isinstance(v, torch.Tensor):
                    n = v.numel()
                    out.append(flat[i] if v.dim() == 0 else flat[i:i + n])
                    i += n
                else:
                    out.append(v)
            then(out)


class NoiseMeter:
    """When exposure is measured, and the group gradients of that step, shared by the hooks.

    Due steps: step 0 (so Curv is known before any injection), the end of each interval of `every`
    steps, the last step, and the last step before each injection window opens or closes, so that no
    logged row stands for steps in which a schedule was in another state (method §6)."""

    def __init__(self, cfg: Exposure, total: int, boundaries: tuple[int, ...] = ()):
        self.every, self.total = cfg.every, total
        self.groups, self.per_example = cfg.groups, cfg.per_example
        self.extra = {b - 1 for b in boundaries if 0 < b <= total} | {0, total - 1}
        self._step, self._noise, self.G = -1, None, None

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0 or step in self.extra

    def n_groups(self, batch: int) -> int:
        return batch if self.per_example else min(self.groups, batch)

    def measure(self, ctx: StepContext) -> GradNoise:
        """The step's group gradients (the ensemble's in ctx.group_grads, else its own) and their statistics."""
        if self._step != ctx.step:
            B = len(ctx.batch)
            K = self.n_groups(B)
            self.G = (ctx.group_grads if ctx.group_grads is not None else
                      group_grads(ctx.model, ctx.loss_fn, ctx.batch.xs, ctx.batch.ys, K))
            self._noise, self._step = grad_noise(self.G, B // K), ctx.step
        return self._noise


class ExposureLogger:
    """On due steps: the exposure row of EXPOSURE_SCHEMA (iclnoise.noise.exposure). One A per row: the
    preconditioner before this update (v̂ of the previous steps; at step 0 the v̂_1 = g² the first update
    uses) enters NE and Curv alike; the injected columns are sums of per-step values, each with its own A.

    With an injector it also measures diag Ĥ alone (no row) every `curvature_every` steps inside the
    injection window, and whenever none has been measured yet (a resume state written before the state kept
    diag Ĥ): the closed loop's divisor Σ a_t² diag Ĥ then follows Ĥ as well as A."""

    name, schema = "exposure", EXPOSURE_SCHEMA

    def __init__(self, spec: RunSpec, meter: NoiseMeter, state: ExposureState, device: torch.device):
        cfg = spec.exposure
        self.keys, self.batch, self.total = spec.key_dict, spec.keys.batch, spec.train.steps
        self.beta1 = spec.train.optimizer.momentum
        self.kappa, self.calibrate = kappa(cfg.kappa, self.beta1, spec.train.optimizer.KIND), cfg.kappa == "calibrated"
        self.probes, self.n_heldout = cfg.curvature_probes, cfg.heldout
        self.floor, self.rank = cfg.floor, cfg.eig_rank
        self.curvature, self.curv_every, self.D = cfg.curvature, cfg.curvature_every, spec.data.D
        self.curv_tol = cfg.curvature_tol
        self.meter, self.state, self.window, self.device = meter, state, spec.window, device
        self._rows: list[dict] = []
        self._measured: Measured | None = None
        self.reads = HostReads()   # an ensemble may share one, read once per logging step (HostReads)
        self._last, self._clipped_steps, self._steps = -1, 0, 0   # since the last row: clipped and live steps
        self._counted = False   # True: an ensemble counts them (count_in), on_update only reads and resets them

    def count_in(self, clipped: torch.Tensor, steps: torch.Tensor) -> None:
        """Count the clipped and live steps in these 0-d views of an ensemble's (R,) counters (seeded with this
        logger's counts), which the ensemble advances for all its runs at once every step: on steps where this
        logger does not act, the ensemble calls none of its hooks."""
        clipped.fill_(int(self._clipped_steps)), steps.fill_(int(self._steps))
        self._clipped_steps, self._steps, self._counted = clipped, steps, True

    def _refresh_due(self, step: int) -> bool:
        """diag Ĥ alone is due: none measured yet, or inside the injection window `curvature_every` steps old
        (adaptive, `curvature_tol`: the state's interval, never longer than the steps since the window opened)."""
        if self.window is None:
            return False
        st, (start, stop) = self.state, self.window
        every = self.curv_every if self.curv_tol is None else min(st.curv_interval, step - start)
        return st.curv_diag is None or (start <= step < stop and step - st.curv_step >= max(1, every))

    def _measure_curvature(self, ctx: StepContext, a: torch.Tensor | None, meas: Measured | None = None) -> None:
        """diag Ĥ on this step's held-out batch (the ensemble's measurement in ctx.curvature, else its own), kept in
        the shared state; once read (self.reads), Curv at this step's A and its standard error into `meas`, the
        relative standard error into the state, and the refresh interval adapted to the drift from the previous Ĥ
        (curvature_tol)."""
        hess = ctx.curvature or self._curvature(ctx)
        st = self.state
        adapt = self.curv_tol is not None and st.curv_diag is not None and a is not None
        old = (a.square() * st.curv_diag).sum() if adapt else None
        st.curv_diag, st.curv_step = hess.diag, ctx.step

        def then(v: list) -> None:
            (curv, se), old_curv = v
            rse = se / curv if curv > 0 else math.nan
            if adapt:
                st.curv_interval = refresh_interval(st.curv_interval, old_curv, curv, math.hypot(st.curv_rse, rse),
                                                    self.curv_tol, self.curv_every)
            st.curv_rse = rse
            st.close_measurement()
            if meas is not None:
                meas.curv, meas.curv_se = curv, se
        self.reads.ask([hess.at_device(a), old], then)

    def probe_generator(self, step: int) -> torch.Generator:
        """The generator of step `step`'s Hutchinson probes (one stream per run and step)."""
        return torch.Generator(device=self.device).manual_seed(seed_mix(_PROBE, self.keys["seed"], step))

    def _curvature(self, ctx: StepContext) -> Curvature:
        """This run's diag Ĥ probes on this step's held-out batch."""
        gen, held = self.probe_generator(ctx.step), ctx.heldout(ctx.step, self.n_heldout)
        if self.curvature == "ggn":  # the MSE objective: loss_scale 1/D (iclnoise.core.model.mse_loss)
            return ggn_curvature(ctx.model, held.xs, held.ys, self.probes, gen, 1.0 / self.D)
        if self.curvature == "ggn_exact":
            return exact_ggn_curvature(ctx.model, held.xs, held.ys, 1.0 / self.D)
        return hessian_curvature(ctx.model, ctx.loss_fn, held.xs, held.ys, self.probes, gen)

    def measures_curvature(self, step: int) -> bool:
        """on_grads measures diag Ĥ at this step: a row or a diag Ĥ alone is due."""
        return self.meter.due(step) or self._refresh_due(step)

    def acts(self, step: int) -> bool:
        """A row or a diag Ĥ is due; on other steps on_update only counts (clip_frac), on the device."""
        return self.measures_curvature(step)

    def on_grads(self, ctx: StepContext) -> None:
        self._measured = None
        if not self.meter.due(ctx.step):
            if self._refresh_due(ctx.step):
                self._measure_curvature(ctx, preconditioner(ctx.adam))
            return
        noise = self.meter.measure(ctx)
        a = preconditioner(ctx.adam)
        a_state = preconditioner(ctx.adam, fallback_grads=False)
        meas = self._measured = Measured(noise, a)
        lr = ctx.lr

        def then(v: list) -> None:
            upd_var, aca = v
            meas.update_var = upd_var
            meas.update_var_pred = lr ** 2 * aca / self.batch if aca is not None else math.nan
            if self.calibrate:
                k = calibrated_kappa([r["update_var"] for r in self._rows] + [meas.update_var],
                                     [r["update_var_pred"] for r in self._rows] + [meas.update_var_pred], self.beta1)
                if math.isfinite(k):
                    self.kappa = self.state.kappa = k
        self.reads.ask([update_innovation_variance(ctx.adam, self.meter.G, self.batch, lr),
                        (a_state.square() * noise.diag).sum() if a_state is not None else None], then)
        self._measure_curvature(ctx, a, meas)

    def on_update(self, ctx: StepContext) -> None:
        if not self._counted:
            self._steps += ctx.live
            self._clipped_steps += ctx.live & (ctx.clip_coef < 1.0)
        if self._measured is None:
            return
        meas, B, lr, step = self._measured, self.batch, ctx.lr, ctx.step
        noise, a = meas.noise, meas.a
        interval = step - self._last
        ne_inj, pne_inj, dose_var = self.state.take_interval()
        counts = [c.clone() if isinstance(c, torch.Tensor) else c for c in (self._clipped_steps, self._steps)]

        def then(v: list) -> None:
            coef, clipped, steps, aca, trace_c, mean_sq, lam, gram_trace, gram_sq = v
            cols = pne_columns(lr, self.kappa, B, aca, meas.curv, self.floor, coef,
                               ne_inj / interval, pne_inj / interval)  # exact interval means
            lam, alpha, pr = spectrum_summary(np.asarray(lam, dtype=float), gram_trace, gram_sq)
            self._rows.append({
                **self.keys, "step": step, "interval": interval, "lr": lr,
                "kappa": self.kappa, "update_var": meas.update_var, "update_var_pred": meas.update_var_pred,
                "groups": noise.factor.shape[0], "group_size": noise.m,
                "grad_norm": math.sqrt(mean_sq), "trace_c": trace_c,
                "b_simple": b_simple(mean_sq, trace_c, B), "curv": meas.curv, "curv_se": meas.curv_se,
                "clip_coef": coef, "clip_frac": int(clipped) / max(1, int(steps)), **cols,
                "pne_injected_var": dose_var,
                "aca_eigs": lam.tolist(), "tail_index": alpha, "participation_ratio": pr})
            self.state.pne_postclip = cols["pne_postclip"]
        self.reads.ask([torch.as_tensor(ctx.clip_coef), *counts, (a.square() * noise.diag).sum(), noise.diag.sum(),
                        noise.mean.square().sum(), *spectrum_parts(noise.factor, a, self.rank)], then)
        self._last, self._measured = step, None
        if self._counted:
            self._clipped_steps.zero_(), self._steps.zero_()
        else:
            self._clipped_steps = self._steps = 0

    def rows(self) -> list[dict]:
        return self._rows

    def state_dict(self) -> dict:
        return {"rows": list(self._rows), "counts": (int(self._clipped_steps), int(self._steps)), "last": self._last,
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
