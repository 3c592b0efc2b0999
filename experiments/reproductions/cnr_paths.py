"""Where CNR's expansion leaves its range (issue 46): the displacement one noise realisation causes, linearised by
CNR, against the realised divergence of two trainings whose noises differ by as much.

Base run `param_b16` of cnr_check's tiny setting, counterfactual `param_b4` (the same shape at covariance × 5: with
the same seeds its draws are √5 times the base's, up to each run measuring its covariance on its own trajectory),
so ‖θ^b4_t − θ^b16_t‖ / (√5 − 1) is one realisation's displacement, realised (`realised`), at every checkpoint t;
CNR's (`linear`) is the RMS ‖δθ_t‖ of the paths its replay drives with the run's own noise (Replayer.norms, first
order), `drift` the RMS ‖eθ_t‖ of their second-order drift. Both from step 0 and, with `--from-step`, over
[t0, T] only (retrained and replayed from the base's resume state at t0). Prints a table per window and writes it
to `--out`.

Usage: python experiments/reproductions/cnr_paths.py [--steps 60] [--M 8] [--seed 0] [--probes 6] [--from-step 8]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from iclnoise.config.grid import run_spec
from iclnoise.core.runspec import RunSpec
from iclnoise.run.replay import replay_paths
from iclnoise.run.runs import checkpoint_path, load_torch

sys.path.insert(0, str(Path(__file__).parent))
from cnr_check import BASE, params, retrain, train_base  # noqa: E402

CF, K = "param_b4", 5.0   # the counterfactual and its covariance over the base's


def flat(run_dir: Path, step: int) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in load_torch(checkpoint_path(run_dir, step))["model"].values()])


def window(p: dict, M: int, seed: int, probes: int, jac_batch: int, from_step: int | None) -> pd.DataFrame:
    run, cf = f"M{M}-B64-{BASE}-s{seed}", f"M{M}-B64-{CF}-s{seed}"
    with tempfile.TemporaryDirectory(prefix="cnr-paths-") as tmp:
        rd, cd = Path(tmp) / run, Path(tmp) / cf
        _, state, _ = train_base(p, run, rd, from_step)
        retrain(p, cf, cd, state)
        st = None if state is None else load_torch(state)
        t0 = 0 if st is None else st["commit"]
        *_, norms = replay_paths(RunSpec.of(run_spec(p, run)), [], probes, jac_batch, seed, "cpu", st)
        linear = {s + 1: (n, e) for s, n, e in norms}   # after update s and its draws: θ at checkpoint s + 1
        steps = sorted(int(s) for s in load_torch(rd / "resume.pt")["manifest"] if int(s) > t0)
        rows = [{"from_step": t0, "step": s, "theta": float(flat(rd, s).norm()),
                 "realised": float((flat(cd, s) - flat(rd, s)).norm()) / (math.sqrt(K) - 1),
                 "linear": linear[s][0], "drift": linear[s][1]} for s in steps]
    df = pd.DataFrame(rows)
    df["ratio"] = df.linear / df.realised
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probes", type=int, default=6)
    ap.add_argument("--jac-batch", type=int, default=8)
    ap.add_argument("--from-step", type=int, default=8)
    ap.add_argument("--out", default="reference/reproductions/cnr_paths.csv")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = params(a.steps, None)
    df = pd.concat([window(p, a.M, a.seed, a.probes, a.jac_batch, f) for f in (None, a.from_step)])
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    df.to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
