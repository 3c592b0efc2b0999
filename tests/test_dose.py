"""The dose–response (issue 43): the per-run dose table, the operating regime and the slopes of r and log2 M* against
log dose, on planted outcome tables with known slopes (coverage, size and power measured by
experiments/dose_coverage.py)."""
import math

import numpy as np
import pandas as pd
import pytest
from test_gates import table

from iclnoise.analysis import dose, stats
from iclnoise.analysis.thresholds import logistic4
from iclnoise.analysis.verdicts import GATES, hypothesis_tests
from iclnoise.config.grid import has_dose_series
from iclnoise.core.probe_sections import Stats
from iclnoise.core.tasks import M_INF

CFG = Stats(alpha=0.05, equivalence_fraction=0.5, equivalence_margin=None, transient_tol=0.05)
DOSES = (0.01, 0.03, 0.1, 0.3, 1.0)   # 2 decades, 5 levels
LADDER = (8, 16, 32)
FULL = (1, 4, 8, 16, 32, 64, 256)


def planted(rng, slope=0.0, shift=0.0, doses=DOSES, seeds=3, noise=0.02, seed_sd=0.03, source="param",
            full_at=(0.0,), inf_at=None, ratio=None, booked=None, x0=4.0, scale=1.0, fall=None) -> pd.DataFrame:
    """Outcomes of one dose series at batch 64 and its dose 0: r = logistic4(log2 M − shift·log10(d/d₁); floor 0.05,
    ceiling 0.85, midpoint x0, scale) + slope·log10(d/d₁) + a seed's shift (sd `seed_sd`) + run noise (sd `noise`);
    d₁ the lowest positive dose, dose 0 at d₁'s r. So r rises by `slope` per decade at fixed M and M* moves by
    `shift` octaves per decade. The ladder M ∈ {8, 16, 32} at every dose, the full grid (and M = ∞) at the doses in
    `full_at`, M = ∞ also at `inf_at` (default: the highest dose); M = ∞ ends at `ratio`[d] × ridge's OOD loss
    (default 1.05) after falling `fall`[d] × ridge's over the last third of training (default 0.005: levelled);
    the booked dose is `booked`[d] × the target (default 1)."""
    inf_at = (max(doses),) if inf_at is None else inf_at
    ratio, booked, fall = ratio or {}, booked or {}, fall or {}
    rows = []
    for seed in range(seeds):
        u = seed_sd * rng.standard_normal()
        for d in (0.0, *doses):
            ld = math.log10(max(d, doses[0]) / doses[0])
            ms = [*(FULL if d in full_at else LADDER), *([M_INF] if d in (*full_at, *inf_at) else [])]
            for M in ms:
                r = (logistic4(np.log2(M) - shift * ld, 0.05, 0.85, x0, scale) + slope * ld + u
                     + noise * rng.standard_normal()) if M != M_INF else np.nan
                noise_name = "none" if d == 0 else f"{source}_{d:g}"
                rows.append({"run_id": f"M{M}-B64-{noise_name}-s{seed}", "M": M, "seed": seed, "batch": 64,
                             "noise": noise_name, "noise_source": "batch" if d == 0 else source,
                             "noise_schedule": "none" if d == 0 else "constant", "emulate_batch": 0,
                             "steps_as_batch": 0, "noise_shape": "none" if d == 0 else "diagonal",
                             "noise_level": 1 / 64 if d == 0 else d, "integrated_lr_over_b": 1.0,
                             "integrated_pne": 0.05 + d, "integrated_pne_injected": d * booked.get(d, 1.0),
                             "integrated_pne_injected_se": 0.001 * d, "r": r,
                             "ood_loss": 0.4 * ratio.get(d, 1.05) if M == M_INF else 0.6,
                             "ood_loss_fall": fall.get(d, 0.005), "ood_loss_fall_se": 0.005,
                             "ood_loss_fall_n": 5})
    return table(rows)


def h1(out):
    t = hypothesis_tests(out, CFG)
    return t[t.test.str.startswith("dose-response")].reset_index(drop=True)


@pytest.mark.unit
def test_the_dose_table_has_a_row_per_run_of_the_series_and_dose_zero():
    out = planted(np.random.default_rng(0), booked={0.01: 1.02})
    runs = dose.dose_runs(out, GATES["convergence_tol"])
    assert len(runs) == len(out) and list(runs.columns) == dose.DOSE_SCHEMA.names
    assert set(runs.source) == {"param", "none"} and set(runs.target_dose) == {0.0, *DOSES}
    assert np.allclose(runs[runs.target_dose == 0.01].realised_dose, 0.0102)
    assert (runs[runs.target_dose == 0].realised_dose == 0).all()
    assert runs[runs.M == M_INF].converged.astype(bool).all() and runs[runs.M != M_INF].converged.isna().all()


@pytest.mark.unit
def test_no_dose_series_changes_nothing():
    """One positive dose is no series: no dose runs, no dose rows, the other tests as before."""
    out = planted(np.random.default_rng(0), doses=(0.1,))
    assert not len(dose.dose_runs(out, GATES["convergence_tol"]))
    assert not hypothesis_tests(out, CFG).test.str.startswith("dose-response").any()


@pytest.mark.unit
def test_the_regime_leaves_out_unconverged_saturated_and_unchecked_doses():
    """M = ∞ 1.2× ridge's and still falling (0.15 × ridge's over the last third) at dose 1 leaves out 1; the dose 0.3
    (no M = ∞ run) lies above the highest converged dose checked (0.1), so it is out too; 0.03 books 0.5× its
    target (saturated). The same 1.2× levelled (noise still on) is a noise floor: dose 1 and 0.3 stay in."""
    out = planted(np.random.default_rng(0), inf_at=(0.1, 1.0), ratio={1.0: 1.2}, fall={1.0: 0.15},
                  booked={0.03: 0.5})
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"]).set_index("target_dose")
    assert list(lv.index[lv.in_regime]) == [0.0, 0.01, 0.1]
    assert "fails the convergence gate (1.200× ridge's" in lv.regime[1.0] and "saturated" in lv.regime[0.03]
    assert "no M = ∞ run at or above" in lv.regime[0.3]
    out = planted(np.random.default_rng(0), inf_at=(0.1, 1.0), ratio={1.0: 1.2}, fall={1.0: 0.02},
                  booked={0.03: 0.5})
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"]).set_index("target_dose")
    assert list(lv.index[lv.in_regime]) == [0.0, 0.01, 0.1, 0.3, 1.0]
    assert lv.ood_loss_over_ridge[1.0] == pytest.approx(1.2)   # the noise floor, reported per dose


@pytest.mark.unit
def test_only_m_inf_s_gate_vouches_for_a_dose_without_m_inf_runs():
    """A dose without M = ∞ runs (0.3) is vouched for by M = ∞ passing the gate at a dose above it (1), not by that
    dose's other faults: 1 saturated (booked 0.5×) is out itself, and 0.3 stays in; a diverged finite-M run at dose 0
    leaves dose 0 out, not the doses above it. With the gate not applied nothing vouches: 0.3 is in even when M = ∞
    fails at 1."""
    out = planted(np.random.default_rng(0), inf_at=(0.1, 1.0), booked={1.0: 0.5})
    out.loc[(out.noise_level == 1 / 64) & (out.M == 256) & (out.seed == 0), "diverged"] = True
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"]).set_index("target_dose")
    assert list(lv.index[~lv.in_regime]) == [0.0, 1.0]
    assert "diverged" in lv.regime[0.0] and "saturated" in lv.regime[1.0]
    out = planted(np.random.default_rng(0), inf_at=(0.1, 1.0), ratio={1.0: 1.3}, fall={1.0: 0.2})
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    gated = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"]).set_index("target_dose")
    free = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"], gate=False).set_index("target_dose")
    assert list(gated.index[~gated.in_regime]) == [0.3, 1.0] and "no M = ∞ run at or above" in gated.regime[0.3]
    assert free.in_regime.all()


@pytest.mark.unit
def test_a_dose_still_training_with_too_few_seeds_is_left_out_and_does_not_shorten_the_ladder():
    """1 trained at M = ∞ by every seed but at finite M only at M = 8 by 2 seeds (jobs half done): it leaves the
    regime ('2 seeds at finite M (fewer than 3)') while its M = ∞ still vouches for 0.3 below it, the ladder stays
    {8, 16, 32} over the other doses, and the r row is in the family over them."""
    out = planted(np.random.default_rng(3), slope=0.05, inf_at=(1.0,))
    thin = (out.noise_level == 1.0) & (out.M != M_INF) & ~((out.M == 8) & (out.seed < 2))
    out = out[~thin].reset_index(drop=True)
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    res = dose.analyse(g, 0.05, GATES["dose_tol"], GATES["min_seeds"])
    assert res["ladder"] == [8, 16, 32] and res["doses"] == [0.01, 0.03, 0.1, 0.3]
    assert res["left_out"].set_index("target_dose").regime[1.0] == "2 seeds at finite M (fewer than 3)"
    row = h1(out).set_index("test").filter(like="MixedLM r ~ log10(dose) + C(M) + (1|M:seed)", axis=0).iloc[0]
    assert row.in_family and row.n == 36 and "1: 2 seeds at finite M (fewer than 3)" in row.name


@pytest.mark.unit
def test_doses_sharing_no_finite_m_with_dose_0_say_so_and_compare_no_exposures():
    """Two in-regime doses run at different M (0.1 at M = 8, 1 at M = 16): no ladder, so no r slope (the row says
    why), no total exposure, and the per-M table runs nothing on exposures taken over different M."""
    out = planted(np.random.default_rng(4), doses=(0.1, 1.0), inf_at=(1.0,))
    keep = (out.noise_level == 1 / 64) | (out.M == M_INF) | ((out.noise_level == 0.1) & (out.M == 8)) \
        | ((out.noise_level == 1.0) & (out.M == 16))
    out = out[keep].reset_index(drop=True)
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    res = dose.analyse(g, 0.05, GATES["dose_tol"], GATES["min_seeds"])
    assert res["ladder"] == [] and res["doses"] == [0.1, 1.0] and res["levels"].total_exposure.isna().all()
    per_m = dose.by_m(g, 0.05, GATES["dose_tol"], GATES["min_seeds"])
    assert len(per_m) and per_m.status.str.startswith("not run: no finite M run at dose 0 and every").all()
    row = h1(out).set_index("test").filter(like="MixedLM r ~ log10(dose) + C(M) + (1|M:seed)", axis=0).iloc[0]
    assert row.status == "not run: no finite M run at dose 0 and every in-regime dose (no ladder)"


@pytest.mark.unit
def test_the_persistent_arm_is_read_against_the_arm_switched_off_seed_by_seed():
    """Two arms at doses 0.1 and 1 sharing dose 0: constant (on to the end) and early (off before the end), the
    persistent arm's r 0.03 higher and its in-distribution loss 0.01 higher in every (M, seed) cell (+ run noise sd
    0.01 and 0.002). Per dose, each seed's mean (on − off) over the ladder, t over seeds, holds the planted
    differences; with none planted the interval holds 0. Outside the family; an outcome not recorded is said."""
    def arms(gap_r, gap_id, rng):
        on = planted(rng, doses=(0.1, 1.0), inf_at=(0.1, 1.0), seeds=4)
        on = on.assign(id_loss=0.5 + 0.002 * rng.standard_normal(len(on)))
        off = on[on.noise_level != 1 / 64].copy()
        off = off.assign(noise_schedule="early", run_id=off.run_id.str.replace("-param", "-off_param"),
                         noise=off.noise.str.replace("param", "off_param"),
                         r=off.r - gap_r + 0.01 * rng.standard_normal(len(off)),
                         id_loss=off.id_loss - gap_id + 0.002 * rng.standard_normal(len(off)))
        return pd.concat([on, off], ignore_index=True)

    t = h1(arms(0.03, 0.01, np.random.default_rng(11)))
    rows = t[t.test.str.contains("against param (diagonal, early), batch 64 at dose", regex=False)].set_index("test")
    assert len(rows) == 6 and not rows.in_family.any()
    for name, row in rows.iterrows():
        if row.outcome == "ood_delta_ridge":
            assert row.status == "not run: ood_delta_ridge not recorded on every run"
            continue
        gap = {"r": 0.03, "id_loss": 0.01}[row.outcome]
        assert row.status == "run" and row.n == 4 and row.ci_lo <= gap <= row.ci_hi and row.ci_lo > 0, name
        assert "M ∈ {8, 16, 32}" in name and "(constant − early)" in name
        assert row.verdict.startswith(("r higher with the noise on to the end", "in-distribution loss higher"))
    t = h1(arms(0.0, 0.0, np.random.default_rng(12)))
    rows = t[t.test.str.contains("against param") & (t.status == "run")]
    assert len(rows) == 4 and ((rows.ci_lo <= 0) & (0 <= rows.ci_hi)).all()


@pytest.mark.unit
def test_a_planted_slope_of_r_is_recovered_and_a_null_is_a_null():
    rng = np.random.default_rng(1)
    t = h1(planted(rng, slope=0.05)).set_index("outcome")
    row = t[t.test.str.contains("MixedLM r ~")].iloc[0]
    assert row.gates_passed and row.in_family and row.ci_lo < 0.05 < row.ci_hi and row.ci_lo > 0
    assert row.verdict.startswith("r increases with the param dose") and row.n == 45
    assoc = t[t.test.str.contains("association")].iloc[0]   # planted: integrated P-NE* = 0.05 + dose
    assert assoc.estimate > 0 and not assoc.in_family and "(association)" in assoc.verdict
    null = h1(planted(rng, slope=0.0))
    row = null[null.test.str.contains("MixedLM r ~")].iloc[0]
    assert row.ci_lo < 0 < row.ci_hi and row.verdict.startswith("no evidence") and "could detect a slope" in row.verdict


@pytest.mark.unit
def test_a_dose_with_m_inf_runs_only_vouches_for_the_regime_and_the_slope_reads_the_rest():
    """The CPU plan's order: the ladder at 0.01 and 0.1, and at 0.3 M = ∞ alone (trained early to show the regime
    reaches that far). 0.3 stays inside the regime; the r slope is fitted over 0.01 and 0.1 at the ladder (before,
    the ladder was the M run at every in-regime dose: none, so no slope), and the contrast with dose 0 is at 0.1."""
    out = planted(np.random.default_rng(5), slope=0.05, doses=(0.01, 0.1, 0.3), inf_at=(0.3,))
    out = out[~((out.noise_level == 0.3) & (out.M != M_INF))].reset_index(drop=True)
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    assert dose.regime(g, GATES["dose_tol"], GATES["min_seeds"]).set_index("target_dose").in_regime.all()
    t = h1(out)
    row = t[t.test.str.contains("MixedLM r ~")].iloc[0]
    assert row.status == "run" and row.n == 18 and "M ∈ {8, 16, 32}" in row.test and "doses 0.01, 0.1" in row.test
    assert row.ci_lo < 0.05 < row.ci_hi
    assert (t.test.str.contains("paired t \\(dose 0.1 − dose 0\\)")).sum() == 1


@pytest.mark.unit
def test_the_reports_regime_span_counts_the_doses_a_fit_reads_and_names_m_inf_alone_apart():
    """The same shape (0.3 with M = ∞ alone): given dose.parquet, the report's operating regime spans 0.01-0.1,
    the doses the slopes read, and names 0.3 apart as inside with M = ∞ alone; without it (a set aggregated before
    the report read it) the span is the in-regime doses, as before."""
    from iclnoise.output.report import dose_answer

    out = planted(np.random.default_rng(5), slope=0.05, doses=(0.01, 0.1, 0.3), inf_at=(0.3,))
    out = out[~((out.noise_level == 0.3) & (out.M != M_INF))].reset_index(drop=True)
    runs = dose.dose_runs(out, GATES["convergence_tol"])
    lv, t = dose.levels_table(runs, 0.05, GATES["dose_tol"], 3), h1(out)
    line = next(x for x in dose_answer(t, lv, None, runs) if "operating regime:" in x)
    assert line.endswith("operating regime: doses 0.01–0.1 (2 doses, 1.00 decades); inside with M = ∞ runs alone "
                         "(no fit reads them yet): dose 0.3."), line
    old = next(x for x in dose_answer(t, lv) if "operating regime:" in x)
    assert "(3 doses, 1.48 decades)" in old and "M = ∞ runs alone" not in old


@pytest.mark.unit
def test_the_ladder_reads_a_planted_shift_of_m_star():
    """M* moves by −0.25 octave per decade (r's curve translates): the ladder's converted slope covers it, M* by r50
    is not fitted (3 M at the positive doses), and the shift per dose follows −0.25·log10(d/0.01). (The conversion
    is first order: at −0.5 per decade, a 1-octave shift over the 2 decades, it reads 5 % low;
    experiments/dose_coverage.py.)"""
    out = planted(np.random.default_rng(2), shift=-0.25, noise=0.01)
    t = h1(out)
    lad = t[t.test.str.contains("threshold ladder")].iloc[0]
    assert lad.ci_lo < -0.25 < lad.ci_hi and lad.ci_hi < 0 and not lad.in_family
    assert t[t.test.str.contains(r"slope of log2 M\* \(r50\)")].status.iloc[0].startswith("not run")
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.analyse(g, 0.05, GATES["dose_tol"], 3)["levels"].set_index("target_dose")
    want = -0.25 * np.log10(np.array(DOSES) / 0.01)
    assert np.allclose(lv.ladder_shift[list(DOSES)], want, atol=0.08)
    assert np.isfinite(lv.M_star_r50[0.0]) and np.isnan(lv.M_star_r50[0.1]) and np.isfinite(lv.r16[0.1])


@pytest.mark.unit
def test_the_cpu_plan_checks_the_ladder_against_m_star_at_its_full_grid_dose():
    """The CPU plan: the full M grid at dose 0 and at the highest dose (1, 2 decades above the lowest), the ladder
    elsewhere. M* moves −0.25 octave per decade: log2 M* at dose 1 − dose 0 ≈ −0.5 (paired by seed), and the
    M* slope does not run (one positive dose with a full grid)."""
    t = h1(planted(np.random.default_rng(9), shift=-0.25, noise=0.01, full_at=(0.0, 1.0)))
    z = t[t.test.str.contains(r"paired t of log2 M\* \(r50\)")].iloc[0]
    assert z.status == "run" and z.ci_lo < -0.5 < z.ci_hi and z.gates_passed
    assert t[t.test.str.contains(r"slope of log2 M\* \(r50\)")].status.iloc[0].startswith("not run")


@pytest.mark.unit
def test_m_star_slope_takes_seeds_as_the_unit():
    """Two doses a decade apart: the slope is the paired t of log2 M* between them (estimate, interval, p, mde), the
    interval on n − 1 = 2 df; three doses: each seed's least-squares slope, cov/var, averaged. (A random-intercept
    MixedLM's Wald interval, the fit before, covered 0.79 at the two-dose design: experiments/dose_coverage.py.)"""
    lo, hi = np.array([4.02, 4.11, 3.95]), np.array([3.97, 3.99, 3.93])
    d = pd.DataFrame({"seed": [0, 1, 2] * 2, "log10_dose": [-2.0] * 3 + [-1.0] * 3, "log2_M_star": [*lo, *hi]})
    e, z = dose.mstar_slope(d, 0.05), stats.paired_test(hi, lo)
    for k in ("estimate", "ci_lo", "ci_hi", "p", "mde"):
        assert math.isclose(e[k], z[k], rel_tol=1e-9), k
    x = np.array([-3.0, -2.0, -1.0])
    y = {0: [4.0, 3.9, 3.7], 1: [4.2, 4.2, 4.0], 2: [3.8, 3.8, 3.8]}
    d = pd.DataFrame([{"seed": s, "log10_dose": xi, "log2_M_star": yi} for s, v in y.items() for xi, yi in zip(x, v)])
    by_hand = [np.sum((x - x.mean()) * (np.array(v) - np.mean(v))) / np.sum((x - x.mean()) ** 2) for v in y.values()]
    assert math.isclose(dose.mstar_slope(d, 0.05).estimate, np.mean(by_hand))


@pytest.mark.unit
def test_full_grids_at_two_positive_doses_give_m_star_a_slope():
    """configs/dose.yaml's full M grids at 0.03x and 0.3x: here at 0.1 and 1 (a decade apart) and dose 0. M* moves
    −0.25 octave per decade: the r50 slope runs over those 2 doses and its interval covers −0.25."""
    t = h1(planted(np.random.default_rng(9), shift=-0.25, noise=0.01, full_at=(0.0, 0.1, 1.0)))
    row = t[t.test.str.contains(r"slope of log2 M\* \(r50\)")].iloc[0]
    assert row.status == "run" and row.n == 3 and row.in_family and row.ci_lo < -0.25 < row.ci_hi   # 3 seeds


@pytest.mark.unit
def test_m_star_has_a_slope_on_total_exposure_with_dose_zero_in_it():
    """H1's own axis (method §11): the slope of log2 M* per decade of total exposure (batch + injected), dose 0
    included. Planted: total exposure 10^ld where M* moves −0.25 octave per ld (ld = log10(d/d₁); dose 0 at d₁'s
    total), full grids at dose 0, 0.1 and 1: the row's interval covers −0.25, its span is 2 decades and its mde is
    stated; r50 in the family, the midpoint a sensitivity row."""
    out = planted(np.random.default_rng(9), shift=-0.25, noise=0.01, full_at=(0.0, 0.1, 1.0))
    out["integrated_pne"] = np.where(out.noise_level > 0.05, out.noise_level / DOSES[0], 1.0)
    t = hypothesis_tests(out, CFG)
    rows = t[t.test.str.contains("per decade of total exposure")]
    r50, mid = rows.iloc[0], rows.iloc[1]
    assert r50.status == "run" and r50.in_family and r50.n == 3 and "(2.00 decades)" in r50.test
    assert r50.ci_lo < -0.25 < r50.ci_hi and r50.ci_hi < 0 and np.isfinite(r50.mde)
    assert r50.verdict.startswith("M* falls with total exposure") and not mid.in_family


@pytest.mark.unit
def test_with_a_full_grid_at_every_dose_m_star_slope_is_fitted_by_both_definitions():
    out = planted(np.random.default_rng(3), shift=-0.5, noise=0.01, full_at=(0.0, *DOSES))
    t = h1(out)
    for point, family in (("r50", True), ("midpoint", False)):
        row = t[t.test.str.contains(rf"slope of log2 M\* \({point}\)")].iloc[0]
        assert row.status == "run" and row.ci_lo < -0.5 < row.ci_hi and row.ci_hi < 0 and row.in_family == family
        z = t[t.test.str.contains(rf"paired t of log2 M\* \({point}\)")].iloc[0]   # dose 1 against dose 0: −1 octave
        assert z.term == "dose 1 − dose 0" and z.ci_lo < -1 < z.ci_hi and z.ci_hi < 0 and z.in_family == family


@pytest.mark.unit
def test_the_dose_zero_contrast_and_an_unconverged_dose_zero():
    out = planted(np.random.default_rng(4), slope=0.05)
    z = h1(out).set_index("term").loc["dose 1 − dose 0"]
    assert abs(z.estimate - 0.1) < 0.03 and z.gates_passed
    bad = h1(planted(np.random.default_rng(4), slope=0.05, ratio={0.0: 1.3}))
    assert bad[bad.status == "run"].verdict.str.startswith("inconclusive: unconverged").all()


@pytest.mark.validation
def test_monotonicity_holds_its_size_on_a_line_and_finds_a_step():
    """Linear in log dose: p roughly uniform (rejections near α); a step between 0.03 and 0.1: rejected."""
    rng = np.random.default_rng(5)
    x = np.log10(DOSES)

    def cells(y):
        return pd.DataFrame([{"log10_dose": xi, "seed": s, "y": yi + 0.02 * rng.standard_normal() + 0.03 * u}
                             for s, u in enumerate(rng.standard_normal(3)) for xi, yi in zip(x, y)])
    ps = [stats.monotonicity(cells(0.05 * x), n_sim=300)["p"] for _ in range(40)]
    assert 0.0 <= np.mean(np.array(ps) < 0.05) <= 0.15
    step = stats.monotonicity(cells(np.where(x > -1.7, 0.2, 0.0)), n_sim=400)
    assert step["p"] < 0.05 and step["estimate"] > 0


@pytest.mark.unit
def test_an_m_inf_only_scan_reports_its_regime_and_runs_no_slope():
    """configs/dose_scan.yaml's shape: M = ∞ only at every dose: the regime is read, every slope says why not."""
    out = planted(np.random.default_rng(6), inf_at=DOSES, ratio={1.0: 1.2}, fall={1.0: 0.15})
    out = out[out.M == M_INF]
    t = h1(out)
    assert len(t) and (t.status != "run").all()
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.analyse(g, 0.05, GATES["dose_tol"], 3)["levels"].set_index("target_dose")
    assert list(lv.index[~lv.in_regime]) == [1.0] and np.isnan(lv.r16).all()


@pytest.mark.unit
def test_reference_sets_have_no_dose_series_and_their_tests_are_unchanged():
    """The committed reference sets (no dose series): no dose runs, and hypothesis_tests gives their tests.parquet."""
    import json

    from iclnoise.analysis.aggregate import read_outcomes
    from iclnoise.config import typed
    from iclnoise.core.io import read_parquet

    for ref in ("science", "noise"):
        out = read_outcomes(f"reference/{ref}/aggregate/outcomes.parquet")
        params = json.load(open(f"reference/{ref}/provenance.json"))["params"]
        assert not len(dose.dose_runs(out, GATES["convergence_tol"])) and not has_dose_series(params)
        pd.testing.assert_frame_equal(hypothesis_tests(out, typed(params, "stats")),
                                      read_parquet(f"reference/{ref}/aggregate/tests.parquet"))


@pytest.mark.unit
def test_has_dose_series_reads_the_grid_as_dose_runs_reads_the_outcomes():
    from iclnoise.config import load_params

    assert not has_dose_series(load_params("params.yaml"))
    assert not has_dose_series(load_params("params.yaml", ["configs/noise.yaml"]))
    assert has_dose_series(load_params("params.yaml", ["configs/science.yaml", "configs/dose_scan.yaml"]))
    assert has_dose_series(load_params("params.yaml", ["configs/science.yaml", "configs/dose.yaml"]))
    p = load_params("params.yaml", ["configs/science.yaml", "configs/exposure.yaml"])
    p["grid"]["noise"] = ["none", "off_x1", "off_x10"]   # the noise-off arm alone (schedule early) is a series
    assert has_dose_series(p)
    p["grid"]["noise"] = ["none", "off_x1", "on_x10"]    # one dose per schedule: no series
    assert not has_dose_series(p)


@pytest.mark.unit
def test_aggregate_writes_the_dose_tables_only_for_a_dose_series(tmp_path, monkeypatch):
    from test_gates import planted as no_dose

    from iclnoise.analysis import aggregate as agg
    from iclnoise.analysis.aggregate import OUTCOMES_SCHEMA
    from iclnoise.core.io import read_parquet

    for name, out in (("dose", planted(np.random.default_rng(7), slope=0.03)),
                      ("none", no_dose(np.random.default_rng(7)))):
        out = out.assign(run_id=out.get("run_id", pd.Series(range(len(out))).astype(str)), steps=1000, t_crit=10)
        monkeypatch.setattr(agg, "outcomes", lambda dirs, tol, o=out: (o.reindex(columns=OUTCOMES_SCHEMA.names),
                                                                        OUTCOMES_SCHEMA))
        monkeypatch.setattr(agg, "trajectories", lambda dirs: pd.DataFrame(columns=agg.TRAJECTORY_COLUMNS))
        agg.aggregate([], tmp_path / name, CFG)
    files = {p.name for p in (tmp_path / "dose").iterdir()}
    assert {"dose.parquet", "dose_levels.parquet", "dose.md", "dose_levels.md"} <= files
    assert not list((tmp_path / "none").glob("dose*"))
    runs = read_parquet(tmp_path / "dose" / "dose.parquet")
    assert len(runs) == 72 and list(runs.columns) == dose.DOSE_SCHEMA.names   # 3 seeds × (8 + 3 × 4 + 4) runs
    lv = read_parquet(tmp_path / "dose" / "dose_levels.parquet")
    assert list(lv.target_dose) == [0.0, *DOSES] and lv.in_regime.all()


@pytest.mark.unit
def test_figure_6_against_dose_and_the_report_opening_with_the_answer(tmp_path):
    from iclnoise.analysis.verdicts import TESTS_SCHEMA
    from iclnoise.core.io import write_parquet
    from iclnoise.output.figures.stats import fig_dose
    from iclnoise.output.report import build

    out = planted(np.random.default_rng(8), shift=-0.25, noise=0.01, inf_at=(0.3, 1.0), ratio={1.0: 1.2},
                  fall={1.0: 0.15})
    (_, g), = dose.series(dose.dose_runs(out, GATES["convergence_tol"]))
    lv = dose.levels_table(dose.dose_runs(out, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], 3)
    fig_dose(lv, tmp_path / "figures" / "fig06_threshold_vs_noise_dose")
    assert (tmp_path / "figures" / "fig06_threshold_vs_noise_dose.png").stat().st_size > 10_000
    agg = tmp_path / "aggregate"
    write_parquet(hypothesis_tests(out, CFG), agg / "tests.parquet", TESTS_SCHEMA)
    write_parquet(lv, agg / "dose_levels.parquet", dose.LEVELS_SCHEMA)
    text = build(tmp_path, {}, tmp_path)
    assert text.index("## The answer: ICL against the injected noise dose") < text.index("## What this run shows")
    assert ("operating regime: doses 0.01–0.3 (4 doses, 1.48 decades); outside: dose 1 (M = ∞ fails the convergence "
            "gate (1.200× ridge's") in text
    assert "threshold ladder" in text and "fig06_threshold_vs_noise_dose.png" in text


@pytest.mark.unit
def test_a_series_under_two_optimizers_is_two_series_each_with_its_own_dose_zero():
    """grid.optimizer (issue 45): a dose series trained under AdamW and SGD with momentum is two series; each takes
    dose 0 from its own optimizer's batch-noise runs, and AdamW's levels are those of its runs alone (SGD's planted
    slope does not leak into them)."""
    a = planted(np.random.default_rng(0))
    b = planted(np.random.default_rng(1), slope=0.2).assign(optimizer="sgd_momentum")
    both = pd.concat([a, b.assign(run_id=b.run_id + "-sgd_momentum")], ignore_index=True)
    runs = dose.dose_runs(both, GATES["convergence_tol"])
    series = dose.series(runs)
    assert [k for k, _ in series] == [("param", "diagonal", "constant", 64, "adamw"),
                                      ("param", "diagonal", "constant", 64, "sgd_momentum")]
    for (*_, opt), g in series:
        zero = runs[(runs.source == "none") & (runs.optimizer == opt)]
        assert (g.optimizer == opt).all() and len(zero)
        assert g[g.target_dose == 0].run_id.tolist() == zero.run_id.tolist()
    lv = dose.levels_table(runs, 0.05, GATES["dose_tol"], 3)
    alone = dose.levels_table(dose.dose_runs(a, GATES["convergence_tol"]), 0.05, GATES["dose_tol"], 3)
    pd.testing.assert_frame_equal(alone, lv[lv.optimizer == "adamw"].reset_index(drop=True))


@pytest.mark.unit
def test_the_dose_grid_is_the_issues_design():
    """configs/dose.yaml (issue 43 item 2, CPU plan): per injected source ≥ 5 positive doses inside the operating
    regime measured on 3 seeds (reference/dose: M = ∞ within 1.10× ridge's OOD loss at 0.3× and not at param 1×; grad
    1× saturated) spanning ≥ 1.5 decades, each at the threshold ladder M ∈ {8, 16, 32} on 3 seeds; the H2 pair at
    equal budgets ≥ 50 % of the batch noise's integrated P-NE* (0.055); the full M grid at dose 0 and at two doses
    of each source a decade apart inside the regime (0.03× and 0.3×: log M* has a slope against log dose from full
    grids); and every run of every seed probed (item 5: H4's seed gate)."""
    from iclnoise.config import load_params
    from iclnoise.config.grid import expand_grid, probe_sections, run_spec

    p = load_params("params.yaml", ["configs/science.yaml", "configs/dose.yaml"])
    conds = {c: {**p["noise"]["conditions"][c], "budget": run_spec(p, f"M16-B64-{c}-s0")["noise"]["budget"]}
             for c in p["grid"]["noise"] if c != "none"}   # relative doses resolved to the budgets the runs use
    top = 0.0165   # 0.3x: the highest dose inside the regime for both sources
    for source in ("param", "grad"):
        doses = sorted(c["budget"] for c in conds.values() if c["source"] == source and c["schedule"] == "constant"
                       and c["budget"] <= top)
        assert len(doses) >= 5 and math.log10(doses[-1] / doses[0]) >= 1.5, (source, doses)
    for c in conds.values():
        assert c["schedule"] != "constant" or set(LADDER) <= set(c.get("M") or p["grid"]["M"])
    early, late = conds["h2_early"], conds["h2_late"]
    assert early["budget"] == late["budget"] >= 0.5 * 0.055 and early["M"] == late["M"]
    runs = expand_grid(p)
    assert {k.seed for k in runs} == {0, 1, 2}
    full = {k.noise for k in runs if k.M == 1}   # the full M grid at dose 0 and at two doses of each source
    assert full == {"none", "param_x0p03", "param_x0p3", "grad_x0p03", "grad_x0p3"}
    assert all(len({k.M for k in runs if k.noise == n}) == len(p["grid"]["M"]) for n in full)
    assert all({"llc", "geometry", "mech"} <= set(probe_sections(p, k)) for k in runs)


@pytest.mark.unit
def test_figure_6_draws_the_ladder_reading_beside_a_full_grid_m_star():
    """Where a dose has a full M grid, its own M* and the ladder's reading are both drawn (the ladder's a little to
    the right), so that the conversion can be checked against a direct estimate; where it has only the ladder, the
    ladder's reading sits at the dose."""
    import matplotlib.pyplot as plt

    from iclnoise.output.figures.stats import _plot_dose_mstar

    nan = np.nan
    g = pd.DataFrame({"target_dose": [0.0, 0.01, 0.1], "ladder_shift": [nan, 0.1, -0.2],
                      "ladder_shift_lo": [nan, 0.0, -0.3], "ladder_shift_hi": [nan, 0.2, -0.1]})
    for point, m in (("r50", 16.0), ("midpoint", 12.0)):
        g[f"M_star_{point}"], g[f"M_star_{point}_lo"], g[f"M_star_{point}_hi"] = \
            [m, nan, m * 0.9], [m - 1, nan, m * 0.9 - 1], [m + 1, nan, m * 0.9 + 1]
    fig, top = plt.subplots()
    _plot_dose_mstar(top, g, np.array([0.001, 0.01, 0.1]))
    drawn = {c.get_label(): c.lines[0] for c in top.containers}
    own, lad = drawn["M* (r50)"], drawn["M* (r50) read from the ladder"]
    assert np.isfinite(own.get_ydata()).tolist() == [True, False, True]
    np.testing.assert_allclose(lad.get_xdata(), [0.01, 0.1 * 1.12])
    np.testing.assert_allclose(lad.get_ydata(), [16 * 2 ** 0.1, 16 * 2 ** -0.2])
    plt.close(fig)
