"""Bias and coverage of the crossover threshold on planted grids (issue 42): asymmetric pulls (tanh widths 1 and 2.5
octaves below / above x*), run noise growing away from x*, crossings drawn inside a gap of the grid, 3, 4 and 6
seeds, on 2^0..2^7 and on the science grid {1, 4, 8, 16, 32, 64, 256}. Prints, per cell, the share of grids with an
interval, the bias of log2 M*, and the coverage of the nominal 95 % interval: the t-interval over seeds alone and
the one crossover_threshold reports (widened by GAP_SHARE × the grid gap in quadrature).

Usage: OMP_NUM_THREADS=1 python experiments/crossover_coverage.py [grids per cell, default 200]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from scipy import stats

from iclnoise.analysis.thresholds import crossover_threshold, pull_slopes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_crossover import asymmetric as planted  # noqa: E402  (the planted grids the test checks, one definition)

CELLS = {"8 M, 3 seeds": ([2 ** k for k in range(8)], 3), "uneven, 3 seeds": ([1, 4, 8, 16, 32, 64, 256], 3),
         "uneven, 4 seeds": ([1, 4, 8, 16, 32, 64, 256], 4), "uneven, 6 seeds": ([1, 4, 8, 16, 32, 64, 256], 6)}


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
