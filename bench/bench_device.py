"""The GPU path against the CPU, side by side in one process on one machine: training run-steps per second
(`train_ensemble`, exactly as `iclnoise train` runs an ensemble) and LLC chain-steps per second
(`estimate_llcs`, as `iclnoise llc` runs a checkpoint's chains).

Shapes: the default's two training jobs (18 runs at batch 16 and at batch 64, params.yaml's model) and the
Hoogland reproduction's (2 runs at batch 256, configs/hoogland.yaml's model); LLC with the default's
sampler and with Hoogland's (10 chains, batch 1024). Each CPU row runs with the threads given (the pipeline
runs its jobs on 1 thread each). Exposure logging is off and checkpoints are few, so the numbers are the
update (or SGLD step) rate; a run-step is one update of one run.

Usage: PYTHONPATH=src python bench/bench_device.py [--devices cuda cpu] [--threads 1 16] [--steps 300]

--science (issue 41): the step of configs/science.yaml's model (D = 5, K = 8) at R = 18, 72 and 288 runs, batch 16 and
64, exposure logging off and on, and a closed-loop injecting arm (its `early` condition: budget, window open), on
every device given (CPU rows on 1 thread each, in parallel processes after the GPU's), into --csv (columns device,
model, engine, runs, batch, exposure, injecting, run_steps_per_s, step_ms, commit). A row times `Ensemble._step` itself:
the steps after a warm-up, and with exposure on the logging step (every `exposure.every`-th) apart, weighted 1 in
`every`. --science-train S then trains configs/science.yaml's ensembles (ensemble_groups) on the first device for
at most S seconds and writes --science-csv: each group's steps done, seconds, and its time at that pace to the end
(measured when it finished, else projected from the steps done: the early log-spaced checkpoints make that an
over-estimate). --engine sets train.cuda_graphs / train.tf32 for the GPU rows and the training (named in the
`engine` column; the CPU ignores both: its rows read eager).

--science --inject-paths (issue 41 item 3): only the injecting arm, at each --runs and the largest --batches, on each
device in this process, its step timed over --steps steps (CPU too) with the injector's closed loop batched
(batched.BatchedInjection) and per run (ensemble.INJECT_BATCHED off), alternating; prints the rows and the speed-up
and writes --csv with an `injector` column (batched / per_run).
"""
from __future__ import annotations

import argparse
import copy
import csv
import multiprocessing
import os
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import iclnoise.run.ensemble as ens
from iclnoise.config import load_params
from iclnoise.config.grid import ensemble_groups, run_spec, spec_hash
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.probe_sections import LLCConfig
from iclnoise.core.runspec import RunSpec
from iclnoise.core.schedules import checkpoints_until
from iclnoise.run.ensemble import Ensemble
from iclnoise.run.member import Member
from iclnoise.run.probing import sampling_data
from iclnoise.run.train import train_ensemble


def train_rate(params: dict, runs: list[str], steps: int, device: str) -> float:
    """Run-steps per second of one ensemble's updates: the time of `steps` updates less that of `steps` / 3
    (the same start-up, data and evaluations), over the 2/3 · `steps` updates between."""
    def once(n: int) -> float:
        p = copy.deepcopy(params)
        p["train"].update(budget={"mode": "steps", "steps": n}, checkpoints={"linear": 1, "log": 0}, device=device)
        p["exposure"]["enabled"] = False
        specs = [run_spec(p, r) for r in runs]
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            train_ensemble(specs, [f"{d}/{r}" for r in runs], progress=False)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0
    once(2)  # warm-up (kernels, allocator)
    return len(runs) * (steps - steps // 3) / (once(steps) - once(steps // 3))


def llc_rate(params: dict, run: str, sgld_steps: int, device: str) -> float:
    """Chain-steps per second of one checkpoint's chains (all chains in one batched pass)."""
    spec = run_spec(params, run)
    cfg = LLCConfig.from_dict({**params["llc"]["sampler"], "burn_in": 0, "draws": sgld_steps})
    d = spec["data"]
    model = build_model(ModelConfig(D=d["D"], K=d["K"], **spec["model"]), 0, device)
    from iclnoise.probes.llc import estimate_llcs
    xs, ys = sampling_data(RunSpec.of(spec), cfg.n, device)
    center = [{k: v.detach() for k, v in model.named_parameters()}]
    short = LLCConfig.from_dict({**params["llc"]["sampler"], "burn_in": 0, "draws": 2})
    estimate_llcs(model, mse_loss, xs, ys, short, center)  # warm-up
    t0 = time.perf_counter()
    estimate_llcs(model, mse_loss, xs, ys, cfg, center)
    if device == "cuda":
        torch.cuda.synchronize()
    return cfg.chains * sgld_steps / (time.perf_counter() - t0)


COLUMNS = ["device", "model", "engine", "runs", "batch", "exposure", "injecting", "run_steps_per_s", "step_ms",
           "commit"]
ENGINES = {"eager": {}, "cuda_graphs": {"cuda_graphs": True}, "tf32": {"tf32": True},
           "cuda_graphs+tf32": {"cuda_graphs": True, "tf32": True}}   # --engine: train's CUDA switches


def commit() -> str:
    """The code's commit: $ICLNOISE_COMMIT, else git's (+ '-dirty' with uncommitted changes), else 'unknown'."""
    if os.environ.get("ICLNOISE_COMMIT"):
        return os.environ["ICLNOISE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)})"


def engine_name(params: dict) -> str:
    """The ENGINES key of params' train switches (the CPU ignores them, so there it is always eager)."""
    t = params["train"]
    on = {k: True for k in ("cuda_graphs", "tf32") if t.get(k) and t.get("device") == "cuda"}
    return next(k for k, v in ENGINES.items() if v == on)


def science_runs(params: dict, runs: int, batch: int, noise: str) -> list[str]:
    """`runs` run ids of one ensemble: the grid's M cycled over seeds 0, 1, ... (each run its own pool and stream)."""
    Ms = params["grid"]["M"]
    return [f"M{Ms[i % len(Ms)]}-B{batch}-{noise}-s{i // len(Ms)}" for i in range(runs)]


def step_row(params: dict, runs: int, batch: int, exposure: bool, injecting: bool, device: str, quiet: int,
             threads: int = 0, batched: bool = True) -> dict:
    """One row of device.csv: an ensemble of `runs` science runs built as `iclnoise train` builds it, its
    `Ensemble._step` timed over `quiet` steps after a warm-up (step 0, exposure's first row, included) and, with
    exposure on, the logging step apart: step_ms = (quiet_ms · (every − 1) + logging_ms) / every. `batched`: the
    injector's closed loop across the runs (ensemble.INJECT_BATCHED), else per run."""
    if threads:
        torch.set_num_threads(threads)
    ens.INJECT_BATCHED = batched
    p = copy.deepcopy(params)
    p["train"].update(checkpoints={"linear": 1, "log": 0}, device=device)   # no checkpoint inside the timed steps
    p["exposure"]["enabled"] = exposure
    specs = [run_spec(p, r) for r in science_runs(p, runs, batch, "early" if injecting else "none")]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as d:
        members = [Member(RunSpec.of(s), Path(d) / s["keys"]["run_id"], spec_hash(s), torch.device(device))
                   for s in specs]
        for m in members:
            m.setup()
        e = Ensemble(members, 0, "bench")
        first = 1 if device == "cpu" else 0   # the CPU skips step 0's exposure row (R of them, seconds each)
        warm = first + (1 if device == "cpu" else 10)

        def timed(steps: range) -> float:
            sync()
            t0 = time.perf_counter()
            for step in steps:
                e._step(step, None)
            sync()
            return (time.perf_counter() - t0) * 1e3 / len(steps)

        timed(range(first, warm))
        ms = timed(range(warm, warm + quiet))
        every = p["exposure"]["every"]
        if exposure and every > warm + quiet:
            ms = (ms * (every - 1) + timed(range(every - 1, every))) / every
    return {"device": device_name(device), "model": "science", "engine": engine_name(p), "runs": runs, "batch": batch,
            "exposure": exposure,
            "injecting": injecting, "run_steps_per_s": round(runs * 1e3 / ms, 1), "step_ms": round(ms, 3),
            "commit": commit(), "injector": ("batched" if batched else "per_run") if injecting else ""}


def science_rows(params: dict, devices: list[str], sizes: list[int], batches: list[int], quiet: int,
                 workers: int, path: str) -> list[dict]:
    """Every (runs, batch, exposure) and, at the largest batch, the injecting arm (exposure on; a tenth of the steps:
    its hooks act every step); GPU rows one after another, then the CPU rows on 1 thread each, in `workers` parallel
    processes (a thirtieth of the steps; one above 72 runs or injecting). `path` is rewritten after every row."""
    cases = [(r, b, x, False) for r in sizes for b in batches for x in (False, True)]
    cases += [(r, max(batches), True, True) for r in sizes]
    rows = []

    def add(row: dict) -> None:
        rows.append(row)
        print(row, flush=True)
        write_csv([{k: r[k] for k in COLUMNS} for r in rows], path)

    for dv in devices:
        if dv != "cpu":
            for c in cases:
                add(step_row(params, *c, dv, max(2, quiet // 10) if c[3] else quiet))
            continue
        # spawned, not forked from a process that has used CUDA; the largest first: they take longest
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = [pool.submit(step_row, params, *c, "cpu", 1 if c[3] or c[0] > 72 else max(2, quiet // 30), 1)
                    for c in sorted(cases, key=lambda c: -c[0])]
            for f in futs:
                add(f.result())
    return rows


def train_science(params: dict, device: str, budget_s: float, first: int = 200) -> list[dict]:
    """Train every ensemble of `params` (as the pipeline groups them) on `device`, one after another, each for its
    share of `budget_s` (by run-steps): stops only at checkpoints (resume commits), so the continuation wastes no
    step (the first stop: the first checkpoint from step `first`). A group's `total_s` is measured when it
    finished, else its seconds so far and the pace of its last stretch (after the first: fewer checkpoints) over the
    steps left."""
    p = copy.deepcopy(params)
    p["train"]["device"] = device
    groups = ensemble_groups(p)
    specs = {g: [run_spec(p, r) for r in runs] for g, runs in groups.items()}
    work = {g: len(s) * s[0]["train"]["steps"] for g, s in specs.items()}
    rows = []
    for g, ss in specs.items():
        steps, share = ss[0]["train"]["steps"], budget_s * work[g] / sum(work.values())
        ckpts = checkpoints_until(steps, p["train"]["checkpoints"]["linear"], p["train"]["checkpoints"]["log"], steps)
        done, secs, target = 0, 0.0, next(c for c in ckpts if c >= min(steps, first))
        with tempfile.TemporaryDirectory() as d:
            while True:
                t0 = time.perf_counter()
                train_ensemble(ss, [Path(d) / s["keys"]["run_id"] for s in ss], progress=False,
                               device=torch.device(device), stop_after=target)
                dt = time.perf_counter() - t0
                pace, secs, done = dt / (target - done), secs + dt, target   # seconds per step of this stretch
                reach = [c for c in ckpts if done < c <= done + (share - secs) / pace]
                if done >= steps or not reach:
                    break
                target = reach[-1]
        rows.append({"device": device_name(device), "engine": engine_name(p), "group": g, "runs": len(ss),
                     "steps": steps, "steps_done": done,
                     "seconds": round(secs, 1), "total_s": round(secs + (steps - done) * pace, 1),
                     "finished": done >= steps, "commit": commit()})
        print(rows[-1], flush=True)
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def inject_rows(params: dict, devices: list[str], sizes: list[int], batch: int, steps: int, threads: int,
                path: str) -> list[dict]:
    """The injecting arm's step with the closed loop per run and batched, side by side in this process (CPU rows on
    `threads` threads), each timed over `steps` steps; the speed-up printed per size."""
    rows = []
    for dv in devices:
        for r in sizes:
            pair = [step_row(params, r, batch, True, True, dv, steps, threads if dv == "cpu" else 0, b)
                    for b in (False, True)]
            rows += pair
            for row in pair:
                print(row, flush=True)
            print(f"{dv} {r} runs: batched {pair[0]['step_ms'] / pair[1]['step_ms']:.2f}x the per-run step", flush=True)
            write_csv([{k: x[k] for k in COLUMNS + ["injector"]} for x in rows], path)
    return rows


def science_main(a: argparse.Namespace) -> None:
    params = load_params("params.yaml", ["configs/science.yaml"])
    params["train"].update(ENGINES[a.engine])
    print(f"torch {torch.__version__}; GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
          f"commit {commit()}", flush=True)
    if a.inject_paths:
        inject_rows(params, a.devices, a.runs, max(a.batches), a.steps, a.threads[0], a.csv)
        return
    if not a.train_only:
        t0 = time.perf_counter()
        rows = science_rows(params, a.devices, a.runs, a.batches, a.steps, a.workers, a.csv)
        print(f"{a.csv}: {len(rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    if a.science_train:
        train = train_science(params, a.devices[0], a.science_train, a.first_stop)
        write_csv(train, a.science_csv)
        total = sum(r["total_s"] for r in train)
        print(f"configs/science.yaml's {sum(r['runs'] for r in train)} runs on {train[0]['device']}: "
              f"{total / 60:.1f} min ({'measured' if all(r['finished'] for r in train) else 'projected'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--steps", type=int, default=300, help="training updates per GPU measurement (CPU: a tenth)")
    ap.add_argument("--sgld", type=int, default=100, help="SGLD steps per GPU measurement (CPU: a tenth)")
    ap.add_argument("--science", action="store_true", help="the science model's rows (issue 41) instead")
    ap.add_argument("--runs", nargs="+", type=int, default=[18, 72, 288], help="--science: ensemble sizes")
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 64], help="--science: batch sizes")
    ap.add_argument("--workers", type=int, default=12, help="--science: parallel CPU processes")
    ap.add_argument("--csv", default="reference/measurements/device.csv")
    ap.add_argument("--science-train", type=float, default=0, metavar="S",
                    help="--science: also train configs/science.yaml for at most S seconds")
    ap.add_argument("--science-csv", default="reference/measurements/device_science.csv")
    ap.add_argument("--train-only", action="store_true", help="--science: only --science-train (no rows)")
    ap.add_argument("--engine", choices=list(ENGINES), default="eager",
                    help="--science: train.cuda_graphs / train.tf32 on the GPU rows and training (the CPU: eager)")
    ap.add_argument("--first-stop", type=int, default=200, help="--science-train: steps before the first stop")
    ap.add_argument("--inject-paths", action="store_true",
                    help="--science: the injecting arm only, its closed loop batched against per run")
    a = ap.parse_args()
    if a.science:
        return science_main(a)
    default = load_params("params.yaml")
    hoogland = load_params("params.yaml", ["configs/hoogland.yaml"])
    jobs = [("default 18 runs x B16", default, [f"M{m}-B16-none-s{s}" for m in (1, 2, 4, 8, 16, "inf")
                                                for s in range(3)]),
            ("default 18 runs x B64", default, [f"M{m}-B64-none-s{s}" for m in (1, 2, 4, 8, 16, "inf")
                                                for s in range(3)]),
            ("hoogland 2 runs x B256", hoogland, ["Minf-B256-none-s0", "Minf-B256-none-s1"])]
    chains = [("default sampler", default, "M16-B64-none-s0"), ("hoogland sampler", hoogland, "Minf-B256-none-s0")]
    settings = [(dv, t) for dv in a.devices for t in (a.threads if dv == "cpu" else [torch.get_num_threads()])]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"torch {torch.__version__}; GPU: {name}")
    rates: dict[tuple, float] = {}
    for dv, t in settings:
        torch.set_num_threads(t)
        f = 1 if dv == "cuda" else 10
        for label, p, runs in jobs:
            rates[label, dv, t] = r = train_rate(p, runs, max(12, a.steps // f), dv)
            print(f"train  {label:<26} {dv:>4} {t:>2} threads: {r:10.1f} run-steps/s", flush=True)
        for label, p, run in chains:
            rates[label, dv, t] = r = llc_rate(p, run, max(5, a.sgld // f), dv)
            print(f"llc    {label:<26} {dv:>4} {t:>2} threads: {r:10.1f} chain-steps/s", flush=True)
    if "cuda" in a.devices and "cpu" in a.devices:
        g = next(k for k in settings if k[0] == "cuda")
        for label in [j[0] for j in jobs] + [c[0] for c in chains]:
            for t in a.threads:
                ratio = rates[(label, *g)] / rates[label, "cpu", t]
                print(f"GPU / CPU ({t} thread{'s' * (t > 1)})  {label:<26} {ratio:8.1f}x")


if __name__ == "__main__":
    main()
