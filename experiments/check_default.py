"""Does a finished default run show the known behaviour? Reads the Parquet tables, prints PASS/FAIL per criterion.

Criteria (issue 13, part 1), with the aggregate's thresholds (iclnoise.analysis.verdicts.GATES): M = 1 dMMSE-like (mean
r ≤ GATES r_low); the largest finite M ridge-like (mean r ≥ GATES r_high); every M = ∞ seed's OOD loss within
--converge (GATES convergence_tol; issue 28's science gate: 0.10) of ridge's; r crosses 0.5
inside the M grid; ≥ 3 seeds; compared batch sizes saw equal data. Where the run has refined LLCs (issue 32):
every rllc.parquet holds every component at every checkpoint, ≥ 90 % of its λ̂ finite, and has its
susceptibility.parquet. Exit status 1 if any criterion fails.

Usage: python experiments/check_default.py [results] [--converge 0.10]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from iclnoise.analysis.verdicts import GATES
from iclnoise.core.tasks import M_INF


def refined_checks(results: Path) -> list[tuple[str, bool]]:
    """Issue 32's done-when on every run with a refined LLC."""
    checks = []
    for f in sorted(results.glob("runs/*/rllc.parquet")):
        r = pd.read_parquet(f)
        per_step = r.groupby("step").component.nunique()
        finite = float(r.llc_mean.notna().mean())   # NaN where undefined; ±inf never written
        full = per_step.nunique() == 1 and per_step.iloc[0] == r.component.nunique()
        checks += [(f"{f.parent.name}: rllc.parquet {r.component.nunique()} components at each of {len(per_step)} "
                    f"checkpoints, {finite:.0%} finite (≥ 90 %)", full and finite >= 0.9),
                   (f"{f.parent.name}: susceptibility.parquet written",
                    (f.parent / "susceptibility.parquet").exists())]
    return checks


def main(results: Path, converge: float = GATES["convergence_tol"]) -> int:
    runs = [pd.read_parquet(f) for f in sorted(results.glob("runs/*/metrics.parquet"))]
    end = pd.concat([m.sort_values("step").tail(1) for m in runs], ignore_index=True)
    batch_noise = end[end.noise == "none"]
    checks = []
    for B, g in batch_noise.groupby("batch"):
        fin = g[g.M != M_INF]
        r_by_m = fin.groupby("M").r.mean()
        inf = g[g.M == M_INF]
        gaps = (inf.ood_loss / inf.ood_loss_ridge - 1).tolist()
        crosses = [(a, b) for a, b in zip(r_by_m.index[:-1], r_by_m.index[1:]) if r_by_m[a] < 0.5 <= r_by_m[b]]
        checks += [
            (f"batch {B}: M = 1 dMMSE-like, mean r = {r_by_m.iloc[0]:.3f} ≤ {GATES['r_low']}",
             r_by_m.index[0] == 1 and r_by_m.iloc[0] <= GATES["r_low"]),
            (f"batch {B}: largest M = {r_by_m.index[-1]} ridge-like, mean r = {r_by_m.iloc[-1]:.3f} ≥ "
             f"{GATES['r_high']}", r_by_m.iloc[-1] >= GATES["r_high"]),
            (f"batch {B}: every M = ∞ seed's OOD loss within {converge:.0%} of ridge's "
             f"(excess {[round(x, 3) for x in gaps]})",
             len(gaps) > 0 and all(abs(x) <= converge for x in gaps)),
            (f"batch {B}: r crosses 0.5 inside the grid ({crosses or 'no crossing'})",
             len(crosses) >= 1 and crosses[0][0] > r_by_m.index[0]),
            (f"batch {B}: {g.seed.nunique()} seeds (≥ 3)", g.seed.nunique() >= 3),
        ]
    seen = batch_noise.groupby("batch").sequences.max()
    checks.append((f"batch sizes saw equal data: sequences {seen.to_dict()}", seen.nunique() == 1))
    checks += refined_checks(results)
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", default="results", type=Path)
    ap.add_argument("--converge", type=float, default=GATES["convergence_tol"],
                    help="largest M = ∞ excess over ridge's OOD loss")
    a = ap.parse_args()
    sys.exit(main(a.results, a.converge))
