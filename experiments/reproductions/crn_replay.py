"""The linearised replay judged against CNR's ground truth (issue 67, item 3), at a small CPU scale.

Issue 46 judged the replay (iclnoise.run.replay, `iclnoise cnr-replay`) against single retrainings, one draw of the
noise each, and found Spearman ρ ≤ 0.26. Here its target is the mean over realisations by common random numbers
(iclnoise.run.crn). Setting: the tests' tiny model (2 layers, d_model 16) at M = 8, batch 64, `--steps` steps; the
run injects parameter-space diagonal noise at budget `--budget` over the last half (schedule late), forked at the
window's start t0. Counterfactuals: the run's own noise at k × its level, k in K (`self*k`: CRN multiplies the budget,
the replay the realised covariance s_t R'_t). Per seed: the replay from the run's resume state at t0 (`--probes`
paths per counterfactual, `--jac-batch` sequences in each Jacobian) and CRN with `--realisations` streams; per
(counterfactual, seed, metric) the replay's ΔE f with its probe SE and the CRN mean with its SE. Prints Spearman ρ
over (counterfactual, seed) for r and the OOD loss, all k and inside |Δ log scale| = |ln k| / 2 ≤ 0.5, the coverage of
replay ± 1.96 √(se² + crn_se²), and the cost of each; writes `--out`.

Usage: OMP_NUM_THREADS=1 python experiments/reproductions/crn_replay.py [--seeds 0 1 2] [--realisations 8]
       [--out reference/reproductions/crn_replay.csv]
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from scipy.stats import spearmanr

from iclnoise.analysis.stats import paired_effects
from iclnoise.config.grid import run_spec
from iclnoise.run.crn import REFERENCE, crn
from iclnoise.run.member import RESUME
from iclnoise.run.replay import replay_run
from iclnoise.run.train import train_ensemble

sys.path.insert(0, str(Path(__file__).parent))
from cnr_check import params  # noqa: E402  (the tiny setting, one definition)

K = (0, 0.25, 0.5, 0.75, 1.5, 2, 3, 4)
METRICS = ("r", "ood_loss")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--realisations", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--jac-batch", type=int, default=8)
    ap.add_argument("--out", default="reference/reproductions/crn_replay.csv")
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = params(a.steps, None)
    p["train"]["checkpoints"] = {"linear": 2, "log": 2}   # a commit at the window's start, step steps/2
    p["noise"]["conditions"]["late"] = {"source": "param", "shape": "diagonal", "schedule": "late", "fraction": 0.5,
                                        "budget": a.budget}
    names = [f"self*{k:g}" for k in K]
    rows = []
    with tempfile.TemporaryDirectory(prefix="crn-replay-") as tmp:
        for seed in a.seeds:
            run = f"M8-B64-late-s{seed}"
            spec, rd, t0 = run_spec(p, run), Path(tmp) / run, a.steps // 2
            train_ensemble([spec], [rd], progress=False, stop_after=t0)
            state = Path(tmp) / f"{run}.t0.pt"
            shutil.copyfile(rd / RESUME, state)
            train_ensemble([spec], [rd], progress=False)
            t = time.time()
            pred = replay_run(rd, names, p["noise"]["conditions"], a.probes, a.jac_batch, seed, state=state)
            replay_s = time.time() - t
            t = time.time()
            values = crn(spec, names, p["noise"]["conditions"], a.realisations, t0)
            crn_s = time.time() - t
            eff = paired_effects(values, REFERENCE).set_index(["counterfactual", "metric"])
            for r in pred[pred.metric.isin(METRICS)].itertuples():
                e = eff.loc[(r.counterfactual, r.metric)]
                rows.append({"seed": seed, "counterfactual": r.counterfactual, "k": float(r.counterfactual[5:]),
                             "metric": r.metric, "n_realisations": int(e.n_realisations), "crn_mean": e.crn_mean,
                             "crn_se": e.crn_se, "predicted": r.delta, "predicted_se": r.se,
                             "predicted_lo": r.delta - 1.96 * math.hypot(r.se, e.crn_se),
                             "predicted_hi": r.delta + 1.96 * math.hypot(r.se, e.crn_se), "sd_draw": r.sd_draw,
                             "replay_s": replay_s, "crn_s": crn_s, "t0": t0, "steps": a.steps, "budget": a.budget,
                             "probes": a.probes, "jac_batch": a.jac_batch})
            print(f"seed {seed}: replay {replay_s:.0f} s, CRN {crn_s:.0f} s", flush=True)
    df = judge(pd.DataFrame(rows), a.out)
    print(f"cost per seed: replay {df.replay_s.mean():.0f} s, CRN {df.crn_s.mean():.0f} s ({len(K)} counterfactuals "
          f"× {a.realisations} realisations)")


def judge(df: pd.DataFrame, out: str) -> pd.DataFrame:
    """An estimator's predictions against the CRN means (columns k, metric, crn_mean, predicted, predicted_lo,
    predicted_hi): whether each interval covers, whether k is inside |Δ log scale| = |ln k| / 2 ≤ 0.5; written to
    `out`; Spearman ρ and coverage printed for r and the OOD loss over the pairs with a prediction, and inside."""
    df = df.assign(covered=(df.predicted_lo <= df.crn_mean) & (df.crn_mean <= df.predicted_hi),
                   local=df.k.map(lambda k: k > 0 and abs(math.log(k)) / 2 <= 0.5))
    df.to_csv(out, index=False, float_format="%.6g")
    for metric in METRICS:
        have = df[(df.metric == metric) & df.predicted.notna()]
        for where, d in (("every k with a prediction", have), ("|Δ log scale| ≤ 0.5", have[have.local])):
            rho = spearmanr(d.predicted, d.crn_mean).statistic
            print(f"{metric}, {where}: Spearman ρ {rho:.2f} over {len(d)}; coverage {d.covered.mean():.2f}; "
                  f"{resolution(d)}")
    return df


def resolution(d: pd.DataFrame, sims: int = 2000) -> str:
    """Whether the CRN means can rank an estimator at all: their spread (sd over the rows) against one draw's sd
    (crn_se √n) and their own SE, and ρ_max, the median Spearman ρ a perfect estimator reaches against means this
    noisy (simulated: true effects with the means' spread less their SEs' share, each seen through its own SE)."""
    m, se = d.crn_mean.to_numpy(), d.crn_se.to_numpy()
    draw = float((se * d.n_realisations.to_numpy() ** 0.5).mean())
    true_sd = math.sqrt(max(0.0, m.var() - (se ** 2).mean()))
    g = torch.Generator().manual_seed(0)
    z = lambda: torch.randn(sims, len(m), generator=g, dtype=torch.float64).numpy()  # noqa: E731
    truth = m.mean() + true_sd * z()
    seen = truth + se * z()
    rho = sorted(spearmanr(t, o).statistic for t, o in zip(truth, seen))[sims // 2]
    return (f"the means spread sd {m.std():.2g} against one draw's {draw:.2g} and their SE {se.mean():.2g}: "
            f"ρ_max {rho:.2f}")


if __name__ == "__main__":
    main()
