"""Tune the embedded default grid (issue 13, part 1): train runs with the real trainer, print end metrics.

All runs of one batch size go through the ensemble engine `iclnoise.run.train.train_ensemble` (main from 8a99ebc;
with an older checkout, or --single, one `train_run(run_spec(params, run_id), run_dir)` per run), with the
params file plus the overrides given here; exposure logging is off and the noise condition is `none`, so the
numbers are those of the plain training loop. One JSON line per run is appended to --out (settings, final
ood_loss, ood_loss_ridge, their ratio, r, the curve at the checkpoints, wall time, ms per run-step).

Usage (one thread, one process at a time on the shared 2-core machine):
  PYTHONPATH=<main>/src python experiments/tuning/tune_default.py --params <main>/params.yaml \\
      --M 1 4 16 inf --seeds 0 1 2 --batch 16 64 --sequences 128000 --lr 3e-3 --D 2 --K 8
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.run.train import train_run

try:  # the ensemble engine (main from 8a99ebc): all runs of one batch size in one vmapped process
    from iclnoise.run.train import train_ensemble
except ImportError:
    train_ensemble = None


def params_with(a: argparse.Namespace) -> dict:
    """params.yaml with this experiment's data/model/optimizer/budget settings."""
    p = load_params(a.params)
    p["exposure"]["enabled"] = False
    p["grid"]["noise"] = ["none"]
    p["data"].update(D=a.D, K=a.K, noise_var=a.noise_var)
    p["model"].update(d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, d_mlp=a.d_mlp or 2 * a.d_model,
                      attn_init=a.attn_init)
    t = p["train"]
    t["budget"] = {"mode": "sequences", "sequences": a.sequences} if a.sequences else {"mode": "steps",
                                                                                          "steps": a.steps}
    t["optimizer"]["lr"] = a.lr
    t["optimizer"]["betas"] = [0.9, a.beta2]
    t["optimizer"]["weight_decay"] = a.weight_decay
    p["eval"]["icl_tokens"] = [1, a.K]
    t["lr_schedule"] = {"kind": a.schedule, "warmup_frac": a.warmup_frac, "min_lr_frac": a.min_lr_frac}
    t["grad_clip"] = a.grad_clip if a.grad_clip > 0 else None
    t["checkpoints"] = {"linear": a.ckpt_linear, "log": a.ckpt_log}
    t["device"] = "cpu"
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--M", nargs="+", default=["inf"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[64])
    ap.add_argument("--sequences", type=int, default=0, help="budget in sequences (steps = sequences / batch)")
    ap.add_argument("--steps", type=int, default=2500, help="budget in steps when --sequences is 0")
    ap.add_argument("--D", type=int, default=4)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--noise-var", type=float, default=0.125)
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--n-heads", type=int, default=2)
    ap.add_argument("--d-mlp", type=int, default=0, help="0 = 2 · d_model")
    ap.add_argument("--attn-init", default="fan_in", choices=["fan_in", "gpt2"])
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--schedule", default="warmup_cosine")
    ap.add_argument("--warmup-frac", type=float, default=0.05)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="<= 0: no clipping")
    ap.add_argument("--ckpt-linear", type=int, default=2)
    ap.add_argument("--ckpt-log", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tag", default="")
    ap.add_argument("--single", action="store_true", help="one train_run per run even if the ensemble engine exists")
    ap.add_argument("--out", default="experiments/tuning/tuning_runs.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    p = params_with(a)
    for B in a.batch:
        run_ids = [f"M{M}-B{B}-none-s{s}" for M in a.M for s in a.seeds]
        specs = [run_spec(p, r) for r in run_ids]
        steps = specs[0]["train"]["steps"]
        with tempfile.TemporaryDirectory() as d:
            t0, c0 = time.perf_counter(), time.process_time()
            if train_ensemble is not None and not a.single:
                tables = train_ensemble(specs, [Path(d) / r for r in run_ids], progress=False)
            else:
                tables = [train_run(sp, Path(d) / r, progress=False) for sp, r in zip(specs, run_ids)]
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        for spec, m in zip(specs, tables):
            last = m.iloc[-1]
            k = spec["keys"]
            row = {"tag": a.tag, "engine": "single" if (train_ensemble is None or a.single) else "ensemble",
                   "n_runs": len(specs), "M": k["M"], "seed": k["seed"], "batch": B, "steps": steps,
                   "sequences": steps * B, "D": a.D, "K": a.K, "noise_var": a.noise_var, "d_model": a.d_model,
                   "n_layers": a.n_layers, "lr": a.lr, "beta2": a.beta2, "weight_decay": a.weight_decay,
                   "schedule": a.schedule, "warmup_frac": a.warmup_frac, "grad_clip": a.grad_clip,
                   "ood_loss": float(last.ood_loss), "ood_loss_ridge": float(last.ood_loss_ridge),
                   "ood_ratio": float(last.ood_loss / last.ood_loss_ridge),
                   "ood_loss_dmmse": float(last.ood_loss_dmmse), "id_loss": float(last.id_loss),
                   "id_loss_dmmse": float(last.id_loss_dmmse), "id_loss_ridge": float(last.id_loss_ridge),
                   "r": None if math.isnan(last.r) else float(last.r), "diverged": bool(last.diverged),
                   "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                   "ms_per_run_step": round(1000 * wall / (steps * len(specs)), 3),
                   "cpu_ms_per_run_step": round(1000 * cpu / (steps * len(specs)), 3),
                   "n_ckpt": len(m),
                   "curve": [[int(st), round(float(o / ref), 3), None if math.isnan(r) else round(float(r), 3)]
                             for st, o, ref, r in zip(m.step, m.ood_loss, m.ood_loss_ridge, m.r)]}
            print(json.dumps(row), flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    main()
