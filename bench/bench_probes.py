"""LLC at a run's checkpoints: one batched SGLD pass over all of them (what `iclnoise llc` does) against
one estimate per checkpoint (the path before), side by side in one process, alternating in rounds.

Both arms use the run's params.yaml sampler settings and checkpoints (`llc.every`), so they give the same
estimates (printed: the largest |difference| in λ̂); the ratio is the speed-up of the probe job's LLC part.
Usage: PYTHONPATH=src python bench/bench_probes.py [--run-dir results/runs/M16-B64-none-s0] [--rounds 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import yaml

from iclnoise import runs
from iclnoise.llc import LLCConfig, estimate_llc, estimate_llcs
from iclnoise.model import mse_loss
from iclnoise.probes import sampling_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="results/runs/M16-B64-none-s0")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llc = yaml.safe_load(open(a.params))["llc"]
    cfg = LLCConfig(**llc["sampler"])
    spec = runs.read_spec(a.run_dir)
    xs, ys = sampling_data(spec, cfg.n)
    steps = runs.select_steps(runs.checkpoint_steps(a.run_dir), llc["every"])
    models = [runs.load_model(a.run_dir, s) for s in steps]
    centers = [{k: v.detach() for k, v in m.named_parameters()} for m in models]
    times: dict[str, list[float]] = {"one at a time": [], "batched": []}
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        alone = [estimate_llc(m, mse_loss, xs, ys, cfg) for m in models]
        times["one at a time"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        together = estimate_llcs(models[0], mse_loss, xs, ys, cfg, centers)
        times["batched"].append(time.perf_counter() - t0)
    diff = max(abs(x.llc_mean - y.llc_mean) for x, y in zip(alone, together))
    print(f"{a.run_dir}: {len(steps)} checkpoints x {cfg.chains} chains x {cfg.burn_in + cfg.draws} steps, "
          f"batch {cfg.batch}, {a.threads} thread(s); max |Δλ̂| between the arms {diff:.2e}")
    for k, v in times.items():
        print(f"  {k:14s} best of {a.rounds}: {min(v):6.2f} s")
    print(f"  speed-up batched / one at a time: {min(times['one at a time']) / min(times['batched']):.2f}x")


if __name__ == "__main__":
    main()
