"""Aggregate every run into outcomes, thresholds and hypothesis tests (method §11).

Each optional input (llc.parquet, exposure.parquet, geometry.parquet) fills its columns when it
exists and leaves them null otherwise, so the tables keep one schema whichever probes ran; a test
whose inputs are missing is reported as 'not run: <reason>' instead of disappearing.

Every threshold carries validity gates (iclnoise.analysis.verdicts.GATES; issue 13): convergence of the M = ∞ runs to
ridge, a threshold fit that exists inside the grid, r spanning low to high, enough seeds, equal data; the
hypothesis tests and their gates are in iclnoise.analysis.verdicts.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ..core.io import CorruptFileError, read_parquet, write_json, write_parquet, write_text
from ..core.probe_sections import Stats
from ..core.runspec import KEY_FIELDS, RunSpec
from ..core.tasks import M_INF, m_label
from ..probes.geometry import GEOMETRY_COLUMNS
from ..probes.mech import CIRCUIT_COLUMNS
from ..run.runs import checked_spec
from . import thresholds
from .dose import BY_M_SCHEMA, DOSE_SCHEMA, LEVELS_SCHEMA, by_m_table, dose_runs, levels_table
from .verdicts import (
    CONDITION,
    GATE_FIELDS,
    GATES,
    TESTS_SCHEMA,
    condition_name,
    convergence,
    gate_columns,
    gate_convergence,
    gate_equal_data,
    gate_seeds,
    hypothesis_tests,
    ood_loss_fall,
    optimizer_note,
)
from .verdicts.h1_batch import BATCH_LEVELS_SCHEMA, batch_levels

log = logging.getLogger(__name__)

OUTCOME_FIELDS = KEY_FIELDS + [
    pa.field("optimizer", pa.string()),   # grid.optimizer (RunKeys.optimizer): part of every condition's key
    pa.field("steps", pa.int64()), pa.field("sequences", pa.int64()), pa.field("diverged", pa.bool_()),
    pa.field("ood_loss", pa.float64()), pa.field("id_loss", pa.float64()), pa.field("r", pa.float64()),
    pa.field("ood_loss_fall", pa.float64()),   # the OOD loss's fall over the last third (verdicts.ood_loss_fall),
    pa.field("ood_loss_fall_se", pa.float64()), pa.field("ood_loss_fall_n", pa.int64()),   # its SE and checkpoints
    pa.field("ood_loss_ridge", pa.float64()), pa.field("ood_loss_dmmse", pa.float64()),
    pa.field("delta_dmmse", pa.float64()), pa.field("delta_ridge", pa.float64()),   # on the q_M set (r's)
    pa.field("ood_delta_dmmse", pa.float64()), pa.field("ood_delta_ridge", pa.float64()),   # on new tasks
    pa.field("icl_score", pa.float64()),
    pa.field("t_crit", pa.int64()), pa.field("ood_loss_at_t_crit", pa.float64()), pa.field("r_at_t_crit", pa.float64()),
    pa.field("icl_score_at_t_crit", pa.float64()), pa.field("transient_window", pa.float64()),
    pa.field("noise_source", pa.string()), pa.field("noise_schedule", pa.string()),
    pa.field("noise_shape", pa.string()), pa.field("noise_level", pa.float64()), pa.field("emulate_batch", pa.int64()),
    pa.field("steps_as_batch", pa.int64()),   # 0: the run's own batch's steps; B_t: batch B_t's (more sequences)
    pa.field("integrated_lr_over_b", pa.float64()),
    pa.field("books_unchecked", pa.string()),   # '' or the settings whose injected books are unchecked (gate_books)
]
# Columns from optional per-run files: always in the table (null where the file or the key is absent), so the
# schema of outcomes.parquet does not depend on which probes ran.
LLC_COLUMNS = ["llc_final", "llc_final_std"]
LLC_COUNTS = ["llc_n_estimates", "llc_n_flagged",   # estimates in llc.parquet; flagged not-levelled/negative/diverged
              "llc_n_sampler"]                     # flagged unstable / escaped (method §7: λ̂ measures the sampler)
LLC_FLAGS = ["llc_final_flagged",   # the final estimate (the one H4 tests) is not levelled / negative / diverged
             "llc_final_sampler"]   # ... is unstable or escaped (null: llc.parquet without those columns)
EXPOSURE_COLUMNS = ["integrated_pne", "integrated_pne_preclip", "integrated_ne", "integrated_ne_injected",
                    "integrated_ne_simple", "integrated_pne_injected",   # exposure.summarize keys (realised, per run)
                    "integrated_pne_injected_se"]   # the last one's SE from diag Ĥ's Hutchinson error
OPTIONAL_FIELDS = ([pa.field(c, pa.float64()) for c in LLC_COLUMNS] + [pa.field(c, pa.int64()) for c in LLC_COUNTS]
                   + [pa.field(c, pa.bool_()) for c in LLC_FLAGS]
                   + [pa.field(c, pa.float64()) for c in EXPOSURE_COLUMNS + GEOMETRY_COLUMNS + CIRCUIT_COLUMNS])
OUTCOMES_SCHEMA = pa.schema(OUTCOME_FIELDS + OPTIONAL_FIELDS)
THRESHOLD_SCHEMA = pa.schema([   # one row per (batch, noise, optimizer, method)
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("optimizer", pa.string()),
    pa.field("noise_source", pa.string()),
    pa.field("noise_schedule", pa.string()), pa.field("emulate_batch", pa.int64()),
    pa.field("noise_level", pa.float64()),
    pa.field("method", pa.string()),   # r50: r crosses 0.5 (thresholds.threshold_with_ci); midpoint: half-way between
                                       # the fitted floor and ceiling (point="midpoint"); crossover: the anchor's M*
                                       # where the late pull on new tasks turns from dMMSE_M to ridge
                                       # (thresholds.crossover_threshold)
    pa.field("M_star", pa.float64()), pa.field("M_star_lo", pa.float64()),
    pa.field("M_star_hi", pa.float64()), pa.field("log2_M_star", pa.float64()), pa.field("log2_se", pa.float64()),
    pa.field("floor", pa.float64()), pa.field("ceiling", pa.float64()), pa.field("scale", pa.float64()),
    pa.field("p_rise", pa.float64()),                                     # r50 only: NaN for crossover
    pa.field("p_sign", pa.float64()), pa.field("slope_first", pa.float64()),
    pa.field("slope_last", pa.float64()),                                 # crossover only: NaN for r50
    *[pa.field(f"M_star{k}_{w}", pa.float64()) for w in ("last_two_thirds", "last_third") for k in ("", "_lo", "_hi")],
    # crossover only: the estimate with the pull over the last ⅔ and ⅓ of training (M_star: the last ½)
    pa.field("in_range", pa.bool_()), pa.field("n_seeds", pa.int64()),
    pa.field("n_seeds_fit", pa.int64()), pa.field("interval", pa.string()), pa.field("reason", pa.string()),
    pa.field("r_min", pa.float64()), pa.field("r_max", pa.float64()), *GATE_FIELDS,
])
TRAJECTORY_COLUMNS = ["run_id", "M", "seed", "batch", "noise", "sequences", "ood_delta_dmmse", "ood_delta_ridge"]


def integrated_lr_over_b(spec: RunSpec) -> float:
    """Σ_t η_t / B over the steps trained (to `train.budget.stop_at` where set): the η/B noise-temperature
    proxy (Smith & Le), from the run's schedule (Train.lr_sum: the η_t it trained with)."""
    return spec.train.lr_sum() / spec.keys.batch


def _noise_fields(spec: RunSpec) -> dict:
    """Source, schedule, shape and level of a run's noise. The level is 1/B for batch noise and
    1/B_target for an emulated batch (an effective inverse batch size), else the budget or target. Absent
    schedule / shape (source none) read "none"; no emulated batch reads 0."""
    n = spec.noise
    if n.source == "none":
        level = 1.0 / spec.keys.batch
    elif n.emulate_batch:
        level = 1.0 / n.emulate_batch
    else:
        level = float(n.budget if n.budget is not None else n.target if n.target is not None else math.nan)
    return {"noise_source": "batch" if n.source == "none" else n.source, "noise_schedule": n.schedule or "none",
            "noise_shape": n.shape or "none", "noise_level": level, "emulate_batch": n.emulate_batch or 0,
            "steps_as_batch": n.steps_as_batch or 0}


def run_outcomes(run_dir: Path, transient_tol: float) -> dict:
    from ..noise.dose_check import books_unchecked  # the noise module judges its books (and imports torch)

    spec = RunSpec.of(checked_spec(run_dir))
    metrics = read_parquet(run_dir / "metrics.parquet").sort_values("step")
    end = metrics.iloc[-1]
    w = thresholds.transient_ridge_window(metrics, transient_tol)
    if w["t_crit"] < 0:
        log.warning("%s: no checkpoint after step 0 (diverged at its first update): no t_crit", run_dir.name)
    at = (metrics[metrics.step == w["t_crit"]].iloc[0] if w["t_crit"] >= 0
          else pd.Series(math.nan, index=metrics.columns))
    row = {**spec.key_dict, "optimizer": spec.keys.optimizer, "steps": int(end.step), "sequences": int(end.sequences),
           "diverged": bool(metrics.diverged.any()),
           **{k: float(end[k]) for k in ("ood_loss", "id_loss", "r", "ood_loss_ridge", "ood_loss_dmmse",
                                         "delta_dmmse", "delta_ridge", "ood_delta_dmmse", "ood_delta_ridge",
                                         "icl_score")},
           **dict(zip(("ood_loss_fall", "ood_loss_fall_se", "ood_loss_fall_n"), ood_loss_fall(metrics))),
           "t_crit": w["t_crit"], "ood_loss_at_t_crit": float(at.ood_loss), "r_at_t_crit": float(at.r),
           "icl_score_at_t_crit": float(at.icl_score), "transient_window": w["window"],
           **_noise_fields(spec), "integrated_lr_over_b": integrated_lr_over_b(spec),
           "books_unchecked": books_unchecked(spec)}
    row.update({f.name: None for f in OPTIONAL_FIELDS})
    if (run_dir / "llc.parquet").exists():
        llc = read_parquet(run_dir / "llc.parquet").sort_values("step")
        if len(llc):
            flagged = llc.not_levelled.astype(bool) | llc.negative.astype(bool) | llc.diverged.astype(bool)
            row.update(llc_final=float(llc.llc_mean.iloc[-1]), llc_final_std=float(llc.llc_std.iloc[-1]),
                       llc_n_estimates=len(llc), llc_n_flagged=int(flagged.sum()),
                       llc_final_flagged=bool(flagged.iloc[-1]))
            if {"unstable", "escaped"} <= set(llc):
                sampler = llc.unstable.astype(bool) | llc.escaped.astype(bool)
                row.update(llc_n_sampler=int(sampler.sum()), llc_final_sampler=bool(sampler.iloc[-1]))
    if (run_dir / "exposure.parquet").exists():
        from ..noise.exposure import summarize  # the noise module owns exposure summaries
        s = summarize(read_parquet(run_dir / "exposure.parquet"))
        row.update({k: float(s[k]) for k in EXPOSURE_COLUMNS if k in s})
    if (run_dir / "geometry.parquet").exists():
        g = read_parquet(run_dir / "geometry.parquet").sort_values("step").iloc[-1]
        row.update({k: float(g[k]) for k in GEOMETRY_COLUMNS if k in g})
    if (run_dir / "mech.parquet").exists():
        from ..probes.mech import run_summary
        s = run_summary(read_parquet(run_dir / "mech.parquet"))
        row.update({k: float(s[k]) for k in CIRCUIT_COLUMNS if k in s})
    return row


def outcomes(run_dirs: list[Path], transient_tol: float) -> tuple[pd.DataFrame, pa.Schema]:
    """One row per run; every column of OUTCOMES_SCHEMA is present (null where a probe did not run)."""
    df = pd.DataFrame([run_outcomes(d, transient_tol) for d in run_dirs], columns=OUTCOMES_SCHEMA.names)
    return _optional_dtypes(df), OUTCOMES_SCHEMA


def _optional_dtypes(df: pd.DataFrame) -> pd.DataFrame:
    for f in OPTIONAL_FIELDS:
        df[f.name] = df[f.name].astype("Int64" if f.type == pa.int64() else float)
    return df


ADDED = ("ood_delta_dmmse", "ood_delta_ridge")   # outcomes.parquet's since issue 70 (NaN in tables written before)


def read_outcomes(path: str | Path) -> pd.DataFrame:
    """outcomes.parquet with the dtypes `outcomes` returns (optional counts Int64, the others float), so what is
    drawn from the table is what the aggregate computed. A table written before the ADDED columns (the committed
    reference sets) reads with them NaN."""
    try:
        df = read_parquet(path, OUTCOMES_SCHEMA)
    except CorruptFileError:
        df = read_parquet(path, pa.schema([f for f in OUTCOMES_SCHEMA if f.name not in ADDED]))
        df = df.assign(**{c: math.nan for c in ADDED})[OUTCOMES_SCHEMA.names]
    return _optional_dtypes(df)


def trajectories(run_dirs: list[Path]) -> pd.DataFrame:
    """Per-checkpoint Δ on new tasks of every run (the crossover threshold's input); NaN for runs whose
    metrics.parquet predates the ood_delta_* columns."""
    frames = [read_parquet(d / "metrics.parquet").reindex(columns=TRAJECTORY_COLUMNS) for d in run_dirs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TRAJECTORY_COLUMNS)


def _condition_fields(key: tuple, g: pd.DataFrame) -> dict:
    """A thresholds row's condition columns, from the condition's key (verdicts.CONDITION) and outcome rows."""
    return {**dict(zip(CONDITION, key)), "noise_source": g.noise_source.iloc[0],
            "noise_schedule": g.noise_schedule.iloc[0], "emulate_batch": int(g.emulate_batch.iloc[0]),
            "noise_level": float(g.noise_level.iloc[0])}


def threshold_table(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame | None = None,
               traj: pd.DataFrame | None = None) -> pd.DataFrame:
    """M* per (batch, noise, optimizer) condition by each method, each with its validity gates: convergence, a
    threshold that exists inside the grid with every per-seed estimate successful, ≥ min_seeds seeds and equal data
    across the condition's runs; r50 (thresholds.threshold_with_ci) also needs r spanning low to high. crossover
    (thresholds.crossover_threshold) reads `traj` (trajectories(); None: not logged)."""
    gates = GATES
    conv = convergence(out, gates["convergence_tol"]) if conv is None else conv
    traj = pd.DataFrame(columns=TRAJECTORY_COLUMNS) if traj is None else traj
    rows = []
    ok = out[~out.diverged & (out.M != M_INF)]
    for key, g in ok.groupby(CONDITION):
        name = condition_name(*key)
        mean_r = g.groupby("M").r.mean()
        unconverged = gate_convergence(g, conv)
        design = gate_seeds(g, gates["min_seeds"]) + gate_equal_data(g, gates["data_tol"])
        base = {**_condition_fields(key, g), "r_min": float(mean_r.min()), "r_max": float(mean_r.max())}
        t = traj[traj.run_id.isin(g.run_id)]
        at = {"level": 1 - cfg.alpha, "min_seeds": gates["min_seeds"], "alpha": cfg.alpha}
        ests = {"r50": thresholds.threshold_with_ci(g, **at),
                "midpoint": thresholds.threshold_with_ci(g, **at, point="midpoint"),
                "crossover": thresholds.crossover_windows(t, **at)}
        if not t.ood_delta_ridge.notna().any():
            ests["crossover"]["reason"] = "no threshold: Δ on new tasks not logged (runs predate ood_delta_*)"
        for method, est in ests.items():
            gate = "crossover fit" if method == "crossover" else "threshold fit"
            fails = []
            if est["reason"].startswith("no threshold"):
                fails.append((gate, f"{name}: {est['reason'].removeprefix('no threshold: ')}"))
            elif est["seeds_failed"]:
                fails.append((gate, f"{name}: per-seed estimates without threshold: {est['seeds_failed']}"))
            if method == "crossover" and not est["window_consistent"]:
                fails.append(("crossover window", f"{name}: {est['window_detail']}"))
            if method != "crossover" and not (mean_r.min() <= gates["r_low"] and mean_r.max() >= gates["r_high"]):
                fails.append(("r does not span low to high", f"{name}: seed-mean r {mean_r.min():.2f}–"
                              f"{mean_r.max():.2f}, needs ≤ {gates['r_low']} and ≥ {gates['r_high']}"))
            rows.append({**base, **est, "method": method, **gate_columns(unconverged + fails + design)})
    finite = out[out.M != M_INF]
    for key, g in finite.groupby(CONDITION):
        if g.diverged.all():   # the condition stays in the table, saying why it has no threshold
            name = condition_name(*key)
            rows += [{**_condition_fields(key, g), "method": method, "reason": "no threshold: every run diverged",
                      **gate_columns([(gate, f"{name}: every run with finite M diverged")])}
                     for method, gate in (("r50", "threshold fit"), ("midpoint", "threshold fit"),
                                          ("crossover", "crossover fit"))]
    return pd.DataFrame(rows).reindex(columns=THRESHOLD_SCHEMA.names)


def _json_safe(v):
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    return v


def metrics_summary(th: pd.DataFrame, tests: pd.DataFrame, conv: pd.DataFrame, out: pd.DataFrame) -> dict:
    """Small machine-readable summary for `dvc metrics show`: M* per condition (verdicts.condition_name;
    thresholds: r50, thresholds_midpoint: the logistic's midpoint, thresholds_crossover: the anchor's crossover),
    verdicts with their gates, convergence per condition and the share of flagged LLC estimates."""
    n_llc = out.llc_n_estimates.sum()
    return {
        **{key: {condition_name(r.batch, r.noise, r.optimizer): {k: _json_safe(getattr(r, k)) for k in (
            "M_star", "M_star_lo", "M_star_hi", "n_seeds", "reason", "gates_passed", "gate_failures")}
            for r in th[th.method == method].itertuples()}
           for key, method in (("thresholds", "r50"), ("thresholds_midpoint", "midpoint"),
                               ("thresholds_crossover", "crossover"))},
        "tests": {f"{r.hypothesis} {r.test} [{r.outcome}{', ' + r.term if r.term else ''}]"
                  f"{optimizer_note(r.optimizer)}": {
            "verdict": r.verdict or r.status, "estimate": _json_safe(r.estimate), "p_holm": _json_safe(r.p_holm),
            "gates_passed": bool(r.gates_passed), "gate_failures": r.gate_failures} for r in tests.itertuples()},
        "convergence": {condition_name(r.batch, r.noise, r.optimizer): {
            "ood_loss_over_ridge": _json_safe(r.ood_loss_over_ridge), "converged": bool(r.converged)}
            for r in conv.itertuples()},
        "llc_flagged_share": _json_safe(out.llc_n_flagged.sum() / n_llc) if n_llc else None,
        "llc_final_flagged_share": _json_safe(out.llc_final_flagged.dropna().astype(bool).mean())
        if out.llc_final_flagged.notna().any() else None,
    }


def markdown(df: pd.DataFrame) -> str:
    show = df.drop(columns=["gate_records"], errors="ignore")   # gate_failures says the same in words
    if "M" in show:
        show["M"] = show.M.map(m_label)
    return show.to_markdown(index=False, floatfmt=".4g") + "\n"


def aggregate(run_dirs: list[Path], out_dir: Path, cfg: Stats) -> pd.DataFrame:
    """Outcomes, thresholds and tests of `run_dirs` into `out_dir` (.parquet and .md) with metrics.json, and where
    the grid has a dose series (iclnoise.analysis.dose) dose.parquet (one row per run), dose_levels.parquet and
    dose_decomposition.parquet (r's decomposition per M), and where an arm has ≥ 3 batch sizes
    batch_levels.parquet (verdicts.h1_batch); returns the tests. Figures 6-10 are drawn from these tables
    (iclnoise.output.figures.aggregate)."""
    out, schema = outcomes(run_dirs, cfg.transient_tol)
    write_parquet(out, out_dir / "outcomes.parquet", schema)
    conv = convergence(out, GATES["convergence_tol"])
    th = threshold_table(out, cfg, conv, trajectories(run_dirs))
    write_parquet(th, out_dir / "thresholds.parquet", THRESHOLD_SCHEMA)
    tests = hypothesis_tests(out, cfg, conv)
    write_parquet(tests, out_dir / "tests.parquet", TESTS_SCHEMA)
    write_json(metrics_summary(th, tests, conv, out), out_dir / "metrics.json")
    tables = [("outcomes", out), ("thresholds", th), ("tests", tests)]
    runs = dose_runs(out, GATES["convergence_tol"])
    if len(runs):   # a dose series in the grid (issue 43): its per-run table and its levels
        levels = levels_table(runs, cfg.alpha, GATES["dose_tol"], GATES["min_seeds"])
        per_m = by_m_table(runs, cfg.alpha, GATES["dose_tol"], GATES["min_seeds"])
        write_parquet(runs, out_dir / "dose.parquet", DOSE_SCHEMA)
        write_parquet(levels, out_dir / "dose_levels.parquet", LEVELS_SCHEMA)
        write_parquet(per_m, out_dir / "dose_decomposition.parquet", BY_M_SCHEMA)
        tables += [("dose", runs), ("dose_levels", levels), ("dose_decomposition", per_m)]
    batch = batch_levels(out, cfg.alpha, GATES["min_seeds"])
    if len(batch):   # an arm of ≥ 3 batch sizes (issue 70): figure 6 on the batch axis
        write_parquet(batch, out_dir / "batch_levels.parquet", BATCH_LEVELS_SCHEMA)
        tables.append(("batch_levels", batch))
    for name, df in tables:
        write_text(markdown(df), out_dir / f"{name}.md")
    return tests
