"""Theorem 1 of seed 002 measured (iclnoise.core.linear_attention): distance of the learned predictor to the theorem's
posterior mean (*) at σ²/T and to the Bayes predictor at σ², by layers, training length, T, noise shape and seed.

Setting: D = 4, K = 8, σ² = 0.25, power-law Σβ (exponent 2, trace D), misaligned Σ = R Σβ Rᵀ (R a random
rotation: same spectrum and trace). Prints one markdown row per run.

Usage: PYTHONPATH=src python experiments/theorem1.py --layers 2 --prompts 1024 --steps 1000 4000 --lr 0.05 \
           --T 0 0.001 0.003 0.01 0.03 --seeds 0 1
"""
from __future__ import annotations

import argparse
import time

from iclnoise.core import linear_attention as la
from iclnoise.core.sections import TaskPrior
from iclnoise.core.tasks import BatchSampler, prior_cov, random_basis

D, K, S2 = 4, 8, 0.25
PRIOR = TaskPrior(spectrum="power_law", exponent=2.0, basis_seed=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--steps", type=int, nargs="+", default=[1000])
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--T", type=float, nargs="+", default=[0.0, 0.01])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = ap.parse_args()
    S = prior_cov(PRIOR, D)
    R = random_basis(99, D)
    tr = BatchSampler(None, K + 1, D, S2, data_seed=1, prior=PRIOR).batch(0, a.prompts)
    te = BatchSampler(None, K + 1, D, S2, data_seed=2, prior=PRIOR).batch(0, 4096)
    print("| L | prompts | steps | η | T | noise | seed | Δ to (*) | Δ to Bayes | s |\n|" + "---|" * 10)
    for steps in a.steps:
        for T in a.T:
            for name, C in (("aligned", S), ("misaligned", R @ S @ R.T)):
                for seed in a.seeds:
                    if T == 0 and (name == "misaligned" or seed != a.seeds[0]):
                        continue   # no noise: one run
                    t0 = time.time()
                    g = la.train(tr.xs, tr.ys, C, la.Langevin(a.layers, T, a.lr, steps, seed=seed))
                    d = la.distances(g, te.xs, te.ys, S, S2, T if T > 0 else 1.0)
                    print(f"| {a.layers} | {a.prompts} | {steps} | {a.lr} | {T} | {name if T else 'none'} | {seed} | "
                          f"{d['to_theorem']:.4f} | {d['to_bayes']:.4f} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
