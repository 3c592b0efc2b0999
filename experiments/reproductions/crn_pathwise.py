"""The first-order pathwise estimator (iclnoise.run.pathwise) judged against CNR's ground truth (issue 67, item 3) at a
small CPU scale: the CRN means of reference/reproductions/crn_replay.csv (`--crn`; the tests' tiny model, 200 steps,
M = 8, batch 64, parameter-space diagonal noise at budget 0.05 over the last half, k ∈ {0, 0.25, ..., 4}, seeds 0-2,
8 realisations: written by the linearised replay's check at commit 18a0265, whose predictions it also holds;
tests/test_crn.py reproduces its CRN means). `judge` is every estimator's judgement (crn_check.py's too).

Per seed: the run's resume state at t0 (the window's start), then `--realisations` replays of the run's own noise
(noise_seed i) carrying the tangent of the noise's log-level; ḡ ± SE per metric; the prediction for the level × k is
ḡ ln k (NaN at k = 0). Prints Spearman ρ over (counterfactual, seed) for r and the OOD loss (k > 0, and inside
|Δ log scale| = |ln k| / 2 ≤ 0.5), the coverage of prediction ± 1.96 √(se² + crn_se²), the cost; writes `--out`.

`--per-path H`: instead, per realisation 0-2 of seed 0, the pathwise dr/d ln k and dOOD/d ln k against central
differences of CRN members at ln k = ±H along the same realisation (the closed loop included there).

Usage: OMP_NUM_THREADS=1 python experiments/reproductions/crn_pathwise.py [--crn reference/reproductions/crn_replay.csv]
       [--out reference/reproductions/crn_pathwise.csv] [--per-path 0.03]
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import rankdata, spearmanr

from iclnoise.config.grid import run_spec
from iclnoise.core.runspec import RunSpec
from iclnoise.run.crn import counterfactual, crn, member_spec
from iclnoise.run.pathwise import fork_state, predict, sensitivity

sys.path.insert(0, str(Path(__file__).parent))
from tiny import params  # noqa: E402  (the tiny setting, one definition)

METRICS = ("r", "ood_loss")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--crn", default="reference/reproductions/crn_replay.csv")
    ap.add_argument("--realisations", type=int, default=8)
    ap.add_argument("--jac-batch", type=int, default=64, help="sequences of each step's batch in its Jacobian")
    ap.add_argument("--out", default="reference/reproductions/crn_pathwise.csv")
    ap.add_argument("--per-path", type=float, default=None, metavar="H")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ref = pd.read_csv(a.crn)
    steps, budget = int(ref.steps.iloc[0]), float(ref.budget.iloc[0])
    p = params(steps)
    p["train"]["checkpoints"] = {"linear": 2, "log": 2}
    p["noise"]["conditions"]["late"] = {"source": "param", "shape": "diagonal", "schedule": "late", "fraction": 0.5,
                                        "budget": budget}
    if a.per_path:
        return per_path(p, steps // 2, a.per_path, a.jac_batch)
    rows = []
    for seed in sorted(ref.seed.unique()):
        spec, t0 = run_spec(p, f"M8-B64-late-s{seed}"), steps // 2
        state = fork_state(spec, t0)
        own = counterfactual("self", p["noise"]["conditions"], RunSpec.of(spec))
        t = time.time()
        g = [sensitivity(RunSpec.of(member_spec(spec, own, i)), copy.deepcopy(state), a.jac_batch)
             for i in range(a.realisations)]
        seconds = time.time() - t
        for r in ref[ref.seed == seed].itertuples():
            pred, se = predict(g, r.k)[r.metric]
            half = 1.96 * math.hypot(se, r.crn_se)
            rows.append({"seed": seed, "counterfactual": r.counterfactual, "k": r.k, "metric": r.metric,
                         "n_realisations": r.n_realisations, "crn_mean": r.crn_mean, "crn_se": r.crn_se,
                         "predicted": pred, "predicted_se": se, "predicted_lo": pred - half,
                         "predicted_hi": pred + half, "g": float(pd.Series([gi[r.metric] for gi in g]).mean()),
                         "pathwise_s": seconds, "crn_s": r.crn_s, "t0": t0, "steps": steps, "budget": budget,
                         "realisations": a.realisations, "jac_batch": a.jac_batch})
        print(f"seed {seed}: {a.realisations} pathwise replays {seconds:.0f} s (CRN {r.crn_s:.0f} s)", flush=True)
    judge(pd.DataFrame(rows), a.out)


# the prediction columns judged, where present; the band is made from the two forms (judge)
FORMS = {"predicted": "ḡ ln k", "predicted_linear": "ḡ (k − 1)", "predicted_band": "the band between them"}


def judge(df: pd.DataFrame, out: str) -> pd.DataFrame:
    """An estimator's predictions against the CRN means (columns k, metric, crn_mean, crn_se, predicted,
    predicted_se, predicted_lo, predicted_hi; the same for predicted_linear where present: FORMS): whether each
    interval covers (covered, covered_linear), whether k is inside |Δ log scale| = |ln k| / 2 ≤ 0.5; written to
    `out`. Printed per form, for r and the OOD loss, over the pairs with k > 0 and inside: Spearman ρ,
    coverage, and the mean squared standardised error z² = (crn_mean − predicted)² / (predicted_se² + crn_se²)
    (1 where the prediction is right and its SE honest; how well a form fits, beside whether it ranks). With both
    forms, also the band between them, each ± its interval (predicted_band_lo..hi, the point predicted_band its
    midpoint ḡ (ln k + k − 1) / 2; covered_band): a response whose curvature in ln k lies between 0 (ḡ ln k) and ḡ
    (ḡ (k − 1)), e.g. ḡ (k^p − 1)/p with 0 ≤ p ≤ 1. Its interval is not a confidence interval: no z² for it."""
    df = df.assign(local=df.k.map(lambda k: k > 0 and abs(math.log(k)) / 2 <= 0.5))
    if "predicted" in df and "predicted_linear" in df:
        df["predicted_band"] = (df.predicted + df.predicted_linear) / 2
        df["predicted_band_lo"] = df[["predicted_lo", "predicted_linear_lo"]].min(axis=1)
        df["predicted_band_hi"] = df[["predicted_hi", "predicted_linear_hi"]].max(axis=1)
    forms = [c for c in FORMS if c in df]
    for col in forms:
        df[col.replace("predicted", "covered")] = (df[f"{col}_lo"] <= df.crn_mean) & (df.crn_mean <= df[f"{col}_hi"])
    df.to_csv(out, index=False, float_format="%.6g")
    for col in forms:
        for metric in METRICS:
            have = df[(df.metric == metric) & df[col].notna() & (df.k > 0)]   # the same rows for every form
            for where, d in (("every k > 0", have), ("|Δ log scale| ≤ 0.5", have[have.local])):
                rho = spearmanr(d[col], d.crn_mean).statistic
                z2 = (f"; mean z² {((d.crn_mean - d[col]) ** 2 / (d[f'{col}_se'] ** 2 + d.crn_se ** 2)).mean():.2f}"
                      if f"{col}_se" in d else "")
                print(f"{FORMS[col]}: {metric}, {where}: Spearman ρ {rho:.2f} over {len(d)}; coverage "
                      f"{d[col.replace('predicted', 'covered')].mean():.2f}{z2}; {resolution(d)}")
    return df


def resolution(d: pd.DataFrame, sims: int = 2000) -> str:
    """Whether the CRN means can rank an estimator at all: their spread (sd over the rows) against one draw's sd
    (crn_se √n) and their own SE, and ρ_max, the median Spearman ρ a perfect estimator reaches against means this
    noisy (simulated: true effects with the means' spread less their SEs' share, each seen through its own SE)."""
    m, se = d.crn_mean.to_numpy(), d.crn_se.to_numpy()
    draw = float((se * d.n_realisations.to_numpy() ** 0.5).mean())
    true_sd = math.sqrt(max(0.0, m.var() - (se ** 2).mean()))
    if true_sd == 0:   # the means spread no wider than their SEs: no estimator can rank them
        return (f"the means spread sd {m.std():.2g} against one draw's {draw:.2g} and their SE {se.mean():.2g}: "
                f"not resolved (ρ_max 0)")
    g = torch.Generator().manual_seed(0)
    z = lambda: torch.randn(sims, len(m), generator=g, dtype=torch.float64).numpy()  # noqa: E731
    truth = m.mean() + true_sd * z()
    seen = truth + se * z()
    rt, ro = (r - r.mean(1, keepdims=True) for r in (rankdata(truth, axis=1), rankdata(seen, axis=1)))
    rho = sorted((rt * ro).sum(1) / np.sqrt((rt ** 2).sum(1) * (ro ** 2).sum(1)))[sims // 2]   # Spearman per row
    return (f"the means spread sd {m.std():.2g} against one draw's {draw:.2g} and their SE {se.mean():.2g}: "
            f"ρ_max {rho:.2f}")


def per_path(p: dict, t0: int, h: float, jac_batch: int) -> None:
    """Seed 0, realisations 0-2: the pathwise derivative against CRN's central difference along the realisation."""
    spec = run_spec(p, "M8-B64-late-s0")
    up, down = f"self*{math.exp(h):.6g}", f"self*{math.exp(-h):.6g}"
    state = fork_state(spec, t0)
    v = crn(spec, [up, down], p["noise"]["conditions"], 3, t0)
    own = counterfactual("self", p["noise"]["conditions"], RunSpec.of(spec))
    for i in range(3):
        g = sensitivity(RunSpec.of(member_spec(spec, own, i)), copy.deepcopy(state), jac_batch)
        w = v[v.realisation == i].pivot_table(index="metric", columns="counterfactual", values="value")
        fd = (w[up] - w[down]) / (2 * h)
        print(f"realisation {i}: " + ", ".join(f"{k} pathwise {g[k]:+.5f}, central difference {fd[k]:+.5f}"
                                                 for k in ("r", "ood_loss")))


if __name__ == "__main__":
    main()
