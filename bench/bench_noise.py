"""Cost of exposure logging and of each injection shape, relative to plain training, side by side in one run.

Every variant is the real training loop (iclnoise.run.train.train_run) on the default model, with checkpoints
only at the start and the end so evaluation does not dilute the per-step cost; rounds are interleaved
and the fastest of each variant kept (machines here are noisy: read the ratios).

`--runs R` trains R runs together (an ensemble, as the noise experiment's jobs do: M 1, 4, 16, ∞ × seeds), so
the per-run hook work is measured against the shared stacked step. `budget_diagonal` injects on every step
under the closed loop of the early and late arms (the realised-exposure budget, curvature re-measured every
`exposure.curvature_every` steps from `exposure.curvature_probes` probes); compare it with `exposure`, the plain arm
of the noise experiment; `budget_param_diagonal` is the same in parameter space (configs/dose.yaml's param source).
`budget_nap` is the same closed loop with NAP's shape (issue 45: rank 4, 16 tasks × 4 sequences per refresh, every
`--every` steps, iclnoise.noise.nap); compare it with `budget_lowrank` and `budget_diagonal`, plain injecting steps (the
issue asks ≤ 1.3x; measured 1.05-1.10x at --every 100, 1.27-1.38x at --every 25: cost.py). `sgd_momentum` is
`exposure` trained with SGD and heavy-ball momentum instead of AdamW (measured 1.01x).

Usage: python bench/bench_noise.py [--steps 600] [--batch 64] [--every 100] [--rounds 3] [--device cpu]
       python bench/bench_noise.py --variants budget_diagonal budget_lowrank budget_nap sgd_momentum exposure
       python bench/bench_noise.py --runs 12 --every 400 --variants exposure budget_diagonal   (the H2 jobs)
       python bench/bench_noise.py --override configs/carroll.yaml --device cuda --batch 256   (Carroll et al. scale)
"""
from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time

import torch
import yaml

from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.model import ModelConfig, build_model
from iclnoise.run.train import train_ensemble


def deep_update(base: dict, over: dict) -> dict:
    """Merge `over` into `base` key by key, as Snakemake merges a --configfile."""
    for k, v in over.items():
        base[k] = deep_update(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--override", help="a YAML merged over the params key by key (e.g. configs/carroll.yaml)")
    ap.add_argument("--variants", nargs="*", help="only these variants (default: all)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=1, help="runs trained together (one ensemble)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = yaml.safe_load(open(a.params))
    if a.override:
        deep_update(base, yaml.safe_load(open(a.override)))
    base = validate_params(base)
    base["grid"].update(batch_sizes=[a.batch])
    base["train"].update(budget={"mode": "steps", "steps": a.steps}, checkpoints={"linear": 0, "log": 0},
                         device=a.device)
    base["eval"].update(n_sequences=64, n_root=8)
    base["exposure"]["every"] = a.every
    emulate = max(1, a.batch // 4)
    nap = {"rank": 4, "nap_tasks": 16, "nap_per_task": 4, "nap_memory": 4}
    variants = {  # name: (exposure logging, noise condition[, optimizer])
        "plain": (False, {"source": "none"}),
        "exposure": (True, {"source": "none"}),
        "grad_lowrank": (False, {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant",
                                 "emulate_batch": emulate}),
        "grad_diagonal": (False, {"source": "grad", "shape": "diagonal", "schedule": "constant",
                                  "emulate_batch": emulate}),
        "grad_isotropic": (False, {"source": "grad", "shape": "isotropic", "schedule": "constant",
                                   "emulate_batch": emulate}),
        "param_lowrank": (False, {"source": "param", "shape": "lowrank", "rank": 4, "schedule": "constant",
                                  "emulate_batch": emulate}),
        "grad_lowrank+exposure": (True, {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant",
                                         "emulate_batch": emulate}),
        "budget_diagonal": (True, {"source": "grad", "shape": "diagonal", "schedule": "constant", "budget": 1.0}),
        "budget_param_diagonal": (True, {"source": "param", "shape": "diagonal", "schedule": "constant",
                                          "budget": 1.0}),
        "budget_lowrank": (True, {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant",
                                  "budget": 1.0}),
        "budget_nap": (True, {"source": "grad", "shape": "nap", **nap, "schedule": "constant", "budget": 1.0}),
        "budget_nap_misaligned": (True, {"source": "grad", "shape": "nap_misaligned", **nap, "schedule": "constant",
                                         "budget": 1.0}),
        "sgd_momentum": (True, {"source": "none"}, "sgd_momentum"),
    }
    variants = {k: v for k, v in variants.items() if not a.variants or k in a.variants or k == "plain"}

    def run(log: bool, cond: dict, steps: int, opt: str = "adamw") -> float:
        p = copy.deepcopy(base)
        p["exposure"]["enabled"] = log
        p["noise"]["conditions"]["bench"] = cond
        p["train"]["budget"]["steps"] = steps
        p["train"]["sgd_momentum"] = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
        Ms = ["64" if cond.get("shape", "").startswith("nap") else "1", "4", "16", "inf"]  # NAP: ≥ 2 tasks a batch
        label = "" if opt == "adamw" else f"-{opt}"
        specs = [run_spec(p, f"M{Ms[i % 4]}-B{a.batch}-bench{label}-s{i // 4}") for i in range(a.runs)]
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            train_ensemble(specs, [f"{d}/{i}" for i in range(a.runs)], progress=False)
            return time.perf_counter() - t0

    for v in variants.values():  # warm-up: imports, allocator, first vmap traces
        run(*v[:2], a.every, *v[2:])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, v in variants.items():
            times[name].append(run(*v[:2], a.steps, *v[2:]))
    best = {k: min(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in build_model(
        ModelConfig(D=base["data"]["D"], K=base["data"]["K"], **base["model"]),
        0).parameters())
    print(f"params={n_params} d_model={base['model']['d_model']} D={base['data']['D']} K={base['data']['K']}")
    print(f"device={a.device} threads={a.threads} runs={a.runs} batch={a.batch} steps={a.steps} log/refresh every "
          f"{a.every} steps; curvature every {base['exposure']['curvature_every']} steps in injection windows; "
          f"injection emulates batch {emulate}")
    for k, t in best.items():
        print(f"  {k:22s} {1e3 * t / a.steps / a.runs:7.3f} ms/run-step   ratio to plain: {t / best['plain']:.3f}x   "
              f"to exposure: {t / best.get('exposure', math.nan):.3f}x")


if __name__ == "__main__":
    main()
