"""Ensemble training against one run per process, measured side by side in one process run (ratios).

  alone    : N runs trained one after another, each an ensemble of one (today's one-run-per-job path,
             without the process start-up, which only favours it)
  ensemble : the same N runs trained together (iclnoise.run.train.train_ensemble)

Both arms are the real training path (data, hooks and exposure logging, evaluation, checkpoints) for
`--steps` steps of runs of one ensemble group of the params (default: params.yaml, first group), and
alternate in rounds so machine noise hits both. Prints aggregate run-steps per second and the ratio.

With --compare rng the two arms are instead the ensemble under train.rng generator (a torch.Generator per run)
and counter (one counter-based stream for all runs, iclnoise.core.rng).

Usage: python bench/bench_ensemble.py [--runs 12 36] [--steps 100] [--rounds 2] [--device cpu]
                                      [--override configs/carroll.yaml] [--compare alone|rng]
Also: python bench/bench_ensemble.py --dag results benchmarks   (run-steps per job-second of a finished DAG)
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

from iclnoise.config import validate_params
from iclnoise.config.grid import ensemble_groups, run_spec
from iclnoise.run.train import train_ensemble


def merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def runs_for(params: dict, n: int) -> list[str]:
    """n runs of one ensemble group (cycling seeds beyond the grid's if the group is smaller)."""
    p = copy.deepcopy(params)
    p["train"]["ensemble_runs"] = n  # else groups are chunked at the params' size and never reach n
    group = max(ensemble_groups(p).values(), key=len)
    seeds = list(p["grid"]["seeds"])
    while len(group) < n:
        seeds.append(max(seeds) + 1)
        p["grid"]["seeds"] = seeds
        group = max(ensemble_groups(p).values(), key=len)
    return group[:n]


def timed(specs: list[dict], steps: int, device: torch.device, together: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / s["keys"]["run_id"] for s in specs]
        t0 = time.perf_counter()
        if together:
            train_ensemble(specs, dirs, progress=False, device=device, stop_after=steps)
        else:
            for s, d in zip(specs, dirs):
                train_ensemble([s], [d], progress=False, device=device, stop_after=steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def dag_throughput(results: Path, benchmarks: Path) -> None:
    """Run-steps per job-second of the training rules of a finished DAG (issue 12's measure)."""
    steps = sum(int(pd.read_parquet(f, columns=["step"]).step.max()) for f in results.glob("runs/*/metrics.parquet"))
    secs = sum(float(pd.read_csv(f, sep="\t").s.iloc[0]) for f in (benchmarks / "train").glob("*.tsv"))
    print(f"training rules: {steps} run-steps in {secs:.1f} job-seconds = {steps / secs:.0f} run-steps per job-second")


def compare_rng(params: dict, n: int, steps: int, rounds: int, device: torch.device) -> None:
    """The same n runs as one ensemble under each train.rng, alternating in rounds; run-steps/s and the ratio."""
    arms = {k: merge(params, {"train": {"rng": k}}) for k in ("generator", "counter")}
    specs = {k: [run_spec(p, r) for r in runs_for(p, n)] for k, p in arms.items()}
    t = dict.fromkeys(arms, 0.0)
    for _ in range(rounds):
        for k in arms:
            t[k] += timed(specs[k], steps, device, together=True)
    rs = n * steps * rounds
    print(f"N = {n:3d} runs × {steps} steps (batch {specs['counter'][0]['keys']['batch']}, "
          f"{specs['counter'][0]['keys']['noise']}, {device}): generator {rs / t['generator']:7.1f} run-steps/s, "
          f"counter {rs / t['counter']:7.1f} run-steps/s, counter / generator {t['generator'] / t['counter']:.2f}×")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, nargs="+", default=[12, 36])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--override", default=None)
    ap.add_argument("--compare", choices=("alone", "rng"), default="alone")
    ap.add_argument("--dag", nargs=2, metavar=("RESULTS", "BENCHMARKS"), default=None)
    a = ap.parse_args()
    if a.dag:
        return dag_throughput(Path(a.dag[0]), Path(a.dag[1]))
    torch.set_num_threads(a.threads)
    params = yaml.safe_load(Path(a.params).read_text())
    if a.override:
        params = merge(params, yaml.safe_load(Path(a.override).read_text()))
    params["train"]["budget"] = {"mode": "steps", "steps": max(a.steps * 10, 1000)}
    validate_params(params)
    device = torch.device(a.device)
    for n in a.runs:
        if a.compare == "rng":
            compare_rng(params, n, a.steps, a.rounds, device)
            continue
        specs = [run_spec(params, r) for r in runs_for(params, n)]
        t_alone = t_ens = 0.0
        for _ in range(a.rounds):
            t_alone += timed(specs, a.steps, device, together=False)
            t_ens += timed(specs, a.steps, device, together=True)
        rs = n * a.steps * a.rounds
        print(f"N = {n:3d} runs × {a.steps} steps (batch {specs[0]['keys']['batch']}, {specs[0]['keys']['noise']}, "
              f"{device}): one per process {rs / t_alone:7.1f} run-steps/s, ensemble {rs / t_ens:7.1f} run-steps/s, "
              f"ratio {t_alone / t_ens:.2f}×")


if __name__ == "__main__":
    main()
