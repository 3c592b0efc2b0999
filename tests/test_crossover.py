"""The anchor's crossover threshold (method §11): Δ on new tasks per checkpoint, the late pull, and M* where it
changes sign, validated on planted trajectories.

Planted grids: per seed a crossover x*_s = x* + 0.3·N(0, 1) (octaves), per run (M, seed) a pull
β = A · tanh((x*_s − log2 M) / w) + 0.15·N(0, 1), and per checkpoint ln Δ(f, ridge) = c − 0.3 ln S + β ln S / 2 + ε,
ln Δ(f, dMMSE_M) = c − 0.3 ln S − β ln S / 2 + ε' (ε, ε' ~ N(0, 0.05²)): both distances also shrink together,
which the pull must ignore. The rates below are printed by `pytest -s tests/test_crossover.py`.
"""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from iclnoise.analysis.thresholds import crossover_threshold, crossover_windows, pull_slopes, sign_change
from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.predictors import delta, dmmse, ridge
from iclnoise.core.runspec import RunSpec
from iclnoise.core.schedules import checkpoint_steps
from iclnoise.core.tasks import M_INF, eval_set, m_label, task_pool
from iclnoise.run.evaluate import Evaluator

DEFAULT_CK = np.array(checkpoint_steps(10_000, 12, 16)[1:]) * 16   # the default's batch-16 checkpoints
SPARSE_CK = np.array(checkpoint_steps(10_000, 4, 4)[1:]) * 16      # 7 checkpoints, 3 in the late half
G8, G5 = [2 ** k for k in range(8)], [1, 2, 4, 8, 16]
GU = [1, 4, 8, 16, 32, 64, 256]   # the science grid: uneven (gaps of 2, 1 and 2 octaves)


def planted(rng, x_star, Ms, seeds=3, A=1.0, w=1.5, seed_sd=0.3, run_sd=0.15, ck_sd=0.05, ck=DEFAULT_CK, flat=None):
    """Per-checkpoint OOD Δ trajectories; `flat`: every pull = flat + noise instead (no crossover)."""
    rows, lnS = [], np.log(ck)
    for s in range(seeds):
        xs = x_star + seed_sd * rng.standard_normal()
        for M in Ms:
            beta = (A * math.tanh((xs - math.log2(M)) / w) if flat is None else flat) + run_sd * rng.standard_normal()
            base = rng.normal(0, 1) - 0.3 * lnS
            rows.append(pd.DataFrame({
                "M": M, "seed": s, "sequences": ck,
                "ood_delta_ridge": np.exp(base + beta * lnS / 2 + ck_sd * rng.standard_normal(len(ck))),
                "ood_delta_dmmse": np.exp(base - beta * lnS / 2 + ck_sd * rng.standard_normal(len(ck)))}))
    return pd.concat(rows, ignore_index=True)


def rates(n, rng, x_star, Ms, **kw):
    """(share of grids with an interval, coverage of 2^x* among them, share with no M*) over n planted grids;
    x_star may be a callable drawing it per grid."""
    got = cover = none = 0
    for _ in range(n):
        x = x_star(rng) if callable(x_star) else x_star
        e = crossover_threshold(pull_slopes(planted(rng, x, Ms, **kw)))
        none += not np.isfinite(e["M_star"])
        if np.isfinite(e["M_star_lo"]):
            got += 1
            cover += e["M_star_lo"] <= 2 ** x <= e["M_star_hi"]
    return got / n, cover / max(got, 1), none / n


@pytest.mark.unit
def test_pull_reads_the_direction_and_ignores_a_common_shrink():
    """d = ln Δ(f, ridge) − ln Δ(f, dMMSE_M) with slope +0.4 per e-fold of data while both distances halve every
    e-fold: pull +0.4 from the late half only (the early half, planted with the opposite slope, is left out)."""
    S = np.geomspace(1e3, 1.6e5, 20)
    beta = np.where(S >= S[-1] / 2, 0.4, -2.0)
    d = np.cumsum(np.r_[0, beta[1:] * np.diff(np.log(S))])
    traj = pd.DataFrame({"M": 4, "seed": 0, "sequences": S, "ood_delta_ridge": np.exp(d / 2) / S ** 0.7,
                         "ood_delta_dmmse": np.exp(-d / 2) / S ** 0.7})
    p = pull_slopes(pd.concat([traj, traj.assign(M=M_INF, ood_delta_dmmse=np.nan)]))
    assert len(p) == 1 and p.slope.iloc[0] == pytest.approx(0.4, abs=1e-6) and p.n.iloc[0] == (S >= S[-1] / 2).sum()
    assert np.isnan(pull_slopes(traj.tail(2)).slope.iloc[0])                  # < 3 late checkpoints: no pull


@pytest.mark.unit
def test_sign_change_pools_noise_and_says_which_side():
    x = np.arange(6.0)
    assert sign_change(x, np.array([1.0, 0.5, -0.5, -1, -1, -1]))[0] == pytest.approx(1.5)
    # a non-monotone blip is pooled: one crossing between x = 2 and 3
    assert sign_change(x, np.array([1.0, 0.8, 0.6, -0.2, 0.1, -1]))[0] == pytest.approx(2 + 0.6 / 0.65)
    assert np.isnan(sign_change(x, np.full(6, 0.3))[0]) and "above the grid" in sign_change(x, np.full(6, 0.3))[1]
    assert "below the grid" in sign_change(x, np.full(6, -0.3))[1]


@pytest.mark.validation
def test_crossover_interval_covers_planted_thresholds():
    """Crossovers planted anywhere in the interior of an 8-M grid (log2 M* ~ U(1.5, 5.5)), 3 seeds, 100 grids;
    measured (seed 0): an interval in 99, coverage 97 of 99 with the gap allowance (issue 42; the t-interval alone:
    92 of 99, and 0.934 of 392 on 400 more grids, seed 10); the other one: no significant sign change. Pull
    amplitude and width vary per grid (A ~ U(0.6, 1.4), w ~ U(1, 2))."""
    rng = np.random.default_rng(0)
    got = cover = 0
    for _ in range(100):
        x = rng.uniform(1.5, 5.5)
        e = crossover_threshold(pull_slopes(planted(rng, x, G8, A=rng.uniform(0.6, 1.4), w=rng.uniform(1, 2))))
        if np.isfinite(e["M_star_lo"]):
            got += 1
            cover += e["M_star_lo"] <= 2 ** x <= e["M_star_hi"]
    print(f"\ninterior crossover, 8 M, 3 seeds: interval in {got}/100, coverage {cover}/{got}")
    assert got >= 90 and cover / got >= 0.9, (got, cover)


def asymmetric(rng, x_star, Ms, seeds, wl=1.0, wr=2.5, seed_sd=0.3, run_sd=0.15, ck=DEFAULT_CK):
    """Per-checkpoint Δ whose pull is asymmetric about x*: tanh width `wl` below it and `wr` above it, run noise
    growing away from x* (sd run_sd · (1 + |log2 M − x*| / 2))."""
    rows, lnS = [], np.log(ck)
    for s in range(seeds):
        xs = x_star + seed_sd * rng.standard_normal()
        for M in Ms:
            x = math.log2(M)
            beta = math.tanh((xs - x) / (wl if x < xs else wr)) + run_sd * (1 + abs(x - xs) / 2) * rng.standard_normal()
            base = rng.normal(0, 1) - 0.3 * lnS
            rows.append(pd.DataFrame({
                "M": M, "seed": s, "sequences": ck,
                "ood_delta_ridge": np.exp(base + beta * lnS / 2 + 0.05 * rng.standard_normal(len(ck))),
                "ood_delta_dmmse": np.exp(base - beta * lnS / 2 + 0.05 * rng.standard_normal(len(ck)))}))
    return pd.concat(rows, ignore_index=True)


@pytest.mark.validation
def test_crossover_interval_covers_asymmetric_pulls_on_an_uneven_grid():
    """Issue 42: asymmetric pulls (widths 1 and 2.5 octaves), heteroscedastic run noise, the crossing inside a gap of
    the science grid {1, 4, 8, 16, 32, 64, 256}, 6 seeds: linear interpolation reads log2 M* high, the t-interval
    alone under-covers, and the allowance of GAP_SHARE × the gap restores it. Measured by
    experiments/crossover_coverage.py
    (200 grids per cell, seed 1; bias of log2 M*, coverage of the t-interval alone → of the reported interval):
    8 M, 3 seeds: +0.215, 0.911 → 0.950; uneven, 3 seeds: +0.211, 0.932 → 0.983; uneven, 4 seeds: +0.213,
    0.904 → 0.960; uneven, 6 seeds: +0.189, 0.879 → 0.990. Here, 40 grids at 6 seeds: the reported interval covers
    40 of 40, the t-interval alone 38 (which fails the assertion)."""
    rng = np.random.default_rng(1)
    lg = np.log2(GU)
    got = cover = t_only = 0
    for _ in range(40):
        i = rng.integers(1, len(lg) - 2)
        x = lg[i] + rng.uniform(0.2, 0.8) * (lg[i + 1] - lg[i])
        e = crossover_threshold(pull_slopes(asymmetric(rng, x, GU, 6)))
        if np.isfinite(e["M_star_lo"]):
            got += 1
            cover += e["M_star_lo"] <= 2 ** x <= e["M_star_hi"]
            t_only += abs(e["log2_M_star"] - x) <= 2.571 * e["log2_se"]   # t_{0.975, 5}
    print(f"\nasymmetric pulls, uneven grid, 6 seeds: interval in {got}/40, coverage {cover}/{got} "
          f"(t-interval alone {t_only})")
    assert got >= 36 and cover / got >= 0.975, (got, cover)


@pytest.mark.validation
def test_no_crossover_grids_give_no_m_star():
    """Pulls of one sign or none: crossover 0.5-2 octaves above or below an 8-M grid, or just above it (0.1-0.5
    octave: the largest M's pull is +0.07 to +0.32), or a flat pull (+0.3, 0: noise only). 40 grids each, 200 in
    all; measured (seed 1): no M* in 198 of 200 (39 of 40 just above and flat 0; 200 grids each, seed 5:
    flat 0 0.995, just above 0.99)."""
    rng = np.random.default_rng(1)
    cases = {"above": dict(x_star=lambda r: r.uniform(7.5, 9.0)), "below": dict(x_star=lambda r: r.uniform(-2, -0.5)),
             "just above": dict(x_star=lambda r: r.uniform(7.1, 7.5)), "flat +0.3": dict(x_star=3.0, flat=0.3),
             "flat 0": dict(x_star=3.0, flat=0.0)}
    none = {k: rates(40, rng, Ms=G8, **kw)[2] for k, kw in cases.items()}
    print(f"\nno crossover in the grid, share with no M*: {none}")
    assert sum(none.values()) / len(none) >= 0.95 and min(none.values()) >= 0.9, none


@pytest.mark.unit
def test_crossover_edge_cases():
    """Unlike the cases above: a 5-M grid like the default's (x* = 2.2), sparse checkpoints (3 in the late half),
    5 seeds, and a crossover 0.7 octave from the grid's edge. Measured (seed 2, 30 grids each, with the gap
    allowance of issue 42; before it in brackets): 5 M: interval 28/30, coverage 28/28 (28/28); sparse: 30/30, 30/30
    (29/30); 5 seeds: 30/30, 30/30 (28/30); near the edge: 18/30, 18/18 (16/18; the 12 others: no significant sign
    change: one M below it, tested over 3 seeds)."""
    rng = np.random.default_rng(2)
    five = rates(30, rng, 2.2, G5)
    sparse = rates(30, rng, 3.5, G8, ck=SPARSE_CK)
    seeds5 = rates(30, rng, 3.5, G8, seeds=5)
    edge = rates(30, rng, 0.7, G8)
    print(f"\n5 M {five}, sparse checkpoints {sparse}, 5 seeds {seeds5}, near the edge {edge}")
    for got, cover, _ in (five, sparse, seeds5):
        assert got >= 0.8 and cover >= 0.85, (five, sparse, seeds5)
    assert edge[0] >= 0.3 and edge[1] >= 0.8, edge   # the interval, where there is one, still covers


@pytest.mark.unit
def test_crossover_reasons():
    rng = np.random.default_rng(3)
    p = pull_slopes(planted(rng, 3.5, G8))
    assert crossover_threshold(p[p.M <= 8])["reason"].startswith("no threshold: too few M (4")
    assert crossover_threshold(p[p.seed == 0])["reason"].startswith("no threshold: too few seeds")
    e = crossover_threshold(p[p.seed < 2])
    assert np.isfinite(e["M_star"]) and e["reason"] == "no interval: insufficient seeds (2 < 3)"
    p = pull_slopes(planted(rng, 3.5, G8, seeds=5))   # seed 4 pulls toward dMMSE_M at every M, if barely
    p.loc[p.seed == 4, "slope"] = p.slope.clip(lower=0.05)
    e = crossover_threshold(p)
    assert np.isfinite(e["M_star"]) and e["n_seeds_fit"] == 4
    assert e["reason"] == "no interval: a seed's pull does not change sign (seed 4: pull toward dMMSE_M at every M " \
                          "(M* above the grid))"


@pytest.mark.unit
def test_a_crossover_that_depends_on_the_window_is_flagged():
    """Issue 42: the estimate at the last ½, ⅔ and ⅓ of training; where the pull stops changing with data in the
    last 40 % (d frozen there), the last third and the last half find no threshold while the last two thirds do
    (measured, seed 5: last half p = 0.057, last two thirds M* 11.9, last third none): not window-consistent."""
    rng = np.random.default_rng(5)
    t = planted(rng, 3.5, G8)
    e = crossover_windows(t)
    assert e["window_consistent"] and e["reason"] == "" and np.isfinite(e["M_star_last_third"])
    assert e["M_star"] == crossover_threshold(pull_slopes(t))["M_star"]
    frozen = t.copy()
    end = frozen.groupby(["M", "seed"]).sequences.transform("max")
    late = frozen.sequences >= 0.6 * end
    for c in ("ood_delta_ridge", "ood_delta_dmmse"):   # the last checkpoints repeat the one before them
        first = frozen[late].groupby(["M", "seed"])[c].transform("first")
        frozen.loc[late, c] = first * np.exp(0.05 * rng.standard_normal(late.sum()))
    e = crossover_windows(frozen)
    assert not e["window_consistent"] and e["window_detail"].startswith("last half: no significant sign change"), e
    assert np.isfinite(e["M_star_last_two_thirds"]) and not np.isfinite(e["M_star_last_third"])


@pytest.mark.unit
def test_no_delta_logged_is_a_reason_not_a_crash():
    """Issue 42: runs without Δ on new tasks (None in the trajectory table, or no trajectory at all) raised a
    TypeError in crossover_threshold; now they give the documented 'no threshold' reason, in threshold_table too."""
    from iclnoise.analysis.aggregate import TRAJECTORY_COLUMNS, threshold_table
    from iclnoise.core.probe_sections import Stats

    empty = pd.DataFrame(columns=TRAJECTORY_COLUMNS)
    unlogged = pd.DataFrame({"run_id": "a", "M": 4, "seed": 0, "batch": 16, "noise": "none", "sequences": [1, 2, 3],
                             "ood_delta_dmmse": None, "ood_delta_ridge": None})
    for traj in (empty, unlogged):
        assert crossover_threshold(pull_slopes(traj))["reason"] == "no threshold: no pull (Δ on new tasks not logged)"
    out = pd.DataFrame([{"run_id": f"{M}-{s}", "M": M, "seed": s, "batch": 16, "noise": "none", "optimizer": "adamw",
                         "diverged": False,
                         "r": 0.1 + 0.8 * (M > 8), "ood_loss": 0.42, "ood_loss_ridge": 0.4, "sequences": 1000,
                         "noise_source": "batch", "noise_schedule": "none", "emulate_batch": 0, "noise_level": 1 / 16}
                        for M in (1, 2, 4, 8, 16, 32, -1) for s in range(3)])
    th = threshold_table(out, Stats(alpha=0.05, equivalence_fraction=0.5, equivalence_margin=None, transient_tol=0.05),
                         traj=None).set_index("method")
    assert th.loc["crossover", "reason"] == "no threshold: Δ on new tasks not logged (runs predate ood_delta_*)"
    assert not th.loc["crossover", "gates_passed"] and "crossover fit" in th.loc["crossover", "gate_failures"]


@pytest.mark.unit
@pytest.mark.numerics
@pytest.mark.parametrize("M", [4, M_INF])
def test_evaluator_logs_delta_on_new_tasks(M):
    """ood_delta_* = Δ(f, dMMSE_M of the run's pool) and Δ(f, ridge) on the OOD sequences; NaN dMMSE for M = ∞."""
    spec = run_spec(load_params("params.yaml"), f"M{m_label(M)}-B16-none-s0")
    spec.update(data={"D": 3, "K": 6, "noise_var": 0.125, "pool_seed": 0},
                eval={"n_sequences": 40, "n_root": 4, "icl_tokens": [1, 6], "eval_seed": 7})

    class Model(torch.nn.Module):
        def forward(self, xs, ys):
            return xs[..., 0] + 0.1 * ys

    m, _, _ = Evaluator(RunSpec.of(spec))(Model())
    b = eval_set("ood", M, 40, 6, 3, 0.125, 0, 7)
    f = Model()(b.xs, b.ys)
    assert m["ood_delta_ridge"] == pytest.approx(delta(f, ridge(b.xs, b.ys, 0.125), 3))
    if M == M_INF:
        assert math.isnan(m["ood_delta_dmmse"]) and math.isnan(m["r"])
    else:
        want = delta(f, dmmse(b.xs, b.ys, task_pool(0, M, 3), 0.125), 3)
        assert m["ood_delta_dmmse"] == pytest.approx(want) and m["ood_delta_dmmse"] != m["delta_dmmse"]
