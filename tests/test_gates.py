"""Verdicts and validity gates of the hypothesis tests on planted outcome tables (issues 13, 17 and 42)."""
import numpy as np
import pandas as pd
import pytest

from iclnoise.analysis.aggregate import OUTCOMES_SCHEMA
from iclnoise.analysis.thresholds import logistic
from iclnoise.analysis.verdicts import NO_MANIPULATION, h1_noise_beyond_eta_b, hypothesis_tests
from iclnoise.analysis.verdicts.rows import _row, _verdicts
from iclnoise.core.probe_sections import Stats

CFG = Stats(alpha=0.05, equivalence_fraction=0.5, equivalence_margin=0.05, transient_tol=0.05)   # a stated margin
DERIVED = Stats(alpha=0.05, equivalence_fraction=0.5, equivalence_margin=None, transient_tol=0.05)


def primary(t: pd.DataFrame) -> pd.DataFrame:
    """Test rows by hypothesis without the sensitivity rows (one row each for H2 and H3 in these grids)."""
    return t[~t.test.str.startswith("sensitivity")].set_index("hypothesis")


def table(rows: list[dict]) -> pd.DataFrame:
    """Outcome rows completed to the full outcomes schema: converged, equal data, no probes unless given."""
    defaults = {"diverged": False, "id_loss": 0.5, "ood_loss_ridge": 0.4, "ood_loss_dmmse": 0.9, "sequences": 64_000,
                "noise_shape": "isotropic", "noise_level": 1.0, "optimizer": "adamw"}
    df = pd.DataFrame([{**defaults, **r} for r in rows])
    for c in OUTCOMES_SCHEMA.names:
        if c not in df:
            df[c] = np.nan
    return df


CONDITIONS = {  # noise -> (batch, source, schedule, emulated batch, η/B)
    "none16": (16, "batch", "none", 0, 4.0), "none64": (64, "batch", "none", 0, 1.0),
    "grad_b16": (64, "grad", "constant", 16, 1.0),
    "early": (64, "grad", "early", 0, 1.0), "late": (64, "grad", "late", 0, 1.0),
}


def planted(rng, late_gain=0.1, inj_shift=0.0, exposure={"early": 1.0, "late": 1.0}, seq_b16=64_000, seeds=6,
            llc_flagged=0.0, manipulation=0.03, Ms=(4, 16, 64, 256)):
    """4 finite M × `seeds` seeds in five conditions (batch 16 and 64; batch 64 emulating 16; early and late
    injection at batch 64), each with converged M = ∞ runs (OOD loss 5 % above ridge's). r at batch 16 − batch 64
    = `manipulation`; the injected arm is `inj_shift` above batch 16; per-run noise sd 0.005 on a (seed, M) level
    shared by the conditions. A share `llc_flagged` of the runs end on a flagged LLC estimate; every run has 3 of
    its 10 estimates flagged (as at initialisation: no minimum)."""
    rows = []
    for seed in range(seeds):
        for M in (*Ms, -1):
            base = 0.2 + 0.1 * np.log2(abs(M)) / 8 + 0.02 * rng.standard_normal()
            for noise, (B, src, sched, emu, eta_b) in CONDITIONS.items():
                shift = {"grad_b16": inj_shift, "late": late_gain, "none64": -manipulation}.get(noise, 0.0)
                rows.append({"M": M, "seed": seed, "batch": B, "noise": noise, "noise_source": src,
                             "noise_schedule": sched, "emulate_batch": emu, "integrated_lr_over_b": eta_b,
                             "sequences": seq_b16 if B == 16 else 64_000,
                             "r": np.nan if M == -1 else base + shift + 0.005 * rng.standard_normal(),
                             "ood_loss": 0.42 if M == -1 else 1.0 - base, "integrated_pne": 1.0 + rng.random(),
                             "integrated_pne_injected": exposure.get(sched, np.nan), "llc_final": 5 + rng.random(),
                             "llc_n_estimates": 10, "llc_n_flagged": 3,
                             "llc_final_flagged": len(rows) % 20 < 20 * llc_flagged})
    return table(rows)


@pytest.mark.unit
def test_h2_is_two_sided_and_h3_matches_by_emulated_batch():
    full = hypothesis_tests(planted(np.random.default_rng(0), 0.1, 0.0), CFG)
    t = primary(full)
    h2, h3 = t.loc["H2"], t.loc["H3"]
    assert h2.gates_passed and h2.n == 6 and abs(h2.estimate - 0.1) < 0.01 and h2.ci_lo > 0.05   # 6 seeds
    assert h2.test == "paired t (late − early) by seed (mean over M), two-sided" and h2.in_family
    pairs = full[full.test.str.startswith("sensitivity: paired t (late − early) by (M, seed)")].iloc[0]
    assert pairs.n == 24 and not pairs.in_family and abs(pairs.estimate - h2.estimate) < 1e-12
    assert h2.verdict.startswith("late noise raises ICL more than early (Holm p")
    assert h3.term == "batch 16 − grad_b16" and h3.n == 24 and h3.verdict.startswith("equivalent") and h3.gates_passed
    # planted late − early = −0.10: significant in the other direction, not "no evidence" (issue 17, point 8)
    t = hypothesis_tests(planted(np.random.default_rng(1), -0.1, 0.1), CFG).pipe(primary)
    assert t.loc["H2"].verdict.startswith("early noise raises ICL more than late (Holm p")
    assert t.loc["H3"].verdict.startswith("equivalence within ±0.05 not shown")
    t = hypothesis_tests(planted(np.random.default_rng(2), 0.0, 0.0), CFG).pipe(primary)
    assert t.loc["H2"].ci_lo < 0 < t.loc["H2"].ci_hi and t.loc["H2"].verdict.startswith("no evidence")


@pytest.mark.unit
def test_h2_with_unequal_realised_exposure_is_inconclusive():
    """Late planted with 2× the realised injected exposure: the old H2 read 'late noise raises ICL more,
    significant'; now it is 'inconclusive: unequal exposure (early 1, late 2)'."""
    t = hypothesis_tests(planted(np.random.default_rng(3), 0.1, exposure={"early": 1.0, "late": 2.0}), CFG)
    h2 = t.pipe(primary).loc["H2"]
    assert not h2.gates_passed and h2.verdict == "inconclusive: unequal exposure (early 1, late 2)"
    t = hypothesis_tests(planted(np.random.default_rng(3), 0.1, exposure={"early": 1.0, "late": 1.08}), CFG)
    assert t.pipe(primary).loc["H2"].gates_passed                     # within 10 %: compared
    t = hypothesis_tests(planted(np.random.default_rng(3), 0.1, exposure={}), CFG)
    assert "realised exposure not recorded" in t.pipe(primary).loc["H2"].verdict


@pytest.mark.unit
def test_arms_that_saw_different_data_are_inconclusive():
    """Batch 16 at equal steps sees 4× fewer sequences than batch 64: H3 compares them, so it is gated."""
    t = hypothesis_tests(planted(np.random.default_rng(4), seq_b16=16_000), CFG).pipe(primary)
    assert t.loc["H3"].verdict == "inconclusive: unequal data (sequences seen 16,000–64,000)"
    assert t.loc["H2"].gates_passed     # early and late both at batch 64: equal data, still compared


@pytest.mark.unit
def test_llc_verdicts_are_gated_by_llc_diagnostics():
    rows = hypothesis_tests(planted(np.random.default_rng(5), llc_flagged=0.4), CFG)
    llc = rows[rows.outcome == "llc_final"].iloc[0]
    assert llc.status == "run" and llc.verdict.startswith("inconclusive: LLC diagnostics (")
    k, n = map(int, llc.verdict.split("(")[1].split(" final")[0].split(" of "))
    fin = planted(np.random.default_rng(5), llc_flagged=0.4).query("M != -1")
    assert (k, n) == (fin.llc_final_flagged.sum(), len(fin)) and k / n > 0.25
    # flags before the end (30 % of all estimates here) do not enter: H4 tests the final estimates
    rows = hypothesis_tests(planted(np.random.default_rng(5), llc_flagged=0.2), CFG)
    assert rows[rows.outcome == "llc_final"].iloc[0].gates_passed


@pytest.mark.unit
def test_unconverged_and_too_few_seeds_are_inconclusive():
    df = planted(np.random.default_rng(6), seeds=2)
    df.loc[(df.M == -1) & (df.batch == 16), "ood_loss"] = 0.6           # 1.5× ridge's
    t = hypothesis_tests(df, CFG).pipe(primary)
    assert t.loc["H3"].verdict.startswith("inconclusive: unconverged (none16/B16: M = ∞ OOD loss 1.50× ridge's)")
    assert "insufficient seeds (2 < 3)" in t.loc["H2"].verdict and "unconverged" not in t.loc["H2"].verdict
    assert not t.verdict.str.contains("significant|raises|increases|equivalent within").any()


@pytest.mark.unit
def test_verdict_words_follow_the_holm_decision():
    """Raw p 0.03 and 0.04 in a family of three: Holm p = 0.09 each, so neither may read as a finding; a gated
    test with p = 1e-10 reads inconclusive and stays out of the family; direction words only for a significant
    effect; a null states its minimum detectable effect."""
    words = ("r increases", "no evidence")
    rows = [_row("H1", "a", "r", p=0.03, words=words), _row("H1", "b", "r", p=0.04, words=words),
            _row("H4", "c", "r", p=0.2, words=words, mde=0.0123),
            _row("H2", "d", "r", p=1e-10, words=words, fails=[("unequal data", "")])]
    v = _verdicts(rows, 0.05)
    assert list(v.p_holm) == pytest.approx([0.09, 0.09, 0.2, np.nan], nan_ok=True)   # statsmodels' Holm: same
    assert v.in_family.tolist() == [True, True, True, False]
    assert v.verdict.tolist()[:3] == ["no evidence (Holm p = 0.09)"] * 2 + [
        "no evidence (could detect |effect| ≥ 0.012; Holm p = 0.2)"]
    assert v.verdict.iloc[3] == "inconclusive: unequal data" and not v.gates_passed.iloc[3]
    assert v.gate_records.iloc[3] == [{"code": "unequal data", "detail": ""}] and v.gate_records.iloc[0] == []
    v = _verdicts([_row("H1", "a", "r", p=0.001, words=words)], 0.05)
    assert v.verdict.iloc[0] == "r increases (Holm p = 0.001)" and v.gates_passed.iloc[0]


@pytest.mark.unit
def test_holm_family_is_the_tests_that_ran_and_passed_their_gates():
    """Issue 42: on the science reference seven H4 tests that did not produce a verdict (one seed) sat in the family
    and turned H1's p 0.008 into Holm p 0.085. Now a not-run, a gated and a sensitivity row are outside it: the
    two passing tests alone make the family (Holm p = 2 × 0.008), whatever the others' p."""
    words = ("r decreases", "no evidence")
    rows = [_row("H1", "a", "r", p=0.008, words=words), _row("H2", "b", "r", p=0.2, words=words),
            *[_row("H4", f"g{i}", "r", p=0.01, words=words, fails=[("insufficient seeds", "1 < 3")]) for i in range(7)],
            _row("H3", "c", "r", status="not run: no injected condition"),
            _row("H1", "s", "r", p=0.001, words=words, family=False)]
    v = _verdicts(rows, 0.05)
    assert v.in_family.tolist() == [True, True] + [False] * 9
    assert v.p_holm.iloc[0] == pytest.approx(0.016) and v.p_holm.iloc[1] == pytest.approx(0.2)
    assert v.p_holm.iloc[2:].isna().all() and v.verdict.iloc[0] == "r decreases (Holm p = 0.016)"
    assert v.verdict.iloc[-1] == "r decreases (sensitivity, not in the Holm family: p = 0.001)"
    t = hypothesis_tests(planted(np.random.default_rng(8)), DERIVED)
    outside = t.test.str.startswith("sensitivity") | t.test.str.startswith("descriptive")
    assert (t.in_family == (t.gates_passed & (t.status == "run") & ~outside)).all()
    assert t[~t.in_family].p_holm.isna().all() and t[t.in_family].p_holm.notna().all()


@pytest.mark.unit
def test_h3_margin_is_half_the_manipulations_effect():
    """Issue 42's done-when: batch 16 − batch 64 = 0.03 (seed sd 0.005) and the injected arm 0.002 from batch 16:
    margin 0.5 × 0.03 ≈ 0.015, equivalent; the manipulation's effect and CI are in the row. With no manipulation
    effect (0) there is nothing to compare sources on: inconclusive, and out of the Holm family. A fixed
    margin (stats.equivalence_margin) replaces the derived one but not the manipulation gate."""
    t = hypothesis_tests(planted(np.random.default_rng(9), inj_shift=0.002), DERIVED).pipe(primary)
    h3 = t.loc["H3"]
    assert h3.manipulation_ci_lo < 0.03 < h3.manipulation_ci_hi and h3.manipulation_ci_lo > 0.02
    assert h3.margin == pytest.approx(0.5 * h3.manipulation_effect) and 0.013 < h3.margin < 0.017
    assert h3.verdict.startswith(f"equivalent within ±{h3.margin:.2g} (Holm p") and h3.in_family
    assert "0.5 × |batch 16 − batch 64|" in h3.test and h3.mde < h3.margin
    t = hypothesis_tests(planted(np.random.default_rng(9), inj_shift=0.002, manipulation=0.0), DERIVED)
    h3 = t.pipe(primary).loc["H3"]
    assert h3.verdict.startswith(f"inconclusive: {NO_MANIPULATION} (batch 16 − batch 64 = ")
    assert not h3.in_family and h3.gate_records[-1]["code"] == NO_MANIPULATION
    # the arms 0.02 apart: outside ±0.015, not shown; inside a stated ±0.05
    t = hypothesis_tests(planted(np.random.default_rng(9), inj_shift=0.02), DERIVED).pipe(primary)
    h3 = t.loc["H3"]
    assert h3.verdict.startswith(f"equivalence within ±{h3.margin:.2g} not shown (could show ±") and h3.margin < 0.02
    t = hypothesis_tests(planted(np.random.default_rng(9), inj_shift=0.02), CFG).pipe(primary)
    assert t.loc["H3"].margin == 0.05 and t.loc["H3"].verdict.startswith("equivalent within ±0.05")


@pytest.mark.unit
def test_h1_rows_by_design():
    """H1's exposure association uses the plain runs only (stated in the row) with M and batch size as factors and
    a random intercept per (M, seed) cell (the batch sizes share cells), sensitivity rows without M = 1 and with a
    seed intercept outside the family, and the paired batch 16 − batch 64 comparison at equal data."""
    df = planted(np.random.default_rng(10), Ms=(1, 4, 16, 64, 256))
    t = hypothesis_tests(df, DERIVED)
    h1 = t[t.hypothesis == "H1"].set_index("test")
    assoc = h1.loc["MixedLM r ~ log(integrated_pne) + C(M) + C(batch) + (1|M:seed), plain runs (no injection)"]
    assert assoc.n == len(df.query("M != -1 and noise_source == 'batch'")) and np.isfinite(assoc.mde)
    assert assoc.in_family and "at fixed batch size" in assoc.verdict
    seed = h1.loc["sensitivity, seed intercept: MixedLM r ~ log(integrated_pne) + C(M) + C(batch) + (1|seed), "
                  "plain runs (no injection)"]
    assert not seed.in_family and seed.n == assoc.n
    pair = h1.loc["paired t (batch 16 − batch 64), plain runs by (M, seed)"]
    assert pair.term == "batch 16 − batch 64" and pair.estimate == pytest.approx(0.03, abs=0.004) and pair.n == 30
    assert pair.verdict.startswith("r higher at batch 16 than at batch 64 (equal data) (Holm p")
    sens = t[t.test.str.startswith("sensitivity, M ≥ 2")]
    assert len(sens) == 1 and not sens.in_family.iloc[0] and sens.n.iloc[0] == assoc.n - 12   # 2 batches × 6 seeds
    assert "sensitivity, not in the Holm family: p = " in sens.verdict.iloc[0]
    t = hypothesis_tests(planted(np.random.default_rng(10)), DERIVED)   # no M = 1: nothing to drop
    assert t[t.test.str.startswith("sensitivity, M ≥ 2")].status.iloc[0] == "not run: no M = 1 runs to leave out"


@pytest.mark.unit
def test_h2_arms_are_conditions_not_schedules():
    """Two conditions with schedule 'early' are not averaged: H2 does not run and says why."""
    df = planted(np.random.default_rng(11))
    twin = df[df.noise == "early"].assign(noise="early2")
    t = hypothesis_tests(pd.concat([df, twin], ignore_index=True), DERIVED).pipe(primary)
    assert t.loc["H2"].status.startswith("not run: more than one condition per schedule (early: ['early', 'early2']")


def phase_panel(rng, inj_effect=0.0, seeds=4, Ms=(1, 4, 16, 64, 256)):
    """Batch 16 and 64 without injection, batch 64 with injection: η/B shifts the threshold (log2 M* 4 vs 6),
    injection shifts r by `inj_effect`. Measured exposure tracks the phase: log P-NE = log(η/B) + 0.5 · r."""
    rows = []
    for seed in range(seeds):
        u = rng.normal(0, 0.05)
        for M in Ms:
            for noise, B in (("none", 16), ("none", 64), ("inj", 64)):
                r = (logistic(np.log2(M), 4.0 if B == 16 else 6.0, 1.0) + u + rng.normal(0, 0.05)
                     + (inj_effect if noise == "inj" else 0.0))
                rows.append({"seed": seed, "M": M, "batch": B, "noise": noise, "r": r, "integrated_lr_over_b": 10 / B,
                             "integrated_pne": np.exp(np.log(10 / B) + 0.5 * r + rng.normal(0, 0.05))})
    return pd.DataFrame(rows)


@pytest.mark.validation
def test_noise_beyond_eta_b_holds_its_size_when_exposure_tracks_the_phase():
    """Planted null (no effect of noise on r, log P-NE = log(η/B) + 0.5·phase): the old 'P-NE beyond η/B' LR test
    rejected 60 of 60 panels (measured again on these panels: 60/60); the test on the manipulated condition,
    at equal η/B and M, rejects 3 of 60 (5 %). Power: a planted injection effect of +0.1 on r is detected in 20 of
    20 panels (+0.05: 19 of 20, measured once, not asserted)."""
    rng = np.random.default_rng(0)
    rejections = sum(h1_noise_beyond_eta_b(phase_panel(rng))["p"] < 0.05 for _ in range(60))
    assert rejections <= 6, rejections
    hits = sum(h1_noise_beyond_eta_b(phase_panel(rng, 0.1))["p"] < 0.05 for _ in range(20))
    assert hits >= 18, hits
    row = h1_noise_beyond_eta_b(phase_panel(rng, 0.1))
    assert row["term"] == "C(noise) | η/B, M (1 df)" and row["effect_size"] < 0   # ΔAIC favours the treatment


@pytest.mark.unit
def test_noise_condition_aliased_with_eta_b_is_not_tested():
    """Injection only at batch 64 and batch noise only at batch 16: no two conditions share an η/B level, so the
    design identifies no contrast at equal η/B and the test says so instead of attributing η/B to the noise."""
    d = phase_panel(np.random.default_rng(7))
    row = h1_noise_beyond_eta_b(d[~((d.noise == "none") & (d.batch == 64))])
    assert row["status"] == "not run: no two noise conditions share an η/B level"


@pytest.mark.unit
def test_a_test_without_p_value_is_inconclusive():
    v = _verdicts([_row("H1", "a", "r", p=float("nan"), words=("r increases", "no evidence"))], 0.05)
    assert v.verdict.iloc[0] == "inconclusive: degenerate test (p undefined)" and not v.gates_passed.iloc[0]


@pytest.mark.unit
def test_h3_at_equal_steps_is_gated_on_steps_and_matched_exposure():
    """An arm that trains batch 16's steps at batch 64 (steps_as_batch) sees 4× the sequences: its H3 row is gated
    on equal steps and matched realised exposure, not equal data, and it stays out of H1 / H2 / H4 (which compare
    runs at the sequence budget)."""
    df = planted(np.random.default_rng(7))
    df["steps"], df["steps_as_batch"] = np.where(df.batch == 16, 4000, 1000), 0
    df["integrated_pne"] = np.where(df.batch == 16, 0.5, 0.12)          # equal data: a quarter of batch 16's
    steps = df[df.noise == "grad_b16"].assign(noise="grad_b16_steps", steps_as_batch=16, steps=4000,
                                              sequences=256_000, integrated_pne=0.55)
    t = hypothesis_tests(pd.concat([df, steps], ignore_index=True), CFG)
    h3 = t[t.hypothesis == "H3"].set_index("term")
    at_data, at_steps = h3.loc["batch 16 − grad_b16"], h3.loc["batch 16 − grad_b16_steps"]
    assert at_data.verdict == "inconclusive: unmatched exposure (batch 16 0.5, grad_b16 0.12 integrated P-NE*)"
    assert at_steps.gates_passed and "equal steps" in at_steps.test and at_steps.verdict.startswith("equivalent")
    h1 = t[(t.hypothesis == "H1") & (t.outcome == "r")].iloc[0]   # exposure set by batch: nothing at fixed batch
    assert h1.status.startswith("not run: integrated_pne is a function of batch size")
    pair = t.set_index("test").loc["paired t (batch 16 − batch 64), plain runs by (M, seed)"]
    assert pair.n == len(df.query("M != -1 and noise_source == 'batch' and batch == 16"))
    assert "unequal data" not in pair.verdict
    # exposure 0.8 against 0.5 (60 % more) fails the 25 % gate; steps that differ fail the steps gate
    t = hypothesis_tests(pd.concat([df, steps.assign(integrated_pne=0.8)], ignore_index=True), CFG)
    assert "unmatched exposure (batch 16 0.5, grad_b16_steps 0.8" in t.set_index("term").loc[
        "batch 16 − grad_b16_steps"].verdict
    t = hypothesis_tests(pd.concat([df, steps.assign(steps=3000)], ignore_index=True), CFG)
    assert "unequal steps (3,000–4,000)" in t.set_index("term").loc["batch 16 − grad_b16_steps"].verdict


@pytest.mark.unit
def test_llc_verdicts_count_estimates_that_measure_the_sampler_apart():
    """Issue 44: final LLC estimates flagged unstable / escaped (method §7) gate H4's LLC test on their own count,
    beside the not-levelled / negative / diverged one; tables from before the flags (null) pass as before."""
    df = planted(np.random.default_rng(5))
    fin = df.M != -1
    df["llc_final_sampler"] = df["llc_final_sampler"].astype(object)
    df.loc[fin, "llc_final_sampler"] = np.arange(fin.sum()) % 10 < 4            # 40 % of the final estimates
    llc = hypothesis_tests(df, CFG).query("outcome == 'llc_final'").iloc[0]
    k = int(df.loc[fin, "llc_final_sampler"].sum())
    assert llc.verdict == f"inconclusive: LLC measures the sampler ({k} of {int(fin.sum())} final estimates " \
                         "unstable / escaped)"
    df.loc[fin, "llc_final_sampler"] = np.arange(fin.sum()) % 10 < 2            # 20 %: within the 25 % share
    assert hypothesis_tests(df, CFG).query("outcome == 'llc_final'").iloc[0].gates_passed
    assert hypothesis_tests(planted(np.random.default_rng(5)), CFG).query("outcome == 'llc_final'").iloc[0].gates_passed
