"""Where a CPU ensemble step's time goes: the gradient of N stacked default models, as the trainer computes it
(one call of the model on parameters with a run axis) and as a vmap over one model's functional_call (the
trainer's earlier path), against the matmul rate of the same shapes and this core's large-matmul peak, side by
side in one process (one thread; the two paths alternate, best of 3 rounds each).

Prints, per (runs, batch): ms per step for both paths and their ratio, the step's GFLOP/s (6 · parameters ·
tokens), and the ratios to the stacked-matmul rate and to the peak. A step far below the matmul rate is
overhead-bound; one near it is arithmetic-bound and only a GPU (or fewer FLOPs) makes it faster.
Usage: PYTHONPATH=src python bench/bench_step.py [--shapes 18x64 18x16] [--params params.yaml]
(default shapes: the params' train.ensemble_runs × each grid batch size, i.e. the default's training jobs)
"""
from __future__ import annotations

import argparse
import time

import torch
import yaml
from torch.func import functional_call, grad, stack_module_state, vmap

from iclnoise.core.model import ModelConfig, build_model, mse_loss


def best_of(*fns, reps: int = 20, rounds: int = 3, clock=time.perf_counter) -> list[float]:
    """Seconds per call of each fn: the best of `rounds` rounds, the fns alternating within a round (`clock`:
    time.process_time counts this process's CPU seconds alone, for one thread on a shared machine)."""
    for fn in fns:
        fn()
    out = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = clock()
            for _ in range(reps):
                fn()
            out[i].append((clock() - t0) / reps)
    return [min(o) for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=None, help="RUNSxBATCH ...")
    ap.add_argument("--params", default="params.yaml")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = yaml.safe_load(open(a.params))
    shapes = a.shapes or [f"{p['train']['ensemble_runs']}x{b}" for b in p["grid"]["batch_sizes"]]
    cfg = ModelConfig(D=p["data"]["D"], K=p["data"]["K"], **p["model"])
    n = 1024
    x, y = torch.randn(n, n), torch.randn(n, n)
    peak = 2 * n ** 3 / best_of(lambda: x @ y, reps=5)[0]
    print(f"large matmul peak (1024², one thread): {peak / 1e9:.1f} GFLOP/s")
    for shape in shapes:
        N, B = map(int, shape.split("x"))
        models = [build_model(cfg, s) for s in range(N)]
        params, bufs = stack_module_state(models)
        base = models[0]

        def loss(pp, bb, xs, ys):
            return mse_loss(lambda u, v: functional_call(base, (pp, bb), (u, v)), xs, ys)

        g = vmap(grad(loss), in_dims=(0, None, 0, 0))
        xs, ys = torch.randn(N, B, cfg.K, cfg.D), torch.randn(N, B, cfg.K)
        bufs = dict(base.named_buffers())
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}

        def stacked():  # the trainer's step: one call on the stacked parameters, per-run losses summed
            return torch.autograd.grad(loss(leaves, bufs, xs, ys).sum(), list(leaves.values()))

        ref, got = g(params, bufs, xs, ys), stacked()
        err = max(float((ref[k] - v).detach().abs().max()) for k, v in zip(leaves, got))
        dt, dv = best_of(stacked, lambda: g(params, bufs, xs, ys))
        P = sum(q.numel() for q in base.parameters())
        tokens = N * B * 2 * cfg.K
        step = 6 * P * tokens / dt
        w = torch.randn(N, cfg.d_model, cfg.d_mlp)
        h = torch.randn(N, B * 2 * cfg.K, cfg.d_model)
        mm = 2 * N * B * 2 * cfg.K * cfg.d_model * cfg.d_mlp / best_of(lambda: torch.bmm(h, w))[0]
        print(f"{N} runs x batch {B}: stacked {dt * 1e3:6.1f} ms/step, vmap {dv * 1e3:6.1f} ms/step, vmap / stacked "
              f"{dv / dt:.2f} (gradients agree to {err:.1e})")
        print(f"  stacked: {N / dt:6.0f} run-steps/s, step {step / 1e9:5.1f} "
              f"GFLOP/s; stacked matmul {mm / 1e9:5.1f} GFLOP/s; step / matmul {step / mm:.2f}, step / peak "
              f"{step / peak:.2f}")


if __name__ == "__main__":
    main()
