"""CNR's ground truth on the science window, and the first-order pathwise estimator judged against it (issue 67,
items 3-4): the run M16-B64-late-s<seed> of configs/science.yaml (late grad-source diagonal noise over the last 30 %
of 20 000 steps).

Stage `crn`: per seed, the run forked at the window's start into its own noise and COUNTERFACTUALS ×
`--realisations` noise streams (iclnoise.run.crn), one ensemble and one file (`--out`/realisations_s<seed>.parquet,
written when the seed is done); the reference's state at the fork is kept (`--work`/fork_s<seed>.pt), and a second
call forks from it into MORE_LEVELS (realisations_s<seed>_levels.parquet). Killed, it resumes: a finished call from
its file, the running one from its members' last commit (`--work`/work_s<seed>[_levels]). The per-seed tables are
small and committed (reference/measurements/crn); fork states and work directories are not.

Stage `pathwise`: per seed, from the fork state (trained to t0 here if the crn stage has not kept it), one replay of
each realisation i < `--realisations` of the run's own noise carrying the tangent of its log-level
(iclnoise.run.pathwise.sensitivities, GROUP realisations replayed together); each group's g_i are appended to
`--out`/pathwise_s<seed>.parquet as it finishes, so a killed stage resumes at the next group. The two stages may
run at once, in two processes.

Stage `split`: per seed, the same replays with the tangent split by layer (each block, and the rest) and by third
of the window (iclnoise.run.pathwise.split_sensitivities: 12 tangents per replay; their g add up to the whole), so
which layers' noise, and when, moves the metrics; `--out`/split_s<seed>.parquet, per group of realisations, and a
summary printed (ḡ ± SE per group for r). Not needed for the table.

After either stage, when every seed has both: effects.csv beside the table (ΔE f ± SE per counterfactual, seed and
metric, paired by realisation: iclnoise.analysis.stats.paired_effects) and `--table` (the same with the pathwise
prediction for the level counterfactuals self*k in both first-order forms, ΔE f ≈ ḡ ln k (predicted) and ≈ ḡ (k − 1)
(predicted_linear: stated before seeds 1-2's CRN means existed to fit better, docs/reproductions.md), each with its
SE and the interval prediction ± 1.96 √(se² + crn_se²), and the band between them (crn_pathwise.judge); Spearman ρ,
coverage and mean z² printed per form, for r and the OOD loss, over every k and inside |Δ log scale| ≤ 0.5).

Usage: OMP_NUM_THREADS=1 python experiments/reproductions/crn_check.py [--stage crn|pathwise|split] [--seeds 0 1 2]
       [--realisations 8] [--out DIR] [--work DIR] [--table DIR/crn.csv]
Then: iclnoise paper reference/science --attach-crn DIR/crn.csv --note "..." (the set's figure 13 and report).
"""
from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from iclnoise.analysis.stats import paired_effects
from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet, write_parquet
from iclnoise.core.runspec import RunSpec
from iclnoise.run.crn import REALISATIONS_SCHEMA, REFERENCE, counterfactual, crn, member_spec
from iclnoise.run.pathwise import fork_state, predict, sensitivities, split_sensitivities
from iclnoise.run.runs import load_torch, save_torch

sys.path.insert(0, str(Path(__file__).parent))
from crn_pathwise import judge  # noqa: E402  (one judgement of every estimator)

# the noise scale (×k of the budget: 7 levels, the first-order pathwise estimator's direction, iclnoise.run.pathwise),
# none, and the shape, the source and the window, each against the run's own
COUNTERFACTUALS = ["none", "self*0.25", "self*0.5", "self*0.75", "self*1.5", "self*2", "self*3", "self*4",
                   "self+shape=isotropic", "self+source=param", "self+fraction=0.15"]
# four more levels inside the pathwise estimator's local range (|ln k| / 2 ≤ 0.5), a second call forking from the
# kept state (its reference members are the first call's, bit for bit)
MORE_LEVELS = ["self*0.6", "self*0.85", "self*1.2", "self*1.75"]
PARTS = (("", COUNTERFACTUALS), ("_levels", MORE_LEVELS))
JAC_BATCH = 64   # sequences of each step's batch in the replay's Jacobian (crn_pathwise.py's)
GROUP = 4   # realisations replayed together (1.30x four alone, the same g: bench/bench_pathwise.py), written per group
PATHWISE_SCHEMA = pa.schema([("seed", pa.int64()), ("realisation", pa.int64()), ("metric", pa.string()),
                             ("g", pa.float64()), ("seconds", pa.float64())])
SPLIT_LAYERS, SPLIT_WINDOWS = ["blocks.0", "blocks.1", "blocks.2"], 3   # the science model's three blocks, thirds
SPLIT_SCHEMA = pa.schema([("seed", pa.int64()), ("realisation", pa.int64()), ("layers", pa.string()),
                          ("window_start", pa.int64()), ("window_stop", pa.int64()), ("metric", pa.string()),
                          ("g", pa.float64()), ("seconds", pa.float64())])


def level(text: str) -> float | None:
    """k of a level counterfactual (self*k; none is k = 0), None for any other."""
    if text == "none":
        return 0.0
    m = re.fullmatch(r"self\*([0-9.eE+-]+)", text)
    return float(m.group(1)) if m else None


def crn_stage(p: dict, seed: int, out: Path, work_dir: Path, n: int, commit: str) -> None:
    for part, names in PARTS:
        path = out / f"realisations_s{seed}{part}.parquet"
        if path.exists():
            continue
        t = time.time()
        work = work_dir / f"work_s{seed}{part}"   # the members' run directories: a killed call resumes from there
        values = crn(run_spec(p, f"M16-B64-late-s{seed}"), names, p["noise"]["conditions"], n, work=work,
                     fork=work_dir / f"fork_s{seed}.pt")
        write_parquet(values, path, REALISATIONS_SCHEMA, spec_hash=f"commit {commit}, {time.time() - t:.0f} s")
        shutil.rmtree(work)
        print(f"seed {seed}{part}: CRN {time.time() - t:.0f} s", flush=True)


def realisations(out: Path, seed: int) -> pd.DataFrame:
    """Both calls' members of a seed, the reference once (checked equal in both)."""
    main, more = (read_parquet(out / f"realisations_s{seed}{part}.parquet") for part, _ in PARTS)
    ref = [v[v.counterfactual == REFERENCE].reset_index(drop=True) for v in (main, more)]
    pd.testing.assert_frame_equal(ref[0], ref[1])
    return pd.concat([main, more[more.counterfactual != REFERENCE]], ignore_index=True)


def pathwise_stage(p: dict, seed: int, out: Path, work_dir: Path, n: int, commit: str, split: bool = False) -> None:
    path, fork = out / f"{'split' if split else 'pathwise'}_s{seed}.parquet", work_dir / f"fork_s{seed}.pt"
    schema = SPLIT_SCHEMA if split else PATHWISE_SCHEMA
    done = read_parquet(path) if path.exists() else pd.DataFrame(columns=schema.names)
    todo = [i for i in range(n) if i not in set(done.realisation)]
    if not todo:
        return
    spec = run_spec(p, f"M16-B64-late-s{seed}")
    t0 = RunSpec.of(spec).window[0]
    if not fork.exists():
        save_torch(fork_state(spec, t0), fork)
    state = load_torch(fork, "cpu")
    if state["step"] != t0:
        raise SystemExit(f"{fork}: a state at step {state['step']}, not the window's start {t0}")
    own = counterfactual("self", p["noise"]["conditions"], RunSpec.of(spec))
    for group in (todo[j:j + GROUP] for j in range(0, len(todo), GROUP)):
        t = time.time()
        specs = [RunSpec.of(member_spec(spec, own, i)) for i in group]
        if split:
            by = split_sensitivities(specs, state, JAC_BATCH, SPLIT_LAYERS, SPLIT_WINDOWS)
            seconds = (time.time() - t) / len(group)   # per replay
            rows = pd.DataFrame([{"seed": seed, "realisation": i, "layers": grp, "window_start": a,
                                  "window_stop": b, "metric": k, "g": v, "seconds": seconds}
                                 for i, b_ in zip(group, by) for (grp, a, b), g in b_.items() for k, v in g.items()])
        else:
            gs = sensitivities(specs, state, JAC_BATCH)
            seconds = (time.time() - t) / len(group)   # per replay
            rows = pd.DataFrame([{"seed": seed, "realisation": i, "metric": k, "g": v, "seconds": seconds}
                                 for i, g in zip(group, gs) for k, v in g.items()])
        done = pd.concat([done, rows], ignore_index=True) if len(done) else rows
        write_parquet(done, path, schema, spec_hash=f"commit {commit}")
        print(f"seed {seed}, realisations {group}: {'split' if split else 'pathwise'} {time.time() - t:.0f} s",
              flush=True)
    if split:
        r = done[done.metric == "r"].groupby(["layers", "window_start", "realisation"]).g.sum()
        summary = r.groupby(["layers", "window_start"]).agg(["mean", "sem"])
        print(f"seed {seed}: dr/d ln k per layer group and window (mean ± SE over realisations)\n{summary}",
              flush=True)


def table(out: Path, seeds: list[int], n: int, dest: Path) -> None:
    """effects.csv beside `dest` once every seed's CRN members are in `out`, and `dest` (judged) once every seed has
    n pathwise realisations too; what is missing is said, not skipped silently."""
    missing = [f"realisations_s{s}{part}.parquet" for s in seeds for part, _ in PARTS
               if not (out / f"realisations_s{s}{part}.parquet").exists()]
    if missing:
        return print(f"no table yet: {out} lacks {', '.join(missing)} (--stage crn --seeds …)", flush=True)
    values = pd.concat([realisations(out, s) for s in seeds])
    eff = paired_effects(values, REFERENCE, by=("counterfactual", "seed", "metric"))
    eff = eff[eff.counterfactual != REFERENCE]
    dest.parent.mkdir(parents=True, exist_ok=True)
    eff.to_csv(dest.parent / "effects.csv", index=False, float_format="%.6g")
    print(f"{dest.parent / 'effects.csv'}: the CRN effects of seeds {seeds}", flush=True)
    paths = [out / f"pathwise_s{s}.parquet" for s in seeds]
    have = {s: read_parquet(q).realisation.nunique() if q.exists() else 0 for s, q in zip(seeds, paths)}
    if min(have.values()) < n:
        short = ", ".join(f"seed {s} {k} of {n}" for s, k in have.items() if k < n)
        return print(f"no {dest} yet: pathwise realisations {short} (--stage pathwise --seeds …)", flush=True)
    g = pd.concat([read_parquet(q) for q in paths])
    rows = []
    for r in eff.itertuples():
        k = level(r.counterfactual)
        gs = [dict(zip(d.metric, d.g)) for _, d in g[g.seed == r.seed].groupby("realisation")]
        row = {"counterfactual": r.counterfactual, "seed": r.seed, "metric": r.metric,
               "n_realisations": r.n_realisations, "crn_mean": r.crn_mean, "crn_se": r.crn_se,
               "k": float("nan") if k is None else k}
        for form, col in (("log", "predicted"), ("linear", "predicted_linear")):
            nan = (float("nan"), float("nan"))   # no prediction: not a level, or a metric the replay does not read
            pred, se = predict(gs, k, form).get(r.metric, nan) if k is not None else nan
            half = 1.96 * (se ** 2 + r.crn_se ** 2) ** 0.5
            row |= {col: pred, f"{col}_se": se, f"{col}_lo": pred - half, f"{col}_hi": pred + half}
        rows.append(row)
    judge(pd.DataFrame(rows), str(dest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("crn", "pathwise", "split"), default="crn")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--realisations", type=int, default=8)
    ap.add_argument("--out", default="reference/measurements/crn",
                    help="the finished per-seed tables (small, committed: a new machine starts from them)")
    ap.add_argument("--work", default="results/crn_check", help="the fork states and the members' run directories")
    ap.add_argument("--table", default=None, help="default --out/crn.csv")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    p = load_params("params.yaml", ["configs/science.yaml"])
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for seed in a.seeds:
        if a.stage == "crn":
            crn_stage(p, seed, out, work, a.realisations, commit)
        else:
            pathwise_stage(p, seed, out, work, a.realisations, commit, split=a.stage == "split")
    table(out, a.seeds, a.realisations, Path(a.table) if a.table else out / "crn.csv")


if __name__ == "__main__":
    main()
