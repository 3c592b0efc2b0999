"""The probe job's two costly parts, each against the path it replaced, side by side in one process,
alternating in rounds (best of `--rounds`):

- LLC at a run's checkpoints: one batched SGLD pass over all of them (what `iclnoise llc` does) against one
  estimate per checkpoint. Both arms use the run's params.yaml sampler settings and checkpoints (`llc.every`),
  so they give the same estimates (printed: the largest |difference| in λ̂).
- Geometry's Hessian-vector products at the run's last checkpoint on `geometry.n_heldout` sequences, as one
  checkpoint needs them (`geometry.lanczos_iters` single products and `geometry.probes` Hutchinson probes):
  reverse-over-reverse on one retained graph of ∇L (`FlatLoss.hvp_at_w0`, what `iclnoise geometry` does)
  against forward-over-reverse (`FlatLoss.hvp`; the probes vmapped). Printed: the largest |difference|.
Usage: PYTHONPATH=src python bench/bench_probes.py [--run-dir results/runs/M16-B64-none-s0] [--rounds 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import yaml

from iclnoise.core.model import mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.core.schedules import select_steps
from iclnoise.probes.geometry import FlatLoss
from iclnoise.probes.llc import LLCConfig, estimate_llc, estimate_llcs
from iclnoise.run import runs
from iclnoise.run.probing import sampling_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="results/runs/M16-B64-none-s0")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    p = yaml.safe_load(open(a.params))
    llc = p["llc"]
    cfg = LLCConfig(**llc["sampler"])
    spec = runs.read_spec(a.run_dir)
    xs, ys = sampling_data(RunSpec.of(spec), cfg.n)
    steps = select_steps(runs.saved_steps(a.run_dir), llc["every"])
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
    bench_hvp(models[-1], xs[:p["geometry"]["n_heldout"]], ys[:p["geometry"]["n_heldout"]], p["geometry"], a.rounds)


def bench_hvp(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, geo: dict, rounds: int) -> None:
    f = FlatLoss(model, mse_loss, xs, ys)
    g = torch.Generator().manual_seed(0)
    V = torch.randn(max(geo["lanczos_iters"], geo["probes"]), f.w0.numel(), generator=g)
    single, probes = V[:geo["lanczos_iters"]], V[:geo["probes"]]

    def fwd_over_rev():
        return [f.hvp(v) for v in single], torch.func.vmap(f.hvp)(probes)

    def rev_over_rev():
        h = f.hvp_at_w0()
        return [h(v) for v in single], torch.stack([h(v) for v in probes])

    arms = {"forward-over-reverse": fwd_over_rev, "reverse-over-reverse": rev_over_rev}
    times: dict[str, list[float]] = {k: [] for k in arms}
    out = {}
    for _ in range(rounds):
        for k, fn in arms.items():
            t0 = time.perf_counter()
            out[k] = fn()
            times[k].append(time.perf_counter() - t0)
    (s1, p1), (s2, p2) = out.values()
    diff = max(max(float((x - y).abs().max()) for x, y in zip(s1, s2)), float((p1 - p2).abs().max()))
    print(f"geometry H·v at the last checkpoint: {len(single)} single products + {len(probes)} probes on "
          f"{len(xs)} sequences; max |difference| between the arms {diff:.1e}")
    for k, v in times.items():
        print(f"  {k:21s} best of {rounds}: {min(v):6.2f} s")
    print(f"  speed-up reverse-over-reverse / forward-over-reverse: "
          f"{min(times['forward-over-reverse']) / min(times['reverse-over-reverse']):.2f}x")


if __name__ == "__main__":
    main()
