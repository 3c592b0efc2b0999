"""Statistics validated on synthetic data with planted effects (SPEC §11)."""
import numpy as np
import pandas as pd
import pytest
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import ttost_ind

from iclnoise.stats import (compare_models, correlation, fit_threshold, holm, logistic, mixed_model, paired_test,
                            threshold_with_ci, tost, transient_ridge_window)


def planted_threshold(x0=6.0, s=0.8, seeds=4, noise=0.03, seed=0):
    rng = np.random.default_rng(seed)
    Ms = 2 ** np.arange(0, 13)
    return pd.DataFrame([{"M": M, "seed": k, "r": float(np.clip(logistic(np.log2(M), x0, s) + noise * rng.standard_normal(), 0, 1))}
                         for M in Ms for k in range(seeds)] + [{"M": -1, "seed": k, "r": np.nan} for k in range(seeds)])


def test_threshold_fit_recovers_a_planted_m_star_with_covering_ci():
    df = planted_threshold()
    est = threshold_with_ci(df, n_boot=100, seed=1)
    assert est["M_star"] == pytest.approx(64, rel=0.1)
    assert est["M_star_lo"] <= 64 <= est["M_star_hi"] and est["in_range"]
    assert not fit_threshold(np.array([1, 2, 4, 8]), np.array([0.9, 0.95, 0.97, 0.99]))["in_range"]


def sim_panel(slope, rng, n_seeds=6):
    rows = []
    for s in range(n_seeds):
        u = rng.normal(0, 0.3)
        for M in (1, 4, 16, 64, 256):
            for lvl in range(4):
                x = lvl + rng.normal(0, 0.3)
                rows.append({"seed": s, "log_pne": x, "log2M": np.log2(M), "id_loss": rng.normal(1, 0.1),
                             "r": 0.1 * np.log2(M) + slope * x + u + rng.normal(0, 0.2)})
    return pd.DataFrame(rows)


def test_mixed_model_recovers_planted_slope():
    df = sim_panel(0.25, np.random.default_rng(0))
    t = mixed_model(df, "r ~ log_pne + log2M + id_loss").set_index("term")
    assert t.loc["log_pne", "ci_lo"] <= 0.25 <= t.loc["log_pne", "ci_hi"]
    assert t.loc["log_pne", "p"] < 1e-6
    cmp = compare_models(df, "r ~ log_pne + log2M + id_loss", "r ~ log2M + id_loss")
    assert cmp["p"] < 1e-6 and cmp["delta_aic"] < -10


def test_planted_null_rejects_at_about_the_nominal_rate():
    rng = np.random.default_rng(1)
    n_sim = 100
    rejections = sum(mixed_model(sim_panel(0.0, rng, n_seeds=4), "r ~ log_pne + log2M").set_index("term").loc["log_pne", "p"] < 0.05
                     for _ in range(n_sim))
    # binomial(100, 0.05): 99.9 % of outcomes lie in [0, 13]; Wald p-values of MixedLM are a bit liberal
    assert rejections <= 13, rejections


def test_tost():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0, 1, 200), rng.normal(0, 1, 200)
    res = tost(a, b, margin=0.5)
    assert res["equivalent"] and res["ci_lo"] > -0.5 and res["ci_hi"] < 0.5
    shifted = tost(a, b + 1.0, margin=0.5)
    assert not shifted["equivalent"]
    p_ref, lower, upper = ttost_ind(a, b, -0.5, 0.5, usevar="unequal")
    assert res["p"] == pytest.approx(p_ref, rel=1e-6)


def test_paired_tost_matches_statsmodels_and_uses_the_pairing():
    from statsmodels.stats.weightstats import ttost_paired
    from iclnoise.stats import paired_tost
    rng = np.random.default_rng(5)
    level = rng.normal(0, 1, 30)               # a large shared per-pair effect (like M)
    a, b = level + rng.normal(0, 0.05, 30), level + rng.normal(0, 0.05, 30)
    res = paired_tost(a, b, margin=0.1)
    assert res["equivalent"] and res["ci_lo"] > -0.1 and res["ci_hi"] < 0.1
    assert not tost(a, b, margin=0.1)["equivalent"]  # unpaired, the shared level swamps the comparison
    assert not paired_tost(a, b + 0.2, margin=0.1)["equivalent"]
    p_ref, _, _ = ttost_paired(a, b, -0.1, 0.1)
    assert res["p"] == pytest.approx(p_ref, rel=1e-6)


def test_paired_test_and_correlation():
    rng = np.random.default_rng(3)
    early = rng.normal(0, 1, 30)
    late = early + 0.5 + rng.normal(0, 0.3, 30)
    r = paired_test(late, early)
    assert r["ci_lo"] < 0.5 < r["ci_hi"] and r["p"] < 1e-6 and r["effect_size"] > 1
    x = rng.normal(size=200)
    c = correlation(x, 2 * x + rng.normal(size=200))
    assert c["ci_lo"] > 0.8 and c["p"] < 1e-10
    # under independence the 95 % CI covers 0 in about 95 % of samples
    cover = np.mean([(lambda c: c["ci_lo"] < 0 < c["ci_hi"])(correlation(rng.normal(size=40), rng.normal(size=40)))
                     for _ in range(300)])
    assert 0.91 <= cover <= 0.99, cover


def test_holm_matches_statsmodels():
    p = np.array([0.01, 0.04, 0.03, 0.2, 0.001, np.nan])
    ours = holm(p)
    ref = multipletests(p[:-1], method="holm")[1]
    np.testing.assert_allclose(ours[:-1], ref)
    assert np.isnan(ours[-1])


def test_transient_ridge_window_on_a_planted_dip():
    steps = np.array([0, 10, 20, 40, 80, 160, 320, 640])
    ood = np.array([1.0, 0.8, 0.5, 0.45, 0.52, 0.7, 0.9, 0.95])   # dip at 40, departs by 80
    w = transient_ridge_window(pd.DataFrame({"step": steps, "ood_loss": ood}), rel_tol=0.05)
    assert w["t_crit"] == 40 and w["departure"] == 80 and w["window"] == 40
    mono = transient_ridge_window(pd.DataFrame({"step": steps, "ood_loss": np.linspace(1, 0.4, 8)}))
    assert np.isnan(mono["window"])
