"""Bias of λ̂ on models with known learning coefficients, over sampler settings; writes llc_bias.csv.

Models (tests/test_llc.py::known_model): linear regression with d = 4 (regular, λ = 2), f = w²x with
truth 0 (K ∝ w⁴, λ = 1/4), f = abx with truth ab = 1 (λ = 1/2); n = 1000, nβ = n / log n, γ = 1.
Usage (≈ 6 min on one CPU core):  PYTHONPATH=src python experiments/reproductions/llc_bias.py
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pandas as pd
import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "reference" / "reproductions"  # the tables and figures these scripts write
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from test_llc import KNOWN, known_model, mse  # noqa: E402

from iclnoise.probes.llc import LLCConfig, estimate_llc  # noqa: E402

GRID = {"sgld": [1e-3, 3e-4], "rmsprop_sgld": [1e-4, 3e-5]}
BATCHES = {"full": 1000, "mini": 100}


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for method, epsilons in GRID.items():
        for eps in epsilons:
            for name in KNOWN:
                m, X, Y, lam = known_model(name)
                for bname, b in BATCHES.items():
                    cfg = LLCConfig(seed=0, epsilon=eps, gamma=1.0, chains=8, burn_in=500, draws=1500, batch=b, n=1000,
                                    method=method)
                    t0 = time.perf_counter()
                    r = estimate_llc(m, mse, X, Y, cfg)
                    se = r.llc_std / math.sqrt(cfg.chains)
                    rows.append({"model": name, "true_lambda": lam, "method": method, "epsilon": eps,
                                 "gamma": cfg.gamma, "nbeta": round(r.nbeta, 3), "batch": bname, "chains": cfg.chains,
                                 "burn_in": cfg.burn_in, "draws": cfg.draws, "llc_mean": round(r.llc_mean, 4),
                                 "llc_se": round(se, 4), "bias": round(r.llc_mean - lam, 4),
                                 "rel_bias": round((r.llc_mean - lam) / lam, 3), "mala_accept": round(r.mala_accept, 3),
                                 "flags": ",".join(k for k, v in r.flags.items() if v)})
                    print(rows[-1], f"{time.perf_counter() - t0:.1f} s", flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(DATA / "llc_bias.csv", index=False)
    print(df.to_string(index=False))


if __name__ == "__main__":
    main()
