"""CNR by common random numbers (iclnoise.run.crn, `iclnoise cnr`; method §13): the run's own noise as a
counterfactual changes nothing exactly, each member is bit for bit the plain retraining of its spec, realisations
are other noise on the same data, and ΔE f's standard error covers at its stated rate (simulated)."""
import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from iclnoise.analysis.stats import paired_effects
from iclnoise.cli import main
from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.io import read_parquet, write_json
from iclnoise.core.runspec import RunSpec
from iclnoise.run.crn import METRICS, counterfactual, crn, member_spec
from iclnoise.run.train import train_run

RUN = "M4-B16-late-s0"
LATE = {"source": "param", "shape": "diagonal", "schedule": "late", "fraction": 0.5, "budget": 0.004}
CFS = ["self", "self*3", "none", "self+shape=isotropic", "lategrad", "self+layers=blocks.1,unembed"]


def _params(tiny, rng):
    p = copy.deepcopy(tiny)
    p["train"]["rng"] = rng
    p["train"]["checkpoints"] = {"linear": 2, "log": 2}
    p["noise"]["conditions"].update(late=LATE, lategrad={**LATE, "source": "grad", "budget": 0.002})
    return p


def _cfg(p):
    return json.dumps({"noise": p["noise"]})


@pytest.fixture(scope="module", params=["generator", "counter"])
def forked(request, tiny, one_thread, tmp_path_factory):
    p = _params(tiny, request.param)
    rd = tmp_path_factory.mktemp(f"crn-{request.param}") / RUN
    rd.mkdir()
    spec = run_spec(p, RUN)
    write_json({**spec, "spec_hash": spec_hash(spec)}, rd / "run.json")
    main(["cnr", str(rd), "--counterfactual", *CFS, "--realisations", "2", "--cfg", _cfg(p)])
    return p, spec, rd


@pytest.mark.numerics
@pytest.mark.unit
def test_the_runs_own_noise_as_a_counterfactual_changes_nothing_exactly(forked):
    """`self` trained again as its own members (other slots of the same ensemble): ΔE f = 0 and SE 0 exactly, for
    every metric, while the realisations themselves differ (two noise streams) and the counterfactuals move f."""
    _, _, rd = forked
    eff, val = read_parquet(rd / "crn.parquet"), read_parquet(rd / "crn_realisations.parquet")
    own = eff[eff.counterfactual == "self"]
    assert len(own) == len(METRICS) and (own.crn_mean == 0).all() and (own.crn_se == 0).all()
    assert (own.n_realisations == 2).all() and (eff.t0 == 30).all()   # the window of fraction 0.5 of 60 steps
    assert not (rd / "crn_work").exists()   # the members' directories, removed once the tables are written
    r = val[(val.metric == "ood_loss")].set_index(["counterfactual", "realisation"]).value
    assert r["self", 0] != r["self", 1]            # noise_seed 0 and 1: other noise
    assert r["self", 1] == r["reference", 1]
    assert r["none", 0] == r["none", 1]            # no noise: the realisations are one run
    for cf in CFS[1:]:
        assert r[cf, 0] != r["self", 0], cf


@pytest.mark.numerics
@pytest.mark.unit
@pytest.mark.parametrize("cf,i", [("self*3", 1), ("none", 0), ("self+shape=isotropic", 0), ("lategrad", 1),
                                  ("self+layers=blocks.1,unembed", 1)])
def test_each_member_is_its_specs_plain_retraining_bit_for_bit(forked, cf, i, tmp_path):
    """Member (cf, i), forked at t0 from the shared state and trained in the ensemble of all fourteen, ends with the
    final metrics of its spec trained alone from step 0 (N = 1 of a counterfactual is plain retraining), whether
    its injector is the run's (budget × 3), another shape, another source, the run's on some layers, or none (one
    thread)."""
    p, spec, rd = forked
    val = read_parquet(rd / "crn_realisations.parquet")
    want = val[(val.counterfactual == cf) & (val.realisation == i)].set_index("metric").value
    alone = train_run(member_spec(spec, counterfactual(cf, p["noise"]["conditions"], RunSpec.of(spec)), i),
                      tmp_path / "alone", progress=False).iloc[-1]
    for k in METRICS:
        assert alone[k] == want[k] or math.isnan(alone[k]) and math.isnan(want[k]), (k, alone[k], want[k])


@pytest.mark.unit
def test_counterfactuals_cnr_cannot_fork_are_refused(tiny):
    p = _params(tiny, "generator")
    spec = run_spec(p, RUN)
    conds = p["noise"]["conditions"]
    p["noise"]["conditions"]["const"] = {**LATE, "schedule": "constant", "fraction": None}
    with pytest.raises(ValueError, match="before the fork at t0 = 30"):
        crn(spec, ["self+schedule=constant"], conds, 1)
    with pytest.raises(ValueError, match="before the fork at t0 = 40"):
        crn(spec, [], conds, 1, t0=40)      # the run's own window starts at 30
    with pytest.raises(ValueError, match="not a noise condition"):
        crn(spec, ["nope"], conds, 1)
    with pytest.raises(ValueError, match="expected NAME"):
        crn(spec, ["self*"], conds, 1)
    with pytest.raises(ValueError, match="noise_seed is not the noise's"):
        crn(spec, ["self+noise_seed=3"], conds, 1)
    with pytest.raises(ValueError, match="emulate_batch"):
        counterfactual("eb*2", {"eb": {"source": "grad", "shape": "diagonal", "emulate_batch": 8}}, RunSpec.of(spec))
    with pytest.raises(ValueError, match="relative_dose"):
        counterfactual("rel*2", {"rel": {**LATE, "budget": None, "relative_dose": 3}}, RunSpec.of(spec))
    with pytest.raises(ValueError, match="shape"):
        counterfactual("self+shape=round", conds, RunSpec.of(spec))
    with pytest.raises(ValueError, match="outside the run's training steps"):
        crn(spec, [], conds, 1, t0=60)
    with pytest.raises(ValueError, match="blocks.9 names no parameter"):
        crn(spec, ["self+layers=blocks.9"], conds, 1)
    assert counterfactual("self+layers=blocks.1,embed", conds, RunSpec.of(spec)).noise["layers"] == ["blocks.1",
                                                                                                    "embed"]
    assert counterfactual("self*0", conds, RunSpec.of(spec)).noise == {"source": "none"}
    assert counterfactual("late*0.5", conds, RunSpec.of(spec)).noise["budget"] == 0.002


@pytest.mark.unit
def test_paired_effects_known_answer_and_coverage():
    """A planted effect: f(c, i) = f(self, i) + δ_c + e_ci with a seed term 100× the effect's spread. ΔE f is the
    mean paired difference (known answer, by hand), and over 4000 simulated experiments of N = 8 the interval
    crn_mean ± t(0.975, 7)·crn_se covers δ at 0.95 (measured 0.944-0.958 over generator seeds 0-4; the band is
    ±4 binomial SE, 0.014). An unpaired SE is ~140× wider here (the seed term) and covers at 1.000: it could not
    tell δ from 0."""
    g = np.random.default_rng(0)
    n, reps, delta = 8, 4000, 0.01
    base = g.normal(0, 1.0, (reps, n))                       # per realisation: shared by both arms
    cf = base + delta + g.normal(0, 0.01, (reps, n))
    rows = [{"counterfactual": c, "metric": f"m{j}", "realisation": i, "value": v[j, i]}
            for c, v in (("self", base), ("c", cf)) for j in range(reps) for i in range(n)]
    eff = paired_effects(pd.DataFrame(rows)).set_index(["counterfactual", "metric"])
    d = cf - base
    assert np.allclose(eff.loc["c"].crn_mean.to_numpy(), d.mean(1), rtol=0, atol=1e-12)
    assert np.allclose(eff.loc["c"].crn_se.to_numpy(), d.std(1, ddof=1) / math.sqrt(n), rtol=1e-12)
    assert (eff.loc["self"].crn_mean == 0).all() and (eff.n_realisations == n).all()
    t = stats.t.ppf(0.975, n - 1)
    cover = float((np.abs(eff.loc["c"].crn_mean - delta) <= t * eff.loc["c"].crn_se).mean())
    assert abs(cover - 0.95) <= 4 * math.sqrt(0.95 * 0.05 / reps)
    unpaired = np.sqrt(cf.var(1, ddof=1) / n + base.var(1, ddof=1) / n)
    assert (np.abs(eff.loc["c"].crn_mean.to_numpy() - delta) <= t * unpaired).mean() > 0.999


@pytest.mark.unit
def test_the_two_first_order_forms_known_answer():
    """`predict`'s two forms from the same sensitivities (method §13): ḡ ln k and ḡ (k − 1), each with SE
    |x| sd(g)/√N, by hand; the log form has no prediction at k = 0, the linear one does; their gap is second order,
    (k − 1) − ln k → (ln k)²/2 as k → 1, and ≥ 0 everywhere; an unknown form is refused."""
    from iclnoise.run.pathwise import METRICS as PM
    from iclnoise.run.pathwise import predict

    gs = [{m: v * (j + 1) for j, m in enumerate(PM)} for v in (0.1, 0.3, 0.2, 0.6)]
    for j, m in enumerate(PM):
        v = np.array([gi[m] for gi in gs])
        sd = v.std(ddof=1) / 2
        for k in (0.25, 0.5, 1.5, 4.0):
            for form, x in (("log", math.log(k)), ("linear", k - 1)):
                pred, se = predict(gs, k, form)[m]
                assert pred == pytest.approx(v.mean() * x, rel=1e-12) and se == pytest.approx(abs(x) * sd, rel=1e-9)
        assert math.isnan(predict(gs, 0.0)[m][0])
        assert predict(gs, 0.0, "linear")[m][0] == pytest.approx(-v.mean(), rel=1e-12)
        assert predict(gs, 1.0, "linear")[m] == predict(gs, 1.0)[m] == (0.0, 0.0)
    m = PM[0]   # ḡ = 0.3
    for k in (0.9, 0.99, 1.01, 1.1):
        gap = predict(gs, k, "linear")[m][0] - predict(gs, k)[m][0]
        lk = math.log(k)
        assert gap >= 0 and gap == pytest.approx(0.3 * lk * lk / 2, rel=abs(lk))
    with pytest.raises(ValueError, match="form must be"):
        predict(gs, 2.0, "quadratic")


@pytest.mark.unit
def test_the_crn_table_is_drawn(forked, tmp_path):
    """`iclnoise cnr-figure` draws a CRN effects table (crn.parquet's columns as CSV) and names what a table lacks;
    `iclnoise cnr` refuses a work directory it would remove with something else in it."""
    p, _, rd = forked
    eff = read_parquet(rd / "crn.parquet")
    eff[eff.counterfactual != "reference"].to_csv(tmp_path / "effects.csv", index=False)
    main(["cnr-figure", str(tmp_path / "effects.csv"), "--out", str(tmp_path / "crn")])
    assert {p.suffix for p in tmp_path.glob("crn.*")} == {".png", ".pdf", ".parquet"}
    for work in (rd, rd.parent):   # a work directory is removed at the end: never the run's or one holding it
        with pytest.raises(SystemExit, match="holds the run directory"):
            main(["cnr", str(rd), "--counterfactual", "none", "--cfg", _cfg(p), "--work", str(work)])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="not members' run directories"):
        main(["cnr", str(rd), "--counterfactual", "none", "--cfg", _cfg(p), "--work", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").exists()
    eff[["metric", "seed"]].to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(SystemExit, match="not a CRN table .*counterfactual, crn_mean, crn_se, n_realisations"):
        main(["cnr-figure", str(tmp_path / "bad.csv")])


@pytest.mark.unit
def test_the_reported_check_judges_each_first_order_form(tmp_path):
    """The report's CNR section (report.crn_section) gives Spearman ρ and interval coverage per form where the
    table has both (predicted: ḡ ln k; predicted_linear: ḡ (k − 1)), over the pairs each form predicts and inside
    the local range, over the pairs both predict; by hand on a planted table whose truth is linear in k: the linear
    form covers every row, the log form misses k = 2 and 4 and has no prediction at k = 0. Figure 13 draws both."""
    from iclnoise.output.figures.cnr import fig_crn
    from iclnoise.output.report import crn_section

    g, ks = 0.01, [0.0, 0.5, 0.75, 1.5, 2.0, 4.0]
    rows = []
    for k in ks:
        row = {"counterfactual": f"self*{k}" if k else "none", "seed": 0, "metric": "r", "n_realisations": 8,
               "crn_mean": g * (k - 1), "crn_se": 0.001, "k": k, "local": k > 0 and abs(math.log(k)) / 2 <= 0.5}
        for col, x in (("predicted", math.log(k) if k else math.nan), ("predicted_linear", k - 1)):
            row |= {col: g * x, f"{col}_lo": g * x - 0.002, f"{col}_hi": g * x + 0.002}
        rows.append(row)
    text = "\n".join(crn_section(pd.DataFrame(rows)))
    assert "every counterfactual with a prediction, ḡ ln k: Spearman ρ 1.00 over 5 (counterfactual, seed) pairs; " \
           "interval coverage 0.60" in text   # misses k = 2 (0.0031 off) and 4 (0.016 off)
    assert "inside the estimator's local range, ḡ ln k: Spearman ρ 1.00 over 4" in text
    assert "every counterfactual with a prediction, ḡ (k − 1): Spearman ρ 1.00 over 5 (counterfactual, seed) " \
           "pairs; interval coverage 1.00" in text   # the pairs both forms predict (k = 0 only in the table)
    assert {p.suffix for p in fig_crn(pd.DataFrame(rows), tmp_path / "fig")} == {".png", ".pdf", ".parquet"}


@pytest.mark.unit
def test_the_band_between_the_forms_known_answer(tmp_path, capsys):
    """crn_pathwise.judge adds the band between the two forms: its point the midpoint ḡ (ln k + k − 1) / 2, its
    interval from the lower of their lower ends to the higher of their upper ends. By hand on a planted truth
    ḡ (√k − 1) / ½ (curvature in ln k half of ḡ), intervals ± 0.0005 with ḡ = 0.01: at k = 0.25, 0.5, 2 and 4 the
    truth misses both forms' intervals (0.25: −0.01 against −0.0139 and −0.0075) yet lies between them; the band
    covers every k > 0, the log form only k = 0.75 and 1.5. The report gives the band's ρ and coverage."""
    import sys
    from pathlib import Path

    from iclnoise.output.report import crn_section

    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments" / "reproductions"))
    from crn_pathwise import judge

    g, ks = 0.01, [0.25, 0.5, 0.75, 1.5, 2.0, 4.0]
    rows = []
    for k in ks:
        row = {"counterfactual": f"self*{k}", "seed": 0, "metric": "r", "n_realisations": 8, "k": k,
               "crn_mean": g * (math.sqrt(k) - 1) / 0.5, "crn_se": 1e-4}
        for col, x in (("predicted", math.log(k)), ("predicted_linear", k - 1)):
            row |= {col: g * x, f"{col}_se": 2e-4, f"{col}_lo": g * x - 5e-4, f"{col}_hi": g * x + 5e-4}
        rows.append(row)
    df = judge(pd.DataFrame(rows), str(tmp_path / "t.csv"))
    assert df.covered_band.all() and df.covered.tolist() == [False, False, True, True, False, False]
    k = df.k.to_numpy()
    assert np.allclose(df.predicted_band, g * (np.log(k) + k - 1) / 2)
    assert np.allclose(df.predicted_band_lo, g * np.minimum(np.log(k), k - 1) - 5e-4)
    assert np.allclose(df.predicted_band_hi, g * np.maximum(np.log(k), k - 1) + 5e-4)
    assert "the band between them: r, every k > 0: Spearman ρ 1.00 over 6; coverage 1.00;" in capsys.readouterr().out
    text = "\n".join(crn_section(pd.read_csv(tmp_path / "t.csv")))
    assert "every counterfactual with a prediction, the band between the two forms: Spearman ρ 1.00 over 6 " \
           "(counterfactual, seed) pairs; interval coverage 1.00" in text
    assert "every counterfactual with a prediction, ḡ ln k: Spearman ρ 1.00 over 6 (counterfactual, seed) pairs; " \
           "interval coverage 0.33" in text


@pytest.mark.unit
def test_the_attached_science_check_is_its_committed_tables_judged(tmp_path):
    """reference/science/crn/crn.csv (issue 67's check, attached with `iclnoise paper --attach-crn`) is what
    crn_check.table makes of the committed per-seed tables in reference/measurements/crn/ (the CRN members' metrics
    and the pathwise g of seeds 0-2), and so are their effects.csv: float64 arithmetic on stored numbers, so equal to
    the CSVs' 6 significant digits."""
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    sys.path.insert(0, str(root / "experiments" / "reproductions"))
    from crn_check import table

    table(root / "reference/measurements/crn", [0, 1, 2], 8, tmp_path / "crn.csv")
    for got, want in ((tmp_path / "crn.csv", root / "reference/science/crn/crn.csv"),
                      (tmp_path / "effects.csv", root / "reference/measurements/crn/effects.csv")):
        got, want = pd.read_csv(got), pd.read_csv(want)
        assert list(got.columns) == list(want.columns) and len(got) == len(want) > 0
        num = got.select_dtypes("number").columns
        assert got.drop(columns=num).equals(want.drop(columns=num))
        assert np.allclose(got[num].astype(float), want[num].astype(float), rtol=1e-5, atol=0, equal_nan=True)


@pytest.mark.integration
def test_snakemake_crn_plans_one_job_per_injecting_run_of_the_seeds(tmp_path):
    """`snakemake crn` (cnr.enabled): one crn_run job per run of cnr.seeds that injects noise (Snakemake's dry run),
    none without cnr.enabled; `snakemake cnr` one cnr_run (iclnoise cnr-pathwise) per such run."""
    import re
    import subprocess
    import sys

    import yaml

    cfg = {"grid": {"M": [4, 8], "seeds": [0, 1], "batch_sizes": [16], "noise": ["none", "lateparam"]},
           "noise": {"conditions": {"lateparam": LATE}},
           "cnr": {"enabled": True, "seeds": [1], "counterfactuals": ["none", "self*2"], "realisations": 2,
                   "k": [0.5, 2], "jac_batch": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "params.yaml").write_text(open("params.yaml").read())   # read from the working directory

    def jobs(*extra, target="crn"):
        out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "--configfile",
                              str(tmp_path / "c.yaml"), *extra, "--directory", str(tmp_path), target], cwd=".",
                             capture_output=True, text=True)
        return out.stdout + out.stderr

    plan = jobs()
    assert re.search(r"(?m)^crn_run\s+2$", plan), plan[-2000:]
    assert "crn_run" not in jobs("--config", "cnr={enabled: false}")
    plan = jobs(target="cnr")   # `snakemake cnr`: the pathwise estimator's jobs
    assert re.search(r"(?m)^cnr_run\s+2$", plan) and "iclnoise cnr-pathwise" in plan, plan[-2000:]


class Killed(Exception):
    pass


@pytest.mark.numerics
@pytest.mark.unit
def test_a_killed_crn_resumes_from_its_work_directory_to_the_same_numbers(tiny, one_thread, tmp_path, monkeypatch):
    """Killed while the members' states at the last commit are being written (two of four saved), `crn` called again
    with the same work directory resumes the ensemble from the commit before (the fork's states are not rebuilt) and
    ends bit for bit where an uninterrupted call ends."""
    import iclnoise.run.ensemble as ens

    p = _params(tiny, "counter")
    p["train"]["checkpoints"] = {"linear": 4, "log": 2}   # commits at 0, 1, 15, 30, 45, 60: two inside the window
    spec, conds = run_spec(p, RUN), p["noise"]["conditions"]
    whole = crn(spec, ["self*3"], conds, 2, work=tmp_path / "whole")
    save, saved = ens.save_resume, []

    def dying(m, state):
        if state["commit"] == 60 and len(saved) == 2:
            raise Killed
        saved.extend([1] if state["commit"] == 60 else [])
        save(m, state)

    monkeypatch.setattr(ens, "save_resume", dying)
    with pytest.raises(Killed):
        crn(spec, ["self*3"], conds, 2, work=tmp_path / "killed")
    monkeypatch.setattr(ens, "save_resume", save)
    built = []
    monkeypatch.setattr("iclnoise.run.crn.states_at", lambda *a: built.append(1))
    again = crn(spec, ["self*3"], conds, 2, work=tmp_path / "killed")
    assert not built
    pd.testing.assert_frame_equal(again, whole)


@pytest.mark.unit
def test_a_second_call_forks_from_the_kept_state_to_the_same_numbers(tiny, one_thread, tmp_path, monkeypatch):
    """`crn(..., fork=F)` writes the reference's state at t0 to F; a second call with more counterfactuals forks its
    reference-structure members from F (only another structure trains its first t0 steps), and every member ends
    bit for bit where one call with all the counterfactuals ends; a state at another step is refused."""
    import iclnoise.run.crn as crn_mod
    from iclnoise.run.runs import load_torch, save_torch

    p = _params(tiny, "counter")
    spec, conds, fork = run_spec(p, RUN), p["noise"]["conditions"], tmp_path / "fork.pt"
    first = crn(spec, ["self*3"], conds, 2, fork=fork)
    trained, states_at = [], crn_mod.states_at
    monkeypatch.setattr(crn_mod, "states_at", lambda raw, cfs, *a: trained.extend(cfs) or states_at(raw, cfs, *a))
    second = crn(spec, ["self*0.5", "self+shape=isotropic"], conds, 2, fork=fork)
    assert [cf.text for cf in trained] == ["self+shape=isotropic"]
    whole = crn(spec, ["self*3", "self*0.5", "self+shape=isotropic"], conds, 2)
    key = ["counterfactual", "realisation", "metric"]
    both = pd.concat([first, second[second.counterfactual != "reference"]]).sort_values(key, ignore_index=True)
    pd.testing.assert_frame_equal(both, whole.sort_values(key, ignore_index=True))
    pd.testing.assert_frame_equal(first[first.counterfactual == "reference"],
                                  second[second.counterfactual == "reference"])
    save_torch({**load_torch(fork, "cpu"), "step": 20}, fork)
    with pytest.raises(ValueError, match="not the fork's t0 = 30"):
        crn(spec, ["self*2"], conds, 1, fork=fork)


@pytest.mark.numerics
@pytest.mark.unit
@pytest.mark.parametrize("name", ["late", "lategrad"])
def test_the_pathwise_derivative_along_a_realisation_is_its_central_difference(tiny, one_thread, tmp_path, name):
    """The first-order pathwise estimator's known answer, per path: dr/d ln k, dOOD/d ln k and dΔ(f, ridge)/d ln k
    along realisations 0-2 (iclnoise.run.pathwise, Jacobian on the whole batch) against central differences of CRN
    members at ln k = ±0.03 along the same realisations (the closed loop and second order all in there) on the tiny
    model, counter stream: parameter-space noise at budget 0.004, and gradient-space noise at 0.002 without gradient
    clipping. Measured: least-squares slope of pathwise on difference 1.11 and 0.96, correlation 0.999 and 0.9999 over
    the 9 pairs; a tangent of the wrong sign or size (ξ instead of ½ ξ: slope 2.2) fails. The state it replays from is
    the one `crn` keeps (`fork`): the run's plain state at t0. Where the clip acts it fails, as the held clip factor
    says it may: gradient-space noise with clipping at 1.0 (87 % of the window's steps clipped, median c² 0.55) reads
    slope −0.30, correlation −0.34 (method §13)."""
    import copy as cp

    import torch

    from iclnoise.run.member import RESUME
    from iclnoise.run.pathwise import sensitivity
    from iclnoise.run.runs import load_torch
    from iclnoise.run.train import train_ensemble

    p = _params(tiny, "counter")
    if name == "lategrad":
        p["train"]["grad_clip"] = None   # the held clip factor: the estimator's stated range
    spec, conds = run_spec(p, RUN.replace("late", name)), p["noise"]["conditions"]
    train_ensemble([spec], [tmp_path / "s0"], progress=False, stop_after=30)
    state = load_torch(tmp_path / "s0" / RESUME, "cpu")
    up, down = f"self*{math.exp(0.03):.6g}", f"self*{math.exp(-0.03):.6g}"
    v = crn(spec, [up, down], conds, 3, fork=tmp_path / "fork.pt")
    kept = load_torch(tmp_path / "fork.pt", "cpu")
    assert kept["step"] == 30 and all(torch.equal(state["params"][n], kept["params"][n]) for n in state["params"])
    state = kept
    own = counterfactual("self", conds, RunSpec.of(spec))
    pw, fd = [], []
    for i in range(3):
        g = sensitivity(RunSpec.of(member_spec(spec, own, i)), cp.deepcopy(state), 16)
        w = v[v.realisation == i].pivot_table(index="metric", columns="counterfactual", values="value")
        for k in ("r", "ood_loss", "ood_delta_ridge"):
            pw.append(g[k])
            fd.append((w.loc[k, up] - w.loc[k, down]) / 0.06)
    pw, fd = np.array(pw), np.array(fd)
    slope, corr = float(pw @ fd / (fd @ fd)), float(np.corrcoef(pw, fd)[0, 1])
    assert 0.7 <= slope <= 1.3 and corr >= 0.95, (slope, corr)


@pytest.mark.unit
def test_realisations_replayed_together_give_each_ones_own_sensitivity(tiny, one_thread, tmp_path):
    """`sensitivities` replays realisations 0-2 in one ensemble (stacked training, a tangent each): each g equals its
    realisation's replay alone, bit for bit (one thread), and the realisations differ."""
    from iclnoise.run.pathwise import fork_state, sensitivities, sensitivity

    p = _params(tiny, "counter")
    spec = run_spec(p, RUN)
    state = fork_state(spec, 30)
    cf = counterfactual("self", {}, RunSpec.of(spec))
    specs = [RunSpec.of(member_spec(spec, cf, i)) for i in range(3)]
    together = sensitivities(specs, state, 16)
    assert together == [sensitivity(s, state, 16) for s in specs]
    assert len({g["r"] for g in together}) == 3


@pytest.mark.unit
def test_layer_groups_and_windows_split_the_pathwise_sensitivity(tiny, one_thread, tmp_path):
    """Per layer group (blocks.0, blocks.1 and the rest: embeddings, final norm, unembedding) and per window of the
    noise's [30, 60) (three of 10 steps), the tangents of one replay add up to the whole noise's g for every metric
    (to float32 round-off of the sum), and the groups' g differ. Known answers: the last window's g is the whole g of
    a replay forked at step 50 from the same realisation; on a run whose noise is restricted to blocks.1
    (noise.layers) the other groups' g is exactly 0 and blocks.1's is the whole g. Overlapping groups are refused."""
    from iclnoise.run.crn import Counterfactual, states_at
    from iclnoise.run.pathwise import fork_state, sensitivity, split_sensitivities

    def adds_up(parts: list[dict], whole: dict, what) -> None:
        for k, g in whole.items():
            v = [q[k] for q in parts]
            assert sum(v) == pytest.approx(g, rel=1e-4, abs=1e-6 * max(map(abs, v))), (what, k)

    p = _params(tiny, "counter")
    for layers in (None, ["blocks.1"]):
        if layers:
            p["noise"]["conditions"]["late"] = {**LATE, "layers": layers}
        spec = run_spec(p, RUN)
        state = fork_state(spec, 30)
        own = counterfactual("self", {}, RunSpec.of(spec))
        one = RunSpec.of(member_spec(spec, own, 0))
        whole = sensitivity(one, copy.deepcopy(state), 16)
        (by,) = split_sensitivities([one], copy.deepcopy(state), 16, ["blocks.0", "blocks.1"], windows=3)
        groups, spans = ["blocks.0", "blocks.1", "rest"], [(30, 40), (40, 50), (50, 60)]
        assert list(by) == [(g, a, b) for g in groups for a, b in spans]
        adds_up(list(by.values()), whole, layers)
        if layers:
            assert all(v == 0 for (g, *_), q in by.items() if g != "blocks.1" for v in q.values())
            adds_up([by["blocks.1", a, b] for a, b in spans], whole, "blocks.1")
            continue
        assert len({q["r"] for q in by.values()}) == 9 and all(q["r"] != 0 for q in by.values())
        mine = Counterfactual("0", member_spec(spec, own, 0)["noise"])   # realisation 0's stream up to step 50
        at50 = states_at(spec, [mine], 50, tmp_path / "fork", "cpu")[mine.structure]
        adds_up([by[g, 50, 60] for g in groups], sensitivity(one, at50, 16), "the last window")
    with pytest.raises(ValueError, match="overlap"):
        split_sensitivities([one], state, 16, ["blocks.0", "blocks.0.attn"])
    with pytest.raises(ValueError, match="windows = 31"):
        split_sensitivities([one], state, 16, windows=31)


@pytest.mark.integration
def test_cnr_pathwise_predicts_the_same_from_the_kept_fork_and_from_its_own(tiny, one_thread, tmp_path):
    """`iclnoise cnr-pathwise` replays from the state `iclnoise cnr --fork` keeps or from one it trains itself, to the
    same numbers; its ḡ is the mean of the realisations' sensitivities (noise_seed 0, 1: the realisations CRN pairs)
    and its prediction ḡ ln k ± |ln k| SE; split by --layers and --windows, the groups' ḡ add up to it; k ≤ 0 and a
    run without noise are refused with the reason."""
    import copy as cp

    from iclnoise.run.pathwise import sensitivity
    from iclnoise.run.runs import load_torch

    p = _params(tiny, "counter")
    rd, fork = tmp_path / RUN, tmp_path / "fork.pt"
    rd.mkdir()
    spec = run_spec(p, RUN)
    write_json({**spec, "spec_hash": spec_hash(spec)}, rd / "run.json")
    main(["cnr", str(rd), "--counterfactual", "self*2", "--realisations", "2", "--cfg", _cfg(p), "--fork", str(fork)])
    common = ["cnr-pathwise", str(rd), "--k", "0.5", "2", "--realisations", "2", "--jac-batch", "16"]
    main([*common, "--fork", str(fork), "--out", str(tmp_path / "kept.parquet")])
    main([*common, "--out", str(tmp_path / "own.parquet")])
    kept, own = (read_parquet(tmp_path / f"{n}.parquet").drop(columns="seconds") for n in ("kept", "own"))
    pd.testing.assert_frame_equal(kept, own)
    assert (kept.layers == "all").all() and (kept.window_start == 30).all() and (kept.window_stop == 60).all()
    main([*common, "--fork", str(fork), "--layers", "blocks.0", "--windows", "2", "--out", str(tmp_path / "split.pq")])
    split = read_parquet(tmp_path / "split.pq")
    assert set(zip(split.layers, split.window_start, split.window_stop)) == {
        (g, a, b) for g in ("blocks.0", "rest") for a, b in ((30, 45), (45, 60))}
    total = split.groupby(["metric", "k"]).g.sum()
    for r in kept.itertuples():
        assert total[r.metric, r.k] == pytest.approx(r.g, rel=1e-4, abs=1e-9), r.metric
    cf = counterfactual("self", {}, RunSpec.of(spec))
    g = [sensitivity(RunSpec.of(member_spec(spec, cf, i)), cp.deepcopy(load_torch(fork, "cpu")), 16) for i in (0, 1)]
    for r in kept.itertuples():
        v = [gi[r.metric] for gi in g]
        assert r.g == pytest.approx(np.mean(v), rel=1e-12) and r.t0 == 30 and r.n_realisations == 2
        assert r.predicted == pytest.approx(r.g * math.log(r.k), rel=1e-12)
        assert r.predicted_se == pytest.approx(abs(math.log(r.k)) * np.std(v, ddof=1) / math.sqrt(2), rel=1e-9)
    with pytest.raises(SystemExit, match="every k must be > 0"):
        main([*common[:3], "0", "2", *common[5:]])
    # a fork between two commits (23: no checkpoint step) is the state at that step, as crn keeps it
    from iclnoise.run.pathwise import fork_state
    mid = fork_state(spec, 23)
    crn(spec, [], p["noise"]["conditions"], 1, t0=23, fork=tmp_path / "mid.pt")
    kept = load_torch(tmp_path / "mid.pt", "cpu")
    assert mid["step"] == kept["step"] == 23
    assert all(torch.equal(mid["params"][n], w) for n, w in kept["params"].items())
    none = tmp_path / RUN.replace("late", "none")
    none.mkdir()
    plain = run_spec(p, none.name)
    write_json({**plain, "spec_hash": spec_hash(plain)}, none / "run.json")
    with pytest.raises(SystemExit, match="injects no noise"):
        main(["cnr-pathwise", str(none)])


@pytest.mark.validation
def test_the_committed_small_scale_crn_means_reproduce(one_thread):
    """reference/reproductions/crn_replay.csv's seed-0 row for self*2 (r and the OOD loss) comes out of `crn` again:
    the same setting (experiments/reproductions/crn_pathwise.py's docstring), with only that counterfactual beside the
    reference
    (a member's numbers do not depend on its ensemble). Equal to the CSV's 6 digits on the machine that wrote it;
    elsewhere float32 rounds otherwise, so the bound is a quarter of the mean's own SE."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "experiments" / "reproductions"))
    from tiny import params

    p = params(200)
    p["train"]["checkpoints"] = {"linear": 2, "log": 2}
    p["noise"]["conditions"]["late"] = {"source": "param", "shape": "diagonal", "schedule": "late", "fraction": 0.5,
                                        "budget": 0.05}
    eff = paired_effects(crn(run_spec(p, "M8-B64-late-s0"), ["self*2"], p["noise"]["conditions"], 8, 100),
                         "reference").set_index(["counterfactual", "metric"])
    ref = pd.read_csv("reference/reproductions/crn_replay.csv").set_index(["seed", "counterfactual", "metric"])
    for metric in ("r", "ood_loss"):
        got, want = eff.loc[("self*2", metric)], ref.loc[(0, "self*2", metric)]
        assert abs(got.crn_mean - want.crn_mean) <= 0.25 * want.crn_se, (metric, got.crn_mean, want.crn_mean)
