"""Size, power and coverage of the models the design chooses (method §11, Pairing, Within M; issue 65), on the
planted tables of tests/test_design.py (one definition, imported from there):

- the dose series' r slope with a random intercept per (M, seed) cell against one per seed, at reference/dose's
  variance components (cell sd 0.011, run sd 0.0062, seed sd 0.003; 3 M × 3 seeds × 5 doses over 2 decades), at
  slope 0 (size) and 0.0035 per decade (the grad series' estimate);
- a probe against exposure within M (stats.stratified_correlation) against the pooled Spearman, where both move
  with M and are independent within it (size), and at a within-M Gaussian correlation 0.3 (coverage, power);
- the exposure association with the batch term (verdicts.h1.h1_exposure) against the same model without it, where
  r moves with batch only and batch sets exposure (size).

Usage: OMP_NUM_THREADS=1 python experiments/design_rates.py [replications, default 1000]
Measured: docs/validation.md, 'Models chosen by the design'.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_design import batch_panel, rates, strata_panel  # noqa: E402

from iclnoise.analysis import stats  # noqa: E402
from iclnoise.analysis.verdicts.h1 import h1_exposure  # noqa: E402


def main(n: int) -> None:
    print("| model | planted slope | rejection rate (α 0.05) | coverage (95 %) |\n|---|---|---|---|")
    for slope, seed in ((0.0, 11), (0.0035, 12)):
        for g, (rej, cov) in rates(slope, n, seed).items():
            print(f"| r slope, {stats.GROUPS[g]} | {slope} | {rej:.3f} | {cov:.3f} |")
    rng = np.random.default_rng(13)
    rho_s = 6 / np.pi * np.arcsin(0.3 / 2)
    within = pooled = hit = cover = 0
    for _ in range(n):
        d = strata_panel(rng, 0.0)
        within += stats.stratified_correlation(d.x, d.y, d.M)["p"] < 0.05
        pooled += stats.correlation(d.x, d.y)["p"] < 0.05
        d = strata_panel(rng, 0.3)
        e = stats.stratified_correlation(d.x, d.y, d.M)
        hit += e["p"] < 0.05
        cover += e["ci_lo"] <= rho_s <= e["ci_hi"]
    print(f"| probe ~ exposure within M, null | 0 | {within / n:.3f} | – |")
    print(f"| probe ~ exposure pooled over M, null | 0 | {pooled / n:.3f} | – |")
    print(f"| probe ~ exposure within M | ρ_s {rho_s:.3f} | {hit / n:.3f} | {cover / n:.3f} |")
    rng = np.random.default_rng(14)
    with_b = without = 0
    for _ in range(n):
        d = batch_panel(rng)
        with_b += h1_exposure(d, "integrated_pne", 0.05, lambda runs, strata=None: [])[0]["p"] < 0.05
        without += stats.mixed_model(d, "r ~ log_exposure + C(M)", group="cell").set_index("term").loc[
            "log_exposure", "p"] < 0.05
    print(f"| r ~ exposure + C(batch), r set by batch | 0 | {with_b / n:.3f} | – |")
    print(f"| r ~ exposure without the batch term | 0 | {without / n:.3f} | – |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
