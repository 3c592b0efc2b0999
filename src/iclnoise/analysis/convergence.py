"""The one convergence gate (method §11, One convergence gate): an M = ∞ run reached ridge, or its levelled excess
is what injected noise did (a noise floor with the noise still on, or what the noise left after it was switched
off); diverged, still falling or levelled short of ridge without injected noise otherwise. Read by every verdict
(iclnoise.analysis.verdicts.gates) and by the dose regime (iclnoise.analysis.dose)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

CONVERGENCE_TOL = 0.15   # an M = ∞ run ends with OOD loss ≤ (1 + tol) × ridge's ...
FALL_SHARE = 0.5         # ... or is levelled: its OOD loss fell by less than this share of its excess over ridge's
                         # across the last third of training (or not significantly), and injected noise explains it
INJECTED = ("grad", "param")   # noise sources injected on top of the batch noise
ON_AT_END = ("constant", "late", "controlled")   # injection schedules whose noise is still on at the last step


def ood_loss_fall(metrics: pd.DataFrame) -> tuple[float, float, int]:
    """How much a run's OOD loss was still falling at the end, in units of ridge's OOD loss: (fall, its standard
    error, the checkpoints it rests on). fall = −(the least-squares slope of ood_loss / ood_loss_ridge on the
    training fraction over the checkpoints of the last third of training) / 3, the line's fall across that third
    (method §11, One convergence gate). NaN with fewer than 3 such checkpoints or a diverged run."""
    last = metrics.step.max()
    w = metrics[(metrics.step >= 2 * last / 3) & (last > 0)]
    y = (w.ood_loss / w.ood_loss_ridge).to_numpy(float)
    if len(w) < 3 or not np.isfinite(y).all() or metrics.diverged.any():
        return math.nan, math.nan, len(w)
    x = w.step.to_numpy(float) / last
    b, a = np.polyfit(x, y, 1)
    resid = y - (a + b * x)
    se = math.sqrt(resid @ resid / (len(x) - 2) / ((x - x.mean()) ** 2).sum()) if len(x) > 2 else math.nan
    return float(-b / 3), se / 3, len(w)


def _still_falling(fall, se, n, excess) -> np.ndarray:
    """Still falling: the fall over the last third is at least FALL_SHARE of the excess over ridge's and
    the line's slope is below 0 by a one-sided t-test at 5 % (n − 2 df), so a noisy floor does not read as a fall."""
    t = stats.t.ppf(0.95, np.maximum(np.asarray(n, float) - 2, 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (fall >= FALL_SHARE * excess) & (fall > t * se)


def converged_runs(runs: pd.DataFrame, tol: float = CONVERGENCE_TOL) -> pd.DataFrame:
    """The one convergence gate, per run (method §11): columns ratio (final OOD loss over ridge's; ∞ when diverged),
    fall, falling, converged, noise_floor and noise_left. A run converged when ratio ≤ 1 + tol, or when its excess
    is what injected noise did: not diverged, not still falling (_still_falling, from ood_loss_fall's columns), with
    injected noise still on at the end (ON_AT_END: a noise floor) or switched off before it (noise_left: what the
    noise changed in what was learned). Both are outcomes to report, not failed training. Training failed
    otherwise: diverged, still falling, or levelled short of ridge with no injected noise to explain it (a plateau).
    A NaN ratio or fall (a missing ridge loss, tables from before the fall was recorded) does not pass."""
    ratio = (runs.ood_loss / runs.ood_loss_ridge).astype(float).to_numpy(copy=True)
    ratio[runs.diverged.to_numpy(bool)] = np.inf
    col = lambda c: runs[c].astype(float).to_numpy() if c in runs else np.full(len(runs), np.nan)   # noqa: E731
    fall, se, n = col("ood_loss_fall"), col("ood_loss_fall_se"), col("ood_loss_fall_n")
    injected = runs.noise_source.isin(INJECTED).to_numpy(bool)
    on = runs.noise_schedule.isin(ON_AT_END).to_numpy(bool)
    levelled = np.isfinite(fall) & ~_still_falling(fall, se, n, ratio - 1)
    excess = injected & np.isfinite(ratio) & (ratio > 1 + tol) & levelled
    return pd.DataFrame({"ratio": ratio, "fall": fall, "falling": np.isfinite(fall) & ~levelled & (ratio > 1 + tol),
                         "converged": (ratio <= 1 + tol) | excess, "noise_floor": excess & on,
                         "noise_left": excess & ~on}, index=runs.index)


def passes_as_noise_left(ratio, source, schedule, converged, tol: float = CONVERGENCE_TOL) -> np.ndarray:
    """Which runs pass the gate only as what injected noise left after it was switched off (converged_runs'
    noise_left), from a table that kept the verdict but not the fall (aggregate/dose.parquet): converged, over
    1 + tol, injected, its schedule off at the end. The stricter reading counts them as failed (method §11)."""
    ratio = np.asarray(ratio, float)
    return (np.asarray(converged, bool) & np.isfinite(ratio) & (ratio > 1 + tol)
            & pd.Series(source).isin(INJECTED).to_numpy(bool) & ~pd.Series(schedule).isin(ON_AT_END).to_numpy(bool))
