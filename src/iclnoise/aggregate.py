"""Aggregate every run into outcomes, thresholds and hypothesis tests (SPEC §11).

Each optional input (llc.parquet, exposure.parquet, geometry.parquet) fills its columns when it
exists and leaves them null otherwise, so the tables keep one schema whichever probes ran; a test
whose inputs are missing is reported as 'not run: <reason>' instead of disappearing.

Every threshold and every verdict carries validity gates (GATES; issue 13): convergence of the
M = ∞ runs to ridge, a threshold fit that exists inside the grid, r spanning low to high, enough
seeds, equal data (and for H2 equal realised exposure) between compared arms, LLC diagnostics.
A verdict that fails a gate reads 'inconclusive: <gates>'; otherwise its words follow the
Holm-adjusted decision, with direction words only for significant effects.
"""
from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

from . import stats
from .io import KEY_FIELDS, read_json, read_parquet, write_json, write_parquet, write_text
from .runs import last_step
from .schedules import lr_lambda
from .sections import LRSchedule, NoiseCondition, Stats
from .tasks import M_INF, m_label

log = logging.getLogger(__name__)

OUTCOME_FIELDS = KEY_FIELDS + [
    pa.field("steps", pa.int64()), pa.field("sequences", pa.int64()), pa.field("diverged", pa.bool_()),
    pa.field("ood_loss", pa.float64()), pa.field("id_loss", pa.float64()), pa.field("r", pa.float64()),
    pa.field("ood_loss_ridge", pa.float64()), pa.field("ood_loss_dmmse", pa.float64()),
    pa.field("delta_dmmse", pa.float64()), pa.field("delta_ridge", pa.float64()), pa.field("icl_score", pa.float64()),
    pa.field("t_crit", pa.int64()), pa.field("ood_loss_at_t_crit", pa.float64()), pa.field("r_at_t_crit", pa.float64()),
    pa.field("icl_score_at_t_crit", pa.float64()), pa.field("transient_window", pa.float64()),
    pa.field("noise_source", pa.string()), pa.field("noise_schedule", pa.string()),
    pa.field("noise_shape", pa.string()), pa.field("noise_level", pa.float64()), pa.field("emulate_batch", pa.int64()),
    pa.field("integrated_lr_over_b", pa.float64()),
]
# Columns from optional per-run files: always in the table (null where the file or the key is absent), so the
# schema of outcomes.parquet does not depend on which probes ran.
LLC_COLUMNS = ["llc_final", "llc_final_std"]
LLC_COUNTS = ["llc_n_estimates", "llc_n_flagged"]   # estimates in llc.parquet; flagged not-levelled/negative/diverged
LLC_FLAGS = ["llc_final_flagged"]   # the final estimate (the one H4 tests) is not levelled / negative / diverged
EXPOSURE_COLUMNS = ["integrated_pne", "integrated_pne_preclip", "integrated_ne", "integrated_ne_injected",
                    "integrated_ne_simple", "integrated_pne_injected"]   # exposure.summarize keys (realised, per run)
GEOMETRY_COLUMNS = ["hessian_trace", "top_eigenvalue", "sam_sharpness"]
CIRCUIT_COLUMNS = ["attn_to_y_excess", "icl_drop_max", "probe_ridge_r2_max"]   # mech.run_summary (end of training)
OPTIONAL_FIELDS = ([pa.field(c, pa.float64()) for c in LLC_COLUMNS] + [pa.field(c, pa.int64()) for c in LLC_COUNTS]
                   + [pa.field(c, pa.bool_()) for c in LLC_FLAGS]
                   + [pa.field(c, pa.float64()) for c in EXPOSURE_COLUMNS + GEOMETRY_COLUMNS + CIRCUIT_COLUMNS])
OUTCOMES_SCHEMA = pa.schema(OUTCOME_FIELDS + OPTIONAL_FIELDS)
GATE_FIELDS = [pa.field("gates_passed", pa.bool_()), pa.field("gate_failures", pa.string())]
TESTS_SCHEMA = pa.schema([
    pa.field("hypothesis", pa.string()), pa.field("test", pa.string()), pa.field("outcome", pa.string()),
    pa.field("term", pa.string()), pa.field("estimate", pa.float64()), pa.field("ci_lo", pa.float64()),
    pa.field("ci_hi", pa.float64()), pa.field("p", pa.float64()), pa.field("p_holm", pa.float64()),
    pa.field("effect_size", pa.float64()), pa.field("n", pa.int64()), pa.field("status", pa.string()),
    pa.field("verdict", pa.string()), *GATE_FIELDS,
])
THRESHOLD_SCHEMA = pa.schema([   # one row per (batch, noise, method)
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("noise_source", pa.string()),
    pa.field("noise_schedule", pa.string()), pa.field("emulate_batch", pa.int64()),
    pa.field("noise_level", pa.float64()),
    pa.field("method", pa.string()),   # r50: r crosses 0.5 (stats.threshold_with_ci); crossover: the anchor's M*
                                       # where the late pull on new tasks turns from dMMSE_M to ridge
                                       # (stats.crossover_threshold)
    pa.field("M_star", pa.float64()), pa.field("M_star_lo", pa.float64()),
    pa.field("M_star_hi", pa.float64()), pa.field("log2_M_star", pa.float64()), pa.field("log2_se", pa.float64()),
    pa.field("floor", pa.float64()), pa.field("ceiling", pa.float64()), pa.field("scale", pa.float64()),
    pa.field("p_rise", pa.float64()),                                     # r50 only: NaN for crossover
    pa.field("p_sign", pa.float64()), pa.field("slope_first", pa.float64()),
    pa.field("slope_last", pa.float64()),                                 # crossover only: NaN for r50
    pa.field("in_range", pa.bool_()), pa.field("n_seeds", pa.int64()),
    pa.field("n_seeds_fit", pa.int64()), pa.field("interval", pa.string()), pa.field("reason", pa.string()),
    pa.field("r_min", pa.float64()), pa.field("r_max", pa.float64()), *GATE_FIELDS,
])
TRAJECTORY_COLUMNS = ["run_id", "M", "seed", "batch", "noise", "sequences", "ood_delta_dmmse", "ood_delta_ridge"]
CONVERGENCE_SCHEMA = pa.schema([
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("n_inf_runs", pa.int64()),
    pa.field("ood_loss_over_ridge", pa.float64()), pa.field("converged", pa.bool_()),
])
# Validity gates (issue 13): thresholds every verdict must pass before it may read as a finding.
GATES = {
    "convergence_tol": 0.15,   # every M = ∞ run ends with OOD loss ≤ (1 + tol) × ridge's
    "min_seeds": 3,            # fewer seeds: no interval, no verdict ("insufficient seeds")
    "r_low": 0.25,             # r must span low (some M with seed-mean r ≤ r_low) ...
    "r_high": 0.75,            # ... to high (some M with seed-mean r ≥ r_high) for a threshold to be a transition
    "data_tol": 0.01,          # compared arms saw the same number of sequences within 1 %
    "exposure_tol": 0.10,      # H2: early and late realised injected exposure within 10 %
    "llc_flagged_max": 0.25,   # LLC verdicts: at most 25 % of the tested (final) estimates not levelled / negative /
                               # diverged; estimates at initialisation (no minimum there) do not enter
}


def integrated_lr_over_b(spec: dict) -> float:
    """Σ_t η_t / B over the steps trained (to `train.budget.stop_at` where set): the η/B noise-temperature
    proxy (Smith & Le), exact from the schedule."""
    t = spec["train"]
    s = LRSchedule.from_dict(t["lr_schedule"])
    f = lr_lambda(s.kind, t["steps"], s.warmup_frac, s.min_lr_frac)
    return t["optimizer"]["lr"] * sum(f(i) for i in range(last_step(spec))) / spec["keys"]["batch"]


def _noise_fields(spec: dict) -> dict:
    """Source, schedule, shape and level of a run's noise. The level is 1/B for batch noise and
    1/B_target for an emulated batch (an effective inverse batch size), else the budget or target. Absent
    schedule / shape (source none) read "none"; no emulated batch reads 0."""
    n = NoiseCondition.of_spec(spec)
    if n.source == "none":
        level = 1.0 / spec["keys"]["batch"]
    elif n.emulate_batch:
        level = 1.0 / n.emulate_batch
    else:
        level = float(n.budget if n.budget is not None else n.target if n.target is not None else math.nan)
    return {"noise_source": "batch" if n.source == "none" else n.source, "noise_schedule": n.schedule or "none",
            "noise_shape": n.shape or "none", "noise_level": level, "emulate_batch": n.emulate_batch or 0}


def run_outcomes(run_dir: Path, transient_tol: float) -> dict:
    spec = read_json(run_dir / "run.json")
    m = read_parquet(run_dir / "metrics.parquet").sort_values("step")
    end = m.iloc[-1]
    w = stats.transient_ridge_window(m, transient_tol)
    if w["t_crit"] < 0:
        log.warning("%s: no checkpoint after step 0 (diverged at its first update): no t_crit", run_dir.name)
    at = m[m.step == w["t_crit"]].iloc[0] if w["t_crit"] >= 0 else pd.Series(math.nan, index=m.columns)
    row = {**spec["keys"], "steps": int(end.step), "sequences": int(end.sequences), "diverged": bool(m.diverged.any()),
           **{k: float(end[k]) for k in ("ood_loss", "id_loss", "r", "ood_loss_ridge", "ood_loss_dmmse",
                                         "delta_dmmse", "delta_ridge", "icl_score")},
           "t_crit": w["t_crit"], "ood_loss_at_t_crit": float(at.ood_loss), "r_at_t_crit": float(at.r),
           "icl_score_at_t_crit": float(at.icl_score), "transient_window": w["window"],
           **_noise_fields(spec), "integrated_lr_over_b": integrated_lr_over_b(spec)}
    row.update({f.name: None for f in OPTIONAL_FIELDS})
    if (run_dir / "llc.parquet").exists():
        llc = read_parquet(run_dir / "llc.parquet").sort_values("step")
        if len(llc):
            flagged = llc.not_levelled.astype(bool) | llc.negative.astype(bool) | llc.diverged.astype(bool)
            row.update(llc_final=float(llc.llc_mean.iloc[-1]), llc_final_std=float(llc.llc_std.iloc[-1]),
                       llc_n_estimates=len(llc), llc_n_flagged=int(flagged.sum()),
                       llc_final_flagged=bool(flagged.iloc[-1]))
    if (run_dir / "exposure.parquet").exists():
        from .exposure import summarize  # the noise module owns exposure summaries
        s = summarize(read_parquet(run_dir / "exposure.parquet"))
        row.update({k: float(s[k]) for k in EXPOSURE_COLUMNS if k in s})
    if (run_dir / "geometry.parquet").exists():
        g = read_parquet(run_dir / "geometry.parquet").sort_values("step").iloc[-1]
        row.update({k: float(g[k]) for k in GEOMETRY_COLUMNS if k in g})
    if (run_dir / "mech.parquet").exists():
        from .mech import run_summary
        s = run_summary(read_parquet(run_dir / "mech.parquet"))
        row.update({k: float(s[k]) for k in CIRCUIT_COLUMNS if k in s})
    return row


def outcomes(run_dirs: list[Path], transient_tol: float) -> tuple[pd.DataFrame, pa.Schema]:
    """One row per run; every column of OUTCOMES_SCHEMA is present (null where a probe did not run)."""
    df = pd.DataFrame([run_outcomes(d, transient_tol) for d in run_dirs], columns=OUTCOMES_SCHEMA.names)
    for f in OPTIONAL_FIELDS:
        df[f.name] = df[f.name].astype("Int64" if f.type == pa.int64() else float)
    return df, OUTCOMES_SCHEMA


def _cond(batch, noise) -> str:
    return f"{noise}/B{int(batch)}"


def convergence(out: pd.DataFrame, tol: float = GATES["convergence_tol"]) -> pd.DataFrame:
    """Per (batch, noise) condition: the worst M = ∞ run's final OOD loss over ridge's (diverged runs count as
    ∞); converged when it is ≤ 1 + tol (issue 13: the transformer must reach the Bayes predictor for q∞)."""
    rows = []
    for (B, noise), g in out.groupby(["batch", "noise"]):
        inf = g[g.M == M_INF]
        ratio = np.array(inf.ood_loss / inf.ood_loss_ridge, dtype=float)
        ratio[inf.diverged.to_numpy(bool) | inf.ood_loss.isna().to_numpy()] = np.inf
        worst = float(np.nanmax(ratio)) if np.isfinite(ratio).any() or np.isinf(ratio).any() else math.nan
        rows.append({"batch": B, "noise": noise, "n_inf_runs": len(inf), "ood_loss_over_ridge": worst,
                     "converged": bool(worst <= 1 + tol)})
    return pd.DataFrame(rows, columns=CONVERGENCE_SCHEMA.names)


def _gate_convergence(runs: pd.DataFrame, conv: pd.DataFrame) -> list[str]:
    """A condition converged when its M = ∞ runs did. A condition run at some M only (noise.conditions.<c>.M,
    e.g. an early/late pair at one M) has no M = ∞ run of its own: the batch-noise runs at its batch size, the
    same model, data and budget without injection, stand for it."""
    c = conv.set_index(["batch", "noise"])
    bad = []
    for key in sorted({(int(b), n) for b, n in zip(runs.batch, runs.noise)}):
        row = c.loc[key] if key in c.index else None
        if row is None or not row.n_inf_runs:
            ref = (key[0], "none")
            row = c.loc[ref] if ref in c.index and c.loc[ref].n_inf_runs else None
            if row is None:
                bad.append(f"{_cond(*key)}: no M = ∞ run, nor batch-noise M = ∞ runs at batch {key[0]}")
            elif not row.converged:
                bad.append(f"{_cond(*key)}: no M = ∞ run; batch noise's at batch {key[0]} "
                           f"{row.ood_loss_over_ridge:.2f}× ridge's")
        elif not row.converged:
            bad.append(f"{_cond(*key)}: M = ∞ OOD loss {row.ood_loss_over_ridge:.2f}× ridge's")
    return [f"unconverged ({', '.join(bad)})"] if bad else []


def _gate_seeds(runs: pd.DataFrame, min_seeds: int) -> list[str]:
    k = runs.seed.nunique()
    return [f"insufficient seeds ({k} < {min_seeds})"] if k < min_seeds else []


def _gate_equal_data(runs: pd.DataFrame, tol: float, strata: list[str] | None = None) -> list[str]:
    """Compared arms must have seen the same number of training sequences (within each stratum)."""
    groups = runs.groupby(strata) if strata else [(None, runs)]
    for _, g in groups:
        lo, hi = g.sequences.min(), g.sequences.max()
        if not (lo > 0 and hi / lo - 1 <= tol):
            return [f"unequal data (sequences seen {lo:,}–{hi:,})"]
    return []


def _gate_llc(runs: pd.DataFrame, max_share: float) -> list[str]:
    """The estimates a verdict uses (each run's final LLC) must be reliable: at most `max_share` of them flagged.
    Flags earlier in training do not enter: at initialisation the model is not near a minimum, where the LLC
    is defined, and a negative estimate there is expected (metrics.json keeps the share over all estimates)."""
    flags = runs.llc_final_flagged.dropna().astype(bool)
    n, k = len(flags), int(flags.sum())
    if not n:
        return ["LLC diagnostics (no estimates)"]
    return [f"LLC diagnostics ({k} of {n} final estimates not levelled / negative / diverged)"] \
        if k / n > max_share else []


def trajectories(run_dirs: list[Path]) -> pd.DataFrame:
    """Per-checkpoint Δ on new tasks of every run (the crossover threshold's input); NaN for runs whose
    metrics.parquet predates the ood_delta_* columns."""
    frames = [read_parquet(d / "metrics.parquet").reindex(columns=TRAJECTORY_COLUMNS) for d in run_dirs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TRAJECTORY_COLUMNS)


def _condition_fields(B: int, noise: str, g: pd.DataFrame) -> dict:
    """A thresholds row's condition columns, from the condition's outcome rows."""
    return {"batch": B, "noise": noise, "noise_source": g.noise_source.iloc[0],
            "noise_schedule": g.noise_schedule.iloc[0], "emulate_batch": int(g.emulate_batch.iloc[0]),
            "noise_level": float(g.noise_level.iloc[0])}


def thresholds(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame | None = None,
               traj: pd.DataFrame | None = None) -> pd.DataFrame:
    """M* per (batch, noise) condition by both methods, each with its validity gates: convergence, a threshold that
    exists inside the grid with every per-seed estimate successful, ≥ min_seeds seeds and equal data across the
    condition's runs; r50 (stats.threshold_with_ci) also needs r spanning low to high. crossover
    (stats.crossover_threshold) reads `traj` (trajectories(); None: not logged)."""
    gates = GATES
    conv = convergence(out, gates["convergence_tol"]) if conv is None else conv
    traj = pd.DataFrame(columns=TRAJECTORY_COLUMNS) if traj is None else traj
    rows = []
    ok = out[~out.diverged & (out.M != M_INF)]
    for (B, noise), g in ok.groupby(["batch", "noise"]):
        name = _cond(B, noise)
        mean_r = g.groupby("M").r.mean()
        unconverged = _gate_convergence(out[(out.batch == B) & (out.noise == noise)], conv)
        design = _gate_seeds(g, gates["min_seeds"]) + _gate_equal_data(g, gates["data_tol"])
        base = {**_condition_fields(B, noise, g), "r_min": float(mean_r.min()), "r_max": float(mean_r.max())}
        t = traj[traj.run_id.isin(g.run_id)]
        ests = {"r50": stats.threshold_with_ci(g, level=1 - cfg.alpha, min_seeds=gates["min_seeds"], alpha=cfg.alpha),
                "crossover": stats.crossover_threshold(stats.pull_slopes(t), level=1 - cfg.alpha,
                                                       min_seeds=gates["min_seeds"], alpha=cfg.alpha)}
        if not t.ood_delta_ridge.notna().any():
            ests["crossover"]["reason"] = "no threshold: Δ on new tasks not logged (runs predate ood_delta_*)"
        for method, est in ests.items():
            gate = "threshold fit" if method == "r50" else "crossover fit"
            fails = []
            if est["reason"].startswith("no threshold"):
                fails.append(f"{gate} ({name}: {est['reason'].removeprefix('no threshold: ')})")
            elif est["seeds_failed"]:
                fails.append(f"{gate} ({name}: per-seed estimates without threshold: {est['seeds_failed']})")
            if method == "r50" and not (mean_r.min() <= gates["r_low"] and mean_r.max() >= gates["r_high"]):
                fails.append(f"r does not span low to high ({name}: seed-mean r {mean_r.min():.2f}–"
                             f"{mean_r.max():.2f}, needs ≤ {gates['r_low']} and ≥ {gates['r_high']})")
            fails = unconverged + fails + design
            rows.append({**base, **est, "method": method, "gates_passed": not fails, "gate_failures": "; ".join(fails)})
    finite = out[out.M != M_INF]
    for (B, noise), g in finite.groupby(["batch", "noise"]):
        if g.diverged.all():   # the condition stays in the table, saying why it has no threshold
            name = _cond(B, noise)
            rows += [{**_condition_fields(B, noise, g), "method": method, "reason": "no threshold: every run diverged",
                      "gates_passed": False, "gate_failures": f"{gate} ({name}: every run with finite M diverged)"}
                     for method, gate in (("r50", "threshold fit"), ("crossover", "crossover fit"))]
    return pd.DataFrame(rows).reindex(columns=THRESHOLD_SCHEMA.names)


def _row(h, test, outcome, term="", status="run", n=0, words=("", ""), fails=(), **vals) -> dict:
    """One test row. `words` = (verdict if the Holm-adjusted test is significant, verdict if not); `fails` = the
    validity gates it failed. The verdict is written after Holm (`_verdicts`)."""
    base = {k: math.nan for k in ("estimate", "ci_lo", "ci_hi", "p", "p_holm", "effect_size")}
    base.update({k: v for k, v in vals.items() if k in base})
    return {"hypothesis": h, "test": test, "outcome": outcome, "term": term, **base, "n": n, "status": status,
            "verdict": "", "gates_passed": status == "run" and not fails, "gate_failures": "; ".join(fails),
            "_words": words}


def _verdicts(rows: list[dict], alpha: float) -> pd.DataFrame:
    """Holm–Bonferroni over every test that ran; each verdict follows the Holm-adjusted decision, and a test that
    failed a validity gate reads 'inconclusive: <gates>' whatever its p."""
    for r in rows:   # a test that ran but has no p (a degenerate fit) cannot carry a verdict either
        if r["status"] == "run" and not np.isfinite(r["p"]):
            r["gate_failures"] = "; ".join(filter(None, [r["gate_failures"], "degenerate test (p undefined)"]))
            r["gates_passed"] = False
    df = pd.DataFrame(rows)
    df["p_holm"] = stats.holm(df.p.to_numpy())
    verdicts = []
    for r, p in zip(rows, df.p_holm):
        if r["status"] != "run":
            verdicts.append("")
        elif r["gate_failures"]:
            verdicts.append(f"inconclusive: {r['gate_failures']}")
        else:
            sig = bool(np.isfinite(p) and p < alpha)
            verdicts.append(f"{r['_words'][0] if sig else r['_words'][1]} (Holm p = {p:.3g})")
    df["verdict"] = verdicts
    return df[TESTS_SCHEMA.names]


def _direction(est: float, up: str, down: str) -> str:
    return up if est > 0 else down


def hypothesis_tests(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame | None = None) -> pd.DataFrame:
    alpha, margin = cfg.alpha, cfg.equivalence_margin
    gates = GATES
    conv = convergence(out, gates["convergence_tol"]) if conv is None else conv
    rows = []
    fin = out[(out.M != M_INF) & ~out.diverged].copy()
    fin["log2M"] = np.log2(fin.M)

    def common(runs, strata=None):
        return (_gate_convergence(runs, conv) + _gate_seeds(runs, gates["min_seeds"])
                + _gate_equal_data(runs, gates["data_tol"], strata))

    exposure = "integrated_pne" if fin.integrated_pne.notna().all() and len(fin) else "integrated_lr_over_b"
    fin["log_exposure"] = np.log(fin[exposure])
    covars = " + ".join(c for c in ("log2M", "id_loss") if fin[c].nunique() > 1)  # constants make X singular
    covars = f" + {covars}" if covars else ""
    # H1 (association): outcomes against measured exposure at matched loss and M. Measured exposure also tracks
    # the phase the model is in, so this row is worded as an association; the causal test is the LR row below.
    for outcome in ("r", "ood_loss"):
        if fin.log_exposure.nunique() < 2 or fin.seed.nunique() < 2:
            rows.append(_row("H1", "mixed model", outcome,
                             status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds"))
            continue
        try:
            t = stats.mixed_model(fin, f"{outcome} ~ log_exposure{covars}", alpha=alpha).set_index("term")
            e = t.loc["log_exposure"]
            rows.append(_row("H1", f"MixedLM {outcome} ~ log({exposure}){covars} + (1|seed)", outcome,
                             f"log {exposure}", n=len(fin), estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi, p=e.p,
                             effect_size=e.std_effect, fails=common(fin),
                             words=(f"{outcome} {_direction(e.estimate, 'increases', 'decreases')} with measured "
                                    f"exposure (association)", f"no evidence that {outcome} changes with exposure")))
        except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
            rows.append(_row("H1", "mixed model", outcome, status=f"not run: fit failed ({type(err).__name__})"))
    rows.append(h1_noise_beyond_eta_b(fin, common))
    rows.append(h2_early_late(fin, alpha, gates, common))
    # H3: batch noise at batch b vs injected noise emulating b at a larger batch: TOST on the differences
    # paired by (M, seed), so the spread across M does not enter the error
    h3 = 0
    for cond, inj in fin[fin.noise_source.isin(["grad", "param"]) & (fin.emulate_batch > 0)].groupby("noise"):
        b = int(inj.emulate_batch.iloc[0])
        bat = fin[(fin.noise_source == "batch") & (fin.batch == b)]
        pairs = bat.merge(inj, on=["M", "seed"], suffixes=("_batch", "_inj"))
        if len(pairs) < 2:
            continue
        used = pd.concat([bat[bat.set_index(["M", "seed"]).index.isin(pairs.set_index(["M", "seed"]).index)],
                          inj[inj.set_index(["M", "seed"]).index.isin(pairs.set_index(["M", "seed"]).index)]])
        res = stats.paired_tost(pairs.r_batch.to_numpy(), pairs.r_inj.to_numpy(), margin, alpha)
        rows.append(_row("H3", f"paired TOST (margin ±{margin})", "r", f"batch {b} − {cond}", **res,
                         fails=common(used),
                         words=(f"equivalent within ±{margin}", f"equivalence within ±{margin} not shown")))
        h3 += 1
    if not h3:
        rows.append(_row("H3", "TOST", "r", status="not run: no injected condition emulating a batch size in the grid"))
    # H4: geometry, LLC and in-context circuitry (mech.run_summary) against exposure
    for col in ("llc_final", *GEOMETRY_COLUMNS, *CIRCUIT_COLUMNS):
        used = fin[fin[col].notna()]
        if len(used) >= 4 and used.log_exposure.nunique() < 2:
            rows.append(_row("H4", "Spearman correlation", col,
                             status=f"not run: exposure constant where {col} exists"))
        elif len(used) >= 4:
            res = stats.correlation(used.log_exposure, used[col], alpha)
            fails = common(used) + (_gate_llc(used, gates["llc_flagged_max"]) if col == "llc_final" else [])
            rows.append(_row("H4", "Spearman correlation", col, f"log {exposure}", n=res["n"], estimate=res["estimate"],
                             ci_lo=res["ci_lo"], ci_hi=res["ci_hi"], p=res["p"], effect_size=res["estimate"],
                             fails=fails, words=(_direction(res["estimate"], "positively associated",
                                                            "negatively associated"), "no evidence of association")))
        else:
            rows.append(_row("H4", "Spearman correlation", col, status=f"not run: no {col} column"))
    return _verdicts(rows, alpha)


def h1_noise_beyond_eta_b(fin: pd.DataFrame, common=None) -> dict:
    """H1, causal form: does the manipulated noise condition change r beyond the η/B noise temperature?

    LR test (stats.manipulation_lr_test) of r ~ C(η/B level) + C(M) + C(noise) against r ~ C(η/B level) + C(M),
    random intercept per seed: the treatment is what was manipulated (batch size enters through η/B; injected
    noise and its schedule through the condition), so arms are compared at equal η/B and M. Measured P-NE is
    not a regressor: it tracks the phase, and on planted data where log P-NE = log(η/B) + 0.5·phase with no
    effect of noise on r, the old 'P-NE beyond η/B' test rejected 60 of 60 panels; this one rejects at about
    the nominal rate (tests/test_aggregate.py)."""
    name = "LR test: noise condition beyond η/B"
    if fin.seed.nunique() < 2 or fin.noise.nunique() < 2:
        return _row("H1", name, "r", status="not run: needs ≥ 2 seeds and ≥ 2 noise conditions")
    d = fin.assign(eta_b=np.round(np.log(fin.integrated_lr_over_b), 6))
    try:
        res = stats.manipulation_lr_test(d, "r", "C(noise)", "C(eta_b):C(M)")
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", name, "r", status=f"not run: fit failed ({type(err).__name__})")
    if not res["df"]:
        return _row("H1", name, "r", status="not run: no two noise conditions share an η/B level")
    fails = common(d, ["eta_b"]) if common else []
    return _row("H1", name, "r", f"C(noise) | η/B, M ({res['df']} df)", n=res["n"], estimate=res["lr_stat"],
                p=res["p"], effect_size=res["delta_aic"], fails=fails,
                words=("the noise condition changes r beyond η/B", "no evidence that noise changes r beyond η/B"))


def h2_early_late(fin: pd.DataFrame, alpha: float, gates: dict, common=None) -> dict:
    """H2: late − early ridge-likeness, paired by (seed, M, batch), two-sided; valid only when the two arms'
    realised injected exposure (integrated_pne_injected, after clipping) agrees within gates['exposure_tol']."""
    name = "paired t (late − early), two-sided"
    sched = fin[fin.noise_schedule.isin(["early", "late"])]
    if set(sched.noise_schedule) != {"early", "late"}:
        return _row("H2", name, "r", status="not run: grid has no early/late schedule pair")
    p = sched.pivot_table(index=["seed", "M", "batch"], columns="noise_schedule", values="r").dropna()
    used = sched[sched.set_index(["seed", "M", "batch"]).index.isin(p.index)]
    res = stats.paired_test(p["late"].to_numpy(), p["early"].to_numpy(), alpha)
    fails = common(used) if common else []
    e = used.groupby("noise_schedule").integrated_pne_injected.mean()
    if used.integrated_pne_injected.isna().any():
        fails.append("realised exposure not recorded (integrated_pne_injected)")
    elif not (min(e) > 0 and max(e) / min(e) - 1 <= gates["exposure_tol"]):
        fails.append(f"unequal exposure (early {e['early']:.3g}, late {e['late']:.3g})")
    return _row("H2", name, "r", "late − early", **res, fails=fails,
                words=(_direction(res["estimate"], "late noise raises ICL more than early",
                                  "early noise raises ICL more than late"), "no evidence for phase sensitivity"))


def _json_safe(v):
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    return v


def metrics_summary(th: pd.DataFrame, tests: pd.DataFrame, conv: pd.DataFrame, out: pd.DataFrame) -> dict:
    """Small machine-readable summary for `dvc metrics show`: M* per condition (thresholds: r50,
    thresholds_crossover: the anchor's crossover), verdicts with their gates,
    convergence per condition and the share of flagged LLC estimates."""
    n_llc = out.llc_n_estimates.sum()
    return {
        **{key: {_cond(r.batch, r.noise): {k: _json_safe(getattr(r, k)) for k in (
            "M_star", "M_star_lo", "M_star_hi", "n_seeds", "reason", "gates_passed", "gate_failures")}
            for r in th[th.method == method].itertuples()}
           for key, method in (("thresholds", "r50"), ("thresholds_crossover", "crossover"))},
        "tests": {f"{r.hypothesis} {r.test} [{r.outcome}{', ' + r.term if r.term else ''}]": {
            "verdict": r.verdict or r.status, "estimate": _json_safe(r.estimate), "p_holm": _json_safe(r.p_holm),
            "gates_passed": bool(r.gates_passed), "gate_failures": r.gate_failures} for r in tests.itertuples()},
        "convergence": {_cond(r.batch, r.noise): {"ood_loss_over_ridge": _json_safe(r.ood_loss_over_ridge),
                                                  "converged": bool(r.converged)} for r in conv.itertuples()},
        "llc_flagged_share": _json_safe(out.llc_n_flagged.sum() / n_llc) if n_llc else None,
        "llc_final_flagged_share": _json_safe(out.llc_final_flagged.dropna().astype(bool).mean())
        if out.llc_final_flagged.notna().any() else None,
    }


def markdown(df: pd.DataFrame) -> str:
    show = df.copy()
    if "M" in show:
        show["M"] = show.M.map(m_label)
    return show.to_markdown(index=False, floatfmt=".4g") + "\n"


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise aggregate", description=__doc__)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", default="results/aggregate")
    ap.add_argument("--cfg", required=True, help="JSON of the params.yaml stats section")
    ap.add_argument("--figures", default="results/figures")
    a = ap.parse_args(argv)
    cfg = Stats.from_dict(yaml.safe_load(a.cfg))
    out_dir = Path(a.out)
    run_dirs = [Path(d) for d in a.run_dirs]
    out, schema = outcomes(run_dirs, cfg.transient_tol)
    write_parquet(out, out_dir / "outcomes.parquet", schema)
    conv = convergence(out, GATES["convergence_tol"])
    th = thresholds(out, cfg, conv, trajectories(run_dirs))
    write_parquet(th, out_dir / "thresholds.parquet", THRESHOLD_SCHEMA)
    tests = hypothesis_tests(out, cfg, conv)
    write_parquet(tests, out_dir / "tests.parquet", TESTS_SCHEMA)
    write_json(metrics_summary(th, tests, conv, out), out_dir / "metrics.json")
    for name, df in (("outcomes", out), ("thresholds", th), ("tests", tests)):
        write_text(markdown(df), out_dir / f"{name}.md")
    from .figures.noise import fig_exposure_series, fig_schedules
    from .figures.probes import fig_geometry
    from .figures.stats import fig_icl_vs_exposure, fig_threshold_vs_noise
    figs = Path(a.figures)
    fig_threshold_vs_noise(th, figs / "fig06_threshold_vs_noise")
    fig_icl_vs_exposure(out, figs / "fig07_icl_vs_exposure")
    fig_schedules(out, figs / "fig08_early_late")
    fig_geometry(out, figs / "fig09_geometry")
    exp = [Path(d) / "exposure.parquet" for d in a.run_dirs if (Path(d) / "exposure.parquet").exists()]
    fig_exposure_series(pd.concat([read_parquet(f) for f in exp]) if exp else pd.DataFrame(),
                        figs / "fig10_exposure_series")
    print(tests[["hypothesis", "test", "outcome", "estimate", "p_holm", "verdict"]].to_string(index=False))
