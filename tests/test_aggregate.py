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
