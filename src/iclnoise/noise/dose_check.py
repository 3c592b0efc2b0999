"""The injected dose recomputed by method §6's definition beside a run (§6, "Booked versus true exposure"): a
check of the closed loop's books that shares no code with it but the preconditioner."""
from __future__ import annotations

import pyarrow as pa
import torch

from ..core.runspec import RunSpec
from .curvature import exact_ggn_diag
from .exposure import preconditioner
from .hooks import StepContext, Unrecorded
from .injection import NoiseInjector


class DoseReference(Unrecorded):
    """method §6's injected P-NE*, recomputed independently beside a run (a check of the closed loop's books, not
    used by it): at every `every`-th injecting step, before the injector acts, this step's A (from the live AdamW)
    and the exact Gauss–Newton diagonal (curvature.exact_ggn_diag) on `n_heldout` held-out sequences at the current
    weights; after the update, c² · η κ Σ a² s R'_ii / max(floor, Σ a² diag G) with the s, R' and c the step really
    used. `booked` holds the injector's own P-NE* of the same steps. Shares no code with the closed loop but
    `preconditioner`. Insert it before the run's hooks (its on_grads must see the gradient before injection).
    Its curvature is one held-out batch's, and 1/Curv is convex: where that batch is not the one the loop measured
    diag Ĥ on, the reference reads high by ≈ the squared coefficient of variation of Curv between batches (≈ 2 % at
    32 sequences on the science model; experiments/dose_accuracy.py); more sequences shrink it as 1/n_heldout."""

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
        diag_g = exact_ggn_diag(ctx.model, held.xs, held.ys, 1.0 / held.xs.shape[-1])   # mse_loss = mean (f − y)² / D
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


SCIENCE_MODEL = {"D": 5, "d_model": 32, "n_layers": 3}   # where the Hutchinson settings below were measured


def books_unchecked(spec: RunSpec) -> str:
    """'' when the closed loop's books of this run's injected exposure were shown within 5 % of method §6's
    definition at its settings and model (docs/validation.md, "The exposure books against the definition"), else
    what its settings are. Shown: the exact Gauss–Newton diagonal refreshed at least every 2 steps (a fast-moving
    model's 20-step windows from step 0 and at the end, tests/test_noise.py; the hardest case measured), or ≥ 16
    Hutchinson probes at least every 10 steps on the science model (D = 5, d_model 32, 3 layers: every dose of
    reference/dose, early and late windows, reference/measurements/dose_accuracy*.csv). A run without injected
    noise books nothing: ''."""
    n, e = spec.noise, spec.exposure
    if n.source == "none" or n.emulate_batch or e is None:
        return ""
    if e.curvature == "ggn_exact" and e.curvature_every <= 2 and e.curvature_tol is None:
        return ""
    science = (spec.data.D, spec.model.d_model, spec.model.n_layers) == tuple(SCIENCE_MODEL.values())
    if e.curvature == "ggn" and e.curvature_probes >= 16 and e.curvature_every <= 10 and science:
        return ""
    how = (f"{e.curvature} every {e.curvature_every} steps" if e.curvature == "ggn_exact" else
           f"{e.curvature} {e.curvature_probes} probes every {e.curvature_every} steps")
    return how + ("" if e.curvature_tol is None else f" (adaptive, tol {e.curvature_tol})")
