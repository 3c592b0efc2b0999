"""Issue 45 item 5, "measure first": does configs/align.yaml's anisotropic prior (power law, exponent 2, D = 5)
separate aligned (nap) from misaligned noise at all, before the 75-run H5 grid is spent on it?

Runs experiments/align_probe.yaml's grid (on configs/science.yaml + configs/align.yaml): M = 16, batch 64, seed 0, noise
none, nap and nap_misaligned at align.yaml's dose, one run at a time on one thread, each resuming where it stopped
(`train.budget.stop_at` is not part of a run's identity: a later, longer --stop-at goes on from the same run). Then
prints per run r, Δ to ridge, OOD loss over ridge's, realised integrated injected P-NE* and the logged alignment
cos_F(injected covariance, between-task covariance), and the paired differences nap − nap_misaligned and
nap − none at every checkpoint of the last half of what was trained (same seed: same data and initialisation, so
the arms differ by the noise's shape and draw only). One seed: a screen, not a test; its spread over checkpoints is
not a CI.

    nohup env OMP_NUM_THREADS=1 PYTHONPATH=src nice -n 10 python experiments/align_probe.py --stop-at 10000 \\
        > reference/measurements/align_probe.log 2>&1 &
Cost (iclnoise.config.cost.cost_estimate, printed first): 3 runs × 10 000 steps ≈ 7.7 CPU core-minutes; the whole
20 000 steps (no --stop-at) ≈ 15.0.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from iclnoise.analysis.aggregate import run_outcomes
from iclnoise.config import load_params
from iclnoise.config.cost import cost_estimate
from iclnoise.config.grid import expand_grid, run_spec
from iclnoise.config.validate import validate_params
from iclnoise.core.io import read_parquet
from iclnoise.run.train import train_ensemble

CONFIGS = ["configs/science.yaml", "configs/align.yaml", "experiments/align_probe.yaml"]
PAIRS = (("nap", "nap_misaligned"), ("nap", "none"))


def trained_to(run_dir: Path) -> int:
    """The last step a run's metrics.parquet holds (−1: none)."""
    f = run_dir / "metrics.parquet"
    return int(read_parquet(f).step.max()) if f.exists() else -1


def summary(run_dir: Path) -> dict:
    """A run's end: outcomes (aggregate.run_outcomes) and the median logged alignment over its second half."""
    o = run_outcomes(run_dir, transient_tol=0.05)
    row = {k: o[k] for k in ("noise", "steps", "r", "delta_ridge", "integrated_pne_injected")}
    row["ood_over_ridge"] = o["ood_loss"] / o["ood_loss_ridge"]
    inj = run_dir / "injection.parquet"
    if inj.exists():
        a = read_parquet(inj)
        row["alignment"] = float(a[a.step >= a.step.max() / 2].alignment.median())
    return row


def paired(run_dirs: dict[str, Path]) -> pd.DataFrame:
    """r and Δ to ridge, arm a − arm b, at each common checkpoint of the last half (PAIRS)."""
    m = {n: read_parquet(d / "metrics.parquet").set_index("step")[["r", "delta_ridge"]] for n, d in run_dirs.items()}
    rows = []
    for a, b in PAIRS:
        d = (m[a] - m[b]).dropna()
        d = d[d.index >= d.index.max() / 2]
        rows += [{"pair": f"{a} − {b}", "outcome": c, "checkpoints": len(d), "mean": d[c].mean(), "min": d[c].min(),
                  "max": d[c].max(), "end": d[c].iloc[-1]} for c in ("r", "delta_ridge")]
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stop-at", type=int, default=None, help="train.budget.stop_at (default: the whole budget)")
    ap.add_argument("--results", default="results/align_probe")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = load_params("params.yaml", CONFIGS)
    if a.stop_at:
        p["train"]["budget"]["stop_at"] = a.stop_at
    p = validate_params(p)
    est = cost_estimate(copy.deepcopy(p))
    print(f"cost: {est['runs']} runs, {est['run_steps']:,} steps, ≈ {60 * est['core_hours']:.1f} CPU core-minutes",
          flush=True)
    dirs = {}
    for keys in expand_grid(p):
        spec, d = run_spec(p, keys.run_id), Path(a.results) / "runs" / keys.run_id
        dirs[keys.noise] = d
        target = min(spec["train"]["budget"].get("stop_at") or spec["train"]["steps"], spec["train"]["steps"])
        if trained_to(d) >= target:
            print(f"{keys.run_id}: trained to {target}", flush=True)
            continue
        print(f"{keys.run_id}: training to step {target}", flush=True)
        train_ensemble([spec], [d], progress=False)
    ends = pd.DataFrame([summary(d) for d in dirs.values()])
    print(ends.to_markdown(index=False, floatfmt=".4g"))
    diffs = paired(dirs)
    print(diffs.to_markdown(index=False, floatfmt=".3g"))
    out = Path(a.results) / "align_probe.json"
    out.write_text(json.dumps({"cost_core_minutes": 60 * est["core_hours"], "stop_at": a.stop_at,
                               "runs": ends.replace({np.nan: None}).to_dict("records"),
                               "paired": diffs.to_dict("records")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
