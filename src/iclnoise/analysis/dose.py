"""The dose–response of ICL to an injected noise dose (method §11 'Dose–response'; issue 43): the per-run dose table,
the operating regime, and the slopes of r and of log2 M* against log10 dose with their intervals.

A dose series is one injected source, shape and schedule at one batch size: injection with an integrated-exposure
budget (the target dose; constant over the whole run, or early or late over a window: issue 70's arm with the noise
off for the last part of training is schedule early), no emulated batch, at ≥ 2 positive target doses; its dose 0
is batch noise alone at that batch (noise source 'none'). Log dose is undefined at 0, so every slope is fitted over
the positive doses and dose 0 is the reference arm, reported beside (the contrast of the highest dose against it,
the ladder's shifts against it). Dose is the realised integrated injected P-NE* (after clipping), averaged over the
runs of its condition: one value per condition, so run-to-run variation of the realised dose, which could track the
phase a run is in (method §11), does not enter the fit. Units: r per decade of dose, octaves of M* per decade of dose.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from ..core.runspec import M_INF
from . import stats
from .convergence import converged_runs
from .ladder import ladder_conversion, ladder_shifts, local_slope
from .thresholds import t_interval, threshold_with_ci

SERIES = ["source", "shape", "schedule", "batch", "optimizer"]   # one dose series (each optimizer its own)
SCHEDULES = ("constant", "early", "late")   # a dose series' schedules (not controlled: its level is a target)
OUTCOMES = ("id_loss", "delta_ridge", "delta_dmmse", "ood_delta_ridge", "ood_delta_dmmse")   # r's decomposition
DOSE_SCHEMA = pa.schema([   # aggregate/dose.parquet: one row per run of a dose series (dose 0 included)
    pa.field("run_id", pa.string()), pa.field("source", pa.string()),   # source: grad | param; 'none' at dose 0
    pa.field("shape", pa.string()), pa.field("schedule", pa.string()),   # 'none' at dose 0
    pa.field("batch", pa.int64()), pa.field("optimizer", pa.string()), pa.field("noise", pa.string()),
    pa.field("target_dose", pa.float64()),     # the condition's budget: integrated injected P-NE*; 0 at dose 0
    pa.field("realised_dose", pa.float64()),   # the run's booked integrated injected P-NE* (exposure.parquet)
    pa.field("realised_dose_se", pa.float64()),   # its SE from diag Ĥ's Hutchinson error (null: not booked)
    pa.field("total_exposure", pa.float64()),   # the run's integrated P-NE* after clipping, batch + injected
    pa.field("M", pa.int64()), pa.field("seed", pa.int64()), pa.field("r", pa.float64()),
    pa.field("ood_loss", pa.float64()), pa.field("ood_loss_ridge", pa.float64()), pa.field("diverged", pa.bool_()),
    pa.field("converged", pa.bool_()),   # M = ∞ only: the one convergence gate (converged_runs); null at finite M
    *[pa.field(c, pa.float64()) for c in OUTCOMES],   # what r is made of (method §11, "Outcomes that tell ...")
])
LEVELS_SCHEMA = pa.schema([   # aggregate/dose_levels.parquet: one row per (series, target dose), dose 0 included
    *[pa.field(c, t) for c, t in (("source", pa.string()), ("shape", pa.string()), ("schedule", pa.string()),
                                  ("batch", pa.int64()), ("optimizer", pa.string()))],
    pa.field("noise", pa.string()), pa.field("target_dose", pa.float64()), pa.field("realised_dose", pa.float64()),
    pa.field("total_exposure", pa.float64()),   # batch + injected integrated P-NE*, the mean at the ladder's M
    pa.field("n_runs", pa.int64()), pa.field("n_seeds", pa.int64()),
    pa.field("ood_loss_over_ridge", pa.float64()),   # the worst M = ∞ run's (NaN: no M = ∞ run at this dose)
    pa.field("in_regime", pa.bool_()), pa.field("regime", pa.string()),   # why a dose is outside ('' inside)
    pa.field("r16", pa.float64()), pa.field("r16_lo", pa.float64()), pa.field("r16_hi", pa.float64()),
    *[pa.field(f"M_star_{p}{k}", pa.float64()) for p in ("r50", "midpoint") for k in ("", "_lo", "_hi")],
    pa.field("ladder_shift", pa.float64()),   # log2 M* − log2 M*(dose 0) read from the ladder (ladder_shifts)
    pa.field("ladder_shift_lo", pa.float64()), pa.field("ladder_shift_hi", pa.float64()),
])

BY_M_SCHEMA = pa.schema([   # aggregate/dose_decomposition.parquet: one row per (series, finite M, outcome)
    *[pa.field(c, t) for c, t in (("source", pa.string()), ("shape", pa.string()), ("schedule", pa.string()),
                                  ("batch", pa.int64()), ("optimizer", pa.string()))],
    pa.field("M", pa.int64()), pa.field("outcome", pa.string()),   # r or one of OUTCOMES
    pa.field("n_runs", pa.int64()), pa.field("n_doses", pa.int64()),   # dose 0 and the in-regime doses run at M
    *[pa.field(c, pa.float64()) for c in ("estimate", "ci_lo", "ci_hi", "p", "mde")],   # per decade of total exposure
    pa.field("status", pa.string()),   # 'run', or why not
])


def dose_runs(out: pd.DataFrame, tol: float) -> pd.DataFrame:
    """The per-run dose table (DOSE_SCHEMA) of the outcomes `out`: the runs of every dose series (≥ 2 positive target
    doses) and their dose-0 runs; empty when the grid has no series. An M = ∞ run's `converged` is the verdicts'
    one convergence gate at tolerance `tol` (verdicts.converged_runs: a levelled noise floor passes)."""
    inj = out[out.noise_source.isin(["grad", "param"]) & out.noise_schedule.isin(SCHEDULES)
              & (out.emulate_batch.fillna(0) == 0) & (out.steps_as_batch.fillna(0) == 0)
              & (out.noise_level.astype(float) > 0)]
    inj = inj.assign(source=inj.noise_source, shape=inj.noise_shape, schedule=inj.noise_schedule)
    n_doses = inj.groupby(SERIES).noise_level.transform("nunique")
    inj = inj[n_doses >= 2]
    at = pd.MultiIndex.from_frame(inj[["batch", "optimizer"]])   # dose 0: batch noise at a series' batch and optimizer
    zero = out[(out.noise_source == "batch") & (out.steps_as_batch.fillna(0) == 0)
               & pd.MultiIndex.from_frame(out[["batch", "optimizer"]]).isin(at)]
    rows = pd.concat([inj.assign(target_dose=inj.noise_level.astype(float)),
                      zero.assign(source="none", shape="none", schedule="none", target_dose=0.0)], ignore_index=True)
    if not len(inj):
        rows = rows.iloc[:0]
    conv = converged_runs(rows, tol).converged
    realised = rows.integrated_pne_injected.astype(float).where(rows.target_dose > 0, 0.0)
    df = rows.assign(realised_dose=realised, realised_dose_se=rows.integrated_pne_injected_se.astype(float),
                     total_exposure=rows.integrated_pne.astype(float),
                     converged=conv.astype(object).where(rows.M == M_INF, None))
    return df.reindex(columns=DOSE_SCHEMA.names).sort_values([*SERIES, "target_dose", "M", "seed"], ignore_index=True)


def series(runs: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    """(source, shape, schedule, batch, optimizer) and the series' runs with its dose-0 runs (source 'none' at its
    batch and optimizer) appended."""
    runs = with_schedule(runs)
    inj = runs[runs.source != "none"]
    zero = runs[runs.source == "none"]
    return [(key, pd.concat([g, zero[(zero.batch == key[3]) & (zero.optimizer == key[4])]], ignore_index=True))
            for key, g in inj.groupby(SERIES)]


def with_schedule(df: pd.DataFrame) -> pd.DataFrame:
    """A dose or levels table with its `schedule` column: tables written before dose series had schedules held
    constant-schedule series only (dose 0's is 'none')."""
    if "schedule" in df:
        return df
    return df.assign(schedule=np.where(df.source == "none", "none", "constant"))


def series_name(key: tuple) -> str:
    """A series in words, as the tests name it: 'param (diagonal), batch 64'; a windowed schedule is named
    ('param (diagonal, early), batch 64')."""
    src, shape, schedule, batch = key[:4]
    return f"{src} ({shape}{'' if schedule == 'constant' else f', {schedule}'}), batch {batch}"


def regime(g: pd.DataFrame, dose_tol: float, min_seeds: int, gate: bool = True) -> pd.DataFrame:
    """The operating regime of one series (`g`: its runs and dose 0's), one row per target dose: a dose is inside
    when its realised dose is within `dose_tol` of the target (not saturated), none of its runs diverged, a positive
    dose run at finite M has ≥ `min_seeds` seeds there (a dose still training neither enters the fits nor
    shortens the ladder), and M = ∞
    converges there (the `converged` column) or, without M = ∞ runs of its own, at a dose at or above it, below
    every dose where it does not (M = ∞'s gate alone vouches: a dose's other faults are its own); `gate` False
    drops that last condition (the sensitivity analysis of the one convergence gate: what the verdict would be if
    the gate admitted every dose on target).
    Columns: target_dose, noise, realised_dose (condition mean), n_runs, n_seeds,
    ood_loss_over_ridge, in_regime, regime (why a dose is outside)."""
    rows = []
    for d, lv in g.groupby("target_dose"):
        inf = lv[lv.M == M_INF]
        ratio = (inf.ood_loss / inf.ood_loss_ridge).where(~inf.diverged.astype(bool), np.inf).astype(float)
        why, real, seeds = [], float(lv.realised_dose.mean()), lv[lv.M != M_INF].seed.nunique()
        if d > 0 and not np.isfinite(real):
            why.append("realised dose not recorded (no exposure.parquet)")
        elif d > 0 and not abs(real / d - 1) <= dose_tol:
            why.append(f"{'saturated' if real < d else 'over target'}: realised {real:.3g} = {real / d:.2f}× target")
        if d > 0 and 0 < seeds < min_seeds:   # at finite M, where the fits read it (M = ∞ alone vouches)
            why.append(f"{seeds} seed{'s' * (seeds != 1)} at finite M (fewer than {min_seeds})")
        if lv.diverged.any():
            why.append(f"{int(lv.diverged.sum())} of {len(lv)} runs diverged")
        passes = bool(len(inf)) and bool(inf.converged.astype(bool).all())
        if gate and len(inf) and not passes:
            why.append(f"M = ∞ fails the convergence gate ({ratio.max():.3f}× ridge's OOD loss)")
        rows.append({"target_dose": d, "noise": lv.noise.iloc[0], "realised_dose": real, "n_runs": len(lv),
                     "n_seeds": lv.seed.nunique(), "ood_loss_over_ridge": float(ratio.max()) if len(inf) else math.nan,
                     "has_inf": len(inf) > 0, "passes": passes, "why": why})
    lv = pd.DataFrame(rows)
    checked = lv[lv.has_inf]
    ok_hi = checked.target_dose[checked.passes].max()
    bad_lo = checked.target_dose[~checked.passes].min()
    for i, r in lv.iterrows():
        if gate and not r.has_inf and not r.why:
            if not r.target_dose <= ok_hi:
                r.why.append("no M = ∞ run at or above this dose that converged")
            elif r.target_dose >= bad_lo:
                r.why.append(f"above dose {bad_lo:.3g}, where M = ∞ does not converge")
    lv["in_regime"] = lv.why.str.len() == 0
    lv["regime"] = lv.why.str.join("; ")
    return lv.drop(columns=["has_inf", "passes", "why"])


def log_dose(g: pd.DataFrame, lv: pd.DataFrame) -> pd.Series:
    """log10 of each run's condition dose (the condition's mean realised dose, `regime`'s realised_dose)."""
    return np.log10(g.target_dose.map(lv.set_index("target_dose").realised_dose))


def r_slope(d: pd.DataFrame, alpha: float, group: str = "cell") -> pd.Series:
    """The slope of r against log10 dose at fixed M: MixedLM r ~ log10_dose + C(M) + (1 | M:seed) (C(M) only with
    several M), REML (stats.mixed_model): the doses of a series share each (M, seed) cell's initialisation, data
    and task pool, so the cell is the random intercept (method §11, Pairing); group='seed' is the sensitivity
    model. The log10_dose row (estimate, se, ci_lo, ci_hi, p, mde, std_effect). `d`: runs with columns r, M, seed,
    log10_dose. Measured on planted series (experiments/dose_coverage.py, 200 each; 5 doses over 2 decades,
    M ∈ {8, 16, 32}, 3 seeds, run sd 0.02, seed sd 0.03, seed intercept): coverage of the 95 % interval 0.960 at
    slopes 0, 0.0117 and 0.03; size 0.040; power 0.77 at the reported mde (0.0117, 80 %). With cell effects
    (tests/test_design.py): see docs/validation.md, 'Pairing'."""
    formula = "r ~ log10_dose" + (" + C(M)" if d.M.nunique() > 1 else "")
    return stats.mixed_model(d, formula, group=group, alpha=alpha).set_index("term").loc["log10_dose"]


def total_slope(d: pd.DataFrame, outcome: str, alpha: float) -> pd.Series:
    """The slope of an outcome (r or one of OUTCOMES) per decade of total exposure at fixed M: MixedLM outcome ~
    log10_total + C(M) + (1 | M:seed), REML, as r_slope (the doses share each (M, seed) cell); `d`: runs with the
    outcome, M, seed and log10_total (their dose's mean total exposure, so the run's own phase does not enter).
    The log10_total row (estimate, se, ci_lo, ci_hi, p, mde, std_effect)."""
    formula = f"{outcome} ~ log10_total" + (" + C(M)" if d.M.nunique() > 1 else "")
    return stats.mixed_model(d, formula, group="cell", alpha=alpha).set_index("term").loc["log10_total"]


def seed_slope(d: pd.DataFrame, x: str, y: str, alpha: float) -> pd.Series:
    """The slope of `y` on `x`, seeds the unit: b_s = each seed's least-squares slope (seeds with ≥ 2 distinct x);
    estimate, t-interval on n − 1 df, p and mde = stats.paired_test of the b_s against 0; n the seeds; std_effect =
    b·sd(x)/sd(y) over all rows, as stats.mixed_model's. Within a seed the doses share its initialisation, data and
    task pool, so its level cancels from b_s; at 5 seeds the t-interval holds its level where a Wald interval on a
    MixedLM does not (by_m; docs/validation.md)."""
    per = np.array([np.polyfit(h[x].astype(float), h[y].astype(float), 1)[0]
                    for _, h in d.groupby("seed") if h[x].nunique() >= 2])
    if len(per) < 2:
        raise ValueError(f"a slope needs ≥ 2 seeds with ≥ 2 doses each, not {len(per)}")
    t = stats.paired_test(per, np.zeros(len(per)), alpha)
    return pd.Series({k: t[k] for k in ("estimate", "ci_lo", "ci_hi", "p", "mde")}
                     | {"std_effect": t["estimate"] * d[x].std() / d[y].std(), "n": len(per)})


def mstar_slope(per_seed: pd.DataFrame, alpha: float) -> pd.Series:
    """The slope of log2 M* against log10 dose, seeds the unit (seed_slope of each seed's per-seed threshold
    estimates, thresholds.threshold_with_ci's log2_per_seed, on log10 dose). A MixedLM with a random intercept per
    seed gives the same b on a balanced design, but its Wald interval assumes many seeds: at the CPU plan's design (2
    doses a decade apart, 3 seeds; seed sd and estimate sd 0.03 octaves) it covered a planted slope in 0.797 of 2 000
    replications (size 0.20), this interval in 0.945 (size 0.056); at 5 doses over 2 decades 0.920 against 0.943
    (experiments/dose_coverage.py)."""
    return seed_slope(per_seed, "log10_dose", "log2_M_star", alpha)


def _t_interval(v: pd.Series, level: float) -> tuple[float, float, float]:
    v = v.dropna()
    n = len(v)
    if n < 2:
        return (float(v.mean()) if n else math.nan), math.nan, math.nan
    m, se, t = t_interval(v, level)
    return m, m - t * se, m + t * se


def _fitted(fn, d: pd.DataFrame, alpha: float, res: dict, what: str):
    """fn(d, alpha), or None with res['failed'][what] = the error's name (a singular design is a result to report,
    not a crash)."""
    try:
        return fn(d, alpha)
    except Exception as err:  # noqa: BLE001
        res["failed"][what] = type(err).__name__
        return None


def analyse(g: pd.DataFrame, alpha: float, dose_tol: float, min_seeds: int, gate: bool = True) -> dict:
    """Everything the dose–response of one series says (`g`: its runs and dose 0's, DOSE_SCHEMA rows):
    levels  one row per target dose: `regime`'s columns, r at M = 16 (t-interval over seeds), M* by r50 and by
            midpoint (thresholds.threshold_with_ci; NaN with fewer than 5 finite M) and the ladder's shift;
    fit     the positive in-regime doses' runs at the ladder (the finite M run at every one of them and at dose 0),
            with log10_dose; ladder: those M; doses: the positive in-regime doses with finite-M runs (a dose whose
            runs are all M = ∞ is in `levels`, not here); left_out: the positive doses out of the regime;
    total   each dose's mean total exposure (batch + injected integrated P-NE*) over its runs at the ladder's M
            (all its finite M without a ladder);
    total_fit, decomposition: dose 0's and the in-regime doses' runs at the ladder with log10_total (their dose's
            total), and {outcome: total_slope} for r and what r is made of (OUTCOMES);
    mstar_total: {point: (mstar_slope of log2 M* on log10 total exposure over dose 0 and the in-regime doses with a
            per-seed M*, decades of total exposure they span, doses)} — the hypothesis's own axis (method §11);
    r       r_slope over `fit`, (M, seed) cells the random intercept (None with < 2 doses); r_seed: the same with a
            seed intercept (the sensitivity model); mstar: {point: (mstar_slope, doses)} over the positive doses
            whose M* has a per-seed interval (≥ 2); mstar_zero: {point: (paired t of log2 M* at the highest such
            dose − dose 0 by seed, that dose)}; local: local_slope at dose 0; ladder_fit: ladder_conversion of r's
            slope;
    zero    paired t (stats.paired_test) of r at the highest in-regime dose − dose 0 by (M, seed) at the ladder;
    mono    stats.monotonicity of the seed means of r over the ladder against log10 dose;
    failed  {fit: error name} of the mixed models that failed.
    `gate`: regime's (False: the convergence gate at M = ∞ not applied)."""
    level = 1 - alpha
    lv, finite, inside, ladder, total = _frame(g, dose_tol, min_seeds, gate)
    fit = finite[finite.target_dose.isin(inside) & finite.M.isin(ladder)]
    res = {"ladder": ladder, "fit": fit, "doses": sorted(inside), "total": total, "mstar_total": {},
           "left_out": lv[~lv.in_regime & (lv.target_dose > 0)], "r": None, "r_seed": None, "mstar": {},
           "mstar_zero": {},
           "ladder_fit": None,
           "zero": None, "mono": None, "failed": {}}
    ex = _dose_thresholds(finite, set(inside), level, alpha, min_seeds)
    res["local"] = local_slope(finite[finite.target_dose == 0], ladder)
    shifts = ladder_shifts(finite[finite.target_dose.isin([0.0, *inside])], ladder, res["local"], level)
    lv = lv.merge(ex.drop(columns=[c for c in ex if c.startswith("_")]), on="target_dose", how="left")
    res["levels"] = lv.merge(shifts, on="target_dose", how="left").assign(total_exposure=lambda d: d.target_dose.map(
        total))
    if len(inside) >= 2 and len(fit) and fit.seed.nunique() >= 2:
        res["r"] = _fitted(r_slope, fit, alpha, res, "r")
        res["r_seed"] = _fitted(lambda d, a: r_slope(d, a, group="seed"), fit, alpha, res, "r (1|seed)")
        if res["r"] is not None and np.isfinite(res["local"]["s"]):
            res["ladder_fit"] = ladder_conversion(res["r"].estimate, res["r"].se, res["local"]["s"],
                                                  res["local"]["se"], alpha)
        cells = fit.groupby(["log10_dose", "seed"], as_index=False).r.mean().rename(columns={"r": "y"})
        res["mono"] = stats.monotonicity(cells)
    for point in ("r50", "midpoint"):
        _mstar_tests(ex, lv, point, alpha, res)
    res["total_fit"] = _total_fit(finite, inside, ladder, total)
    res["decomposition"] = decomposition(res["total_fit"], alpha, res) if len(inside) else {}
    res["zero"] = _zero_contrast(finite, inside, ladder, alpha)
    return res


def _frame(g: pd.DataFrame, dose_tol: float, min_seeds: int, gate: bool = True) -> tuple:
    """analyse's reading of a series: `regime`'s levels; the converged finite-M runs with an r (log10_dose their
    dose's realised dose); the positive in-regime doses with finite-M runs (a dose with M = ∞ runs only vouches for
    the regime below it); the ladder (the M run at dose 0 and every one of them); each dose's mean total exposure
    over its runs at the ladder's M, which every inside dose has (exposure moves with M: a mean over a dose's own M
    set would compare a full grid's, M = 1 included, with a ladder's); NaN without a ladder, and at a dose with no
    runs at the ladder's M."""
    lv = regime(g, dose_tol, min_seeds, gate)
    ok = g[~g.diverged.astype(bool)].assign(log10_dose=lambda d: np.log10(
        d.target_dose.map(lv.set_index("target_dose").realised_dose).where(d.target_dose > 0)))
    finite = ok[(ok.M != M_INF) & ok.r.notna()]
    inside = [d for d in lv[lv.in_regime & (lv.target_dose > 0)].target_dose if (finite.target_dose == d).any()]
    per_dose = [set(finite[finite.target_dose == d].M) for d in [0.0, *inside]]
    ladder = sorted(set.intersection(*per_dose)) if per_dose else []
    return lv, finite, inside, ladder, finite[finite.M.isin(ladder)].groupby("target_dose").total_exposure.mean()


def _total_fit(finite: pd.DataFrame, inside: list, ladder: list[int], total: pd.Series) -> pd.DataFrame:
    return finite[finite.target_dose.isin([0.0, *inside]) & finite.M.isin(ladder)].assign(
        log10_total=lambda d: np.log10(d.target_dose.map(total)))


def total_fit(g: pd.DataFrame, dose_tol: float, min_seeds: int) -> pd.DataFrame:
    """analyse's total_fit alone: dose 0's and the in-regime doses' runs at the ladder with log10_total, the rows
    total_slope and decomposition read (what a coverage simulation of them needs without the rest of analyse)."""
    _, finite, inside, ladder, total = _frame(g, dose_tol, min_seeds)
    return _total_fit(finite, inside, ladder, total)


def by_m(g: pd.DataFrame, alpha: float, dose_tol: float, min_seeds: int) -> pd.DataFrame:
    """r's decomposition per M (method §11, "Outcomes that tell in-context learning from misfit"): for every finite M
    of the series and each of r and OUTCOMES, its slope per decade of total exposure at that M alone (seed_slope:
    per seed, t over seeds) over dose 0 and the in-regime doses run at that M, log10_total each dose's mean total
    exposure at the ladder (analyse's `total`). The pooled rows in the tests average these over the ladder; these
    show where an effect of the pooled row lives. BY_M_SCHEMA's columns less the series'."""
    _, finite, inside, ladder, total = _frame(g, dose_tol, min_seeds)
    rows = []
    for M, h in finite[finite.target_dose.isin([0.0, *inside])].groupby("M"):
        h = h.assign(log10_total=np.log10(h.target_dose.map(total)))
        for y in ("r", *OUTCOMES):
            row = {"M": int(M), "outcome": y, "n_runs": len(h), "n_doses": h.target_dose.nunique(),
                   "status": "run"}
            if not ladder:
                row["status"] = ("not run: no finite M run at dose 0 and every in-regime dose, so no total exposure "
                                 "the doses share")
            elif (h.log10_total.nunique() < 2 or h.log10_total.isna().any() or h.seed.nunique() < 2 or y not in h
                  or h[y].isna().any()):
                row["status"] = ("not run: needs dose 0 and ≥ 1 in-regime dose at this M with a total exposure, "
                                 "≥ 2 seeds, the outcome")
            else:
                try:
                    e = seed_slope(h, "log10_total", y, alpha)
                    row.update({k: float(e[k]) for k in ("estimate", "ci_lo", "ci_hi", "p", "mde")})
                except Exception as err:  # noqa: BLE001 -- a fit that cannot be made is a result to report
                    row["status"] = f"not run: fit failed ({type(err).__name__})"
            rows.append(row)
    return pd.DataFrame(rows).reindex(columns=[c for c in BY_M_SCHEMA.names if c not in SERIES])


def by_m_table(runs: pd.DataFrame, alpha: float, dose_tol: float, min_seeds: int) -> pd.DataFrame:
    """aggregate/dose_decomposition.parquet: `by_m` of every series (BY_M_SCHEMA)."""
    frames = [by_m(g, alpha, dose_tol, min_seeds).assign(**dict(zip(SERIES, k))) for k, g in series(runs)]
    return pd.concat(frames, ignore_index=True).reindex(columns=BY_M_SCHEMA.names) if frames else \
        pd.DataFrame(columns=BY_M_SCHEMA.names)


def _zero_contrast(finite: pd.DataFrame, inside: list, ladder: list[int], alpha: float) -> dict | None:
    """r at the highest in-regime dose − dose 0, paired by (M, seed) at the ladder (None with < 2 pairs)."""
    if not len(inside) or not ladder:
        return None
    top = finite[(finite.target_dose == max(inside)) & finite.M.isin(ladder)].set_index(["M", "seed"]).r
    zero = finite[(finite.target_dose == 0) & finite.M.isin(ladder)].set_index(["M", "seed"]).r
    pairs = pd.concat([top, zero], axis=1, keys=["top", "zero"]).dropna()
    return stats.paired_test(pairs.top.to_numpy(), pairs.zero.to_numpy(), alpha) if len(pairs) >= 2 else None


def decomposition(d: pd.DataFrame, alpha: float, res: dict) -> dict:
    """{outcome: total_slope} for r and each of OUTCOMES recorded on every run of `d` (dose 0 and the in-regime
    doses at the ladder), fits that fail left out (res['failed'])."""
    out = {}
    if d.seed.nunique() < 2 or d.log10_total.nunique() < 2:
        return out
    for y in ("r", *OUTCOMES):
        if y in d and d[y].notna().all():
            e = _fitted(lambda h, a, y=y: total_slope(h.astype({y: float}), y, a), d, alpha, res, f"{y} total")
            if e is not None:
                out[y] = e
    return out


def _dose_thresholds(finite: pd.DataFrame, inside: set, level: float, alpha: float, min_seeds: int) -> pd.DataFrame:
    """One row per target dose of `finite` (its runs at finite M with an r): r at M = 16 with its t-interval over
    seeds, M* by r50 and by midpoint with their intervals, and for dose 0 and the `inside` doses whose M* has an
    interval, `_seeds_<point>`: the per-seed log2 M* (threshold_with_ci's log2_per_seed)."""
    extra = []
    for d, h in finite.groupby("target_dose"):
        row = {"target_dose": d}
        r16 = h[h.M == 16].groupby("seed").r.mean()
        row["r16"], row["r16_lo"], row["r16_hi"] = _t_interval(r16, level)
        for point in ("r50", "midpoint"):
            est = threshold_with_ci(h, level=level, min_seeds=min_seeds, alpha=alpha, point=point)
            ok_ci = not est["reason"]
            row.update({f"M_star_{point}": est["M_star"], f"M_star_{point}_lo": est["M_star_lo"],
                        f"M_star_{point}_hi": est["M_star_hi"]})
            if ok_ci and (d in inside or d == 0):
                row[f"_seeds_{point}"] = est["log2_per_seed"]
        extra.append(row)
    cols = ["target_dose", "r16", "r16_lo", "r16_hi",
            *[f"M_star_{p}{k}" for p in ("r50", "midpoint") for k in ("", "_lo", "_hi")]]
    ex = pd.DataFrame(extra).reindex(columns=[*cols, *(c for r in extra for c in r if c.startswith("_"))])
    return ex.loc[:, ~ex.columns.duplicated()]


def _mstar_tests(ex: pd.DataFrame, lv: pd.DataFrame, point: str, alpha: float, res: dict) -> None:
    """res['mstar_zero'][point] (paired t of log2 M* at the highest dose with a per-seed M* against dose 0's, by
    seed), res['mstar'][point] (mstar_slope over the ≥ 2 positive such doses) and res['mstar_total'][point]
    (mstar_slope on log10 total exposure over those doses and dose 0), from `_dose_thresholds`' rows."""
    col = f"_seeds_{point}"
    have = ex[ex[col].notna()] if col in ex else ex.iloc[:0]
    zero = have[have.target_dose == 0]
    have = have[have.target_dose > 0]
    if len(have) and len(zero):   # the highest dose with its own M* against dose 0's, paired by seed
        a, b = have[col].iloc[-1], zero[col].iloc[0]
        common = sorted(set(a) & set(b))
        if len(common) >= 2:
            res["mstar_zero"][point] = (stats.paired_test([a[k] for k in common], [b[k] for k in common], alpha),
                                        float(have.target_dose.iloc[-1]))
    with_zero = ex[ex[col].notna()] if col in ex else ex.iloc[:0]
    total = with_zero.target_dose.map(res["total"])
    if (total > 0).sum() >= 2:   # dose 0 included: its total exposure is the batch noise's
        per = pd.DataFrame([{"log10_dose": math.log10(xi), "seed": s, "log2_M_star": v}
                            for xi, seeds in zip(total, with_zero[col]) if xi > 0 for s, v in seeds.items()])
        e = _fitted(mstar_slope, per, alpha, res, f"M* total ({point})")
        if e is not None:
            res["mstar_total"][point] = (e, float(np.log10(total.max() / total[total > 0].min())),
                                         int((total > 0).sum()))
    if len(have) >= 2:
        x = np.log10(have.target_dose.map(lv.set_index("target_dose").realised_dose))
        per = pd.DataFrame([{"log10_dose": xi, "seed": s, "log2_M_star": v}
                            for xi, seeds in zip(x, have[col]) for s, v in seeds.items()])
        e = _fitted(mstar_slope, per, alpha, res, f"M* ({point})")
        if e is not None:
            res["mstar"][point] = (e, len(have))


def levels_table(runs: pd.DataFrame, alpha: float, dose_tol: float, min_seeds: int) -> pd.DataFrame:
    """aggregate/dose_levels.parquet: `analyse`'s levels of every series (LEVELS_SCHEMA)."""
    frames = [analyse(g, alpha, dose_tol, min_seeds)["levels"].assign(**dict(zip(SERIES, k)))
              for k, g in series(runs)]
    return pd.concat(frames, ignore_index=True).reindex(columns=LEVELS_SCHEMA.names) if frames else \
        pd.DataFrame(columns=LEVELS_SCHEMA.names)
