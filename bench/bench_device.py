"""The GPU path against the CPU, side by side in one process on one machine: training run-steps per second
(`train_ensemble`, exactly as `iclnoise train` runs an ensemble) and LLC chain-steps per second
(`estimate_llcs`, as `iclnoise llc` runs a checkpoint's chains).

Shapes: the default's two training jobs (18 runs at batch 16 and at batch 64, params.yaml's model) and the
Hoogland reproduction's (2 runs at batch 256, configs/hoogland.yaml's model); LLC with the default's
sampler and with Hoogland's (10 chains, batch 1024). Each CPU row runs with the threads given (the pipeline
runs its jobs on 1 thread each). Exposure logging is off and checkpoints are few, so the numbers are the
update (or SGLD step) rate; a run-step is one update of one run.

Usage: PYTHONPATH=src python bench/bench_device.py [--devices cuda cpu] [--threads 1 16] [--steps 300]
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from iclnoise.config import load_params
from iclnoise.grid import run_spec
from iclnoise.model import ModelConfig, build_model, mse_loss
from iclnoise.probes import sampling_data
from iclnoise.sections import LLCConfig, RunSpec
from iclnoise.train import train_ensemble


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
    from iclnoise.llc import estimate_llcs
    xs, ys = sampling_data(RunSpec.of(spec), cfg.n, device)
    center = [{k: v.detach() for k, v in model.named_parameters()}]
    short = LLCConfig.from_dict({**params["llc"]["sampler"], "burn_in": 0, "draws": 2})
    estimate_llcs(model, mse_loss, xs, ys, short, center)  # warm-up
    t0 = time.perf_counter()
    estimate_llcs(model, mse_loss, xs, ys, cfg, center)
    if device == "cuda":
        torch.cuda.synchronize()
    return cfg.chains * sgld_steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1])
    ap.add_argument("--steps", type=int, default=300, help="training updates per GPU measurement (CPU: a tenth)")
    ap.add_argument("--sgld", type=int, default=100, help="SGLD steps per GPU measurement (CPU: a tenth)")
    a = ap.parse_args()
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
