"""diag Ĥ's Hutchinson probes across an ensemble's runs: one stacked call against one call per run, side by side.

  measure : the Gauss–Newton probes of R runs (params' model, exposure.heldout sequences, exposure.curvature_probes
            probes): R calls of exposure.ggn_curvature against one exposure.stacked_ggn_curvature
  train   : `--steps` steps of R runs of the `early` closed-loop injecting arm (diag Ĥ measured every
            exposure.curvature_every steps in its window, rows every `--every`), the ensemble measuring them
            stacked (Ensemble._curvatures) against each run's logger measuring its own; the arms alternate in rounds

Usage: OMP_NUM_THREADS=1 python bench/bench_curvature.py [--runs 2 4 8] [--steps 60] [--every 10] [--rounds 2]
"""
from __future__ import annotations

import argparse
import copy

import torch
import yaml
from bench_ensemble import runs_for, timed
from bench_step import best_of

import iclnoise.ensemble as ens
from iclnoise.config import validate_params
from iclnoise.exposure import ggn_curvature, stacked_ggn_curvature
from iclnoise.grid import run_spec
from iclnoise.model import ModelConfig, build_model


def measure(params: dict, R: int) -> tuple[float, float]:
    """Seconds per measurement of R runs' probes: one call per run, one stacked call."""
    d, e = params["data"], params["exposure"]
    cfg = ModelConfig(D=d["D"], K=d["K"], **{k: params["model"][k] for k in ("d_model", "d_mlp", "n_layers",
                                                                              "n_heads")})
    models = [build_model(cfg, seed) for seed in range(R)]
    g = torch.Generator().manual_seed(0)
    n, K = e["heldout"], d["K"]
    xs, ys = torch.randn(R, n, K, d["D"], generator=g), torch.randn(R, n, K, generator=g)
    names = [n for n, _ in models[0].named_parameters()]
    stacked = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n in names}
    P = e["curvature_probes"]

    def own():
        for r, m in enumerate(models):
            ggn_curvature(m, xs[r], ys[r], P, torch.Generator().manual_seed(r), 1 / d["D"])

    def one():
        stacked_ggn_curvature(models[0], stacked, xs, ys, P, [torch.Generator().manual_seed(r) for r in range(R)],
                              1 / d["D"])
    return tuple(best_of(own, one, reps=5))


def train(params: dict, R: int, steps: int, every: int, rounds: int) -> tuple[float, float]:
    """Seconds per step of R runs of the `early` arm: each logger measuring its own probes, the stacked call."""
    p = copy.deepcopy(params)
    p["grid"]["noise"], p["grid"]["batch_sizes"] = ["early"], [64]
    p["exposure"]["every"] = every
    p["train"]["budget"] = {"mode": "steps", "steps": steps}   # the window opens at step 0 of `steps`
    specs = [run_spec(p, r) for r in runs_for(p, R)]
    stacked, device, out = ens.Ensemble._curvatures, torch.device("cpu"), [[], []]
    for _ in range(rounds):
        for i, fn in enumerate((lambda self, step, ctxs: None, stacked)):
            ens.Ensemble._curvatures = fn
            out[i].append(timed(specs, steps, device, together=True) / steps)
    ens.Ensemble._curvatures = stacked
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
    print("runs  measure_own_ms  measure_stacked_ms  ratio  step_own_ms  step_stacked_ms  ratio")
    for R in a.runs:
        m_own, m_one = measure(params, R)
        s_own, s_one = train(params, R, a.steps, a.every, a.rounds)
        print(f"{R:4d}  {1e3 * m_own:14.2f}  {1e3 * m_one:18.2f}  {m_own / m_one:5.2f}  {1e3 * s_own:11.2f}  "
              f"{1e3 * s_one:15.2f}  {s_own / s_one:5.2f}", flush=True)


if __name__ == "__main__":
    main()
