"""Bias and coverage of the crossover threshold on planted grids (issue 42): asymmetric pulls (tanh widths 1 and 2.5
octaves below / above x*), run noise growing away from x*, crossings drawn inside a gap of the grid, 3, 4 and 6
seeds, on 2^0..2^7 and on the science grid {1, 4, 8, 16, 32, 64, 256}. Prints, per cell, the share of grids with an
interval, the bias of log2 M*, and the coverage of the nominal 95 % interval: the t-interval over seeds alone and
the one crossover_threshold reports (widened by GAP_SHARE × the grid gap in quadrature).

Usage: OMP_NUM_THREADS=1 python bench/bench_crossover.py [grids per cell, default 200]
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
from scipy import stats

from iclnoise.schedules import checkpoint_steps
from iclnoise.thresholds import crossover_threshold, pull_slopes

CK = np.array(checkpoint_steps(10_000, 12, 16)[1:]) * 16   # the default's batch-16 checkpoints (sequences)
CELLS = {"8 M, 3 seeds": ([2 ** k for k in range(8)], 3), "uneven, 3 seeds": ([1, 4, 8, 16, 32, 64, 256], 3),
         "uneven, 4 seeds": ([1, 4, 8, 16, 32, 64, 256], 4), "uneven, 6 seeds": ([1, 4, 8, 16, 32, 64, 256], 6)}


def planted(rng, x_star, Ms, seeds, wl=1.0, wr=2.5, seed_sd=0.3, run_sd=0.15):
    rows, lnS = [], np.log(CK)
    for s in range(seeds):
        xs = x_star + seed_sd * rng.standard_normal()
        for M in Ms:
            x = math.log2(M)
            beta = math.tanh((xs - x) / (wl if x < xs else wr)) + run_sd * (1 + abs(x - xs) / 2) * rng.standard_normal()
            base = rng.normal(0, 1) - 0.3 * lnS
            rows.append(pd.DataFrame({
                "M": M, "seed": s, "sequences": CK,
                "ood_delta_ridge": np.exp(base + beta * lnS / 2 + 0.05 * rng.standard_normal(len(CK))),
                "ood_delta_dmmse": np.exp(base - beta * lnS / 2 + 0.05 * rng.standard_normal(len(CK)))}))
    return pd.concat(rows, ignore_index=True)


def main(n: int) -> None:
    for name, (grid, seeds) in CELLS.items():
        rng = np.random.default_rng(1)
        lg = np.log2(grid)
        err, t_only, reported = [], [], []
        for _ in range(n):
            i = rng.integers(1, len(lg) - 2)
            x = lg[i] + rng.uniform(0.2, 0.8) * (lg[i + 1] - lg[i])
            e = crossover_threshold(pull_slopes(planted(rng, x, grid, seeds)))
            if not np.isfinite(e["M_star_lo"]):
                continue
            m = e["log2_M_star"]
            err.append(m - x)
            t_only.append(abs(m - x) <= stats.t.ppf(0.975, seeds - 1) * e["log2_se"])
            reported.append(np.log2(e["M_star_lo"]) <= x <= np.log2(e["M_star_hi"]))
        print(f"{name}: interval in {len(err)}/{n}, bias {np.mean(err):+.3f} octave, coverage t-interval alone "
              f"{np.mean(t_only):.3f}, reported {np.mean(reported):.3f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
