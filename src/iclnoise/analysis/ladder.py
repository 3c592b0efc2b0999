"""The threshold ladder (method §11, 'Dose–response'): where a dose has r at three M around the threshold only, its
local slope dr/dlog2 M at dose 0 reads a change of r as a shift of log2 M* (delta method)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as sps

from ..core.runspec import M_INF
from . import stats
from .thresholds import fit_threshold, logistic


def local_slope(zero: pd.DataFrame, ladder: list[int]) -> dict:
    """s = d r̄_L/dlog2 M at dose 0: how fast the ladder's mean r, r̄_L = mean over the ladder's M of r, moves when the
    r-curve translates in log2 M. A translation by δ octaves changes r̄_L by −δ·s to first order, s = the mean over
    the ladder of dr/dlog2 M, which is how a shift in r reads as a shift in M*. Per seed, from the dose-0 runs on the
    full M grid: the derivative (ceiling − floor)·g(1 − g)/scale of that seed's logistic4 fit (thresholds.
    fit_threshold) averaged over the ladder's log2 M ('logistic'); where a seed's fit has no valid curve (too few M,
    failed, no rise, a parameter on its bound) every seed's least-squares slope of r on log2 M at the ladder's M
    instead ('secant': 8 % above the mean derivative on a logistic of scale 1 octave centred on {8, 16, 32}).
    s = the seeds' mean, se = sd/√n (seeds the unit), p = the one-sided t-test that s > 0; `how` says which."""
    z = zero[~zero.diverged.astype(bool) & zero.r.notna() & (zero.M != M_INF)]
    xl = np.log2(np.asarray(ladder, float))
    per, how = [], "logistic"
    for _, h in z.groupby("seed"):
        f = fit_threshold(h.M.to_numpy(), h.r.to_numpy(), None)
        if f["reason"] and not f["reason"].startswith(("r does not cross 0.5", "crossing outside the grid")):
            per, how = [], "secant"
            break
        g = logistic(xl, f["x0"], f["scale"])
        per.append(float(np.mean((f["ceiling"] - f["floor"]) * g * (1 - g) / f["scale"])))
    if how == "secant":
        zl = z[z.M.isin(ladder)]
        per = [np.polyfit(np.log2(h.M.astype(float)), h.r.astype(float), 1)[0]
               for _, h in zl.groupby("seed") if h.M.nunique() >= 2]
    n = len(per)
    if n < 2:
        return {"s": math.nan, "se": math.nan, "p": math.nan, "n": n, "how": how}
    s, se = float(np.mean(per)), float(np.std(per, ddof=1) / math.sqrt(n))
    p = float(sps.t.sf(s / se, n - 1)) if se > 0 else float(s <= 0)
    return {"s": s, "se": se, "p": p, "n": n, "how": how}


def ladder_conversion(b: float, se_b: float, s: float, se_s: float, alpha: float) -> dict:
    """A slope b (r per decade, SE se_b) read as a shift of log2 M* per decade through the local slope s (SE se_s,
    independent: dose 0's runs are not in b's fit): c = −b/s, SE by the delta method
    √(se_b²/s² + b²·se_s²/s⁴), Wald interval and p, mde = stats.mde_wald(SE). First order in the shift: measured on
    planted translations of a logistic r-curve (experiments/dose_coverage.py, 200 each; 5 doses over 2 decades, ladder
    {8, 16, 32} around M* = 16, 3 seeds) coverage 0.960 at 0 (size 0.040), 0.965 at −0.25 octave per decade (mean
    −0.245), 0.935 at −0.5 (mean −0.475, 5 % low); with the secant slope instead of local_slope's logistic
    derivative 0.855 and 0.550."""
    c = -b / s
    se = math.sqrt(se_b ** 2 / s ** 2 + b ** 2 * se_s ** 2 / s ** 4)
    z = sps.norm.ppf(1 - alpha / 2)
    return {"estimate": c, "se": se, "ci_lo": c - z * se, "ci_hi": c + z * se,
            "p": float(2 * sps.norm.sf(abs(c) / se)) if se > 0 else math.nan, "mde": stats.mde_wald(se, alpha)}


def ladder_shifts(g: pd.DataFrame, ladder: list[int], s: dict, level: float) -> pd.DataFrame:
    """Per positive dose, the shift of log2 M* against dose 0 the ladder reads: Δ = per seed the mean over the
    ladder's M of r(dose) − r(0) (paired by M and seed), shift = −mean Δ / s; its SE by the delta method from the
    seeds' spread of Δ (sd/√n) and s's SE, interval ± t_{n−1} × SE. Columns target_dose, ladder_shift, _lo, _hi.
    Measured on planted translations (experiments/dose_coverage.py, 200 each, 3 seeds): coverage 0.960 over 5 doses with
    no shift, 0.968 at −0.25 octave per decade; at the top dose (2 decades) 5 % of intervals exclude 0 under no shift,
    95.5 % at a shift of −0.5 octave. With 2 degrees of freedom an interval's width varies a lot between draws."""
    z = g[g.M.isin(ladder) & ~g.diverged.astype(bool) & g.r.notna()]
    zero = z[z.target_dose == 0].set_index(["M", "seed"]).r
    rows = []
    for d, lv in z[z.target_dose > 0].groupby("target_dose"):
        diff = (lv.set_index(["M", "seed"]).r - zero).dropna()
        per = diff.groupby(level="seed").mean()
        n = len(per)
        if n < 2 or not np.isfinite(s["s"]):
            continue
        m, se_m = float(per.mean()), float(per.std(ddof=1) / math.sqrt(n))
        c = ladder_conversion(m, se_m, s["s"], s["se"], 1 - level)
        half = float(sps.t.ppf(0.5 + level / 2, n - 1)) * c["se"]
        rows.append({"target_dose": d, "ladder_shift": c["estimate"], "ladder_shift_lo": c["estimate"] - half,
                     "ladder_shift_hi": c["estimate"] + half})
    cols = ["target_dose", "ladder_shift", "ladder_shift_lo", "ladder_shift_hi"]
    return pd.DataFrame(rows, columns=cols).astype(float)
