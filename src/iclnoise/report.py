"""results/report.md: figures, tables and hypothesis verdicts on one page, with provenance."""
from __future__ import annotations

import datetime as dt
import os
import subprocess
from pathlib import Path

import yaml

from . import __version__
from .io import read_json, read_parquet
from .verdicts import GATES

FIGURES = [
    ("fig01_ood_loss", "1. OOD loss over training per M (t_crit circles; dotted: dMMSE_M, dashed: ridge)"),
    ("fig02_essential_subspace", "2. Essential subspace: joint trajectory PCA with dMMSE_M (◆) and ridge (■)"),
    ("fig03_loss_llc_vs_m", "3. End-of-training loss and LLC against M"),
    ("fig04_llc_over_training", "4. LLC over training with stage boundaries"),
    ("fig05_ed_forms", "5. Essential-dynamics plane curves, evolutes and forms"),
    ("fig06_threshold_vs_noise", "6. Task-diversity threshold M* against noise level (headline)"),
    ("fig07_icl_vs_exposure", "7. ICL outcome against integrated exposure (H1, H3)"),
    ("fig08_early_late", "8. Early vs late noise at equal exposure (H2)"),
    ("fig09_geometry", "9. Geometry probes against exposure and ICL (H4)"),
    ("fig10_exposure_series", "10. P-NE time series per condition"),
    ("fig11_rllc_over_training", "11. Refined LLC per attention head over training, per M and batch size"),
    ("fig12_susceptibility", "12. Susceptibility of each component to new tasks (component × perturbation, per M)"),
]


def code_version(root: Path) -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return f"git {out.stdout.strip()} (iclnoise {__version__})"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"iclnoise {__version__} (no git checkout)"


# What a failed gate means for the reader (keyed by the start of a gate failure in verdicts.py).
LIMITS = [
    ("unconverged", "the models are not converged ({detail}): r and M* describe undertrained models, not where "
                    "training ends, so no verdict is drawn from them"),
    ("insufficient seeds", "too few seeds ({detail}): no interval and no verdict; run ≥ 3 seeds"),
    ("unequal data", "compared arms saw different amounts of data ({detail}): a difference between them could be "
                     "data seen rather than noise; compare at equal sequences (budget mode 'sequences')"),
    ("unequal exposure", "early and late noise reached different realised exposure ({detail}), so H2's comparison "
                         "is not at equal exposure"),
    ("realised exposure not recorded", "the runs do not record their realised injected exposure, so H2's equal "
                                       "exposure cannot be checked"),
    ("r does not span low to high", "ridge-likeness r does not run from dMMSE-like to ridge-like across the grid "
                                    "({detail}; a transition needs some M at r ≤ {r_low} and some at "
                                    "r ≥ {r_high}): an r = 0.5 crossing there is not a transition"),
    ("threshold fit", "an r = 0.5 threshold could not be fitted everywhere ({detail})"),
    ("crossover fit", "the crossover threshold (where more data stops pulling toward dMMSE_M) could not be "
                      "estimated everywhere ({detail})"),
    ("LLC diagnostics", "too many LLC estimates are unreliable ({detail})"),
]


def _fmt_m(v: float) -> str:
    return f"{v:.3g}" if v == v else "–"


def _threshold_sentence(t) -> str:
    cond = f"{t.method}, noise {t.noise}, batch {t.batch}"
    if not t.M_star == t.M_star:
        return f"{cond}: no M* ({t.reason.removeprefix('no threshold: ')})"
    ci = (f"[{_fmt_m(t.M_star_lo)}, {_fmt_m(t.M_star_hi)}]" if t.M_star_lo == t.M_star_lo
          else f"({t.reason})")
    gate = " — passes every validity gate" if t.gates_passed else " — inconclusive (gates failed, see below)"
    return f"{cond}: M* = {_fmt_m(t.M_star)} {ci}, {t.n_seeds} seeds{gate}"


def what_this_run_shows(th, tests, convergence: dict | None = None) -> list[str]:
    """The opening paragraph, written from the gated tables only: convergence per condition, M* per condition with
    its interval or the reason there is none, each hypothesis verdict, and what the run cannot show and why (the
    gates that failed)."""
    lines = ["## What this run shows", ""]
    if convergence:
        parts = [f"{k} {v['ood_loss_over_ridge']:.2f}×" if v["ood_loss_over_ridge"] is not None
                 else f"{k} no M = ∞ run (batch noise's at its batch size stands for it)"
                 for k, v in convergence.items()]
        ok = all(v["converged"] for v in convergence.values() if v["ood_loss_over_ridge"] is not None)
        lines += [f"Convergence (final OOD loss of the M = ∞ runs over ridge's, worst seed): {', '.join(parts)}; "
                  + ("every condition converged." if ok else "not every condition converged (see below)."), ""]
    if th is not None and len(th):
        lines += ["Task-diversity threshold M* by two methods (95 % t-intervals over seeds): r50, where ridge-likeness "
                  "r crosses 0.5; crossover (Raventós et al.), where more data (late training) stops pulling the "
                  "model toward dMMSE_M and pulls it toward ridge on new tasks:", ""]
        lines += [f"- {_threshold_sentence(t)}." for t in th.itertuples()] + [""]
    if tests is not None and len(tests):
        lines += ["Hypotheses (each verdict follows its Holm-adjusted test and passes its validity gates, "
                  "else it reads 'inconclusive'):", ""]
        for t in tests.itertuples():
            what = t.verdict if t.status == "run" else t.status
            lines.append(f"- {t.hypothesis}, {t.test} [{t.outcome}]: {what}.")
        lines.append("")
    failures = []
    for df in (th, tests):
        if df is not None and len(df):
            failures += [f for text in df.gate_failures.fillna("") for f in text.split("; ") if f]
    limits = []
    for key, sentence in LIMITS:
        details = []
        for f in failures:
            if f.startswith(key):   # 'key (a, b)' or 'key: a': the detail; 'unconverged' lists conditions
                d = f[len(key):].strip(" :")
                d = d[1:-1] if d.startswith("(") and d.endswith(")") else d
                d = d.split(", needs")[0]   # the r-span requirement is stated once, in the sentence
                details += [x for x in (d.split(", ") if key == "unconverged" else [d]) if x and x not in details]
        if details or any(f.startswith(key) for f in failures):
            more = f" and {len(details) - 4} more" if len(details) > 4 else ""
            limits.append(sentence.format(detail=", ".join(details[:4]) + more or key, **GATES))
    if limits:
        lines += ["What it cannot show:", ""] + [f"- {x[0].upper()}{x[1:]}." for x in limits] + [""]
    elif failures == [] and (th is not None or tests is not None):
        lines += ["Every threshold and verdict above passed its validity gates (convergence, threshold fit, "
                  "seeds, equal data and exposure, LLC diagnostics).", ""]
    return lines


def exposure_section(results: Path) -> list[str]:
    """κ in use (from the runs' exposure logs) and the realised exposure per condition (outcomes.parquet)."""
    out_path = results / "aggregate" / "outcomes.parquet"
    logs = sorted(results.glob("runs/*/exposure.parquet"))
    if not out_path.exists() or not logs:
        return []
    kappas = sorted({round(float(k), 4) for f in logs for k in read_parquet(f).kappa.unique()})
    out = read_parquet(out_path)
    g = out.groupby(["noise", "batch"]).agg(runs=("run_id", "size"), sequences=("sequences", "median"),
                                            pne=("integrated_pne", "median"),
                                            injected=("integrated_pne_injected", "median")).reset_index()
    rows = [f"| {r.noise} | {r.batch} | {r.runs} | {r.sequences:,.0f} | {r.pne:.3g} | {r.injected:.3g} |"
            for r in g.itertuples()]
    return ["## Exposure", "",
            f"κ (momentum diffusion factor) in use: {', '.join(map(str, kappas))} — 1 is AdamW's value (SPEC §6). "
            "Realised integrated exposure after gradient clipping, median over the runs of each condition:", "",
            "| noise | batch | runs | sequences seen | Σ P-NE* | Σ injected P-NE* |", "|---|---|---|---|---|---|",
            *rows, ""]


def build(results: Path, params: dict, root: Path, origin: str | None = None) -> str:
    """The text of report.md from the aggregate tables and figures under `results`, ending with `params` (the
    resolved parameters); the code version is that of the checkout at `root`, and `origin` (a reference set's:
    the commits its runs trained at) follows it."""
    agg, figs = results / "aggregate", results / "figures"
    lines = ["# Does stochastic gradient noise drive in-context learning? — report", "",
             f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC} from {code_version(root)}.", ""]
    lines += [origin, ""] if origin else []
    th = read_parquet(agg / "thresholds.parquet") if (agg / "thresholds.parquet").exists() else None
    tests = read_parquet(agg / "tests.parquet") if (agg / "tests.parquet").exists() else None
    conv = read_json(agg / "metrics.json").get("convergence") if (agg / "metrics.json").exists() else None
    if th is not None or tests is not None:
        lines += what_this_run_shows(th, tests, conv)
    if tests is not None:
        lines += ["## Hypothesis verdicts", "",
                  "Effect sizes with 95 % CIs; p-values Holm-adjusted across the family, and every verdict "
                  "follows the Holm-adjusted decision. A verdict whose validity gates fail reads 'inconclusive'; "
                  "a test that could not run says why.", ""]
        for _, t in tests.iterrows():
            if t.status == "run":
                gates = " (all validity gates passed)" if t.gates_passed else ""
                lines.append(f"- **{t.hypothesis}** — {t.test}, {t.outcome}: estimate {t.estimate:.3g} "
                             f"[{t.ci_lo:.3g}, {t.ci_hi:.3g}], effect size {t.effect_size:.3g}, n = {t.n}. "
                             f"{t.verdict}{gates}.")
            else:
                lines.append(f"- **{t.hypothesis}** — {t.test}, {t.outcome}: {t.status}.")
        lines.append("")
    lines += exposure_section(results)
    lines += ["## Figures", ""]
    for stem, caption in FIGURES:
        pngs = sorted(figs.glob(f"{stem}.png")) + sorted(figs.glob(f"{stem}_*.png"))
        if pngs:
            lines += [f"### {caption}", ""]
            lines += [f"![{png.stem}]({os.path.relpath(png, results)})" for png in pngs] + [""]
    for name, title in (("thresholds", "Task-diversity thresholds"), ("outcomes", "Outcomes per run"),
                        ("tests", "Hypothesis tests (full table)")):
        md = agg / f"{name}.md"
        if md.exists():
            lines += [f"## {title}", "", md.read_text(), ""]
    lines += ["## Parameters", "", "```yaml", yaml.safe_dump(params, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)

