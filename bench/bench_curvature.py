"""The exposure logger's measurements across an ensemble's runs: one stacked call against one call per run, in
this process's CPU seconds (one thread: a shared machine's other load does not enter).

  probes : the Gauss–Newton diag Ĥ probes of R runs (params' model, exposure.heldout sequences,
           exposure.curvature_probes probes): R calls of curvature.ggn_curvature against one stacked_ggn_curvature
  grads  : the group gradients of R runs (batch 64, exposure.groups groups): R calls of exposure.group_grads against
           one stacked_group_grads
  step   : a measuring step (a row or diag Ĥ due, no checkpoint) in `--steps` steps of R runs of the `early`
           closed-loop injecting arm (diag Ĥ every exposure.curvature_every steps in its window, rows every
           `--every`), the ensemble measuring stacked (Ensemble._measure) against each run's hooks measuring their
           own; the arms alternate in rounds

Usage: OMP_NUM_THREADS=1 python bench/bench_curvature.py [--runs 2 4 8] [--steps 60] [--every 10] [--rounds 2]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import yaml
from bench_ensemble import runs_for, timed
from bench_step import best_of

import iclnoise.run.ensemble as ens
from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.noise.curvature import ggn_curvature, stacked_ggn_curvature
from iclnoise.noise.exposure import group_grads, stacked_group_grads


def measure(params: dict, R: int) -> list[float]:
    """Seconds per measurement of R runs' probes and group gradients: one call per run, one stacked call."""
    d, e = params["data"], params["exposure"]
    cfg = ModelConfig(D=d["D"], K=d["K"], **{k: params["model"][k] for k in ("d_model", "d_mlp", "n_layers",
                                                                              "n_heads")})
    models = [build_model(cfg, seed) for seed in range(R)]
    g = torch.Generator().manual_seed(0)
    n, K, B = e["heldout"], d["K"], 64
    xs, ys = torch.randn(R, B, K, d["D"], generator=g), torch.randn(R, B, K, generator=g)
    names = [n for n, _ in models[0].named_parameters()]
    stacked = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n in names}
    P = e["curvature_probes"]

    def own():
        for r, m in enumerate(models):
            ggn_curvature(m, xs[r, :n], ys[r, :n], P, torch.Generator().manual_seed(r), 1 / d["D"])

    def one():
        stacked_ggn_curvature(models[0], stacked, xs[:, :n], ys[:, :n], P,
                              [torch.Generator().manual_seed(r) for r in range(R)], 1 / d["D"])

    def own_grads():
        for r, m in enumerate(models):
            group_grads(m, mse_loss, xs[r], ys[r], e["groups"])

    def one_grads():
        stacked_group_grads(models[0], mse_loss, stacked, xs, ys, e["groups"])
    return best_of(own, one, own_grads, one_grads, reps=5, clock=time.process_time)


def train(params: dict, R: int, steps: int, every: int, rounds: int) -> tuple[float, float]:
    """CPU seconds of one measuring step (a live run's logger acts, no checkpoint follows) of R runs of the `early`
    arm, the best round's mean: each run's hooks measuring their own, the stacked calls."""
    p = copy.deepcopy(params)
    p["grid"]["noise"], p["grid"]["batch_sizes"] = ["early"], [64]
    p["exposure"]["every"] = every
    p["train"]["budget"] = {"mode": "steps", "steps": steps}   # the window opens at step 0 of `steps`
    specs = [run_spec(p, r) for r in runs_for(p, R)]
    stacked, step, device, out = ens.Ensemble._measure, ens.Ensemble._step, torch.device("cpu"), [[], []]
    spent: list[float] = []

    def timed_step(self, s, stop_after):
        measuring = s + 1 not in self.ckpt_at and any(h.acts(s) for m in self.members for h in m.hooks
                                                      if isinstance(h, ens.ExposureLogger))
        t0 = time.process_time()
        going = step(self, s, stop_after)
        if measuring:
            spent.append(time.process_time() - t0)
        return going
    ens.Ensemble._step = timed_step
    for _ in range(rounds):
        for i, fn in enumerate((lambda self, s, batch, ctxs: None, stacked)):
            ens.Ensemble._measure, spent[:] = fn, []
            timed(specs, steps, device, together=True)
            out[i].append(sum(spent) / len(spent))
    ens.Ensemble._measure, ens.Ensemble._step = stacked, step
    return min(out[0]), min(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with open("params.yaml") as f:
        params = validate_params(yaml.safe_load(f))
    print(f"threads {torch.get_num_threads()}; model d_model {params['model']['d_model']}, "
          f"{params['model']['n_layers']} layers; probes {params['exposure']['curvature_probes']}, "
          f"heldout {params['exposure']['heldout']}")
    print("ms per call, each run's own / stacked (speed-up)")
    print("runs  probes                  grads                   measuring step")
    for R in a.runs:
        p_own, p_one, g_own, g_one = measure(params, R)
        s_own, s_one = train(params, R, a.steps, a.every, a.rounds)
        print(f"{R:4d}" + "".join(f"  {1e3 * x:8.2f} / {1e3 * y:8.2f} ({x / y:4.2f})"
                                   for x, y in ((p_own, p_one), (g_own, g_one), (s_own, s_one))), flush=True)


if __name__ == "__main__":
    main()
