"""How CNR's error grows with the noise change and the horizon on a small nonlinear model (issue 46, item 2).

A 2-layer tanh MLP (4 → 16 → 1, 97 parameters, float64) is trained by full-batch gradient descent on a fixed
regression set with parameter noise ξ_t ~ N(0, η² σ² I) added after every step (so Φ_t is deterministic and the
only randomness is the injected noise). The counterfactual multiplies the noise variance by c: Λ̃ = c Λ,
‖Λ̃ − Λ‖_F = |c − 1| σ² √P. The metric f is the loss on a held-out set.

Truth: E f_T under c minus E f_T under 1, by Monte Carlo over `--mc` noise sequences with common random numbers
(the same standard normals scaled by √c and 1), its standard error printed. CNR (iclnoise.noise.cnr.replay): from one
recorded run at c = 1 (seed k), `--probes` Hutchinson paths; `cnr_meanpath`: the same along the noise-free
trajectory (which a real replay does not have: it isolates the error of expanding about the noisy recorded path
from the error of truncating at second order). Error² = (Δ̂_CNR − Δ_true)² averaged over the
`--seeds` recorded runs, minus the two estimators' own variances (se², what more probes or draws would remove),
then fitted by least squares with non-negative constants to seed 002's form
    E[(f̂ − f)²] ≈ C1 Σ η² ‖Λ̃ − Λ‖²_F + C2 Σ η³      (L², unknown, inside C2).

Usage: python experiments/cnr_error.py [--horizons 25 50 100 200] [--scales 0 0.5 2 4 8] [--sigma 0.3]
           [--out reference/measurements/cnr_bound.csv]
"""
from __future__ import annotations

import argparse
import csv
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from iclnoise.noise.cnr import bound_terms, replay

D_IN, WIDTH, N = 4, 16, 64


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(D_IN, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)).double()
    shapes = {n: p.shape for n, p in net.named_parameters()}
    sizes = [p.numel() for p in net.parameters()]

    def unflat(th):
        return {n: t.view(s) for (n, s), t in zip(shapes.items(), th.split(sizes))}

    X, Xt = torch.randn(N, D_IN, generator=g, dtype=torch.float64), torch.randn(N, D_IN, generator=g,
                                                                                 dtype=torch.float64)
    w = torch.randn(D_IN, generator=g, dtype=torch.float64)
    y, yt = torch.sin(X @ w)[:, None], torch.sin(Xt @ w)[:, None]

    def loss(th, x=X, t=y):
        return (functional_call(net, unflat(th), (x,)) - t).square().mean()

    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return theta0, loss, lambda th: loss(th, Xt, yt)[None]


def trajectory(theta0, loss, lr, T, sigma, z):
    """θ_0..θ_T with noise lr·sigma·z_t (z: (T, P) standard normals)."""
    g = grad(loss)
    th = [theta0]
    for t in range(T):
        th.append(th[-1] - lr * g(th[-1]) + lr * sigma * z[t])
    return th


def truth(theta0, loss, f, lr, T, sigma, c, mc, seed):
    """Monte Carlo E f_T(c) − E f_T(1) with common random numbers; (mean, se)."""
    z = torch.randn(mc, T, theta0.numel(), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    end = vmap(lambda zz, s: trajectory(theta0, loss, lr, T, s, zz)[-1], in_dims=(0, None))
    d = vmap(f)(end(z, sigma * math.sqrt(c))) - vmap(f)(end(z, sigma))
    d = d[:, 0]
    return float(d.mean()), float(d.std() / math.sqrt(mc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--horizons", type=int, nargs="+", default=[25, 50, 100, 200])
    ap.add_argument("--scales", type=float, nargs="+", default=[0.0, 0.5, 2.0, 4.0, 8.0])
    ap.add_argument("--sigma", type=float, default=0.3, help="noise per step: lr·sigma·N(0, I)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, default=4, help="recorded runs per setting")
    ap.add_argument("--probes", type=int, default=256)
    ap.add_argument("--mc", type=int, default=2000)
    ap.add_argument("--out", default="reference/measurements/cnr_bound.csv")
    a = ap.parse_args()
    torch.set_num_threads(1)
    theta0, loss, f = problem()
    P, g = theta0.numel(), grad(loss)
    step = lambda x: x - a.lr * g(x)  # noqa: E731 - the deterministic update Φ
    rows = []
    for T in a.horizons:
        for c in a.scales:
            t0 = time.time()
            true, true_se = truth(theta0, loss, f, a.lr, T, a.sigma, c, a.mc, seed=1000 + T)
            t_true = time.time() - t0
            preds, ses = [], []
            t0 = time.time()

            def draw(scale):
                return lambda t, gen: a.lr * scale * torch.randn(P, generator=gen, dtype=torch.float64)
            for k in range(a.seeds):
                z = torch.randn(T, P, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
                th = trajectory(theta0, loss, a.lr, T, a.sigma, z)
                est = replay([(step, th[t]) for t in range(T)], f, th[-1], draw(a.sigma * math.sqrt(c)),
                             draw(a.sigma), a.probes, seed=k)
                preds.append(float(est.delta[0]))
                ses.append(float(est.se[0]))
            t_cnr = (time.time() - t0) / a.seeds
            mean_path = trajectory(theta0, loss, a.lr, T, 0.0, torch.zeros(T, P, dtype=torch.float64))
            est = replay([(step, mean_path[t]) for t in range(T)], f, mean_path[-1], draw(a.sigma * math.sqrt(c)),
                         draw(a.sigma), a.probes, seed=99)
            preds, ses = np.array(preds), np.array(ses)
            err2 = float(np.mean((preds - true) ** 2))
            excess = err2 - float(np.mean(ses ** 2)) - true_se ** 2
            s1, s2 = bound_terms([a.lr] * T, [abs(c - 1) * a.sigma ** 2 * math.sqrt(P)] * T, 1.0)
            rows.append({"T": T, "c": c, "true": true, "true_se": true_se, "cnr_mean": float(preds.mean()),
                         "cnr_sd_over_runs": float(preds.std(ddof=1)), "cnr_se": float(np.mean(ses)),
                         "rmse": math.sqrt(err2),
                         "cnr_meanpath": float(est.delta[0]), "cnr_meanpath_se": float(est.se[0]),
                         "excess_err2": excess, "rel_rmse": math.sqrt(err2) / abs(true)
                         if true else math.nan, "S1": s1, "S2": s2, "cnr_s": t_cnr, "mc_s": t_true})
            print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    A = np.array([[r["S1"], r["S2"]] for r in rows])
    b = np.array([max(r["excess_err2"], 0.0) for r in rows])
    from scipy.optimize import nnls
    (C1, C2), res = nnls(A, b)
    print(f"fit: C1 = {C1:.4g}, C2 (·L²) = {C2:.4g}, residual {res:.3g}")
    for r in rows:
        r.update(C1=C1, C2=C2, bound=C1 * r["S1"] + C2 * r["S2"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
