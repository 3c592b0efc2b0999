"""CNR against retraining at a small CPU scale (issue 46, item 3 in miniature: NOT the science-setting check).

Base runs: the tests' tiny setting (2 layers, d_model 16, `--steps` steps of batch 64) at M = `--M`, noise
`param_b16` (parameter noise emulating batch 16, low rank), seeds `--seeds`; or, with `--params FILE`, params.yaml
overlaid with FILE (e.g. configs/science.yaml) as it is. Counterfactuals, each a noise condition that can also be
trained: the same noise at another emulated batch (covariance × 1/3, 7/3, 5), removed, and other shapes and sources
at batch 16. Per (counterfactual, seed): CNR's predicted change of the final OOD loss and r
(iclnoise.run.replay.replay_run, one replay per seed for all counterfactuals) against the realised change, retraining
the same seed under the counterfactual. Prints Spearman's ρ, the intervals' coverage and the cost ratio; writes
`--out` (reference/reproductions/cnr.csv) and the figure beside it (cnr_check.{png,pdf,parquet}).

`--from-step T0`: the counterfactuals change the noise over [t0, T] only, t0 the last checkpoint step ≤ T0 (where
the base run commits a resume state): the base run is trained to t0, its resume state kept, then finished; CNR
replays from that state and each counterfactual is retrained from it (the run's own noise before t0, the
counterfactual's after), so both cost ∝ T − t0.

Usage: python experiments/reproductions/cnr_check.py [--steps 60] [--M 8] [--seeds 0 1 2] [--probes 6] [--jac-batch 8]
       [--params configs/science.yaml] [--from-step T0] [--out reference/reproductions/cnr.csv]
"""
from __future__ import annotations

import argparse
import copy
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from scipy.stats import spearmanr

from iclnoise.config import load_params
from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.runspec import RunSpec
from iclnoise.output.figures.cnr import fig_cnr
from iclnoise.run.ensemble import Ensemble
from iclnoise.run.member import RESUME, Member
from iclnoise.run.replay import counterfactual, replay_paths, replay_run
from iclnoise.run.runs import CKPT_DIR, load_torch
from iclnoise.run.train import train_ensemble

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


def params(steps: int | None, overlay: str | None) -> dict:
    """The tiny setting (`steps` steps, 60 unset), or params.yaml overlaid with `overlay` (its steps unless
    `steps`); EXTRA's conditions added either way."""
    if overlay is None:
        p = load_params("params.yaml")
        p["train"]["checkpoints"] = {"linear": 3, "log": 3}
        p["train"]["micro_batch"] = 8
        p["eval"].update(n_sequences=64, n_root=16)
        p["model"].update(d_model=16, d_mlp=16, n_layers=2)
        p["exposure"].update(every=10, groups=8, curvature_probes=4, heldout=16)
        steps = steps or 60
    else:
        p = load_params("params.yaml", [overlay])
    if steps is not None:
        p["train"]["budget"] = {"mode": "steps", "steps": steps}
    p["noise"]["conditions"].update(copy.deepcopy(EXTRA))
    return p


def train_base(p: dict, run: str, run_dir: Path, from_step: int | None) -> tuple[pd.Series, Path | None, float]:
    """Train the base run (final metrics, its resume state at t0 kept as run_dir/../{run}.t0.pt when `from_step`,
    seconds)."""
    t0, state = time.time(), None
    if from_step:
        train_ensemble([run_spec(p, run)], [run_dir], progress=False, stop_after=from_step)
        state = run_dir.parent / f"{run}.t0.pt"
        shutil.copyfile(run_dir / RESUME, state)
    base = train_ensemble([run_spec(p, run)], [run_dir], progress=False)[0].iloc[-1]
    return base, state, time.time() - t0


def retrain(p: dict, name: str, run_dir: Path, state: Path | None) -> tuple[pd.Series, float]:
    """Train run `name` (final metrics, seconds); from the base run's resume state `state` when given: its
    parameters and AdamW moments at t0, the counterfactual's own hooks from there."""
    t0 = time.time()
    if state is None:
        return train_ensemble([run_spec(p, name)], [run_dir], progress=False)[0].iloc[-1], time.time() - t0
    spec = RunSpec.of(run_spec(p, name))
    m = Member(spec, run_dir, spec_hash(spec.raw), torch.device("cpu"))
    m.setup()
    (run_dir / CKPT_DIR).mkdir(parents=True)
    start = m.resume_from(load_torch(state), hooks=False)
    Ensemble([m], start, "cnr-check").run(False)
    return pd.Series(m.rows[-1]), time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="training steps (tiny setting: 60)")
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--probes", type=int, default=6)
    ap.add_argument("--jac-batch", type=int, default=8)
    ap.add_argument("--params", default=None, help="an overlay of params.yaml (e.g. configs/science.yaml)")
    ap.add_argument("--from-step", type=int, default=None, help="change the noise over [t0, T] only (see above)")
    ap.add_argument("--time-steps", type=int, default=None, help="only time this many steps of training and of the "
                    "replay (seed 0, from step 0) and extrapolate the check's cost")
    ap.add_argument("--out", default="reference/reproductions/cnr.csv")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = params(a.steps, a.params)
    if a.time_steps:
        return time_steps(p, a.M, a.time_steps, a.probes, a.jac_batch, len(a.seeds), a.from_step or 0)
    steps = p["train"]["budget"]["steps"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cnr-check-") as tmp:
        for seed in a.seeds:
            run = f"M{a.M}-B64-{BASE}-s{seed}"
            base, state, train_s = train_base(p, run, Path(tmp) / run, a.from_step)
            t0 = 0 if state is None else load_torch(state)["commit"]
            pred = replay_run(Path(tmp) / run, COUNTERFACTUALS, p["noise"]["conditions"], a.probes, a.jac_batch, seed,
                              state=state)
            for cf in COUNTERFACTUALS:
                real, retrain_s = retrain(p, f"M{a.M}-B64-{cf}-s{seed}", Path(tmp) / f"{cf}-s{seed}", state)
                for _, r in pred[pred.counterfactual == cf].iterrows():
                    if r.metric not in ("ood_loss", "r"):
                        continue
                    rows.append({"seed": seed, "counterfactual": cf, "metric": r.metric, "observed": r.observed,
                                 "delta": r.delta, "se": r.se, "sd_draw": r.sd_draw,
                                 "lo_delta": r.lo - r.observed, "hi_delta": r.hi - r.observed,
                                 "realised": float(real[r.metric] - base[r.metric]), "cnr_s": r.seconds,
                                 "retrain_s": retrain_s, "train_s": train_s, "steps": steps, "from_step": t0,
                                 "M": a.M, "probes": a.probes, "jac_batch": a.jac_batch})
                print(rows[-2], flush=True)
    df = pd.DataFrame(rows)
    df["covered"] = (df.lo_delta <= df.realised) & (df.realised <= df.hi_delta)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out, index=False)
    summary(df)
    fig_cnr(df, Path(a.out).with_name(Path(a.out).stem.replace("cnr", "cnr_check", 1)))


def time_steps(p: dict, M: int, k: int, probes: int, jac_batch: int, seeds: int, t0: int) -> None:
    """Time the base run's training and its replay with every counterfactual's paths over the same steps [c, 2k),
    c the last commit ≤ k (past the first steps' dense checkpoints); print the per-step costs and the check's cost
    over [t0, T] extrapolated from them."""
    run = f"M{M}-B64-{BASE}-s0"
    spec = RunSpec.of(run_spec(p, run))
    cfs = [counterfactual(n, p["noise"]["conditions"], spec) for n in COUNTERFACTUALS]
    with tempfile.TemporaryDirectory(prefix="cnr-time-") as tmp:
        rd = Path(tmp) / run
        train_ensemble([spec.raw], [rd], progress=False, stop_after=k)
        state = load_torch(rd / RESUME)
        c = state["commit"]
        t = time.time()
        train_ensemble([spec.raw], [rd], progress=False, stop_after=2 * k)
        train_s = (time.time() - t) / (2 * k - c)
    t = time.time()
    replay_paths(spec, cfs, probes, jac_batch, 0, "cpu", state, stop_after=2 * k)
    replay_s = (time.time() - t) / (2 * k - c)
    W, n = spec.train.steps - t0, len(COUNTERFACTUALS)
    print(f"{run} ({spec.model}): per step over [{c}, {2 * k}): training {train_s:.3f} s, replay with "
          f"{n} counterfactuals x {probes} probes {replay_s:.3f} s ({replay_s / train_s:.1f}x)")
    print(f"the check over [{t0}, {spec.train.steps}] ({W} steps), {seeds} seeds, one core: base runs "
          f"{seeds * spec.train.steps * train_s / 3600:.1f} h, replays {seeds * W * replay_s / 3600:.1f} h, "
          f"retraining {seeds * n * W * train_s / 3600:.1f} h; cost ratio {replay_s / (n * train_s):.2f}")


def summary(df: pd.DataFrame) -> None:
    """Spearman's ρ per metric over (counterfactual, seed) pairs and over the counterfactuals' seed means, the
    intervals' coverage, and the cost of one replay (all counterfactuals) over retraining them."""
    for metric, d in df.groupby("metric"):
        rho = spearmanr(d.delta, d.realised).statistic
        mean = d.groupby("counterfactual")[["delta", "realised"]].mean()
        rho_cf = spearmanr(mean.delta, mean.realised).statistic
        print(f"{metric}: Spearman over (cf, seed) {rho:.3f}, over counterfactuals (seed means) {rho_cf:.3f}, "
              f"coverage {d.covered.mean():.2f} of {len(d)}")
    per_seed = pd.DataFrame({"cnr": df.groupby("seed").cnr_s.first(),
                             "retrain": df.groupby(["seed", "counterfactual"]).retrain_s.first().groupby("seed").sum()})
    print(f"cost: CNR (one replay, all {df.counterfactual.nunique()} counterfactuals) / retraining them: "
          f"{(per_seed.cnr / per_seed.retrain).mean():.2f}")


if __name__ == "__main__":
    main()
