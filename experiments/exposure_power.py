"""Power of the exposure-axis experiment (issue 70, item 4), planned before it runs: the minimum detectable slope of
log2 M* per decade of *total* integrated P-NE* (batch + injected; method §11, "The hypothesis's own axis") of
candidate designs, from reference/dose's variance components.

The estimator is the pipeline's: per seed, log2 M* at each dose from that dose's full M grid
(thresholds.threshold_with_ci's log2_per_seed), each seed's least-squares slope on log10 total exposure, a t over
seeds (dose.mstar_slope). Its error is the within-seed scatter of per-seed log2 M* across doses (the seed's own
level cancels in the slope), σ_w, so a design's mde is mde_paired_t(σ_w / √Sxx, S) with Sxx = Σ (x_d − x̄)² over its
doses' x_d = log10(1 + relative dose) and S seeds.

1. σ_w from reference/dose: the per-seed log2 M* of its five full grids (dose 0; param and grad at 0.03× and 0.3×),
   two-way residual (seed + condition) on (5 − 1)(3 − 1) = 8 df, with its 95 % interval (χ²).
2. The mde of each candidate design at σ_w and at its upper 95 % bound.
3. A check of that arithmetic through the pipeline's own estimator: planted full grids (dose 0's fitted logistic
   with free floor and ceiling, a seed's shift of log2 M* sd 0.04, r noise per (M, seed) cell sd 0.011 shared by the
   doses and per run sd 0.0062, the dose series' mixed-model components), log2 M* moving by a planted slope per
   decade of total exposure; size at 0 and power at 0.1.

Usage: OMP_NUM_THREADS=1 python experiments/exposure_power.py [replications, default 200]
Measured: docs/findings.md, "The exposure-axis experiment: its power, planned".
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
from scipy import stats as sps

from iclnoise.analysis import dose, stats
from iclnoise.analysis.thresholds import fit_threshold, logistic4, threshold_with_ci

REF = "reference/dose/aggregate/dose.parquet"
GRID = (1, 4, 8, 16, 32, 64, 256)   # the science M grid (finite)
DESIGNS = {   # relative injected doses (multiples of the batch noise's own integrated P-NE*)
    "0, 0.3, 1, 3, 10": (0, 0.3, 1, 3, 10),
    "0, 1, 10": (0, 1, 10),
    "0, 3, 10": (0, 3, 10),
    "0, 1, 3, 10, 30": (0, 1, 3, 10, 30),
}
SEEDS = (3, 4, 5, 6, 8)


def per_seed_mstar(d: pd.DataFrame) -> pd.DataFrame:
    """log2 M* (r50) per seed of every full grid (≥ 5 finite M) of a dose table."""
    rows = []
    for (src, td), g in d[d.M > 0].groupby(["source", "target_dose"]):
        if g.M.nunique() >= 5:
            e = threshold_with_ci(g, level=0.95, min_seeds=3, alpha=0.05)
            per = e.get("log2_per_seed") or {}
            rows += [{"cond": f"{src} {td:g}", "seed": s, "log2": v} for s, v in per.items()]
    return pd.DataFrame(rows)


def within_seed_sd(t: pd.DataFrame) -> tuple[float, float, float, int]:
    """σ_w (two-way residual sd of log2 M*, seed + condition), its 95 % interval and df."""
    w = t.pivot_table(index="cond", columns="seed", values="log2")
    res = w.sub(w.mean(axis=1), axis=0)
    res = res.sub(res.mean(axis=0), axis=1)
    df = (w.shape[0] - 1) * (w.shape[1] - 1)
    s = math.sqrt(float((res ** 2).values.sum()) / df)
    return s, s * math.sqrt(df / sps.chi2.ppf(0.975, df)), s * math.sqrt(df / sps.chi2.ppf(0.025, df)), df


def design_mde(doses, seeds: int, sigma: float) -> float:
    x = np.log10(1 + np.asarray(doses, float))
    return stats.mde_paired_t(sigma / math.sqrt(float(((x - x.mean()) ** 2).sum())), seeds)


def planted(rng, doses, seeds, slope, shape, seed_sd=0.04, cell_sd=0.011, run_sd=0.0062) -> pd.DataFrame:
    """Full grids at every dose: seed k's log2 M* = dose 0's + seed shift + slope · log10(1 + dose); r from dose 0's
    fitted logistic4 moved along log2 M, plus a cell effect shared by the doses and run noise."""
    floor, ceiling, x0, scale = shape
    rows = []
    for k in range(seeds):
        u = rng.normal(0, seed_sd)
        cell = {M: rng.normal(0, cell_sd) for M in GRID}
        for dz in doses:
            shift = u + slope * math.log10(1 + dz)
            for M in GRID:
                r = logistic4(math.log2(M) - shift, floor, ceiling, x0, scale) + cell[M] + rng.normal(0, run_sd)
                rows.append({"M": M, "seed": k, "r": r, "dose": dz})
    return pd.DataFrame(rows)


def simulated(doses, seeds, slope, shape, n, seed) -> tuple[float, float, float]:
    """(rejection rate at α 0.05, coverage of the planted slope, share of replications with a slope)."""
    rng = np.random.default_rng(seed)
    hit = cover = ran = 0
    for _ in range(n):
        g = planted(rng, doses, seeds, slope, shape)
        per = []
        for dz, h in g.groupby("dose"):
            e = threshold_with_ci(h, level=0.95, min_seeds=3, alpha=0.05)
            per += [{"log10_dose": math.log10(1 + dz), "seed": s, "log2_M_star": v}
                    for s, v in (e.get("log2_per_seed") or {}).items()]
        try:
            e = dose.mstar_slope(pd.DataFrame(per), 0.05)
        except (ValueError, KeyError):
            continue
        ran += 1
        hit += e.p < 0.05
        cover += e.ci_lo <= slope <= e.ci_hi
    return hit / max(ran, 1), cover / max(ran, 1), ran / n


def main(n: int) -> None:
    d = pd.read_parquet(REF)
    t = per_seed_mstar(d)
    s, lo, hi, df = within_seed_sd(t)
    seed_sd = t.groupby("seed").log2.mean().std()
    print(f"σ_w (within-seed sd of per-seed log2 M*, r50) = {s:.4f} octave [{lo:.4f}, {hi:.4f}], {df} df, "
          f"{t.cond.nunique()} full grids × {t.seed.nunique()} seeds; seed sd {seed_sd:.4f}")
    print("\n| relative doses | decades of total exposure | " + " | ".join(f"S = {k}" for k in SEEDS) + " |")
    print("|---|---|" + "---|" * len(SEEDS))
    for name, doses in DESIGNS.items():
        span = math.log10(1 + max(doses))
        cells = [f"{design_mde(doses, k, s):.3f} ({design_mde(doses, k, hi):.3f})" for k in SEEDS]
        print(f"| {name} | {span:.2f} | " + " | ".join(cells) + " |")
    g0 = d[(d.source == "none") & (d.M > 0)]
    f = fit_threshold(g0.M.to_numpy(), g0.r.to_numpy(), None)
    shape = (f["floor"], f["ceiling"], f["x0"], f["scale"])
    print(f"\nplanted check (dose 0's logistic4: floor {shape[0]:.3f}, ceiling {shape[1]:.3f}; {n} replications)")
    print("| design | seeds | planted slope | rejection rate | coverage | with a slope | mde (σ_w) |")
    print("|---|---|---|---|---|---|---|")
    for name, k in (("0, 0.3, 1, 3, 10", 5), ("0, 1, 10", 5), ("0, 0.3, 1, 3, 10", 3)):
        for slope, seed in ((0.0, 1), (0.1, 2)):
            rej, cov, ran = simulated(DESIGNS[name], k, slope, shape, n, seed)
            mde = design_mde(DESIGNS[name], k, s)
            print(f"| {name} | {k} | {slope} | {rej:.3f} | {cov:.3f} | {ran:.2f} | {mde:.3f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
