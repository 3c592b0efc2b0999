"""CNR's ground truth on the science window (issue 67, item 4): the run M16-B64-late-s<seed> of configs/science.yaml
(late grad-source diagonal noise over the last 30 % of 20 000 steps) forked at the window's start into its own noise
and COUNTERFACTUALS × `--realisations` noise streams (iclnoise.run.crn), per seed; ΔE f ± SE per counterfactual,
paired by realisation (iclnoise.analysis.stats.paired_effects).

One seed is one ensemble and one file (`--out`/realisations_s<seed>.parquet, written when the seed is done); a killed
check resumes: a finished seed from its file, the running one from its members' last commit (`--out`/work_s<seed>).
When every seed is there it writes `--out`/effects.csv (all metrics) beside them.

Usage: OMP_NUM_THREADS=1 python experiments/reproductions/crn_check.py [--seeds 0 1 2] [--realisations 8]
       [--out reference/reproductions/crn]
"""
from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from iclnoise.analysis.stats import paired_effects
from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet, write_parquet
from iclnoise.run.crn import REALISATIONS_SCHEMA, REFERENCE, crn

# the noise scale (×k of the budget: 7 levels, the first-order pathwise estimator's direction, iclnoise.run.pathwise),
# none, and the shape, the source and the window, each against the run's own
COUNTERFACTUALS = ["none", "self*0.25", "self*0.5", "self*0.75", "self*1.5", "self*2", "self*3", "self*4",
                   "self+shape=isotropic", "self+source=param", "self+fraction=0.15"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--realisations", type=int, default=8)
    ap.add_argument("--out", default="reference/reproductions/crn")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    p = load_params("params.yaml", ["configs/science.yaml"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for seed in a.seeds:
        path = out / f"realisations_s{seed}.parquet"
        if path.exists():
            continue
        t = time.time()
        work = out / f"work_s{seed}"   # the members' run directories: a killed check resumes from the last commit
        values = crn(run_spec(p, f"M16-B64-late-s{seed}"), COUNTERFACTUALS, p["noise"]["conditions"], a.realisations,
                     work=work)
        write_parquet(values, path, REALISATIONS_SCHEMA, spec_hash=f"commit {commit}, {time.time() - t:.0f} s")
        shutil.rmtree(work)
        print(f"seed {seed}: {time.time() - t:.0f} s", flush=True)
    paths = [out / f"realisations_s{s}.parquet" for s in a.seeds]
    if all(q.exists() for q in paths):
        values = pd.concat([read_parquet(q) for q in paths])
        eff = paired_effects(values, REFERENCE, by=("counterfactual", "seed", "metric"))
        eff = eff[eff.counterfactual != REFERENCE]
        eff.to_csv(out / "effects.csv", index=False, float_format="%.6g")
        print(eff[eff.metric == "r"].to_string(index=False))


if __name__ == "__main__":
    main()
