"""How close a closed-loop injected dose is to method §6's definition, on the science model (issue 43, item 0).

A run injects constant-schedule diagonal noise under the closed loop (a budget of integrated injected P-NE*),
and `iclnoise.noise.dose_check.DoseReference` recomputes, at every `--ref-every`-th step, the step's injected P-NE*
with that step's A and the exact Gauss–Newton diagonal on held-out sequences. Both are summed over the same
steps, so their ratio is the books' accuracy: realised / booked. Printed per (curvature setting, source),
over the first `--early` steps (A and the curvature move fastest), over the late window (from `--late` on: the
last 20 % of the schedule, where the learning rate has decayed) and over the steps between; one CSV row each.

The reference divides by one held-out batch's exact curvature, and 1/Curv is convex: where its batch is not the one
the loop measured diag Ĥ on (from the first logged row on, the loop refreshes one step before each reference step), it
reads the dose high by about the squared coefficient of variation of Curv between batches. In one run, steps 500-2000
read 1.020 with references on 32 sequences and 1.004 on 256 (reference/measurements/dose_accuracy_heldout.csv), so
`--heldout` takes several sizes, each its own reference and row in the same run.

The run is the first `--stop` steps of the science schedule (params.yaml + configs/science.yaml, batch 64,
1 280 000 sequences: 20 000 steps, warm-up 1 000), so the learning-rate schedule is the experiment's.

Usage: python experiments/dose_accuracy.py [--stop 1500] [--ref-every 10] [--dose 0.55]
           [--settings 8:25 16:10] [--sources param grad] [--out reference/measurements/dose_accuracy_heldout.csv]
           [--heldout 32 256] [--device cuda] [--deadline S]
`--deadline S`: after S seconds (or on SIGTERM) the run stops and its row covers the steps it reached
(`steps_reached`); windows it did not reach read NaN. scripts/device/dose_accuracy_device.sh runs every dose level at
once on a lent GPU.

The late window on a CPU, from finished runs (reference/measurements/dose_accuracy_late.csv):
       python experiments/dose_accuracy.py --heldout 32 256 --resume results/runs/Minf-B64-grad_x0p3-s0 ...
each run resumes alone from its resume.prev.pt (its ensemble's last commit but one: step 18 333 of 20 000 in
configs/dose.yaml) under its own spec, with the references beside it, to the end of its schedule; its row also gives
the resumed run's books over those steps against the original run's (injection.parquet), near 1 when the resumed run
is the run (the same bits where the run was trained on one thread by code that keeps a run's bits alone, README
"Determinism"; the runs of reference/dose were not). `--states FILE...` starts each run instead
from a copy of its resume.pt kept from an earlier commit (step 15 000: the whole late window), and the row splits the
late window at `--cut` (18 333) as well.
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

import iclnoise.run.member as member
from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet
from iclnoise.noise.dose_check import DoseReference
from iclnoise.run.runs import load_torch, save_torch
from iclnoise.run.train import train_run


def deep_update(base: dict, over: dict) -> dict:
    for k, v in over.items():
        base[k] = deep_update(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


class Deadline(Exception):
    """Raised in the training loop by SIGTERM or SIGALRM (--deadline): the row covers the steps reached."""


EXPIRED = []   # set once the deadline has passed: the measurements after it are not started
OUT, OUT_LATE = "reference/measurements/dose_accuracy_heldout.csv", "reference/measurements/dose_accuracy_late.csv"


def stop_here(signum, frame):
    EXPIRED.append(signum)
    raise Deadline


def measure(base: dict, source: str, probes: int, every: int | str, a) -> list[dict]:
    """One run with a reference beside its injector for each --heldout size; per reference, the booked and
    recomputed P-NE* summed per period."""
    p = copy.deepcopy(base)
    p["exposure"].update(curvature_probes=probes)
    if every == "auto":
        p["exposure"]["curvature_tol"] = a.tol
    else:
        p["exposure"]["curvature_every"] = int(every)
    p["noise"]["conditions"]["dose"] = {"source": source, "shape": "diagonal", "schedule": "constant",
                                        "budget": a.dose, "batch_sizes": [64]}
    p = validate_params(p)
    with tempfile.TemporaryDirectory() as d:
        return referenced(a, lambda: train_run(run_spec(p, "Minf-B64-dose-s0"), Path(d), progress=False))


def measure_resumed(run_dir: Path, start: Path | None, a) -> tuple[dict, int, float, list[dict]]:
    """A finished run's last stretch measured: a copy of its directory resumes alone from `start` (a resume state
    of the run kept from an earlier commit; default its resume.prev.pt, the ensemble's last commit but one) under its
    own run.json, untouched, with the references beside its injector
    (their empty states put in front of the run's hooks' states, as build_hooks puts the references in front);
    the spec, the step it resumed at, the resumed run's booked P-NE* over those steps / the original run's (the
    same run to float32 round-off: near 1), and `referenced`'s rows."""
    spec = {k: v for k, v in json.loads((run_dir / "run.json").read_text()).items() if k != "spec_hash"}
    with tempfile.TemporaryDirectory() as d:
        rd = Path(d) / run_dir.name
        shutil.copytree(run_dir, rd, ignore=shutil.ignore_patterns("resume.pt"))
        state = load_torch(start or rd / "resume.prev.pt")
        state["hooks"] = [{}] * len(a.heldout) + state["hooks"]
        save_torch(state, rd / "resume.pt")
        (rd / "resume.prev.pt").unlink()
        outs = referenced(a, lambda: train_run(spec, rd, progress=False))
        ours, theirs = (read_parquet(x / "injection.parquet") for x in (rd, run_dir))
        reached = outs[0]["reached"] if outs else 0
        same = [x[(x.step >= state["step"]) & (x.step < reached)].pne_injected.sum() for x in (ours, theirs)]
        return spec, state["step"], float(same[0] / same[1]) if same[1] else float("nan"), outs


def referenced(a, train) -> list[dict]:
    """train() with a DoseReference on each --heldout size in front of every injecting run's hooks; per reference,
    realised / booked summed over each period of the steps it measured."""
    made, build = [], member.build_hooks

    def with_reference(spec, device):
        hooks = build(spec, device)
        inj = [h for h in hooks if h.name == "injection"]
        for n in a.heldout if inj else ():
            made.append(DoseReference(inj[0], n, a.ref_every))
            hooks.insert(0, made[-1])
        return hooks

    member.build_hooks = with_reference
    t0 = time.perf_counter()
    try:
        train()
    except Deadline:
        pass
    finally:
        member.build_hooks = build
    wall = time.perf_counter() - t0
    outs = []
    for ref in made:
        n = min(len(ref.steps), len(ref.pne), len(ref.booked))   # a step stopped between its two hooks is left out
        steps, real, booked = (np.array(x[:n]) for x in (ref.steps, ref.pne, ref.booked))
        out = {"heldout": ref.n, "reached": int(steps.max()) + 1 if n else 0, "wall_s": wall}
        periods = (("early", steps < a.early), ("mid", (steps >= a.early) & (steps < a.late)),
                   ("late", steps >= a.late), ("rest", steps >= a.early), ("all", steps >= 0),
                   ("late_a", (steps >= a.late) & (steps < a.cut)), ("late_b", steps >= a.cut))
        for period, sel in periods:
            out[period] = ratio_se(real[sel], booked[sel])
        outs.append(out)
    return outs


def ratio_se(real: np.ndarray, booked: np.ndarray) -> tuple[float, int, float]:
    """Σ real / Σ booked over n reference steps, n, and the ratio's standard error by the delta method, treating the
    steps' terms as independent (each reference step draws its own held-out batch, and at --ref-every 10 with
    curvature_every 10 the books' diag Ĥ is refreshed between reference steps): SE = √(n/(n−1) Σ (realᵢ − R bookedᵢ)²)
    / Σ booked (its 95 % interval covered the planted ratio in 0.952 of 2 000 series of 166 steps, lognormal books,
    10 % noise per step). NaN where there are fewer than 2 steps."""
    n = len(real)
    if n == 0:
        return float("nan"), 0, float("nan")
    r = float(real.sum() / booked.sum())
    se = float(np.sqrt(n / (n - 1) * np.square(real - r * booked).sum()) / booked.sum()) if n > 1 else float("nan")
    return r, n, se


def resumed_rows(a, commit: str) -> list[dict]:
    """--resume: one row per (run, reference) over the steps from the run's resume state (--states, or its
    resume.prev.pt) to its end."""
    if a.states and len(a.states) != len(a.resume):
        raise SystemExit(f"--states names {len(a.states)} files for {len(a.resume)} --resume runs: one per run")
    rows = []
    for run_dir, start in zip(map(Path, a.resume), map(Path, a.states) if a.states else [None] * len(a.resume)):
        spec, at, books, outs = measure_resumed(run_dir, start, a)
        exp, cond = spec["exposure"], spec["noise"]
        for r in outs:
            print(f"{run_dir.name}: from step {at}, reference on {r['heldout']} sequences, realised/booked "
                  f"{r['all'][0]:.3f} ({r['all'][1]} steps; late window from {a.late}: {r['late'][0]:.3f}); its "
                  f"books / the original run's {books:.4f}  "
                  f"[{r['reached']} steps reached, {r['wall_s']:.0f} s]", flush=True)
            rows.append({"run_id": run_dir.name, "source": cond["source"], "dose": cond["budget"],
                         "probes": exp["curvature_probes"], "curvature_every": exp["curvature_every"],
                         "resumed_at": at, "steps_reached": r["reached"], "books_vs_original": round(books, 5),
                         "ref_every": a.ref_every,
                         "ref_heldout": r["heldout"], "ref_steps": r["all"][1], "ratio": round(r["all"][0], 4),
                         "ratio_late": round(r["late"][0], 4), "late_from": a.late,
                         "ratio_late_to_cut": round(r["late_a"][0], 4), "ratio_from_cut": round(r["late_b"][0], 4),
                         "cut": a.cut, "se_late": round(r["late"][2], 4), "se_late_to_cut": round(r["late_a"][2], 4),
                         "se_from_cut": round(r["late_b"][2], 4), "wall_s": round(r["wall_s"], 1),
                         "device": device_name(a.device), "commit": commit})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stop", type=int, default=1500, help="train the first N steps of the schedule")
    ap.add_argument("--ref-every", type=int, default=10)
    ap.add_argument("--early", type=int, default=500)
    ap.add_argument("--heldout", type=int, nargs="+", default=[32],
                    help="held-out sequences of the exact reference; several: one reference each, in one run")
    ap.add_argument("--dose", type=float, default=0.55, help="budget over the whole 20 000-step schedule")
    ap.add_argument("--tol", type=float, default=0.05, help="exposure.curvature_tol of the settings named auto")
    ap.add_argument("--settings", nargs="*", default=["8:25", "16:10"],
                    help="probes:every (every = auto: adaptive refresh at --tol)")
    ap.add_argument("--sources", nargs="*", default=["param", "grad"])
    ap.add_argument("--out", help=f"CSV to append to (default {OUT}; with --resume {OUT_LATE})")
    ap.add_argument("--late", type=int, default=16000, help="the late window starts here (the schedule's last 20 %%)")
    ap.add_argument("--cut", type=int, default=18333,
                    help="--resume rows also split the late window here (default: configs/dose.yaml's last commit "
                         "but one, where a finished run's resume.prev.pt stands)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deadline", type=float, help="stop after this many seconds (also on SIGTERM)")
    ap.add_argument("--resume", nargs="+", metavar="RUN_DIR",
                    help="instead: the last stretch of these finished runs, each resumed alone from its "
                         "resume.prev.pt under its own spec")
    ap.add_argument("--states", nargs="+", metavar="FILE",
                    help="with --resume: the resume state each run starts from (a copy of its resume.pt kept from "
                         "an earlier commit), one per RUN_DIR in the same order; default each run's resume.prev.pt")
    a = ap.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, stop_here)
    signal.signal(signal.SIGALRM, stop_here)
    if a.deadline:
        signal.setitimer(signal.ITIMER_REAL, a.deadline)
    base = deep_update(yaml.safe_load(open("params.yaml")), yaml.safe_load(open("configs/science.yaml")))
    base["train"]["budget"]["stop_at"] = a.stop
    base["train"]["device"] = a.device
    base["train"]["checkpoints"] = {"linear": 0, "log": 0}
    base["eval"].update(n_sequences=64, n_root=8)
    for probe in ("ed", "llc", "geometry", "mech"):
        base[probe]["enabled"] = False
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if a.resume:
        write_rows(resumed_rows(a, commit), a.out or OUT_LATE)
        return
    rows = []
    for setting in a.settings:
        probes, every = setting.split(":")
        for source in a.sources:
            if EXPIRED:
                print(f"probes {probes} every {every} {source}: not started (deadline)", flush=True)
                continue
            for r in measure(base, source, int(probes), every, a):
                print(f"probes {probes:>2} every {every:>4}  {source:5s}  dose {a.dose}  reference on {r['heldout']} "
                      f"sequences, realised/booked: first {a.early} steps {r['early'][0]:.3f} ({r['early'][1]} steps), "
                      f"up to {a.late} {r['mid'][0]:.3f}, late {r['late'][0]:.3f} ({r['late'][1]} steps), all "
                      f"{r['all'][0]:.3f}  [{r['reached']} steps reached, {r['wall_s']:.0f} s]", flush=True)
                rows.append({"probes": probes, "curvature_every": every, "tol": a.tol if every == "auto" else "",
                             "source": source, "dose": a.dose, "steps": a.stop, "steps_reached": r["reached"],
                             "ref_every": a.ref_every, "ratio_early": round(r["early"][0], 4),
                             "ratio_mid": round(r["mid"][0], 4), "ratio_late": round(r["late"][0], 4),
                             "ratio_rest": round(r["rest"][0], 4), "ratio_all": round(r["all"][0], 4),
                             "late_from": a.late, "wall_s": round(r["wall_s"], 1), "device": device_name(a.device),
                             "commit": commit, "ref_heldout": r["heldout"]})
    write_rows(rows, a.out or OUT)


def write_rows(rows: list[dict], out: str) -> None:
    """Append rows to the CSV `out` (its header first when new)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    new = not Path(out).exists()
    if not new and open(out).readline().strip().split(",") != list(rows[0]):
        raise SystemExit(f"{out} has other columns (an older version of this bench); pass another --out")
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return "cpu (2-core dev machine, 1 thread)"


if __name__ == "__main__":
    main()
