"""Why the Hoogland-setting chains diverge at late checkpoints: the top Hessian eigenvalue of our loss at
each checkpoint against the step size's stability limit (issue 29, part 5).

SGLD's drift w ← w − (ε/2)(nβ ∇L + γ (w − w*)) is a gradient step of size ε/2 on nβ L + γ/2 |w − w*|²; along
the Hessian's top direction it is stable only if (ε/2)(nβ λ_max + γ) < 2, i.e. λ_max < (4/ε − γ)/nβ
(configs/hoogland.yaml: ε 1e-3, γ 6, nβ 240 in our loss units → 16.6). λ_max by Lanczos
(iclnoise.probes.geometry) on a fixed batch of sequences from the run's sampling distribution.

  PYTHONPATH=src python experiments/reproductions/hoogland_sharpness.py results/hoogland/runs/Minf-B256-none-s* \\
      --steps 0 985 2491 5050 12222 40000 --out reference/reproductions/hoogland_sharpness.csv
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from iclnoise.config import load_params
from iclnoise.core.model import mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.probes.geometry import FlatLoss, lanczos_top
from iclnoise.run import runs
from iclnoise.run.probing import sampling_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--steps", nargs="+", type=int, required=True)
    ap.add_argument("--n", type=int, default=4096, help="sequences in the Hessian's batch")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    s = load_params("params.yaml", ["configs/hoogland.yaml"])["llc"]["sampler"]
    limit = (4 / s["epsilon"] - s["gamma"]) / s["nbeta"]
    rows = []
    for d in map(Path, a.run_dirs):
        spec = runs.read_spec(d)
        xs, ys = sampling_data(RunSpec.of(spec), a.n)
        for step in a.steps:
            f = FlatLoss(runs.load_model(d, step), mse_loss, xs, ys)
            top = lanczos_top(f.hvp_at_w0(), f.w0.numel(), a.iters, torch.Generator().manual_seed(0))
            rows.append({"seed": spec["keys"]["seed"], "step": step, "loss": float(f(f.w0)),
                         "top_eigenvalue": top["eigenvalue"], "converged": top["converged"],
                         "stability_limit": limit, "epsilon": s["epsilon"], "nbeta": s["nbeta"],
                         "gamma": s["gamma"]})
            print(rows[-1], flush=True)
    pd.DataFrame(rows).to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
