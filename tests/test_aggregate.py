"""Aggregation over a synthetic runs directory with a planted threshold and missing probe tables."""
import json

import numpy as np
import pandas as pd
import pytest

from iclnoise.aggregate import cli as aggregate_cli
from iclnoise.evaluate import METRICS_SCHEMA
from iclnoise.io import read_parquet, write_json, write_parquet
from iclnoise.llc import LLC_SCHEMA
from iclnoise.report import cli as report_cli
from iclnoise.stats import logistic

STEPS = [0, 10, 100, 1000]


def fake_run(root, M, B, seed, r_end, diverged=False, llc=None):
    rid = f"M{'inf' if M == -1 else M}-B{B}-none-s{seed}"
    d = root / rid
    keys = {"run_id": rid, "M": M, "seed": seed, "batch": B, "noise": "none"}
    spec = {"keys": keys, "noise": {"source": "none"},
            "train": {"steps": 1000, "optimizer": {"lr": 0.01}, "lr_schedule": {"kind": "constant"}}}
    write_json(spec, d / "run.json")
    rows = []
    for i, s in enumerate(STEPS):
        rows.append({**keys, "step": s, "sequences": s * B, "lr": 0.01, "train_loss": 1.0, "id_loss": 1 - 0.2 * i,
                     "ood_loss": [1.0, 0.6, 0.7, 0.8][i], "id_loss_dmmse": 0.3, "id_loss_ridge": 0.4,
                     "ood_loss_dmmse": 0.9, "ood_loss_ridge": 0.4, "delta_dmmse": r_end, "delta_ridge": 1 - r_end,
                     "r": r_end if M != -1 else np.nan, "icl_score": 0.1 * i, "diverged": diverged and s == 1000})
    write_parquet(pd.DataFrame(rows), d / "metrics.parquet", METRICS_SCHEMA)
    if llc is not None:
        write_parquet(pd.DataFrame([{**keys, "step": 1000, "llc_mean": llc, "llc_std": 1.0, "llc_se": 0.5,
                                     "llc_per_chain": [llc], "init_loss": 0.1, "mean_sampling_loss": 0.2,
                                     "diverged": False, "negative": False, "not_levelled": False, "epsilon": 1e-4,
                                     "gamma": 100.0, "nbeta": 100.0, "chains": 1, "burn_in": 1, "draws": 8,
                                     "batch_size": 8, "n": 64, "seconds": 0.1}]), d / "llc.parquet", LLC_SCHEMA)
    return d


@pytest.fixture
def runs(tmp_path):
    rng = np.random.default_rng(0)
    dirs = []
    for B, x0 in ((16, 4.0), (64, 6.0)):           # planted: larger batch (less noise) → higher threshold
        for seed in range(3):
            for M in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, -1):
                r = float(np.clip(logistic(np.log2(M), x0, 0.7) + 0.02 * rng.standard_normal(), 0, 1)) if M != -1 else 0.5
                dirs.append(fake_run(tmp_path / "runs", M, B, seed, r, llc=10 + 5 * r if B == 16 else None,
                                     diverged=(M == 2 and seed == 2 and B == 64)))
    return tmp_path, dirs


def test_aggregate_outcomes_thresholds_tests_and_report(runs):
    root, dirs = runs
    out = root / "aggregate"
    aggregate_cli([str(d) for d in dirs] + ["--out", str(out), "--figures", str(root / "figures"),
                                            "--cfg", json.dumps({"n_boot": 50})])
    o = read_parquet(out / "outcomes.parquet")
    assert len(o) == len(dirs) and o.diverged.sum() == 1            # diverged run kept and flagged
    assert (o.t_crit == 10).all() and (o.transient_window == 90).all()
    assert o.llc_final.notna().sum() == 33 and o.llc_final.isna().sum() == 33   # llc only where it exists
    th = read_parquet(out / "thresholds.parquet").set_index("batch")
    assert th.loc[16, "M_star"] == pytest.approx(16, rel=0.25) and th.loc[64, "M_star"] == pytest.approx(64, rel=0.25)
    assert th.loc[16, "M_star_lo"] <= 16 <= th.loc[16, "M_star_hi"]
    tests = read_parquet(out / "tests.parquet")
    assert set(tests.hypothesis) == {"H1", "H2", "H3", "H4"}
    assert tests.loc[tests.hypothesis == "H2", "status"].str.startswith("not run").all()
    h1 = tests[(tests.hypothesis == "H1") & (tests.outcome == "r")].iloc[0]
    assert h1.status == "run" and h1.estimate > 0 and h1.ci_lo > 0   # smaller batch → more η/B → higher r
    assert (root / "figures" / "fig06_threshold_vs_noise.png").exists()
    report_cli(["--results", str(root), "--params", "{grid: {M: [1]}}", "--out", str(root / "report.md")])
    text = (root / "report.md").read_text()
    assert "Hypothesis verdicts" in text and "not run" in text and "grid:" in text


def _outcomes(rng, planted_late_gain: float, inj_shift: float) -> pd.DataFrame:
    """Synthetic outcomes: batch-16 runs, batch-64 runs emulating 16 (r shifted by inj_shift) and early/late
    runs at batch 64 (late r higher by planted_late_gain), 4 finite M × 6 seeds."""
    rows = []
    for M in (4, 16, 64, 256):
        for seed in range(6):
            base = 0.2 + 0.1 * np.log2(M) / 8 + 0.02 * rng.standard_normal()
            common = {"M": M, "seed": seed, "diverged": False, "id_loss": 0.5, "ood_loss": 1.0 - base,
                      "integrated_lr_over_b": 1.0, "integrated_pne": 1.0 + rng.random()}
            rows.append({**common, "batch": 16, "noise": "none", "noise_source": "batch", "noise_schedule": "none",
                         "emulate_batch": 0, "r": base + 0.005 * rng.standard_normal()})
            rows.append({**common, "batch": 64, "noise": "grad_b16", "noise_source": "grad",
                         "noise_schedule": "constant", "emulate_batch": 16,
                         "r": base + inj_shift + 0.005 * rng.standard_normal()})
            for sched, gain in (("early", 0.0), ("late", planted_late_gain)):
                rows.append({**common, "batch": 64, "noise": sched, "noise_source": "grad", "noise_schedule": sched,
                             "emulate_batch": 0, "r": base + gain + 0.005 * rng.standard_normal()})
    return pd.DataFrame(rows)


def test_h2_recovers_a_planted_late_advantage_and_h3_matches_by_emulated_batch():
    from iclnoise.aggregate import hypothesis_tests
    cfg = {"alpha": 0.05, "equivalence_margin": 0.05}
    t = hypothesis_tests(_outcomes(np.random.default_rng(0), 0.1, 0.0), cfg).set_index("hypothesis")
    h2, h3 = t.loc["H2"], t.loc["H3"]
    assert h2.status == "run" and h2.n == 24 and abs(h2.estimate - 0.1) < 0.01 and h2.ci_lo > 0.05
    assert h3.term == "batch 16 − grad_b16" and h3.n == 24 and "equivalent" in h3.verdict and h3.p < 0.05
    # no planted gain: H2 finds none; injected noise shifted by 2× the margin: equivalence is not shown
    t = hypothesis_tests(_outcomes(np.random.default_rng(1), 0.0, 0.1), cfg).set_index("hypothesis")
    assert t.loc["H2"].ci_lo < 0 < t.loc["H2"].ci_hi
    assert "not shown" in t.loc["H3"].verdict
