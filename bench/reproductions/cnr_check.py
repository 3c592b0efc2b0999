"""CNR against retraining at a small CPU scale (issue 46, item 3 in miniature: NOT the science-setting check).

Base runs: the tests' tiny setting (2 layers, d_model 16, `--steps` steps of batch 64) at M = `--M`, noise
`param_b16` (parameter noise emulating batch 16, low rank), seeds `--seeds`. Counterfactuals, each a noise condition
that can also be trained: the same noise at another emulated batch (covariance × 1/3, 7/3, 5), removed, and other
shapes and sources at batch 16. Per (counterfactual, seed): CNR's predicted change of the final OOD loss and r
(iclnoise.replay.replay_run, one replay per seed for all counterfactuals) against the realised change, retraining
the same seed under the counterfactual (iclnoise.train.train_run). Prints Spearman's ρ, the intervals' coverage and
the cost ratio; writes bench/reproductions/cnr.csv and the figure cnr_check.{png,pdf,parquet}.

Usage: python bench/reproductions/cnr_check.py [--steps 60] [--M 8] [--seeds 0 1 2] [--probes 6] [--jac-batch 8]
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
from scipy.stats import spearmanr

from iclnoise.config import validate_params
from iclnoise.figures.cnr import fig_cnr
from iclnoise.grid import run_spec
from iclnoise.replay import replay_run
from iclnoise.train import train_run

BASE = "param_b16"
EXTRA = {  # counterfactual conditions beside params.yaml's (same keys as noise.conditions)
    "param_b32": {"source": "param", "shape": "lowrank", "rank": 4, "schedule": "constant", "emulate_batch": 32},
    "param_b8": {"source": "param", "shape": "lowrank", "rank": 4, "schedule": "constant", "emulate_batch": 8},
    "param_b4": {"source": "param", "shape": "lowrank", "rank": 4, "schedule": "constant", "emulate_batch": 4},
    "param_diag_b16": {"source": "param", "shape": "diagonal", "schedule": "constant", "emulate_batch": 16},
    "param_iso_b16": {"source": "param", "shape": "isotropic", "schedule": "constant", "emulate_batch": 16},
}
COUNTERFACTUALS = ["none", "param_b32", "param_b8", "param_b4", "param_diag_b16", "param_iso_b16", "grad_b16",
                   "grad_iso_b16"]


def params(steps: int) -> dict:
    with open("params.yaml") as f:
        p = validate_params(yaml.safe_load(f))
    p["train"]["budget"] = {"mode": "steps", "steps": steps}
    p["train"]["checkpoints"] = {"linear": 3, "log": 3}
    p["train"]["micro_batch"] = 8
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16, n_layers=2)
    p["exposure"].update(every=10, groups=8, curvature_probes=4, heldout=16)
    p["noise"]["conditions"].update(copy.deepcopy(EXTRA))
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--probes", type=int, default=6)
    ap.add_argument("--jac-batch", type=int, default=8)
    ap.add_argument("--out", default="bench/reproductions/cnr.csv")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = params(a.steps)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cnr-check-") as tmp:
        for seed in a.seeds:
            run = f"M{a.M}-B64-{BASE}-s{seed}"
            t0 = time.time()
            base = train_run(run_spec(p, run), Path(tmp) / run, progress=False).iloc[-1]
            train_s = time.time() - t0
            pred = replay_run(Path(tmp) / run, COUNTERFACTUALS, p["noise"]["conditions"], a.probes, a.jac_batch, seed)
            for cf in COUNTERFACTUALS:
                name = f"M{a.M}-B64-{cf}-s{seed}"
                t0 = time.time()
                real = train_run(run_spec(p, name), Path(tmp) / name, progress=False).iloc[-1]
                retrain_s = time.time() - t0
                for _, r in pred[pred.counterfactual == cf].iterrows():
                    if r.metric not in ("ood_loss", "r"):
                        continue
                    rows.append({"seed": seed, "counterfactual": cf, "metric": r.metric, "observed": r.observed,
                                 "delta": r.delta, "se": r.se, "sd_draw": r.sd_draw,
                                 "lo_delta": r.lo - r.observed, "hi_delta": r.hi - r.observed,
                                 "realised": float(real[r.metric] - base[r.metric]), "cnr_s": r.seconds,
                                 "retrain_s": retrain_s, "train_s": train_s, "steps": a.steps, "M": a.M,
                                 "probes": a.probes, "jac_batch": a.jac_batch})
                print(rows[-2], flush=True)
    df = pd.DataFrame(rows)
    df["covered"] = (df.lo_delta <= df.realised) & (df.realised <= df.hi_delta)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out, index=False)
    for metric, d in df.groupby("metric"):
        rho = spearmanr(d.delta, d.realised).statistic
        mean = d.groupby("counterfactual")[["delta", "realised"]].mean()
        rho_cf = spearmanr(mean.delta, mean.realised).statistic
        print(f"{metric}: Spearman over (cf, seed) {rho:.3f}, over counterfactuals (seed means) {rho_cf:.3f}, "
              f"coverage {d.covered.mean():.2f} of {len(d)}")
    per_seed = pd.DataFrame({"cnr": df.groupby("seed").cnr_s.first(),
                             "retrain": df.groupby(["seed", "counterfactual"]).retrain_s.first().groupby("seed").sum()})
    print(f"cost: CNR (one replay, all {len(COUNTERFACTUALS)} counterfactuals) / retraining them: "
          f"{(per_seed.cnr / per_seed.retrain).mean():.2f}")
    fig_cnr(df, Path(a.out).with_name("cnr_check"))


if __name__ == "__main__":
    main()
