"""Issue 70's analysis on planted outcome tables: the arm with the noise off before the end (schedule early) is a dose
series of its own beside the persistent arm, each read against total exposure, and r's decomposition (in-distribution
loss, Δ(f, ridge) and Δ(f, dMMSE_M) on the q_M set and on new tasks) has its rows, with "more ridge-like" said only
where Δ(f, ridge) on new tasks falls."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from test_dose import CFG, DOSES, FULL, h1, planted

from iclnoise.analysis import dose
from iclnoise.analysis.verdicts import GATES, hypothesis_tests
from iclnoise.output.figures.stats import fig_dose
from iclnoise.output.report import by_m_lines, dose_answer, ridge_reading

ROOT = Path(__file__).resolve().parents[1]


def two_arms(rng, **kw) -> pd.DataFrame:
    """planted()'s series twice: the persistent arm (constant) and the noise-off arm (early), one dose 0 between
    them, the full M grid at every dose."""
    on = planted(rng, full_at=(0.0, *DOSES), **kw)
    off = planted(rng, full_at=(0.0, *DOSES), **kw)
    off = off[off.noise_schedule != "none"]
    off = off.assign(noise_schedule="early", noise=off.noise.str.replace("param_", "off_"),
                     run_id=off.run_id.str.replace("param_", "off_"))
    return pd.concat([on, off], ignore_index=True)


def with_outcomes(out: pd.DataFrame, rng, id_slope: float, ridge_slope: float) -> pd.DataFrame:
    """Planted decomposition: per (M, seed) cell a level shared by its doses, then id_loss = 0.3 + id_slope·log10
    total exposure, ood_delta_ridge = 0.2 + ridge_slope·log10 total exposure, each + run noise sd 0.003."""
    x = np.log10(out.integrated_pne.astype(float))
    cell = out.groupby(["M", "seed"]).ngroup()
    level = rng.normal(0, 0.01, cell.max() + 1)[cell]
    return out.assign(id_loss=0.3 + id_slope * x + level + rng.normal(0, 0.003, len(out)),
                      ood_delta_ridge=0.2 + ridge_slope * x + level + rng.normal(0, 0.003, len(out)),
                      delta_ridge=0.1 + level, delta_dmmse=0.05 + level, ood_delta_dmmse=0.4 + level)


@pytest.mark.unit
def test_the_noise_off_arm_is_its_own_series_with_the_shared_dose_zero():
    out = two_arms(np.random.default_rng(0))
    series = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    assert [k for k, _ in series] == [("param", "diagonal", "constant", 64, "adamw"),
                                      ("param", "diagonal", "early", 64, "adamw")]
    zero = {frozenset(g[g.target_dose == 0].run_id) for _, g in series}
    assert len(zero) == 1 and len(next(iter(zero))) == 3 * (len(FULL) + 1)   # one dose 0, both series
    assert [dose.series_name(k) for k, _ in series] == ["param (diagonal), batch 64",
                                                        "param (diagonal, early), batch 64"]
    t = h1(out)
    early = t[t.test.str.startswith("dose-response param (diagonal, early), batch 64:")]
    total = early[early.test.str.contains("per decade of total exposure") & early.in_family]
    assert len(total) == 1 and total.status.iloc[0] == "run"


@pytest.mark.unit
def test_a_levels_table_from_before_schedules_reads_as_constant():
    lv = dose.levels_table(dose.dose_runs(planted(np.random.default_rng(1)), GATES["convergence_tol"]), 0.05,
                           GATES["dose_tol"], 3)
    old = lv.drop(columns=["schedule"])
    assert dose.with_schedule(old).schedule.tolist() == lv.schedule.tolist()
    assert (lv.total_exposure == 0.05 + lv.target_dose).all()   # planted: batch 0.05 + the dose, at every M


@pytest.mark.unit
def test_the_decomposition_recovers_planted_slopes_and_reads_misfit_not_ridge_likeness(tmp_path):
    """id_loss planted at +0.02 per decade of total exposure and Δ(f, ridge) on new tasks flat, r rising: the
    decomposition rows hold the planted slopes in their intervals, and the report's reading says the rise of r is
    not ridge-likeness but comes with misfit. With Δ(f, ridge) falling instead, it reads "more ridge-like"."""
    rng = np.random.default_rng(2)
    out = with_outcomes(planted(rng, slope=0.05, full_at=(0.0, *DOSES)), rng, id_slope=0.02, ridge_slope=0.0)
    t = h1(out)
    dec = t[t.test.str.contains(": decomposition")].set_index("outcome")
    assert set(dec.index) == {"r", *dose.OUTCOMES} and (dec.status == "run").all() and not dec.in_family.any()
    assert dec.loc["id_loss"].ci_lo <= 0.02 <= dec.loc["id_loss"].ci_hi and dec.loc["id_loss"].ci_lo > 0
    assert dec.loc["ood_delta_ridge"].ci_lo <= 0 <= dec.loc["ood_delta_ridge"].ci_hi
    assert dec.loc["r"].ci_lo > 0
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))   # the rows the validation test below fits
    pd.testing.assert_frame_equal(dose.total_fit(g, GATES["dose_tol"], GATES["min_seeds"]),
                                  dose.analyse(g, CFG.alpha, GATES["dose_tol"], GATES["min_seeds"])["total_fit"])
    reading = ridge_reading(t, "param (diagonal), batch 64")
    assert len(reading) == 1 and "not more ridge-like" in reading[0] and "misfit" in reading[0]
    ridge = with_outcomes(planted(rng, slope=0.05, full_at=(0.0, *DOSES)), rng, id_slope=0.0, ridge_slope=-0.02)
    assert ridge_reading(h1(ridge), "param (diagonal), batch 64") == [
        "Reading: r rises with total exposure and Δ(f, ridge) on new tasks falls: more ridge-like."]
    lv = dose.levels_table(dose.dose_runs(out, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], 3)
    assert any("more ridge-like" in line or "not more ridge-like" in line for line in dose_answer(t, lv))
    fig_dose(lv, tmp_path / "fig6")
    drawn = pd.read_parquet(tmp_path / "fig6.parquet")
    assert np.allclose(np.sort(drawn.total_exposure), np.sort(0.05 + lv.target_dose))


def planted_slope(doses, shift=0.5):
    """The least-squares slope of planted()'s noise-free log2 M* shift (`shift` octaves per decade of dose above the
    lowest positive dose; dose 0 at its M*) on log10 total exposure (0.05 + dose), worked from the formula."""
    x = np.log10([0.05 + d for d in doses])
    y = [shift * math.log10(max(d, DOSES[0]) / DOSES[0]) for d in doses]
    return np.polyfit(x, y, 1)[0]


@pytest.mark.unit
def test_a_dose_the_convergence_gate_alone_keeps_out_gets_sensitivity_rows_with_the_planted_slope():
    """M* planted to move 0.5 octave per decade of dose at doses 0.01-1 (dose 0 at 0.01's), M = ∞ at dose 1 ending
    1.2× ridge and still falling: the gated rows leave dose 1 out; the sensitivity rows (outside the family) admit it,
    say why it was out, and their M* slope on total exposure (0.05 + dose) covers the least-squares slope of the
    planted log2 M* on it, worked here from the formula. Without a gated dose there are no such rows."""
    rng = np.random.default_rng(5)
    out = planted(rng, shift=0.5, full_at=(0.0, *DOSES), ratio={1.0: 1.2}, fall={1.0: 0.1}, seeds=5, noise=0.01)
    t = hypothesis_tests(out, CFG)
    t = t[t.test.str.contains("dose-response")]
    sens = t[t.test.str.startswith("sensitivity, the convergence gate not applied (admits dose 1: M = ∞ fails")]
    assert len(sens) == 2 + 1 + len(dose.OUTCOMES) and not sens.in_family.any()
    gated = t[t.test.str.contains(r"^dose-response .*\(r50\) per decade of total exposure", regex=True)]
    assert len(gated) == 1 and gated.in_family.all() and "left out: 1: M = ∞ fails" in gated.test.iloc[0]

    free = sens[sens.test.str.contains(r"\(r50\) per decade of total exposure", regex=True)].iloc[0]
    assert free.status == "run" and free.ci_lo <= planted_slope((0.0, *DOSES)) <= free.ci_hi
    assert gated.ci_lo.iloc[0] <= planted_slope((0.0, *DOSES[:-1])) <= gated.ci_hi.iloc[0]
    lv = dose.levels_table(dose.dose_runs(out, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], 3)
    assert sum(line.startswith("- sensitivity, the convergence gate not applied (admits dose 1") and "M* rises" in line
               for line in dose_answer(t, lv)) == 2   # the report's answer shows them (r50 and midpoint)
    plain = hypothesis_tests(planted(rng, shift=0.5, full_at=(0.0, *DOSES)), CFG)
    assert not plain.test.str.startswith("sensitivity, the convergence gate").any()


@pytest.mark.unit
def test_what_the_noise_left_after_it_was_off_is_an_outcome_and_the_stricter_reading_a_sensitivity_row():
    """Method §11, One convergence gate: M = ∞ at dose 1 levelled at 1.2× ridge after the noise was switched off
    (schedule early) passes as what the noise left, so the gated M* slope on total exposure spans every dose and
    covers the planted slope; the stricter reading (that excess as failed training) is a sensitivity row outside the
    family that leaves dose 1 out and covers the planted slope without it. The same excess with the noise still
    falling fails the gate; with the noise on to the end (a noise floor) it gets no stricter rows."""
    rng = np.random.default_rng(7)
    out = planted(rng, shift=0.5, full_at=(0.0, *DOSES), ratio={1.0: 1.2}, fall={1.0: 0.0}, seeds=5, noise=0.01)
    off = out.assign(noise_schedule=out.noise_schedule.where(out.noise_schedule == "none", "early"))
    t = hypothesis_tests(off, CFG)
    t = t[t.test.str.contains("dose-response")]
    gated = t[t.test.str.contains(r"^dose-response .*\(r50\) per decade of total exposure", regex=True)]
    assert len(gated) == 1 and gated.in_family.all() and "left out" not in gated.test.iloc[0]
    assert gated.ci_lo.iloc[0] <= planted_slope((0.0, *DOSES)) <= gated.ci_hi.iloc[0]
    strict = t[t.test.str.startswith("sensitivity, a levelled excess after the noise was switched off read as "
                                     "failed training (leaves out dose 1): ")]
    assert len(strict) == 2 + 1 + len(dose.OUTCOMES) and not strict.in_family.any()
    row = strict[strict.test.str.contains(r"\(r50\) per decade of total exposure", regex=True)].iloc[0]
    assert row.status == "run" and row.ci_lo <= planted_slope((0.0, *DOSES[:-1])) <= row.ci_hi
    assert not t.test.str.startswith("sensitivity, the convergence gate not applied").any()
    lv = dose.levels_table(dose.dose_runs(off, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], 3)
    answer = dose_answer(t, lv)
    assert any("M = ∞ inside with its excess read as the noise's outcome (levelled after the noise was switched "
               "off): dose 1 at 1.200×" in line for line in answer), answer
    shown = [line for line in answer if line.startswith("- sensitivity, a levelled excess after the noise was")]
    assert len(shown) == 2 + 1 + len(dose.OUTCOMES)
    falling = off.assign(ood_loss_fall=np.where(off.noise == "param_1", 0.15, off.ood_loss_fall))
    ft = hypothesis_tests(falling, CFG)
    assert ft.test.str.contains(r"^dose-response .*\(r50\) per decade of total exposure.*left out: 1: M = ∞ fails",
                                regex=True).sum() == 1
    floor = hypothesis_tests(out, CFG)   # constant: the same excess is a noise floor
    assert not floor.test.str.startswith("sensitivity, a levelled excess").any()
    assert floor[floor.test.str.contains(r"^dose-response .*\(r50\) per decade of total exposure", regex=True)
                 ].test.str.contains("left out").sum() == 0


@pytest.mark.unit
def test_the_decomposition_per_m_recovers_slopes_of_opposite_sign_and_the_report_tables_them():
    """Method §11 asks for r's decomposition per M. Planted: Δ(f, ridge) on new tasks falls 0.02 per decade of total
    exposure below M = 16 and rises 0.02 above it (flat at 16), the in-distribution loss rises 0.01·log2 M per
    decade, at doses with the full grid (M = 4, 64, 256) and the ladder's (8, 16, 32). Each M's interval covers its
    own planted slope (14 intervals at 99.8 %, so all cover with probability ≥ 0.97); the report's table has one
    line per M with the doses it rests on."""
    rng = np.random.default_rng(11)
    out = planted(rng, slope=0.03, full_at=(0.0, 0.1, 1.0), seeds=5)
    x = np.log10(out.integrated_pne.astype(float))
    m = out.M.astype(float)
    ridge = np.where(m < 16, -0.02, np.where(m > 16, 0.02, 0.0))
    cell = out.groupby(["M", "seed"]).ngroup()
    level = rng.normal(0, 0.01, cell.max() + 1)[cell]
    out = out.assign(id_loss=0.3 + 0.01 * np.log2(m.where(m > 0, 1)) * x + level + rng.normal(0, 0.003, len(out)),
                     ood_delta_ridge=0.2 + ridge * x + level + rng.normal(0, 0.003, len(out)),
                     delta_ridge=0.1 + level, delta_dmmse=0.05 + level, ood_delta_dmmse=0.4 + level)
    runs = dose.dose_runs(out, GATES["convergence_tol"])
    per_m = dose.by_m_table(runs, 0.002, GATES["dose_tol"], GATES["min_seeds"])
    assert set(per_m.M) == set(FULL) and (per_m.status == "run").all()
    got = per_m.set_index(["M", "outcome"])
    for M in FULL:
        want = {"ood_delta_ridge": -0.02 if M < 16 else 0.02 if M > 16 else 0.0, "id_loss": 0.01 * math.log2(M)}
        for y, b in want.items():
            row = got.loc[(M, y)]
            assert row.ci_lo <= b <= row.ci_hi, (M, y, row.estimate)
        assert got.loc[(M, "ood_delta_ridge")].n_doses == (3 if M in (1, 4, 64, 256) else len(DOSES) + 1)
    assert got.loc[(8, "ood_delta_ridge")].ci_hi < 0 < got.loc[(32, "ood_delta_ridge")].ci_lo
    h = runs[(runs.M == 8)]   # by hand: each seed's least-squares slope on log10(0.05 + dose), t over seeds
    b = [np.polyfit(np.log10(0.05 + k.target_dose), k.ood_delta_ridge, 1)[0] for _, k in h.groupby("seed")]
    half = stats.t.ppf(1 - 0.002 / 2, len(b) - 1) * np.std(b, ddof=1) / math.sqrt(len(b))
    assert got.loc[(8, "ood_delta_ridge")][["estimate", "ci_lo", "ci_hi"]].astype(float).to_numpy() == \
        pytest.approx([np.mean(b), np.mean(b) - half, np.mean(b) + half], rel=1e-9)
    t = hypothesis_tests(out, CFG)
    lv = dose.levels_table(runs, CFG.alpha, GATES["dose_tol"], 3)
    answer = dose_answer(t, lv, per_m)
    head = answer.index("| M | doses | r | in-distribution loss | Δ(f, ridge), new tasks | Δ(f, dMMSE_M) |")
    table = answer[head + 2:head + 2 + len(FULL)]
    assert [int(line.split("|")[1]) for line in table] == sorted(FULL)
    row8 = got.loc[(8, "ood_delta_ridge")]
    assert f"{row8.estimate:+.3f} [{row8.ci_lo:+.3f}, {row8.ci_hi:+.3f}]" in table[2]
    assert dose_answer(t, lv) == answer[:head - 2] + answer[head + 3 + len(FULL):]   # a set from before the table


@pytest.mark.unit
def test_the_per_m_table_names_the_m_run_at_dose_0_alone_instead_of_tabling_dashes():
    """The persistent arm runs its positive doses on the ladder (M 8-32) alone, so M 1, 4, 64, 256 have dose 0 and
    nothing to slope: the report's table has the ladder's three rows, each with numbers, and names the others under
    it."""
    rng = np.random.default_rng(3)
    out = with_outcomes(planted(rng, full_at=(0.0,), seeds=5), rng, id_slope=0.01, ridge_slope=0.0)
    per_m = dose.by_m_table(dose.dose_runs(out, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], GATES["min_seeds"])
    assert set(per_m[per_m.status == "run"].M) == {8, 16, 32} and set(per_m.M) == set(FULL)
    lines = by_m_lines(per_m)
    head = lines.index("| M | doses | r | in-distribution loss | Δ(f, ridge), new tasks | Δ(f, dMMSE_M) |")
    table = lines[head + 2:lines.index("", head)]
    assert [int(line.split("|")[1]) for line in table] == [8, 16, 32] and not any("–" in line for line in table)
    assert "Not tabled: M 1, 4, 64, 256, with no in-regime positive dose and dose 0 both run there." in lines
    assert by_m_lines(per_m[per_m.M.isin([1, 4])]) == []


@pytest.mark.validation
def test_the_decomposition_slopes_interval_covers_a_planted_slope_and_holds_its_size():
    """dose.total_slope's 95 % interval on planted series (3 seeds, the ladder at 5 doses and dose 0, (M, seed) cell
    levels sd 0.01 shared by the outcomes, run noise 0.003): over 200 generator seeds it covered the planted id_loss
    slope 0.02 in 0.94 and excluded the flat Δ(f, ridge) slope 0 in 0.05; run here on 100 (bands ±2 binomial SE)."""
    hits = false = 0
    for s in range(100):
        rng = np.random.default_rng(s)
        out = with_outcomes(planted(rng, slope=0.05), rng, id_slope=0.02, ridge_slope=0.0)
        (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
        fit = dose.total_fit(g, GATES["dose_tol"], GATES["min_seeds"])   # analyse's decomposition rows alone
        e, f = (dose.total_slope(fit, y, CFG.alpha) for y in ("id_loss", "ood_delta_ridge"))
        hits += e.ci_lo <= 0.02 <= e.ci_hi
        false += not f.ci_lo <= 0 <= f.ci_hi
    band = 2 * math.sqrt(0.95 * 0.05 / 100)
    assert abs(hits / 100 - 0.95) <= band and abs(false / 100 - 0.05) <= band


@pytest.mark.validation
def test_the_decomposition_per_m_holds_its_level_with_five_seeds():
    """dose.by_m's per-seed slopes, t over 5 seeds, at a full grid's M (3 doses) and the ladder's (6): over 2 500
    replications (experiments/by_m_coverage.py, generator seeds 0-599, 1000-1399, 5000-6499) coverage 0.951 and
    0.949, size 0.058 and 0.053; run here on 300 others (from 10 000; bands ±2.5 binomial SE, as 150 of those
    seeds, 0-149, covered only 0.893 at M = 4 by chance)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("by_m_coverage", ROOT / "experiments" / "by_m_coverage.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    reps = [sim.replicate(np.random.default_rng(10_000 + s)) for s in range(300)]
    band = 2.5 * math.sqrt(0.95 * 0.05 / 300)
    for M in (4, 16):
        assert abs(np.mean([r[M][0] for r in reps]) - 0.95) <= band, M
        assert abs(np.mean([r[M][1] for r in reps]) - 0.05) <= band, M


BATCHES = (16, 32, 64, 128)


def batch_axis(rng, slope: float, seeds: int = 5, steps_arm: bool = True) -> pd.DataFrame:
    """Plain runs at batch 16-128 (configs/exposure_batch.yaml's design): total exposure 0.0525·(B/64)^-1.96 at
    equal data and 0.0525·(B/64)^-0.96 at batch 64's steps; log2 M* = 4 + `slope`·log10(exposure / batch 64's) + a
    seed's shift (sd 0.04); r = logistic4 over log2 M, floor 0.05, ceiling 0.85, + run noise sd 0.0062."""
    from test_gates import table

    from iclnoise.analysis.thresholds import logistic4
    from iclnoise.core.tasks import M_INF

    rows = []
    arms = [("none", 0, 1.96)] + ([("steps64", 64, 0.96)] if steps_arm else [])
    for seed in range(seeds):
        u = 0.04 * rng.standard_normal()
        for noise, bt, k in arms:
            for B in BATCHES:
                if noise == "steps64" and B == 64:
                    continue
                e = 0.0525 * (B / 64) ** -k
                x0 = 4 + slope * math.log10(e / 0.0525) + u
                steps = 20_000 if bt else 1_280_000 // B
                for M in (*FULL, M_INF):
                    r = np.nan if M == M_INF else logistic4(np.log2(M), 0.05, 0.85, x0, 1.0) + 0.0062 * rng.normal()
                    rows.append({"run_id": f"M{M}-B{B}-{noise}-s{seed}", "M": M, "seed": seed, "batch": B,
                                 "noise": noise, "noise_source": "batch", "noise_schedule": "none",
                                 "emulate_batch": 0, "steps_as_batch": bt, "noise_shape": "none",
                                 "noise_level": 1 / B, "steps": steps, "sequences": steps * B,
                                 "integrated_lr_over_b": 1.0, "integrated_pne": e * (1 + 0.01 * rng.normal()),
                                 "r": r, "ood_loss": 0.42 if M == M_INF else 0.6, "ood_loss_fall": 0.005,
                                 "ood_loss_fall_se": 0.005, "ood_loss_fall_n": 5})
    return table(rows)


@pytest.mark.unit
def test_the_batch_axis_reads_m_star_per_decade_of_total_exposure_in_each_arm():
    """A planted slope of 0.15 octave of M* per decade of total exposure across batch 16-128: the equal-data row
    (in the Holm family, gated on equal data) and the equal-steps row (gated on equal steps, not on data) hold it in
    their intervals; at two batch sizes there are no batch-axis rows (the paired batch rows say it)."""
    from iclnoise.analysis.verdicts import hypothesis_tests

    out = batch_axis(np.random.default_rng(3), slope=0.15)
    t = hypothesis_tests(out, CFG)
    ax = t[t.test.str.startswith("batch axis") & t.test.str.contains(r"log2 M\* \(r50\)")].set_index("test")
    assert len(ax) == 2 and (ax.status == "run").all() and ax.in_family.all(), ax[["status", "fails"]]
    for name, row in ax.iterrows():
        assert row.ci_lo <= 0.15 <= row.ci_hi and row.ci_lo > 0, (name, row.ci_lo, row.ci_hi)
    assert ax.index.str.contains("equal data, batch 16, 32, 64, 128").any()
    assert ax.index.str.contains("equal steps \\(batch 64's\\), batch 16, 32, 64, 128").any()
    two = out[out.batch.isin([16, 64]) & (out.noise == "none")]
    assert not hypothesis_tests(two, CFG).test.str.startswith("batch axis").any()


@pytest.mark.unit
def test_a_batch_axis_still_training_compares_exposures_at_the_m_every_batch_size_has():
    """Exposure that grows with M (×(1 + log2 M / 8)) and batch 16 and 128 trained at M ≤ 32 only (two of four
    batch sizes short, so no three hold the whole grid): each batch size's total exposure is its mean at M 1-32, the
    M all four share (a hand mean), in the levels and in the slope's span; an arm whose batch sizes share no M runs
    no slope and says why."""
    from iclnoise.analysis.verdicts.h1_batch import batch_levels, h1_batch_axis

    out = batch_axis(np.random.default_rng(7), slope=0.0, steps_arm=False)
    out = out.assign(integrated_pne=out.integrated_pne * np.where(out.M > 0, 1 + np.log2(out.M.clip(1)) / 8, 1))
    out = out[~(out.batch.isin([16, 128]) & (out.M > 32))].reset_index(drop=True)
    lv = batch_levels(out, 0.05, 3).set_index("batch")
    fin = out[(out.M > 0) & (out.M <= 32)]
    for b in BATCHES:
        assert lv.total_exposure[b] == pytest.approx(fin[fin.batch == b].integrated_pne.mean(), rel=1e-12)
    rows = h1_batch_axis(out[out.M != -1], 0.05, lambda runs: [], decompose=False)
    span = np.log10(lv.total_exposure.max() / lv.total_exposure.min())
    assert f"({span:.2f} decades, M 1, 4, 8, 16, 32)" in rows[0]["test"] and rows[0]["status"] == "run"
    apart = out[(out.M != -1) & ((out.batch == 16) == (out.M <= 8))]
    rows = h1_batch_axis(apart, 0.05, lambda runs: [], decompose=False)
    assert rows[0]["status"] == "not run: no M run at every batch size, so no total exposure they share"


@pytest.mark.unit
def test_a_batch_size_still_training_beside_three_whole_ones_is_left_out_and_named():
    """Batch 32 with 16 of its 35 finite-M runs (a partial export: some M with every seed, one with one, three
    with none) beside three whole batch sizes: it is left out of the slope, the levels and the decomposition, and
    named with its count, so the slope, its span and the decomposition equal those of batch 16, 64 and 128 alone;
    the three keep their full M grid (the M they share with batch 32 would be too few for a fit)."""
    from iclnoise.analysis.verdicts.h1_batch import batch_levels, h1_batch_axis

    rng = np.random.default_rng(11)
    out = batch_axis(rng, slope=0.15, steps_arm=False)
    fin = with_outcomes(out[out.M != -1], rng, id_slope=0.01, ridge_slope=0.0)
    partial = (fin.batch == 32) & ~(fin.M.isin([8, 16, 32]) | ((fin.M == 1) & (fin.seed == 0)))
    part, three = fin[~partial], fin[fin.batch != 32]
    assert (part.batch == 32).sum() == 16
    got, want = h1_batch_axis(part, 0.05, lambda runs: []), h1_batch_axis(three, 0.05, lambda runs: [])
    assert len(got) == len(want) and all(g["status"] == "run" for g in got)
    why = " (left out: batch 32, 16 of the 35 (M, seed) runs the others have)"
    for g, w in zip(got, want):
        assert g["estimate"] == w["estimate"] and g["ci_lo"] == w["ci_lo"] and g["n"] == w["n"]
        if "M* (" in g["test"]:
            assert g["test"] == w["test"][:-1] + "; left out: batch 32: 16 of the 35 (M, seed) runs the others have)"
        else:
            assert g["test"] == w["test"].replace("batch 16, 64, 128:", f"batch 16, 64, 128{why}:")
    r50 = next(g for g in got if "(r50)" in g["test"])
    assert "M 1, 4, 8, 16, 32, 64, 256;" in r50["test"] and r50["ci_lo"] <= 0.15 <= r50["ci_hi"]
    lv = batch_levels(part, 0.05, 3)
    assert sorted(lv.batch) == [16, 64, 128]
    pd.testing.assert_frame_equal(lv, batch_levels(three, 0.05, 3))


@pytest.mark.unit
def test_a_batch_size_without_a_per_seed_m_star_is_left_out_of_the_slope_and_named():
    """Batch 128 trained on 2 seeds: short of the grid the three others hold, so the slope rests on batch 16, 32 and
    64, names them, spans their 1.18 decades (planted 1.96·log10 4) and names batch 128 with why. With batch 32 also
    on 2 seeds no three batch sizes hold the whole grid, so all four are fitted and the two without a per-seed M*
    (no interval: < 3 seeds) are left out of the slope with why; two batch sizes remain and the row does not run (a
    slope over two batch sizes is not in the family's business). The levels table batch 128's pooled M* then, without
    an interval."""
    from iclnoise.analysis.verdicts.h1_batch import batch_levels, h1_batch_axis

    out = batch_axis(np.random.default_rng(9), slope=0.15, steps_arm=False)
    fin = out[out.M != -1]
    short = fin[(fin.batch != 128) | (fin.seed < 2)]
    rows = h1_batch_axis(short, 0.05, lambda runs: [], decompose=False)
    r50 = next(r for r in rows if "(r50)" in r["test"])
    assert r50["status"] == "run" and r50["n"] == 5 and r50["ci_lo"] <= 0.15 <= r50["ci_hi"]
    assert r50["test"].startswith("batch axis at equal data, batch 16, 32, 64: slope of log2 M* (r50)")
    span = np.log10(short[short.batch == 16].integrated_pne.mean() / short[short.batch == 64].integrated_pne.mean())
    assert f"({span:.2f} decades, M 1, 4, 8, 16, 32, 64, 256; left out: batch 128: 14 of the 35 (M, seed) runs " \
        "the others have)" in r50["test"] and abs(span - 1.96 * math.log10(4)) < 0.02
    assert sorted(batch_levels(short, 0.05, 3).batch) == [16, 32, 64]
    shorter = short[(short.batch != 32) | (short.seed < 2)]
    two = next(r for r in h1_batch_axis(shorter, 0.05, lambda runs: [], decompose=False) if "(r50)" in r["test"])
    assert two["status"] == "not run: a per-seed M* at 2 batch size(s) on 5 common seed(s) (needs ≥ 3 batch sizes, " \
        "≥ 2 seeds)" and "left out: batch 32: no interval: insufficient seeds (2 < 3)" in two["test"]
    lv = batch_levels(shorter, 0.05, 3).set_index("batch")
    assert np.isnan(lv.M_star_r50_lo[128]) and np.isfinite(lv.M_star_r50[128]) and np.isfinite(lv.M_star_r50_lo[64])


@pytest.mark.unit
def test_the_batch_axis_fits_every_batch_size_on_the_m_they_all_have():
    """M* depends on the grid it is fitted on. Batch 16 and 128 still without M 64 and 256: every batch size's M*,
    batch 64's too, is fitted on M 1-32 (its per-seed values equal threshold_with_ci on those runs alone) and the
    decomposition rests on those runs; with batch 16 and 128 on the ladder alone (M 8-32, too few M for a fit) there
    is no M* and the row says so rather than slope the two full grids."""
    from iclnoise.analysis.thresholds import threshold_with_ci
    from iclnoise.analysis.verdicts.h1_batch import batch_levels, h1_batch_axis

    rng = np.random.default_rng(4)
    out = batch_axis(rng, slope=0.0, steps_arm=False)
    fin = with_outcomes(out[out.M != -1], rng, id_slope=0.01, ridge_slope=0.0)
    part = fin[~(fin.batch.isin([16, 128]) & fin.M.isin([64, 256]))]
    lv = batch_levels(part, 0.05, 3).set_index("batch")
    own = threshold_with_ci(part[(part.batch == 64) & (part.M <= 32)], alpha=0.05)
    assert lv.M_star_r50[64] == pytest.approx(own["M_star"], rel=1e-12)
    assert lv.n_runs[64] == 5 * 5
    rows = h1_batch_axis(part, 0.05, lambda runs: [])
    dec = next(r for r in rows if "decomposition, MixedLM r " in r["test"])
    assert dec["n"] == 4 * 5 * 5
    ladder = fin[~(fin.batch.isin([16, 128]) & ~fin.M.isin([8, 16, 32]))]
    r50 = next(r for r in h1_batch_axis(ladder, 0.05, lambda runs: [], decompose=False) if "(r50)" in r["test"])
    assert r50["status"].startswith("not run: a per-seed M* at 0 batch size(s)") and "M 8, 16, 32;" in r50["test"]


@pytest.mark.unit
def test_the_equal_steps_arm_needs_m_inf_runs_of_its_own_and_says_when_it_is_short():
    """An equal-steps condition saw other data than batch noise at its batch size, so batch noise's M = ∞ runs do not
    vouch for it: without its own, its row is gated ('no M = ∞ run of its own') and out of the family, while the
    equal-data row is not. With the equal-steps arm at batch 16 and 64 only, it has a row saying it is short."""
    from iclnoise.analysis.verdicts import hypothesis_tests
    from iclnoise.core.tasks import M_INF

    out = batch_axis(np.random.default_rng(3), slope=0.15)
    gone = out[~((out.noise == "steps64") & (out.M == M_INF))]
    t = hypothesis_tests(gone, CFG)
    ax = t[t.test.str.startswith("batch axis") & t.test.str.contains(r"log2 M\* \(r50\)")].set_index("test")
    steps = ax[ax.index.str.contains("equal steps")].iloc[0]
    assert "no M = ∞ run of its own" in steps.gate_failures and not steps.in_family
    assert ax[ax.index.str.contains("equal data")].in_family.all()
    two = out[(out.noise == "none") | (out.batch == 16)]
    t = hypothesis_tests(two, CFG)
    row = t[t.test.str.startswith("batch axis at equal steps (batch 64's), batch 16, 64")]
    assert len(row) == 1 and row.status.iloc[0] == "not run: 2 batch size(s) trained at equal steps (needs ≥ 3)"


@pytest.mark.unit
def test_an_unconverged_batch_size_is_left_out_while_three_converged_remain():
    """Batch 16 at equal steps levels off at 1.3× ridge's OOD loss (M = ∞; the gate is 1.15×): the equal-steps rows
    rest on batch 32, 64, 128, name batch 16 as left out, unconverged, hold the planted slope and are in the family;
    the rows over all four follow as sensitivity rows with the convergence gate not applied, outside the family. With
    batch 128 gone, two converged batch sizes remain: the rows over 16, 32, 64 stand, gated inconclusive. The levels
    table marks batch 16 at equal steps unconverged, and figure 6 names it under its tick."""
    import matplotlib.pyplot as plt

    from iclnoise.analysis.verdicts import hypothesis_tests
    from iclnoise.analysis.verdicts.h1_batch import batch_levels
    from iclnoise.core.tasks import M_INF
    from iclnoise.output.figures.stats import batch_axis_figure

    out = batch_axis(np.random.default_rng(3), slope=0.15)
    bad = (out.noise == "steps64") & (out.batch == 16) & (out.M == M_INF)
    out.loc[bad, "ood_loss"] = 1.3 * out.loc[bad, "ood_loss_ridge"]
    t = hypothesis_tests(out, CFG).set_index("test")
    steps = t[t.index.str.contains(r"equal steps \(batch 64's\)") & t.index.str.contains(r"log2 M\* \(r50\)")]
    main = steps[steps.index.str.startswith("batch axis at equal steps (batch 64's), batch 32, 64, 128")].iloc[0]
    assert "left out: batch 16: unconverged (steps64/B16: M = ∞ OOD loss 1.30× ridge's" in main.name
    assert main.status == "run" and main.gates_passed and main.in_family
    assert main.ci_lo <= 0.15 <= main.ci_hi
    sens = steps[steps.index.str.startswith("sensitivity, the convergence gate not applied (admits batch 16: ")]
    assert len(sens) == 1 and "batch 16, 32, 64, 128" in sens.index[0]
    assert sens.gates_passed.all() and not sens.in_family.any() and (sens.status == "run").all()
    dec = t[t.index.str.startswith("sensitivity, the convergence gate not applied") & t.index.str.contains("MixedLM")]
    assert len(dec) == 6 and not dec.in_family.any()
    lv = batch_levels(out, 0.05, 3)   # the levels and figure 6 name it
    assert lv.loc[~lv.converged, ["arm", "batch"]].values.tolist() == [["equal steps (batch 64's)", 16]]
    fig = batch_axis_figure(lv)
    ticks = [t.get_text() for t in fig.axes[3].get_xticklabels()]
    assert [t.split("\n")[1:] for t in ticks if "unconverged" in t] == [["B16", "unconverged"]], ticks
    plt.close(fig)
    t = hypothesis_tests(out[out.batch != 128], CFG)
    rows = t[t.test.str.contains("batch axis at equal steps (batch 64's), batch 16, 32, 64: slope", regex=False)]
    assert len(rows) == 2 and rows.verdict.str.startswith("inconclusive: unconverged (steps64/B16").all()
    assert not t.test.str.contains("convergence gate not applied").any()


@pytest.mark.validation
def test_the_batch_axis_slope_holds_its_size_and_finds_the_planted_mde():
    """Planted batch axes at 5 seeds (equal data only): at slope 0 the r50 row rejects at its size and at 0.1 octave
    per decade (the issue's mde) in ≥ 0.8. Measured over 200 generator seeds each: size 0.050, power 1.000, and the
    interval covered 0.1 in 0.95; run here on 100 (the size band ±2 binomial SE)."""
    from iclnoise.analysis.verdicts.h1_batch import h1_batch_axis

    def p_of(slope, s):
        out = batch_axis(np.random.default_rng(s), slope=slope, steps_arm=False)
        every = out[out.M != -1].assign(log2M=lambda d: np.log2(d.M))
        rows = h1_batch_axis(every, 0.05, lambda runs: [], decompose=False)
        return next(r["p"] for r in rows if "(r50)" in r["test"])

    size = np.mean([p_of(0.0, s) < 0.05 for s in range(100)])
    power = np.mean([p_of(0.1, s) < 0.05 for s in range(100)])
    assert size <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 100) and power >= 0.8


@pytest.mark.unit
def test_the_batch_axis_levels_hold_the_planted_thresholds_and_are_drawn(tmp_path):
    """batch_levels on a planted batch axis (slope 0.3 octave per decade): one row per arm and batch size, each at
    its planted mean total exposure, M* by midpoint and by r50 (the planted logistic's crossing of ½) within their
    intervals of the planted values (± the seeds' shift, sd 0.04 octave), batch 64 shared by both arms; figure 6 on
    the batch axis draws them, both arms on one scale; `has_batch_axis` finds the arm in
    configs/exposure_batch.yaml's grid and none in configs/science.yaml's (two batch sizes)."""
    import matplotlib.pyplot as plt

    from iclnoise.analysis.thresholds import crossing
    from iclnoise.analysis.verdicts.h1_batch import batch_levels
    from iclnoise.config import load_params
    from iclnoise.config.grid import has_batch_axis
    from iclnoise.output.figures.stats import batch_axis_figure, fig_batch_axis

    out = batch_axis(np.random.default_rng(5), slope=0.3)
    lv = batch_levels(out, 0.05, 3)
    assert sorted(lv.arm.unique()) == ["equal data", "equal steps (batch 64's)"]
    assert (lv.groupby("arm").batch.apply(sorted) == pd.Series([list(BATCHES)] * 2, index=sorted(lv.arm.unique()))
            ).all()
    assert (lv.n_seeds == 5).all() and (lv.n_runs == 5 * len(FULL)).all() and lv.converged.all()
    for r in lv.itertuples():
        k = 1.96 if r.arm == "equal data" else 0.96
        e = 0.0525 * (r.batch / 64) ** -k
        assert r.total_exposure == pytest.approx(e, rel=0.02)
        x0 = 4 + 0.3 * math.log10(e / 0.0525)
        for point, x in (("midpoint", x0), ("r50", crossing(0.05, 0.85, x0, 1.0))):
            lo, hi = getattr(r, f"M_star_{point}_lo"), getattr(r, f"M_star_{point}_hi")
            assert lo / 1.06 <= 2 ** x <= hi * 1.06, (point, r.arm, r.batch, lo, 2 ** x, hi)
    b64 = lv[lv.batch == 64].set_index("arm")
    assert b64.M_star_r50.nunique() == 1   # one set of runs, read in both arms
    fig_batch_axis(lv, tmp_path / "fig")
    assert (tmp_path / "fig.png").exists()
    fig = batch_axis_figure(lv)   # the arms on one scale: each row's limits and the exposure axis shared
    axes = np.array(fig.axes).reshape(2, 2)
    assert len({a.get_xlim() for a in axes.flat}) == 1 and all(len({a.get_ylim() for a in row}) == 1 for row in axes)
    (x0, x1), (m0, m1), (r0, r1) = axes[0, 0].get_xlim(), axes[0, 0].get_ylim(), axes[1, 0].get_ylim()
    assert x0 < lv.total_exposure.min() and lv.total_exposure.max() < x1
    assert m0 <= lv.M_star_midpoint_lo.min() and lv.M_star_r50_hi.max() <= m1
    assert r0 <= lv.r16_lo.min() and lv.r16_hi.max() <= r1
    plt.close(fig)
    science = load_params("params.yaml", ["configs/science.yaml"])
    both = load_params("params.yaml", ["configs/science.yaml", "configs/exposure.yaml", "configs/exposure_batch.yaml"])
    assert not has_batch_axis(science) and has_batch_axis(both)


@pytest.mark.unit
def test_the_batch_axis_trains_whole_batch_sizes_the_span_ends_first():
    """The batch axis's M* is fitted on the M every batch size has, so its plan takes a whole batch size at a time:
    after batch 64 (the exposure design's dose 0) come batch 128's five jobs and batch 16's, so the equal-data slope
    can run after 10 of the 30 new jobs; the equal-steps arm after every equal-data job. The dose and exposure
    designs keep their order (ladders first; whole doses)."""
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "dose_device.py"), "plan", "configs/science.yaml",
                        "configs/exposure.yaml", "configs/exposure_batch.yaml"], cwd=ROOT, capture_output=True,
                       text=True, check=True)
    jobs = [line.split("\t") for line in r.stdout.splitlines()]
    new = [(g, runs.split(",")) for g, runs, _ in jobs if g.startswith(("B16-", "B32-", "B128-"))]
    assert len(new) == 30 and all(len(runs) == 8 for _, runs in new)
    first = {run for _, runs in new[:10] for run in runs}
    assert {f"M{m}-B{b}-none-s{s}" for m in (1, 4, 8, 16, 32, 64, 256, "inf") for b in (16, 128) for s in range(5)} \
        == first
    assert [g.split("-")[1] for g, _ in new[15:]] == ["steps64"] * 15
