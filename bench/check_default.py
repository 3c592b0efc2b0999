"""Does a finished default run show the known behaviour? Reads the Parquet tables, prints PASS/FAIL per criterion.

Criteria (issue 13, part 1): M = 1 dMMSE-like (mean r ≤ 0.2); the largest finite M ridge-like (mean r ≥ 0.75);
M = ∞ OOD loss within 15 % of ridge's; r crosses 0.5 inside the M grid; ≥ 3 seeds; compared batch sizes saw
equal data. Exit status 1 if any criterion fails.

Usage: python bench/check_default.py [results]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from iclnoise.tasks import M_INF


def main(results: Path) -> int:
    runs = [pd.read_parquet(f) for f in sorted(results.glob("runs/*/metrics.parquet"))]
    end = pd.concat([m.sort_values("step").tail(1) for m in runs], ignore_index=True)
    batch_noise = end[end.noise == "none"]
    checks = []
    for B, g in batch_noise.groupby("batch"):
        fin = g[g.M != M_INF]
        r_by_m = fin.groupby("M").r.mean()
        inf = g[g.M == M_INF]
        gap = float((inf.ood_loss / inf.ood_loss_ridge).mean() - 1) if len(inf) else float("nan")
        crosses = [(a, b) for a, b in zip(r_by_m.index[:-1], r_by_m.index[1:]) if r_by_m[a] < 0.5 <= r_by_m[b]]
        checks += [
            (f"batch {B}: M = 1 dMMSE-like, mean r = {r_by_m.iloc[0]:.3f} ≤ 0.2",
             r_by_m.index[0] == 1 and r_by_m.iloc[0] <= 0.2),
            (f"batch {B}: largest M = {r_by_m.index[-1]} ridge-like, mean r = {r_by_m.iloc[-1]:.3f} ≥ 0.75",
             r_by_m.iloc[-1] >= 0.75),
            (f"batch {B}: M = ∞ OOD loss {gap:+.1%} from ridge's (within 15 %)", abs(gap) <= 0.15),
            (f"batch {B}: r crosses 0.5 inside the grid ({crosses or 'no crossing'})",
             len(crosses) >= 1 and crosses[0][0] > r_by_m.index[0]),
            (f"batch {B}: {g.seed.nunique()} seeds (≥ 3)", g.seed.nunique() >= 3),
        ]
    seen = batch_noise.groupby("batch").sequences.max()
    checks.append((f"batch sizes saw equal data: sequences {seen.to_dict()}", seen.nunique() == 1))
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "results")))
