"""Coverage, size and power of the dose–response slopes on planted series (issue 43; tests/test_dose.py's planted
tables, one definition): 5 doses over 2 decades, the ladder M ∈ {8, 16, 32} at every dose and the full grid at dose 0,
3 seeds, run noise sd 0.02, seed sd 0.03. Prints, per cell, the mean estimate, the share of replications whose
nominal 95 % interval covers the planted slope, the rejection rate at α = 0.05 (the size under a null slope, the
power elsewhere), and the mean reported mde.

Cells: r's slope (dose.r_slope) at 0 (size), at 0.03 per decade (coverage) and at the null's mean mde (its claimed
80 % power); the ladder's log2 M* slope (ladder.ladder_conversion, delta method) at a planted translation of the r
curve by 0, −0.25 and −0.5 octave per decade; the ladder's shift at each dose (ladder.ladder_shifts) at 0 and −0.25;
stats.monotonicity's rejection rate under a line in log dose (size) and under a step.

Usage: OMP_NUM_THREADS=1 python experiments/dose_coverage.py [replications per cell, default 200] [mstar]

Measured (2026-11-27, 200 per cell; the ladder rows with local_slope's logistic derivative, commit 1bd3787):
| cell | mean estimate | coverage (95 %) | rejection rate (α 0.05) | mean mde |
|---|---|---|---|---|
| r slope 0 (size) | −0.0003 | 0.960 | 0.040 | 0.0117 |
| r slope 0.03 per decade | +0.0297 | 0.960 | 1.000 | 0.0117 |
| r slope at the null's mde (0.0117; power) | +0.0113 | 0.960 | 0.770 | 0.0117 |
| ladder log2 M* slope 0 (size) | +0.0020 | 0.960 | 0.040 | 0.0682 |
| ladder log2 M* slope −0.25 per decade | −0.245 | 0.965 | 1.000 | 0.0724 |
| ladder log2 M* slope −0.5 per decade | −0.475 | 0.935 | 1.000 | 0.0873 |
| ladder shift per dose, none planted (coverage over 5 doses; top dose) ¹ | +0.0007 | 0.960 | 0.050 | – |
| ladder shift per dose, −0.25 octave per decade (top dose −0.5) ¹ | −0.494 | 0.968 | 0.955 | – |
| monotonicity, r linear in log dose (size) | – | – | 0.065 | – |
| monotonicity, a step of 0.1 between doses 0.03 and 0.1 | – | – | 0.970 | – |
(With the secant over the ladder as the local slope, the ladder rows read +0.0018 / −0.228 / −0.441, coverage
0.960 / 0.855 / 0.550.)
¹ ladder.ladder_shifts' per-dose intervals, figure 6's ladder points (2026-11-29, 200 per cell, commit 5e43026): the
mean estimate and the share of intervals excluding 0 are the top dose's, the coverage is over all 5 doses.

dose.mstar_slope (each seed's least-squares slope of log2 M* on log10 dose, t over 3 seeds) on planted per-seed log2 M*
(seed sd 0.03, each estimate's error sd 0.03 octaves), against the random-intercept MixedLM it replaced
(2026-11-29, 2 000 per cell, `python experiments/dose_coverage.py 2000 mstar`, which runs these cells alone):
| cell | mean estimate | coverage (95 %) | rejection rate (α 0.05) | mean mde | MixedLM coverage, rejection rate |
|---|---|---|---|---|---|
| slope 0, 2 doses a decade apart (configs/dose.yaml's grids; size) | −0.0003 | 0.945 | 0.056 | 0.121 | 0.797, 0.203 |
| slope −0.1 per decade, 2 doses | −0.100 | 0.945 | 0.586 | 0.121 | 0.797, 0.969 |
| slope 0, 5 doses over 2 decades (size) | +0.0006 | 0.943 | 0.057 | 0.0547 | 0.920, 0.080 |
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from iclnoise.analysis import dose, stats
from iclnoise.analysis.verdicts import GATES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_dose import DOSES, planted  # noqa: E402  (the planted series the test checks, one definition)


def fits(rng, **kw):
    (_, g), = dose.series(dose.dose_runs(planted(rng, **kw), GATES["regime_tol"]))
    shape_check, stats.monotonicity = stats.monotonicity, lambda cells: None   # measured apart (mono_cell): 3× faster
    try:
        return dose.analyse(g, 0.05, GATES["dose_tol"], 3)
    finally:
        stats.monotonicity = shape_check


def cell(name, n, key, truth, **kw):
    rng = np.random.default_rng(7)
    cover, reject, mde, est = [], [], [], []
    for _ in range(n):
        res = fits(rng, **kw)
        e = res["r"] if key == "r" else res["ladder_fit"]
        cover.append(e["ci_lo"] <= truth <= e["ci_hi"])
        reject.append(e["p"] < 0.05)
        mde.append(e["mde"])
        est.append(e["estimate"])
    print(f"| {name} | {n} | {np.mean(est):+.3g} | {np.mean(cover):.3f} | {np.mean(reject):.3f} | {np.mean(mde):.3g} |",
          flush=True)
    return float(np.mean(mde))


def shift_cell(name, n, shift):
    """ladder.ladder_shifts' per-dose intervals (figure 6's ladder points) against the planted shift at each positive
    dose, shift·log10(d/d₁) octaves: coverage pooled over the 5 doses, and at the top dose the mean estimate and the
    share of intervals that exclude 0."""
    rng = np.random.default_rng(10)
    cover, top, excl = [], [], []
    for _ in range(n):
        lv = fits(rng, shift=shift)["levels"]
        lv = lv[lv.target_dose > 0]
        truth = shift * np.log10(lv.target_dose / DOSES[0])
        cover.extend((lv.ladder_shift_lo <= truth) & (truth <= lv.ladder_shift_hi))
        hi = lv.iloc[-1]
        top.append(hi.ladder_shift)
        excl.append(not hi.ladder_shift_lo <= 0 <= hi.ladder_shift_hi)
    print(f"| {name} | {n} | {np.mean(top):+.3g} | {np.mean(cover):.3f} | {np.mean(excl):.3f} | – |", flush=True)


def mono_cell(name, n, shape):
    """stats.monotonicity's rejection rate on the seed means of a planted response `shape`(log10 dose) (the cells of
    test_dose's monotonicity test: run noise 0.02, seed sd 0.03, 3 seeds, 5 doses)."""
    rng = np.random.default_rng(8)
    x = np.log10(DOSES)
    reject = []
    for _ in range(n):
        cells = pd.DataFrame([{"log10_dose": xi, "seed": s, "y": yi + 0.02 * rng.standard_normal() + 0.03 * u}
                              for s, u in enumerate(rng.standard_normal(3)) for xi, yi in zip(x, shape(x))])
        reject.append(stats.monotonicity(cells, n_sim=1000)["p"] < 0.05)
    print(f"| {name} | {n} | – | – | {np.mean(reject):.3f} | – |", flush=True)


def mstar_cell(name, n, doses, slope, seed_sd=0.03, sd=0.03):
    """dose.mstar_slope on planted per-seed log2 M* (a seed offset of sd `seed_sd`, each estimate's error sd `sd`, 3
    seeds) at `doses`; the MixedLM random-intercept fit it replaced (stats.mixed_model) on the same draws, its
    coverage and rejection rate in the name's brackets."""
    rng = np.random.default_rng(11)
    x = np.log10(doses)
    cover, reject, mde, est, old = [], [], [], [], []
    for _ in range(n):
        d = pd.DataFrame([{"log10_dose": xi, "seed": s,
                           "log2_M_star": 4.1 + u + slope * xi + sd * rng.standard_normal()}
                          for s, u in enumerate(seed_sd * rng.standard_normal(3)) for xi in x])
        e = dose.mstar_slope(d, 0.05)
        m = stats.mixed_model(d, "log2_M_star ~ log10_dose").set_index("term").loc["log10_dose"]
        cover.append(e.ci_lo <= slope <= e.ci_hi)
        reject.append(e.p < 0.05)
        mde.append(e.mde)
        est.append(e.estimate)
        old.append((m.ci_lo <= slope <= m.ci_hi, m.p < 0.05))
    o = np.mean(old, axis=0)
    print(f"| {name} [MixedLM: {o[0]:.3f}, {o[1]:.3f}] | {n} | {np.mean(est):+.3g} | {np.mean(cover):.3f} | "
          f"{np.mean(reject):.3f} | {np.mean(mde):.3g} |", flush=True)


def main(n: int, only: str = "") -> None:
    print("| cell | replications | mean estimate | coverage (95 %) | rejection rate (α 0.05) | mean mde |\n"
          "|---|---|---|---|---|---|")
    cpu = [0.00165, 0.0165]   # configs/dose.yaml's full M grids: 0.03x and 0.3x
    mstar_cell("log2 M* slope 0, 2 doses a decade apart (size)", n, cpu, 0.0)
    mstar_cell("log2 M* slope −0.1 per decade, 2 doses", n, cpu, -0.1)
    mstar_cell("log2 M* slope 0, 5 doses over 2 decades (size)", n, DOSES, 0.0)
    if only == "mstar":
        return
    mde = cell("r slope 0 (size)", n, "r", 0.0, slope=0.0)
    cell("r slope 0.03 per decade", n, "r", 0.03, slope=0.03)
    cell(f"r slope at the null's mde ({mde:.3g}; power)", n, "r", mde, slope=mde)
    cell("ladder log2 M* slope 0 (size)", n, "ladder", 0.0, shift=0.0)
    cell("ladder log2 M* slope −0.25 per decade", n, "ladder", -0.25, shift=-0.25)
    cell("ladder log2 M* slope −0.5 per decade", n, "ladder", -0.5, shift=-0.5)
    shift_cell("ladder shift per dose, none planted (coverage over 5 doses; top dose)", n, 0.0)
    shift_cell("ladder shift per dose, −0.25 octave per decade (top dose −0.5)", n, -0.25)
    mono_cell("monotonicity, r linear in log dose (0.05 per decade; size)", n, lambda x: 0.05 * (x - x[0]))
    mono_cell("monotonicity, a step of 0.1 between doses 0.03 and 0.1", n, lambda x: np.where(x > -1.7, 0.1, 0.0))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, sys.argv[2] if len(sys.argv) > 2 else "")
