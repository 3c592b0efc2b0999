"""The reachable-dose scan (issue 43, item 1; configs/dose_scan.yaml): per finished run, the injected dose booked
against its target, the batch noise's own integrated P-NE*, the final OOD loss over ridge's (the convergence gate:
≤ 1.10) and whether it diverged. Reads a results directory; prints a Markdown table.

Usage: python experiments/tuning/dose_scan.py RESULTS_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

from iclnoise.core.io import read_parquet
from iclnoise.noise.exposure import summarize
from iclnoise.run.runs import read_spec


def main(results: Path) -> None:
    print("| run | source | target dose | booked dose | booked / target | SE | batch-noise P-NE* | OOD / ridge "
          "| converged (≤ 1.10) | diverged |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rd in sorted((results / "runs").iterdir()):
        if not (rd / "metrics.parquet").exists():
            continue
        spec = read_spec(rd)
        noise = spec["noise"]
        m = read_parquet(rd / "metrics.parquet").sort_values("step").iloc[-1]
        e = summarize(read_parquet(rd / "exposure.parquet"))
        target = noise.get("budget", 0.0)
        booked = e["integrated_pne_injected"]
        batch = e["integrated_pne"] - booked
        ratio = m.ood_loss / m.ood_loss_ridge
        diverged = not ratio == ratio or ratio == float("inf")
        print(f"| {rd.name} | {noise['source']} | {target:.4g} | {booked:.4g} | "
              f"{booked / target if target else float('nan'):.3f} | {e['integrated_pne_injected_se']:.2g} | "
              f"{batch:.4g} | {ratio:.3f} | {'yes' if ratio <= 1.10 else 'no'} | {'yes' if diverged else 'no'} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
