"""Aggregation over a synthetic runs directory with a planted threshold and missing probe tables."""
import json

import numpy as np
import pandas as pd
import pytest

from iclnoise.analysis.aggregate import OUTCOMES_SCHEMA
from iclnoise.analysis.thresholds import logistic
from iclnoise.commands.results import aggregate as aggregate_cli
from iclnoise.commands.results import aggregate_figures as aggregate_figures_cli
from iclnoise.commands.results import report as report_cli
from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet, write_json, write_parquet
from iclnoise.core.runspec import RunKeys
from iclnoise.probes.llc import LLC_SCHEMA
from iclnoise.run.evaluate import METRICS_SCHEMA

pytestmark = pytest.mark.unit

STATS = json.dumps({"stats": {"alpha": 0.05, "equivalence_fraction": 0.5, "equivalence_margin": None,
                              "transient_tol": 0.05}})  # params.yaml

PARAMS = load_params("params.yaml")
SGD = {**PARAMS, "train": {**PARAMS["train"], "sgd_momentum": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}}}


def fake_run(root, M, B, seed, r_end, diverged=False, llc=None, ood_end=0.8, steps=1000, ridge=0.4, llc_flags=False,
             pull=0.0, optimizer="adamw"):
    """A finished run; `pull` = the slope of ln Δ_ood(f, ridge) − ln Δ_ood(f, dMMSE_M) against ln sequences."""
    rid = RunKeys(M, B, "none", seed, optimizer).run_id
    d = root / rid
    keys = {"run_id": rid, "M": M, "seed": seed, "batch": B, "noise": "none"}
    spec = {**run_spec(PARAMS if optimizer == "adamw" else SGD, rid), "keys": keys}
    spec["train"].update(steps=steps, budget={"mode": "steps", "steps": steps}, lr_schedule={"kind": "constant"})
    spec["train"]["optimizer"]["lr"] = 0.01
    write_json(spec, d / "run.json")
    rows = []
    ood = [1.0, 0.6, 0.7, 0.7 + 0.5 * (ood_end - 0.7), 0.7 + 0.75 * (ood_end - 0.7), ood_end]
    for i, s in enumerate([0, steps // 100, steps // 10, steps // 2, 3 * steps // 4, steps]):
        rows.append({**keys, "step": s, "sequences": s * B, "lr": 0.01, "train_loss": 1.0, "id_loss": 1 - 0.1 * i,
                     "ood_loss": ood[i], "id_loss_dmmse": 0.3, "id_loss_ridge": 0.4,
                     "ood_loss_dmmse": 0.9, "ood_loss_ridge": ridge, "delta_dmmse": r_end, "delta_ridge": 1 - r_end,
                     "ood_delta_dmmse": 0.2 * max(s * B, 1) ** (-pull / 2) if M != -1 else np.nan,
                     "ood_delta_ridge": 0.2 * max(s * B, 1) ** (pull / 2),
                     "r": r_end if M != -1 else np.nan, "icl_score": 0.1 * i, "diverged": diverged and s == steps})
    write_parquet(pd.DataFrame(rows), d / "metrics.parquet", METRICS_SCHEMA)
    if llc is not None:
        write_parquet(pd.DataFrame([{**keys, "step": st, "llc_mean": llc, "llc_std": 1.0, "llc_se": 0.5,
                                     "llc_per_chain": [llc], "init_loss": 0.1, "mean_sampling_loss": 0.2,
                                     "diverged": False, "negative": False, "not_levelled": llc_flags and st < steps,
                                     "epsilon": 1e-4, "gamma": 100.0, "nbeta": 100.0, "chains": 1, "burn_in": 1,
                                     "draws": 8, "batch_size": 8, "n": 64, "mala_accept": 0.9,
                                     "method": "sgld", "mean_sampling_loss_se": 0.01, "trivial_loss": 1.03,
                                     "lambda_max": 10.0, "stability_ratio": 0.1, "unstable": False, "escaped": False}
                                    for st in (steps // 10, steps)]), d / "llc.parquet", LLC_SCHEMA)
    return d


@pytest.fixture
def runs(tmp_path):
    """Two batch sizes at equal steps (so unequal data), M = ∞ runs at twice ridge's OOD loss (unconverged)."""
    rng = np.random.default_rng(0)
    dirs = []
    for B, x0 in ((16, 4.0), (64, 6.0)):           # planted: larger batch (less noise) → higher threshold
        for seed in range(3):
            xs = x0 + 0.3 * rng.standard_normal()           # this seed's crossover of the pull
            for M in (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, -1):
                r = (float(np.clip(logistic(np.log2(M), x0, 0.7) + 0.02 * rng.standard_normal(), 0, 1))
                     if M != -1 else 0.5)
                pull = np.tanh(xs - np.log2(abs(M))) + 0.1 * rng.standard_normal()
                dirs.append(fake_run(tmp_path / "runs", M, B, seed, r, llc=10 + 5 * r if B == 16 else None,
                                     diverged=(M == 2 and seed == 2 and B == 64), pull=pull))
    return tmp_path, dirs


def test_aggregate_outcomes_thresholds_tests_and_report(runs):
    """An unconverged grid (M = ∞ OOD loss 2× ridge's) whose batch sizes saw different data: thresholds are still
    fitted, but every threshold and every verdict that ran is gated and reads 'inconclusive'."""
    root, dirs = runs
    out = root / "aggregate"
    aggregate_cli([str(d) for d in dirs] + ["--out", str(out), "--cfg", STATS])
    aggregate_figures_cli(["--aggregate", str(out), "--out-dir", str(root / "figures")])
    o = read_parquet(out / "outcomes.parquet")
    assert list(o.columns) == OUTCOMES_SCHEMA.names                 # one schema whichever probes ran
    assert len(o) == len(dirs) and o.diverged.sum() == 1            # diverged run kept and flagged
    assert (o.t_crit == 10).all() and (o.transient_window == 90).all()
    assert o.llc_final.notna().sum() == 33 and o.llc_final.isna().sum() == 33   # llc only where it exists
    assert o.integrated_pne.isna().all() and o.hessian_trace.isna().all()       # absent probes: null columns
    assert set(o.sequences) == {16000, 64000} and (o.ood_loss_ridge == 0.4).all()
    th = read_parquet(out / "thresholds.parquet").set_index(["batch", "method"])
    assert len(th) == 6 and set(th.index.get_level_values("method")) == {"r50", "midpoint", "crossover"}
    for method in ("r50", "midpoint", "crossover"):   # floor 0, ceiling 1: the midpoint is the r = 0.5 crossing
        t16, t64 = th.loc[(16, method)], th.loc[(64, method)]
        assert t16.M_star == pytest.approx(16, rel=0.25) and t64.M_star == pytest.approx(64, rel=0.25), method
        assert t16.M_star_lo <= 16 <= t16.M_star_hi, method
    assert th.loc[(16, "crossover")].slope_first > 0 > th.loc[(16, "crossover")].slope_last
    assert not th.gates_passed.any() and th.gate_failures.str.contains("unconverged").all()
    tests = read_parquet(out / "tests.parquet")
    assert set(tests.hypothesis) == {"H1", "H2", "H3", "H4"}
    assert tests.loc[tests.hypothesis == "H2", "status"].str.startswith("not run").all()
    h1 = tests[(tests.hypothesis == "H1") & (tests.outcome == "r")].iloc[0]   # η/B is set by batch: no association
    assert h1.status.startswith("not run: integrated_lr_over_b is a function of batch size")   # at fixed batch
    h1 = tests.set_index("test").loc["paired t (batch 16 − batch 64), plain runs by (M, seed)"]
    assert h1.status == "run" and h1.estimate > 0 and h1.ci_lo > 0   # smaller batch → more η/B → higher r
    ran = tests[tests.status == "run"]
    assert len(ran) and (~ran.gates_passed).all() and ran.verdict.str.startswith("inconclusive: unconverged").all()
    assert ran.gate_failures.str.contains("unequal data").all() and not ran.verdict.str.contains("significant").any()
    assert (root / "figures" / "fig06_threshold_vs_noise.png").exists()
    m = json.loads((out / "metrics.json").read_text())
    assert m["convergence"]["none/B16"] == {"ood_loss_over_ridge": pytest.approx(2.0), "converged": False}
    assert m["thresholds"]["none/B64"]["M_star"] == pytest.approx(64, rel=0.25)
    assert m["thresholds_crossover"]["none/B64"]["M_star"] == pytest.approx(64, rel=0.25)
    assert not any(t["gates_passed"] for t in m["tests"].values())
    report_cli(["--results", str(root), "--cfg", '{"grid": {"M": [1]}}', "--out", str(root / "report.md")])
    text = (root / "report.md").read_text()
    assert "Hypothesis verdicts" in text and "not run" in text and "grid:" in text
    shows = text.split("## What this run shows")[1].split("\n## ")[0]
    assert "not converged" in shows and "different amounts of data" in shows and "inconclusive" in shows
    assert "none/B16 2.00×, none/B64 2.00×; not every condition converged" in shows


def two_optimizers(root, optimizers=("adamw", "sgd_momentum")):
    """Condition none/B16 under each of `optimizers`, 3 seeds: r crosses 0.5 at M* = 16 under AdamW and at 64 under
    SGD with momentum (logistic in log2 M, slope 0.7, run noise sd 0.02); M = ∞ at 2× ridge's OOD loss."""
    rng = np.random.default_rng(1)   # AdamW's runs draw first: the same runs whether SGD's follow or not

    def r(M, x0):
        return float(np.clip(logistic(np.log2(M), x0, 0.7) + 0.02 * rng.standard_normal(), 0, 1)) if M != -1 else 0.5

    return [fake_run(root, M, 16, seed, r(M, x0), pull=np.tanh(x0 - np.log2(abs(M))), optimizer=o)
            for o, x0 in (("adamw", 4.0), ("sgd_momentum", 6.0)) if o in optimizers
            for seed in range(3) for M in (1, 4, 8, 16, 32, 64, 256, 1024, -1)]


def test_two_optimizers_of_one_condition_are_kept_apart(tmp_path):
    """Issue 45: runs of one noise condition under AdamW and SGD with momentum are two arms. Each gets its own
    thresholds (M* 16 and 64, not one pooled M* near 32), convergence row, metrics.json entry and tests."""
    out = tmp_path / "aggregate"
    aggregate_cli([str(d) for d in two_optimizers(tmp_path / "runs")] + ["--out", str(out), "--cfg", STATS])
    th = read_parquet(out / "thresholds.parquet")
    r50 = sorted(th[th.method == "r50"].M_star)   # pooled, the old aggregate found one M* near 32
    assert len(r50) == 2 and r50 == [pytest.approx(16, rel=0.25), pytest.approx(64, rel=0.25)], r50
    o = read_parquet(out / "outcomes.parquet")
    assert (o.optimizer == np.where(o.run_id.str.contains("-sgd_momentum-"), "sgd_momentum", "adamw")).all()
    assert sorted(zip(th.optimizer, th.method)) == sorted((opt, m) for opt in ("adamw", "sgd_momentum")
                                                          for m in ("r50", "midpoint", "crossover"))
    th = th.set_index(["optimizer", "method"])
    for method in ("r50", "midpoint", "crossover"):
        assert th.loc[("adamw", method)].M_star == pytest.approx(16, rel=0.25), method
        assert th.loc[("sgd_momentum", method)].M_star == pytest.approx(64, rel=0.25), method
        assert th.loc[("adamw", method)].n_seeds == th.loc[("sgd_momentum", method)].n_seeds == 3
    tests = read_parquet(out / "tests.parquet")
    assert set(tests.optimizer) == {"adamw", "sgd_momentum"}
    assert len(tests[tests.optimizer == "adamw"]) == len(tests[tests.optimizer == "sgd_momentum"])
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["convergence"]) == set(m["thresholds"]) == {"none/B16", "none/B16/sgd_momentum"}
    assert m["thresholds"]["none/B16/sgd_momentum"]["M_star"] == pytest.approx(64, rel=0.25)
    assert len(m["tests"]) == len(tests)   # no two rows share a key
    aggregate_figures_cli(["--aggregate", str(out), "--out-dir", str(tmp_path / "figures")])
    report_cli(["--results", str(tmp_path), "--cfg", '{"grid": {"M": [1]}}', "--out", str(tmp_path / "report.md")])
    text = (tmp_path / "report.md").read_text()
    assert "r50, noise none, batch 16 (sgd_momentum): M* = " in text and "r50, noise none, batch 16: M* = " in text


def test_an_optimizers_tables_are_those_of_its_runs_alone(tmp_path):
    """A one-optimizer grid's tables are the per-condition tables of before plus the `optimizer` column, and adding
    another optimizer's runs of the same condition changes none of its rows (outcomes, thresholds, tests; the tests
    here are all gated, so outside the Holm family, whose size the other optimizer's rows would change)."""
    alone, both = tmp_path / "alone", tmp_path / "both"
    aggregate_cli([str(d) for d in two_optimizers(tmp_path / "runs", ("adamw",))] + ["--out", str(alone),
                                                                                     "--cfg", STATS])
    aggregate_cli([str(d) for d in two_optimizers(tmp_path / "runs")] + ["--out", str(both), "--cfg", STATS])
    for name in ("outcomes", "thresholds", "tests"):
        a, b = read_parquet(alone / f"{name}.parquet"), read_parquet(both / f"{name}.parquet")
        assert (a.optimizer == "adamw").all(), name
        pd.testing.assert_frame_equal(a, b[b.optimizer == "adamw"].reset_index(drop=True), obj=name)
    assert not read_parquet(alone / "tests.parquet").in_family.any()
    m = json.loads((alone / "metrics.json").read_text())
    assert set(m["thresholds"]) == {"none/B16"} and not any(k.endswith(")") for k in m["tests"])


def test_planted_clean_transition_passes_every_gate_and_recovers_m_star(tmp_path):
    """Converged (M = ∞ OOD loss 5 % above ridge), equal data, 3 seeds, r from 0.02 to 0.98 around a planted
    M* = 2^5 = 32 with seed-to-seed sd 0.3 octave: every gate passes and the interval covers 32."""
    rng = np.random.default_rng(1)
    dirs = []
    for seed in range(3):
        xk = 5.0 + 0.3 * rng.standard_normal()
        for M in [2 ** k for k in range(11)] + [-1]:
            r = float(np.clip(0.02 + 0.96 * logistic(np.log2(M), xk, 0.7) + 0.02 * rng.standard_normal(), 0, 1))
            pull = np.tanh(xk - np.log2(abs(M))) + 0.1 * rng.standard_normal()   # crossover at xk too
            # every run's first LLC estimate is flagged (as at initialisation), its final one is not
            dirs.append(fake_run(tmp_path / "runs", M, 16, seed, r, ood_end=0.42, llc=5.0, llc_flags=True, pull=pull))
    out = tmp_path / "aggregate"
    aggregate_cli([str(d) for d in dirs] + ["--out", str(out), "--cfg", STATS])
    aggregate_figures_cli(["--aggregate", str(out), "--out-dir", str(tmp_path / "figures")])
    for th in read_parquet(out / "thresholds.parquet").itertuples():   # r50, then crossover
        assert th.gates_passed and th.gate_failures == "" and th.reason == "", th
        assert th.M_star_lo <= 32 <= th.M_star_hi and th.M_star == pytest.approx(32, rel=0.3)
        assert th.n_seeds == 3 and th.interval.startswith("t-interval")
    tests = read_parquet(out / "tests.parquet")
    assert (tests.gate_failures == "").all()
    m = json.loads((out / "metrics.json").read_text())
    assert m["convergence"]["none/B16"]["converged"] and m["thresholds"]["none/B16"]["gates_passed"]
    assert m["thresholds_crossover"]["none/B16"]["gates_passed"]
    assert m["llc_flagged_share"] == 0.5 and m["llc_final_flagged_share"] == 0.0   # the LLC gate reads the latter
    out_t = read_parquet(out / "outcomes.parquet").query("M != -1")
    assert (out_t.llc_final_sampler == False).all() and (out_t.llc_n_sampler == 0).all()   # noqa: E712


def test_figure_1_has_one_panel_per_trained_condition(tmp_path, monkeypatch):
    """Batch noise at batches 8 and 16, injection only at 16, and batch 16's batch noise under SGD with momentum too:
    four panels in one row (the optimizers apart: each panel's mean is one optimizer's runs), no empty slot."""
    from iclnoise.output.figures import style, training
    assert training.panel_grid(3) == (1, 3) and training.panel_grid(6) == (2, 3) and training.panel_grid(7) == (3, 3)
    rows = []
    for noise, B, opt in (("none", 8, "adamw"), ("none", 16, "adamw"), ("inj", 16, "adamw"),
                          ("none", 16, "sgd_momentum")):
        for M in (1, 4, -1):
            for step in (0, 10, 100):
                rows.append({"run_id": RunKeys(M, B, noise, 0, opt).run_id, "M": M, "seed": 0, "batch": B,
                             "noise": noise, "step": step, "ood_loss": 1.0 / (1 + step),
                             "ood_loss_dmmse": 0.5 if M != -1 else np.nan, "ood_loss_ridge": 0.4})
    shown = {}
    real_save = style.save_figure
    monkeypatch.setattr(style, "save_figure", lambda fig, path, data=None: (
        shown.update(titles=[ax.get_title() for ax in fig.axes]), real_save(fig, path, data)))
    training.fig_ood_loss(pd.DataFrame(rows), tmp_path / "fig01")
    assert shown["titles"] == ["noise: none, batch 8", "noise: none, batch 16", "noise: none, batch 16 (sgd_momentum)",
                               "noise: inj, batch 16"]
    assert (tmp_path / "fig01.png").stat().st_size > 5_000


def _rows_for(schema, keys, n):
    """n rows filling every field of `schema` (keys from `keys`, numbers from the row index + 1)."""
    import pyarrow as pa
    fill = {pa.int64(): lambda i: i + 1, pa.float64(): lambda i: float(i + 1), pa.bool_(): lambda i: False,
            pa.string(): lambda i: "x"}
    return pd.DataFrame([{f.name: keys[f.name] if f.name in keys else fill.get(f.type, lambda i: [1.0])(i)
                          for f in schema} for i in range(n)])


def test_exposure_and_geometry_tables_reach_the_outcomes(tmp_path):
    """The outcome columns come from the probes' own tables and summaries (plumbing, not the formulas)."""
    from iclnoise.noise.exposure import EXPOSURE_SCHEMA, summarize
    from iclnoise.probes.geometry import GEOMETRY_SCHEMA
    d = fake_run(tmp_path / "runs", 4, 16, 0, 0.3)
    keys = {"run_id": d.name, "M": 4, "seed": 0, "batch": 16, "noise": "none"}
    exp = _rows_for(EXPOSURE_SCHEMA, keys, 3)
    write_parquet(exp, d / "exposure.parquet", EXPOSURE_SCHEMA)
    write_parquet(_rows_for(GEOMETRY_SCHEMA, keys, 2), d / "geometry.parquet", GEOMETRY_SCHEMA)
    from iclnoise.analysis.aggregate import outcomes
    o, _ = outcomes([d], transient_tol=0.05)
    s = summarize(read_parquet(d / "exposure.parquet"))
    assert o.integrated_pne.iloc[0] == pytest.approx(s["integrated_pne"]) and np.isfinite(o.integrated_pne.iloc[0])
    assert o.integrated_pne_injected.iloc[0] == pytest.approx(s.get("integrated_pne_injected", np.nan), nan_ok=True)
    assert o.hessian_trace.iloc[0] == 2.0 and o.llc_final.isna().all() and o.sequences.iloc[0] == 16_000


@pytest.mark.numerics
def test_runs_that_diverged_at_their_first_update_are_reported_not_crashed_on(tiny, tmp_path):
    """Real runs whose first loss is above train.diverge_loss stop at step 0 with one metrics row. Aggregate, its
    figures, figure 1 and the report go through: no t_crit (−1), the condition's thresholds say 'every run
    diverged'."""
    import copy

    from iclnoise.commands.results import figures as figures_cli
    from iclnoise.config.grid import run_spec
    from iclnoise.run.train import train_ensemble

    p = copy.deepcopy(tiny)
    p["train"]["diverge_loss"] = 0.01
    ids = ["M1-B8-none-s0", "M4-B8-none-s0", "Minf-B8-none-s0"]
    dirs = [tmp_path / "runs" / r for r in ids]
    train_ensemble([run_spec(p, r) for r in ids], dirs, progress=False)
    assert all(len(read_parquet(d / "metrics.parquet")) == 1 for d in dirs)
    out = tmp_path / "aggregate"
    aggregate_cli([str(d) for d in dirs] + ["--out", str(out), "--cfg", STATS])
    aggregate_figures_cli(["--aggregate", str(out), "--out-dir", str(tmp_path / "figures")])
    o = read_parquet(out / "outcomes.parquet")
    assert o.diverged.all() and (o.t_crit == -1).all() and (o.steps == 0).all()
    th = read_parquet(out / "thresholds.parquet")
    assert sorted(th.method) == ["crossover", "midpoint", "r50"]
    assert (th.reason == "no threshold: every run diverged").all()
    assert not th.gates_passed.any() and th.gate_failures.str.contains("every run with finite M diverged").all()
    figures_cli(["--out-dir", str(tmp_path), *[str(d / "metrics.parquet") for d in dirs]])
    assert (tmp_path / "figures" / "fig01_ood_loss.png").exists()
    report_cli(["--results", str(tmp_path), "--cfg", '{"grid": {"M": [1]}}', "--out", str(tmp_path / "report.md")])
    assert "every run diverged" in (tmp_path / "report.md").read_text()


def opening(tmp_path, dirs) -> str:
    """The report's "What this run shows" section for the runs `dirs`, through aggregate and report."""
    aggregate_cli([str(d) for d in dirs] + ["--out", str(tmp_path / "aggregate"), "--cfg", STATS])
    report_cli(["--results", str(tmp_path), "--cfg", '{"grid": {"M": [1]}}', "--out", str(tmp_path / "report.md")])
    text = (tmp_path / "report.md").read_text()
    start = text.index("## What this run shows")
    return text[start:text.index("\n## ", start)]


def test_the_opening_says_m_inf_runs_diverged_not_that_every_condition_converged(tmp_path):
    """Issue 48, case 5 (lr 50): every run diverged, M = ∞ included. The opening said "no M = ∞ run ... every
    condition converged"; it says the M = ∞ runs diverged, not every condition converged, and names it below."""
    dirs = [fake_run(tmp_path / "runs", M, 16, 0, 0.5, diverged=True) for M in (1, 4, -1)]
    text = opening(tmp_path, dirs)
    assert "none/B16 M = ∞ runs diverged; not every condition converged" in text, text
    assert "no M = ∞ run" not in text and "; every condition converged" not in text, text
    assert "The models are not converged (none/B16: M = ∞ runs diverged)" in text, text
    assert "no M* (every run diverged)" in text and "passed its validity gates" not in text, text



def test_a_nan_ridge_loss_fails_the_convergence_gate_by_name(tmp_path):
    """Issue 68 (7): a NaN ood_loss_ridge in an M = ∞ run's last row dropped that run from the convergence gate (a
    NaN-skipping max) and the report said every condition converged. Now the condition is not converged, and the
    gate, the convergence table and the opening say why."""
    from iclnoise.analysis.verdicts import convergence, gate_convergence

    dirs = [fake_run(tmp_path / "runs", M, 16, s, 0.5, ood_end=0.41, ridge=np.nan if (M, s) == (-1, 1) else 0.4)
            for M in (1, 4, -1) for s in range(3)]
    text = opening(tmp_path, dirs)
    assert "every condition converged" not in text.replace("not every condition converged", ""), text
    assert "none/B16 M = ∞ OOD loss over ridge's not finite" in text, text
    out = read_parquet(tmp_path / "aggregate" / "outcomes.parquet")
    conv = convergence(out)
    assert not conv.converged.any() and conv.ood_loss_over_ridge.isna().all()
    (code, detail), = gate_convergence(out, conv)
    assert code == "unconverged" and "not finite (a NaN ood_loss_ridge" in detail

def test_the_opening_claims_no_passed_gate_where_no_threshold_or_test_ran(tmp_path):
    """Issue 48, case 6: a grid of M = ∞ only (2 seeds, 2× ridge's loss) has no threshold and runs no test. The
    opening ended "Every threshold and verdict above passed its validity gates"; it says that no threshold was
    estimated and no test ran, and that the models are not converged."""
    dirs = [fake_run(tmp_path / "runs", -1, 16, seed, 0.5) for seed in (0, 1)]
    text = opening(tmp_path, dirs)
    assert "passed its validity gates" not in text, text
    assert "none/B16 2.00×; not every condition converged" in text, text
    assert "No task-diversity threshold M*: the grid has no run at a finite M." in text, text
    assert "No threshold was estimated and no hypothesis test ran" in text, text
    assert "The models are not converged (none/B16: M = ∞ OOD loss 2.00× ridge's)" in text, text


def test_an_arm_run_at_one_m_is_judged_converged_by_the_batch_noise_runs_at_its_batch():
    """configs/science.yaml's early/late pair runs at M = 16 only: no M = ∞ run of its own. The batch-noise
    M = ∞ runs at the same batch size (same model, data and budget) stand for it, and their failure is named."""
    from iclnoise.analysis.verdicts import convergence, gate_convergence

    def out(ratio_inf):
        rows = [{"batch": 64, "noise": "none", "M": M, "ood_loss": ratio_inf * 0.4 if M == -1 else 0.6,
                 "ood_loss_ridge": 0.4, "diverged": False} for M in (1, 16, -1)]
        rows += [{"batch": 64, "noise": arm, "M": 16, "ood_loss": 0.6, "ood_loss_ridge": 0.4, "diverged": False}
                 for arm in ("early", "late")]
        return pd.DataFrame(rows).assign(optimizer="adamw", noise_source="batch", noise_schedule="none")

    arms = out(1.05)[lambda d: d.noise != "none"]
    assert gate_convergence(arms, convergence(out(1.05))) == []
    assert gate_convergence(arms, convergence(out(1.3))) == [   # a record: (code, detail)
        ("unconverged", "early/B64: no M = ∞ run; batch noise's at batch 64 1.30× ridge's, "
                        "late/B64: no M = ∞ run; batch noise's at batch 64 1.30× ridge's")]
    alone = out(1.05)[lambda d: d.noise != "none"]
    assert "nor batch-noise M = ∞ runs at batch 64" in gate_convergence(alone, convergence(alone))[0][1]


def test_the_opening_states_the_convergence_gate_it_applied():
    """'every condition converged' names its gate (1 + GATES['convergence_tol'], or a levelled excess the injected
    noise explains), the one gate the verdicts and a dose set's operating regime read (method §11), and says how it
    read each excess: a noise floor with the noise on, what the noise left after it was switched off."""
    from iclnoise.analysis.verdicts import GATES, convergence
    from iclnoise.output.report import what_this_run_shows

    ratio = 1 + GATES["convergence_tol"] - 0.01
    run = lambda noise, src, sched, r: [{   # noqa: E731
        "batch": 64, "noise": noise, "M": M, "ood_loss": r * 0.4 if M == -1 else 0.6, "ood_loss_ridge": 0.4,
        "diverged": False, "optimizer": "adamw", "noise_source": src, "noise_schedule": sched,
        "ood_loss_fall": 0.0, "ood_loss_fall_se": 0.01, "ood_loss_fall_n": 10} for M in (1, 16, -1)]
    out = pd.DataFrame(run("none", "batch", "none", ratio) + run("floor", "param", "constant", 1.3)
                       + run("off", "param", "early", 1.25))
    text = "\n".join(what_this_run_shows(None, None, convergence(out)))
    assert ("floor/B64 1.30× (a levelled noise floor, the noise still on), none/B64 "
            f"{ratio:.2f}×, off/B64 1.25× (levelled: what the noise left after it was switched off); every condition "
            f"converged (worst seed ≤ {1 + GATES['convergence_tol']:.2f}× ridge's, or a levelled excess the injected "
            "noise explains: the verdicts' gate).") in text, text
