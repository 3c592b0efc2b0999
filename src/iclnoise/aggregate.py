"""Aggregate every run into outcomes, thresholds and hypothesis tests (SPEC §11).

Each optional input (llc.parquet, exposure.parquet, geometry.parquet) adds its columns when it
exists, so the aggregate never breaks because a probe is switched off; a test whose inputs are
missing is reported as 'not run: <reason>' instead of disappearing.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

from . import stats
from .io import KEY_FIELDS, read_json, read_parquet, write_parquet, write_text
from .tasks import M_INF, m_label
from .schedules import lr_lambda

OUTCOME_FIELDS = KEY_FIELDS + [
    pa.field("steps", pa.int64()), pa.field("diverged", pa.bool_()),
    pa.field("ood_loss", pa.float64()), pa.field("id_loss", pa.float64()), pa.field("r", pa.float64()),
    pa.field("delta_dmmse", pa.float64()), pa.field("delta_ridge", pa.float64()), pa.field("icl_score", pa.float64()),
    pa.field("t_crit", pa.int64()), pa.field("ood_loss_at_t_crit", pa.float64()), pa.field("r_at_t_crit", pa.float64()),
    pa.field("icl_score_at_t_crit", pa.float64()), pa.field("transient_window", pa.float64()),
    pa.field("noise_source", pa.string()), pa.field("noise_schedule", pa.string()), pa.field("noise_shape", pa.string()),
    pa.field("noise_level", pa.float64()), pa.field("emulate_batch", pa.int64()),
    pa.field("integrated_lr_over_b", pa.float64()),
]
OPTIONAL_OUTCOMES = {  # column -> (per-run file, how it is derived)
    "llc_final": "llc.parquet", "llc_final_std": "llc.parquet",
    "integrated_pne": "exposure.parquet", "integrated_pne_preclip": "exposure.parquet",
    "integrated_ne": "exposure.parquet", "integrated_ne_injected": "exposure.parquet",
    "integrated_ne_simple": "exposure.parquet",
    "hessian_trace": "geometry.parquet", "top_eigenvalue": "geometry.parquet", "sam_sharpness": "geometry.parquet",
}
TESTS_SCHEMA = pa.schema([
    pa.field("hypothesis", pa.string()), pa.field("test", pa.string()), pa.field("outcome", pa.string()),
    pa.field("term", pa.string()), pa.field("estimate", pa.float64()), pa.field("ci_lo", pa.float64()),
    pa.field("ci_hi", pa.float64()), pa.field("p", pa.float64()), pa.field("p_holm", pa.float64()),
    pa.field("effect_size", pa.float64()), pa.field("n", pa.int64()), pa.field("status", pa.string()),
    pa.field("verdict", pa.string()),
])
THRESHOLD_SCHEMA = pa.schema([
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("noise_source", pa.string()),
    pa.field("noise_schedule", pa.string()), pa.field("emulate_batch", pa.int64()),
    pa.field("noise_level", pa.float64()), pa.field("M_star", pa.float64()), pa.field("M_star_lo", pa.float64()),
    pa.field("M_star_hi", pa.float64()), pa.field("log2_M_star", pa.float64()), pa.field("scale", pa.float64()),
    pa.field("in_range", pa.bool_()), pa.field("n_seeds", pa.int64()), pa.field("n_boot_ok", pa.int64()),
])


def integrated_lr_over_b(spec: dict) -> float:
    """Σ_t η_t / B over training: the η/B noise-temperature proxy (Smith & Le), exact from the schedule."""
    t = spec["train"]
    s = t["lr_schedule"]
    f = lr_lambda(s["kind"], t["steps"], s.get("warmup_frac", 0.0), s.get("min_lr_frac", 0.0))
    return t["optimizer"]["lr"] * sum(f(i) for i in range(t["steps"])) / spec["keys"]["batch"]


def _noise_fields(spec: dict) -> dict:
    """Source, schedule, shape and level of a run's noise. The level is 1/B for batch noise and
    1/B_target for an emulated batch (an effective inverse batch size), else the budget or target."""
    n = spec.get("noise") or {}
    source = n.get("source", "none")
    if source == "none":
        level = 1.0 / spec["keys"]["batch"]
    elif n.get("emulate_batch"):
        level = 1.0 / n["emulate_batch"]
    else:
        level = float(n.get("budget", n.get("target", math.nan)))
    return {"noise_source": "batch" if source == "none" else source, "noise_schedule": n.get("schedule", "none"),
            "noise_shape": n.get("shape", "none"), "noise_level": level,
            "emulate_batch": int(n.get("emulate_batch") or 0)}


def run_outcomes(run_dir: Path, transient_tol: float = 0.05) -> dict:
    spec = read_json(run_dir / "run.json")
    m = read_parquet(run_dir / "metrics.parquet").sort_values("step")
    end = m.iloc[-1]
    w = stats.transient_ridge_window(m, transient_tol)
    at = m[m.step == w["t_crit"]].iloc[0]
    row = {**spec["keys"], "steps": int(end.step), "diverged": bool(m.diverged.any()),
           **{k: float(end[k]) for k in ("ood_loss", "id_loss", "r", "delta_dmmse", "delta_ridge", "icl_score")},
           "t_crit": w["t_crit"], "ood_loss_at_t_crit": float(at.ood_loss), "r_at_t_crit": float(at.r),
           "icl_score_at_t_crit": float(at.icl_score), "transient_window": w["window"],
           **_noise_fields(spec), "integrated_lr_over_b": integrated_lr_over_b(spec)}
    if (run_dir / "llc.parquet").exists():
        llc = read_parquet(run_dir / "llc.parquet").sort_values("step").iloc[-1]
        row.update(llc_final=float(llc.llc_mean), llc_final_std=float(llc.llc_std))
    if (run_dir / "exposure.parquet").exists():
        from .exposure import summarize  # the noise module owns exposure summaries
        row.update(summarize(read_parquet(run_dir / "exposure.parquet")))
    if (run_dir / "geometry.parquet").exists():
        g = read_parquet(run_dir / "geometry.parquet").sort_values("step").iloc[-1]
        row.update({k: float(g[k]) for k in ("hessian_trace", "top_eigenvalue", "sam_sharpness") if k in g})
    return row


def outcomes(run_dirs: list[Path], transient_tol: float = 0.05) -> tuple[pd.DataFrame, pa.Schema]:
    df = pd.DataFrame([run_outcomes(d, transient_tol) for d in run_dirs])
    fields = list(OUTCOME_FIELDS) + [pa.field(c, pa.float64()) for c in OPTIONAL_OUTCOMES if c in df]
    return df[[f.name for f in fields]], pa.schema(fields)


def thresholds(out: pd.DataFrame, n_boot: int, seed: int) -> pd.DataFrame:
    rows = []
    ok = out[~out.diverged]
    for (B, noise), g in ok.groupby(["batch", "noise"]):
        est = stats.threshold_with_ci(g, n_boot=n_boot, seed=seed)
        rows.append({"batch": B, "noise": noise, "noise_source": g.noise_source.iloc[0],
                     "noise_schedule": g.noise_schedule.iloc[0], "emulate_batch": int(g.emulate_batch.iloc[0]),
                     "noise_level": float(g.noise_level.iloc[0]), **{k: est[k] for k in THRESHOLD_SCHEMA.names
                                                                      if k in est}})
    return pd.DataFrame(rows, columns=THRESHOLD_SCHEMA.names)


def _row(h, test, outcome, term="", status="run", verdict="", n=0, **vals) -> dict:
    base = {k: math.nan for k in ("estimate", "ci_lo", "ci_hi", "p", "p_holm", "effect_size")}
    base.update({k: v for k, v in vals.items() if k in base})
    return {"hypothesis": h, "test": test, "outcome": outcome, "term": term, **base, "n": n, "status": status,
            "verdict": verdict}


def hypothesis_tests(out: pd.DataFrame, cfg: dict) -> pd.DataFrame:
    alpha, margin = cfg.get("alpha", 0.05), cfg.get("equivalence_margin", 0.05)
    rows = []
    fin = out[(out.M != M_INF) & ~out.diverged].copy()
    fin["log2M"] = np.log2(fin.M)
    exposure = "integrated_pne" if "integrated_pne" in fin and fin.integrated_pne.notna().all() else "integrated_lr_over_b"
    fin["log_exposure"] = np.log(fin[exposure])
    covars = " + ".join(c for c in ("log2M", "id_loss") if fin[c].nunique() > 1)  # constants make X singular
    covars = f" + {covars}" if covars else ""
    # H1: ICL rises with integrated exposure at matched loss and M
    for outcome in ("r", "ood_loss"):
        if fin.log_exposure.nunique() < 2 or fin.seed.nunique() < 2:
            rows.append(_row("H1", "mixed model", outcome, status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds"))
            continue
        try:
            t = stats.mixed_model(fin, f"{outcome} ~ log_exposure{covars}", alpha=alpha).set_index("term")
            e = t.loc["log_exposure"]
            sign = "increases" if e.estimate > 0 else "decreases"
            rows.append(_row("H1", f"MixedLM {outcome} ~ log({exposure}){covars} + (1|seed)", outcome,
                             f"log {exposure}", n=len(fin), estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi, p=e.p,
                             effect_size=e.std_effect, verdict=f"{outcome} {sign} with exposure"))
        except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
            rows.append(_row("H1", "mixed model", outcome, status=f"not run: fit failed ({type(err).__name__})"))
    if exposure == "integrated_pne":
        fin["log_lr_over_b"] = np.log(fin.integrated_lr_over_b)
        try:
            if fin.seed.nunique() < 2 or fin.log_lr_over_b.nunique() < 2:
                raise ValueError("needs ≥ 2 seeds and ≥ 2 values of η/B")
            c = stats.compare_models(fin, f"r ~ log_exposure + log_lr_over_b{covars}", f"r ~ log_lr_over_b{covars}")
            rows.append(_row("H1", "LR test: P-NE beyond η/B", "r", "log integrated_pne", n=len(fin),
                             estimate=c["lr_stat"], p=c["p"], effect_size=c["delta_aic"],
                             verdict="P-NE explains variance η/B does not" if c["p"] < alpha
                             else "no evidence P-NE adds to η/B"))
        except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
            rows.append(_row("H1", "LR test: P-NE beyond η/B", "r", status=f"not run: {err or type(err).__name__}"))
    else:
        rows.append(_row("H1", "LR test: P-NE beyond η/B", "r", status="not run: no exposure.parquet (P-NE) logs"))
    # H2: late vs early at equal exposure, paired by seed (and M, batch)
    sched = fin[fin.noise_schedule.isin(["early", "late"])]
    if set(sched.noise_schedule) == {"early", "late"}:
        p = sched.pivot_table(index=["seed", "M", "batch"], columns="noise_schedule", values="r").dropna()
        res = stats.paired_test(p["late"].to_numpy(), p["early"].to_numpy(), alpha)
        rows.append(_row("H2", "paired t (late − early)", "r", "late − early", **res,
                         verdict="late noise raises ICL more" if res["ci_lo"] > 0 else "no evidence for phase sensitivity"))
    else:
        rows.append(_row("H2", "paired t (late − early)", "r", status="not run: grid has no early/late schedule pair"))
    # H3: batch noise at batch b vs injected noise emulating b at a larger batch: TOST on the differences
    # paired by (M, seed), so the spread across M does not enter the error
    h3 = 0
    for cond, inj in fin[fin.noise_source.isin(["grad", "param"]) & (fin.emulate_batch > 0)].groupby("noise"):
        b = int(inj.emulate_batch.iloc[0])
        bat = fin[(fin.noise_source == "batch") & (fin.batch == b)]
        pairs = bat.merge(inj, on=["M", "seed"], suffixes=("_batch", "_inj"))
        if len(pairs) < 2:
            continue
        res = stats.paired_tost(pairs.r_batch.to_numpy(), pairs.r_inj.to_numpy(), margin, alpha)
        rows.append(_row("H3", f"paired TOST (margin ±{margin})", "r", f"batch {b} − {cond}", **res,
                         verdict="equivalent" if res["equivalent"] else "equivalence not shown"))
        h3 += 1
    if not h3:
        rows.append(_row("H3", "TOST", "r", status="not run: no injected condition emulating a batch size in the grid"))
    # H4: geometry and LLC against exposure
    for col in ("llc_final", "hessian_trace", "top_eigenvalue", "sam_sharpness"):
        if col in fin and fin[col].notna().sum() >= 4:
            res = stats.correlation(fin.log_exposure, fin[col], alpha)
            rows.append(_row("H4", "Spearman correlation", col, f"log {exposure}", n=res["n"], estimate=res["estimate"],
                             ci_lo=res["ci_lo"], ci_hi=res["ci_hi"], p=res["p"], effect_size=res["estimate"],
                             verdict="associated" if res["p"] < alpha else "no evidence of association"))
        else:
            rows.append(_row("H4", "Spearman correlation", col, status=f"not run: no {col} column"))
    df = pd.DataFrame(rows, columns=TESTS_SCHEMA.names)
    df["p_holm"] = stats.holm(df.p.to_numpy())
    df["verdict"] = [v + (f" (Holm p = {p:.3g}{', significant' if p < alpha else ''})" if np.isfinite(p) else "")
                     for v, p in zip(df.verdict, df.p_holm)]
    return df


def markdown(df: pd.DataFrame) -> str:
    show = df.copy()
    if "M" in show:
        show["M"] = show.M.map(m_label)
    return show.to_markdown(index=False, floatfmt=".4g") + "\n"


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise aggregate", description=__doc__)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", default="results/aggregate")
    ap.add_argument("--cfg", default="{}", help="JSON of the params.yaml stats section")
    ap.add_argument("--figures", default="results/figures")
    a = ap.parse_args(argv)
    cfg = yaml.safe_load(a.cfg) or {}
    out_dir = Path(a.out)
    out, schema = outcomes([Path(d) for d in a.run_dirs], cfg.get("transient_tol", 0.05))
    write_parquet(out, out_dir / "outcomes.parquet", schema)
    th = thresholds(out, cfg.get("n_boot", 200), cfg.get("seed", 0))
    write_parquet(th, out_dir / "thresholds.parquet", THRESHOLD_SCHEMA)
    tests = hypothesis_tests(out, cfg)
    write_parquet(tests, out_dir / "tests.parquet", TESTS_SCHEMA)
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
    print(tests[["hypothesis", "test", "outcome", "estimate", "p_holm", "status"]].to_string(index=False))
