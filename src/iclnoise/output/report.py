"""results/report.md: figures, tables and hypothesis verdicts on one page, with provenance."""
from __future__ import annotations

import datetime as dt
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from .. import __version__
from ..analysis.convergence import ON_AT_END
from ..analysis.dose import SERIES, series_name, with_schedule
from ..analysis.verdicts import (
    CONDITION,
    GATES,
    NO_MANIPULATION,
    condition_name,
    convergence,
    optimizer_note,
    over_ridge,
)
from ..core.io import read_parquet
from ..core.tasks import M_INF

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
    ("fig13_crn", "13. CNR's ground truth by common random numbers (filled) and an estimator's predictions (hollow)"),
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
    ("crossover window", "whether the crossover exists depends on which late part of training the pull is read over "
                         "({detail}): the crossover threshold is not robust there"),
    ("LLC diagnostics", "too many LLC estimates are unreliable ({detail})"),
    ("LLC measures the sampler", "too many final LLC estimates measure the sampler rather than the geometry "
                                 "({detail}: SGLD past its stability limit, or chains that left w*'s neighbourhood; "
                                 "method §7, iclnoise llc-calibrate)"),
    (NO_MANIPULATION, "H3 needs a noise manipulation that moves r ({detail}): equivalence of two noise sources "
                      "carries no information where the noise they emulate has no measurable effect"),
]


def _fmt_m(v: float) -> str:
    return f"{v:.3g}" if v == v else "–"


def _threshold_sentence(t) -> str:
    cond = f"{t.method}, noise {t.noise}, batch {t.batch}{optimizer_note(t.optimizer)}"
    if not t.M_star == t.M_star:
        return f"{cond}: no M* ({t.reason.removeprefix('no threshold: ')})"
    ci = (f"[{_fmt_m(t.M_star_lo)}, {_fmt_m(t.M_star_hi)}]" if t.M_star_lo == t.M_star_lo
          else f"({t.reason})")
    gate = " — passes every validity gate" if t.gates_passed else " — inconclusive (gates failed, see below)"
    return f"{cond}: M* = {_fmt_m(t.M_star)} {ci}, {t.n_seeds} seeds{gate}"


def _convergence(conv) -> tuple[list[str], list[str]]:
    """(each condition's part of the convergence sentence, the unconverged ones as the convergence gate names
    them) from a verdicts.convergence table. A condition without M = ∞ runs is judged by batch noise's at its
    batch size (verdicts.gate_convergence); M = ∞ runs that diverged are said to have diverged."""
    c = conv.set_index(CONDITION)
    parts, bad = [], []
    for r in sorted(conv.itertuples(), key=lambda r: condition_name(r.batch, r.noise, r.optimizer)):   # metrics.json's
        name = condition_name(r.batch, r.noise, r.optimizer)
        ref = (r.batch, "none", r.optimizer)
        if r.n_inf_runs:
            parts.append(f"{name} M = ∞ runs diverged" if r.ood_loss_over_ridge == math.inf
                         else f"{name} {r.ood_loss_over_ridge:.2f}×{_excess_read(r)}"
                         if not math.isnan(r.ood_loss_over_ridge)
                         else f"{name} M = ∞ OOD loss {over_ridge(r.ood_loss_over_ridge)}")
            if not r.converged:
                bad.append(f"{name}: M = ∞ runs diverged" if r.ood_loss_over_ridge == math.inf
                           else f"{name}: M = ∞ OOD loss {over_ridge(r.ood_loss_over_ridge)}")
        elif ref in c.index and c.loc[ref].n_inf_runs:
            parts.append(f"{name} no M = ∞ run (batch noise's at its batch size stands for it)")
        else:
            parts.append(f"{name} no M = ∞ run, nor batch noise's at its batch size")
            bad.append(f"{name}: no M = ∞ run, nor batch-noise M = ∞ runs at batch {int(r.batch)}")
    return parts, bad


def _excess_read(r) -> str:
    """What the gate read a converged condition's excess over its tolerance as (method §11, One convergence gate):
    a noise floor, or what the noise left after it was switched off; '' otherwise."""
    if not r.converged:
        return ""
    return (" (a levelled noise floor, the noise still on)" if getattr(r, "noise_floor", False) else
            " (levelled: what the noise left after it was switched off)" if getattr(r, "noise_left", False) else "")


def what_this_run_shows(th, tests, conv=None) -> list[str]:
    """The opening paragraph, written from the gated tables only: convergence per condition (`conv`, a
    verdicts.convergence table), M* per condition with its interval or the reason there is none, each hypothesis
    verdict, and what the run cannot show and why (the gates that failed, and unconverged conditions whether or
    not a gated row names them). It says that every gate passed only where a threshold or a test ran."""
    lines = ["## What this run shows", ""]
    failures = []
    if conv is not None and len(conv):
        parts, bad = _convergence(conv)
        lines += [f"Convergence (final OOD loss of the M = ∞ runs over ridge's, worst seed): {', '.join(parts)}; "
                  + ("not every condition converged (see below)." if bad else
                     f"every condition converged (worst seed ≤ {1 + GATES['convergence_tol']:.2f}× ridge's, or a "
                     "levelled excess the injected noise explains: the verdicts' gate)."), ""]
        failures += [f"unconverged ({', '.join(bad)})"] if bad else []
    if th is not None and len(th):
        lines += ["Task-diversity threshold M* by three methods (95 % t-intervals over seeds): r50, where "
                  "ridge-likeness r crosses 0.5; midpoint, half-way between the fitted logistic's floor and ceiling "
                  "(the same point only when floor + ceiling = 1); crossover (Raventós et al.), where more data (late "
                  "training) stops pulling the model toward dMMSE_M and pulls it toward ridge on new tasks:", ""]
        lines += [f"- {_threshold_sentence(t)}." for t in th.itertuples()] + [""]
    elif th is not None:
        lines += ["No task-diversity threshold M*: the grid has no run at a finite M.", ""]
    ran = tests[tests.status == "run"] if tests is not None and len(tests) else None
    if tests is not None and len(tests):
        lines += ["Hypotheses (each verdict follows its Holm-adjusted test and passes its validity gates, "
                  "else it reads 'inconclusive'):", ""]
        for t in tests.itertuples():
            what = t.verdict if t.status == "run" else t.status
            lines.append(f"- {t.hypothesis}{optimizer_note(t.optimizer)}, {t.test} [{t.outcome}]: {what}.")
        lines.append("")
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
    gated = [what for what, df in (("threshold", th), ("verdict", ran)) if df is not None and len(df)]
    if not gated:
        lines += ["No threshold was estimated and no hypothesis test ran: this run shows no M* and no verdict.", ""]
    if limits:
        lines += ["What it cannot show:", ""] + [f"- {x[0].upper()}{x[1:]}." for x in limits] + [""]
    elif gated and not failures:
        lines += [f"Every {' and '.join(gated)} above passed its validity gates (convergence, threshold fit, "
                  "seeds, equal data and exposure, LLC diagnostics).", ""]
    return lines


def dose_answer(tests, levels, per_m=None, runs=None) -> list[str]:
    """The report's opening where the grid has a dose series (issue 43): per series, the operating regime read
    from the data (dose_levels.parquet) and every dose-response row of the tests (slope per decade of dose with
    its CI and mde, the dose-0 contrast, the shape check; the sensitivity rows prefixed by what they change) in
    words, then r's decomposition per M (`per_m`, dose_decomposition.parquet; None: a set aggregated before it).
    With `runs` (dose.parquet), a dose inside the regime with M = ∞ runs alone (it vouches for the regime, but no
    fit reads it) is named apart rather than counted in the span the slopes cover."""
    lines = ["## The answer: ICL against the injected noise dose", "",
             "Dose = realised integrated injected P-NE* (after clipping), per condition; slopes per decade of dose "
             "over the positive doses inside the operating regime (M = ∞ within "
             f"{1 + GATES['convergence_tol']:.2f}× ridge's OOD loss, or levelled at an excess the injected noise "
             "explains: a noise floor with the noise still on, what the noise left after it was switched off; "
             f"realised dose within {GATES['dose_tol']:.0%} of its target, no run diverged); dose 0 (no "
             "injection) is the reference arm.", ""]
    for key, g in with_schedule(levels).groupby(SERIES):
        name, opt = series_name(key), key[-1]
        inside = g[g.in_regime.astype(bool) & (g.target_dose > 0)].set_index("target_dose").realised_dose
        alone = []
        if runs is not None:
            mine = with_schedule(runs)
            mine = mine[(mine[SERIES].astype(str) == [str(k) for k in key]).all(axis=1)]
            alone = [d for d in inside.index if not (mine[mine.target_dose == d].M != M_INF).any()]
            inside = inside.drop(alone)
        out = g[~g.in_regime.astype(bool)]
        span = (f"doses {inside.min():.3g}–{inside.max():.3g} ({len(inside)} doses, "
                f"{np.log10(inside.max() / inside.min()):.2f} decades)" if len(inside) >= 2 else
                f"{len(inside)} positive dose(s) inside")
        outside = "; ".join(f"{'dose 0' if d.target_dose == 0 else f'dose {d.target_dose:.3g}'} ({d.regime})"
                            for d in out.itertuples())
        over = g[g.in_regime.astype(bool) & (g.ood_loss_over_ridge > 1 + GATES["convergence_tol"])]
        read = "a levelled noise floor" if key[2] in ON_AT_END else "levelled after the noise was switched off"
        excess = "; ".join(f"dose {d.target_dose:.3g} at {d.ood_loss_over_ridge:.3f}×" for d in over.itertuples())
        lines += [f"**{name}{optimizer_note(opt)}** — operating regime: {span}"
                  + (f"; inside with M = ∞ runs alone (no fit reads them yet): dose "
                     f"{', '.join(f'{d:.3g}' for d in alone)}" if alone else "")
                  + (f"; outside: {outside}" if outside else "")
                  + (f"; M = ∞ inside with its excess read as the noise's outcome ({read}): {excess}" if excess
                     else "") + ".", ""]
        mine = tests.test.str.contains(f"dose-response {name}: ", regex=False) & (tests.optimizer == opt)
        for t in tests[mine].itertuples():   # its sensitivity rows too, named by what they change
            what = "".join(t.test.split(f"dose-response {name}: ", 1))
            if t.status != "run":
                lines.append(f"- {what} [{t.outcome}]: {t.status}.")
                continue
            ci = f" [{t.ci_lo:+.3g}, {t.ci_hi:+.3g}]" if t.ci_lo == t.ci_lo else ""
            mde = f", mde {t.mde:.2g}" if t.mde == t.mde else ""
            lines.append(f"- {what} [{t.outcome}, {t.term}]: {t.estimate:+.3g}{ci}{mde}. {t.verdict}.")
        lines += [*ridge_reading(tests[tests.optimizer == opt], name), ""]
        if per_m is not None:
            lines += by_m_lines(per_m[(per_m[SERIES].astype(str) == [str(k) for k in key]).all(axis=1)])
    return lines


BY_M_COLUMNS = {"r": "r", "id_loss": "in-distribution loss", "ood_delta_ridge": "Δ(f, ridge), new tasks",
                "delta_dmmse": "Δ(f, dMMSE_M)"}   # the decomposition method §11 asks for per M


def by_m_lines(rows: pd.DataFrame) -> list[str]:
    """One series' decomposition per M as a table: each outcome's slope per decade of total exposure at that M
    alone [95 % CI] (dose.by_m); a dash where it was not run. An M where no outcome ran (run at dose 0 alone, as
    the persistent arm's M outside its ladder) is named under the table, not tabled. [] without rows."""
    ran = rows.groupby("M").status.transform(lambda s: (s == "run").any())
    idle = sorted(rows[~ran].M.unique())
    rows = rows[ran]
    if not len(rows):
        return []
    cell = {(r.M, r.outcome): (f"{r.estimate:+.3f} [{r.ci_lo:+.3f}, {r.ci_hi:+.3f}]" if r.status == "run" else "–")
            for r in rows.itertuples()}
    lines = ["Per M (each M alone: slope per decade of total exposure [95 % CI], each seed's least-squares slope over "
             "dose 0 and the in-regime doses run at that M, t over seeds):", "",
             "| M | doses | " + " | ".join(BY_M_COLUMNS.values()) + " |", "|---" * (len(BY_M_COLUMNS) + 2) + "|"]
    for M, g in rows.groupby("M"):
        lines.append(f"| {M} | {int(g.n_doses.iloc[0])} | " + " | ".join(cell.get((M, y), "–") for y in BY_M_COLUMNS)
                     + " |")
    if idle:
        lines += ["", f"Not tabled: M {', '.join(map(str, idle))}, with no in-regime positive dose and dose 0 both run "
                  "there."]
    return [*lines, ""]


def ridge_reading(tests, name: str) -> list[str]:
    """One line on whether a rise of r with total exposure is ridge-likeness (method §11, "Outcomes that tell
    in-context learning from misfit"): only where Δ(f, ridge) on new tasks falls; [] without the decomposition."""
    rows = {t.outcome: t for t in tests[tests.test.str.startswith(f"dose-response {name}: decomposition")].itertuples()
            if t.status == "run"}
    r, ridge, fit = rows.get("r"), rows.get("ood_delta_ridge"), rows.get("id_loss")
    if r is None or ridge is None or not r.ci_lo > 0:
        return []
    misfit = fit is not None and fit.ci_lo > 0
    if ridge.ci_hi < 0:
        return ["Reading: r rises with total exposure and Δ(f, ridge) on new tasks falls: more ridge-like"
                + ("; the in-distribution loss rises with it, so part of r's rise is misfit (per M below)."
                   if misfit else ".")]
    return [f"Reading: r rises with total exposure but Δ(f, ridge) on new tasks does not fall (CI "
            f"[{ridge.ci_lo:+.3g}, {ridge.ci_hi:+.3g}]): not more ridge-like"
            + ("; the in-distribution loss rises with it (misfit pulls r toward ½)." if misfit else ".")]


def h5_answer(tests) -> list[str]:
    """The report's opening where the grid has an aligned condition (H5, issue 45): each control's rows
    (verdicts.h5_alignment: r by seed, the M* shift read from it, the distances to ridge and dMMSE, M* by seed; the
    (M, seed) sensitivity row left to the full table) with estimate, interval, mde and verdict; [] without H5 rows."""
    h5 = tests[(tests.hypothesis == "H5") & ~tests.test.str.startswith("sensitivity")]
    if not len(h5):
        return []
    lines = ["## The answer: does noise aligned with the task family raise ICL? (H5)", "",
             "Aligned (nap) against each control at equal realised injected P-NE* (the dose is in each line); r by "
             "seed is the test in the Holm family, the M* shift is read from it through r's slope in log2 M, and the "
             "distances to ridge and to dMMSE say what r's change is made of (r also rises when the model only moves "
             "away from dMMSE).", ""]
    for t in h5.itertuples():
        if t.status != "run":
            lines.append(f"- {t.test} [{t.outcome}]{optimizer_note(t.optimizer)}: {t.status}.")
            continue
        mde = f", mde {t.mde:.2g}" if t.mde == t.mde else ""
        lines.append(f"- {t.test} [{t.outcome}]{optimizer_note(t.optimizer)}: {t.estimate:+.3g} "
                     f"[{t.ci_lo:+.3g}, {t.ci_hi:+.3g}]{mde}. {t.verdict}.")
    return lines + [""]


def exposure_section(results: Path) -> list[str]:
    """κ in use (from the runs' exposure logs) and the realised exposure per condition (outcomes.parquet)."""
    out_path = results / "aggregate" / "outcomes.parquet"
    logs = sorted(results.glob("runs/*/exposure.parquet"))
    if not out_path.exists() or not logs:
        return []
    kappas = sorted({round(float(k), 4) for f in logs for k in read_parquet(f).kappa.unique()})
    out = read_parquet(out_path)
    g = out.groupby(["noise", "batch", "optimizer"]).agg(runs=("run_id", "size"), sequences=("sequences", "median"),
                                            pne=("integrated_pne", "median"),
                                            injected=("integrated_pne_injected", "median")).reset_index()
    rows = [f"| {r.noise} | {r.batch} | {r.optimizer} | {r.runs} | {r.sequences:,.0f} | {r.pne:.3g} "
            f"| {r.injected:.3g} |" for r in g.itertuples()]
    return ["## Exposure", "",
            f"κ (momentum diffusion factor) in use: {', '.join(map(str, kappas))} — 1 is AdamW's value (method §6). "
            "Realised integrated exposure after gradient clipping, median over the runs of each condition:", "",
            "| noise | batch | optimizer | runs | sequences seen | Σ P-NE* | Σ injected P-NE* |",
            "|---|---|---|---|---|---|---|",
            *rows, ""]


def _verdict_line(t) -> str:
    """One test row in words: estimate, CI, effect size, the mde of its design, H3's margin beside the
    manipulation's effect, and the verdict."""
    if t.status != "run":
        return f"- **{t.hypothesis}**{optimizer_note(t.optimizer)} — {t.test}, {t.outcome}: {t.status}."
    nan = float("nan")
    mde, margin, man = (getattr(t, k, nan) for k in ("mde", "margin", "manipulation_effect"))
    power = f", mde (80 % power) {mde:.2g}" if mde == mde else ""
    beside = ""
    if margin == margin or man == man:
        beside = (f"; margin ±{margin:.2g} beside the noise manipulation's effect "
                  + (f"{man:+.3g} [{t.manipulation_ci_lo:+.3g}, {t.manipulation_ci_hi:+.3g}]" if man == man
                     else "(not measured)"))
    gates = " (all validity gates passed)" if t.gates_passed else ""
    return (f"- **{t.hypothesis}**{optimizer_note(t.optimizer)} — {t.test}, {t.outcome}: "
            f"estimate {t.estimate:.3g} [{t.ci_lo:.3g}, {t.ci_hi:.3g}], "
            f"effect size {t.effect_size:.3g}{power}, n = {t.n}{beside}. {t.verdict}{gates}.")


def verdict_section(tests) -> list[str]:
    """'Hypothesis verdicts': every test row in words (_verdict_line) and the Holm family (tests.in_family)."""
    lines = ["## Hypothesis verdicts", "",
             "Effect sizes with 95 % CIs (H3: the TOST's 90 % CI); p-values Holm-adjusted across the family of tests "
             "that ran and passed their validity gates, and every verdict follows the Holm-adjusted decision; a "
             "null states the minimum detectable effect (mde) of its design at 80 % power. A verdict whose validity "
             "gates fail reads 'inconclusive'; a test that could not run says why.", ""]
    lines += [_verdict_line(t) for t in tests.itertuples()] + [""]
    if "in_family" in tests:
        fam = tests[tests.in_family.fillna(False).astype(bool)]
        lines += [f"Holm family ({len(fam)} tests): "
                  + ("; ".join(f"{t.hypothesis} {t.test} [{t.outcome}{', ' + t.term if t.term else ''}]"
                               f"{optimizer_note(t.optimizer)}"
                               for t in fam.itertuples()) or "none") + ".", ""]
    return lines


def crn_section(table: pd.DataFrame) -> list[str]:
    """A CNR check attached to the set (crn/crn.csv; method §13): what it is, the estimator's Spearman ρ and
    interval coverage against the CRN means for r (every counterfactual with a prediction, and inside its local
    range where the table marks one, column `local`), per first-order form where the table has both (predicted:
    ḡ ln k; predicted_linear: ḡ (k − 1); predicted_band: their midpoint, its interval from the lower of their lower
    ends to the higher of their upper ends; crn_check.py; over the pairs every form predicts), and r's rows."""
    from scipy.stats import spearmanr

    r = table[table.metric == "r"]
    lines = ["## CNR check: the noise's counterfactual effect on r, by common random numbers", "",
             "Each counterfactual's ΔE r is the mean, over realisations of the noise, of its retraining from the fork "
             "minus the run's own retraining on the same data and noise stream (crn_mean ± crn_se); an estimator "
             "that retrains nothing predicts it (predicted, interval predicted_lo..predicted_hi). Figure 13 draws "
             "every metric.", ""]
    forms = [(c, f) for c, f in (("predicted", "ḡ ln k"), ("predicted_linear", "ḡ (k − 1)"),
                                 ("predicted_band", "the band between the two forms")) if c in r]
    both = r[r[[c for c, _ in forms]].notna().all(axis=1)]   # the pairs every form predicts: one set of rows
    for col, form in forms:
        have = both
        scopes = [("every counterfactual with a prediction", have)]
        if "local" in have:
            scopes.append(("inside the estimator's local range", have[have.local.astype(bool)]))
        for where, d in scopes:
            if len(d) >= 3:
                cover = ((d[f"{col}_lo"] <= d.crn_mean) & (d.crn_mean <= d[f"{col}_hi"])).mean()
                lines.append(f"- {where}" + (f", {form}" if len(forms) > 1 else "") + ": Spearman ρ "
                             f"{spearmanr(d[col], d.crn_mean).statistic:.2f} over {len(d)} (counterfactual, seed) "
                             f"pairs; interval coverage {cover:.2f}")
    cols = [c for c in ("counterfactual", "seed", "n_realisations", "crn_mean", "crn_se", "predicted",
                        "predicted_lo", "predicted_hi", "predicted_linear") if c in r]
    return lines + ["", r[cols].to_markdown(index=False, floatfmt=".4g"), ""]


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
    conv = convergence(read_parquet(agg / "outcomes.parquet")) if (agg / "outcomes.parquet").exists() else None
    if (agg / "dose_levels.parquet").exists() and tests is not None:   # a dose series: the answer first
        per_m = agg / "dose_decomposition.parquet"
        runs = agg / "dose.parquet"
        lines += dose_answer(tests, read_parquet(agg / "dose_levels.parquet"),
                             read_parquet(per_m) if per_m.exists() else None,
                             read_parquet(runs) if runs.exists() else None)
    if tests is not None:   # an aligned condition: H5's answer first
        lines += h5_answer(tests)
    if th is not None or tests is not None:
        lines += what_this_run_shows(th, tests, conv)
    if tests is not None:
        lines += verdict_section(tests)
    lines += exposure_section(results)
    if (results / "crn" / "crn.csv").exists():   # an attached CNR check (iclnoise paper --attach-crn)
        lines += crn_section(pd.read_csv(results / "crn" / "crn.csv"))
    lines += ["## Figures", ""]
    for stem, caption in FIGURES:
        pngs = sorted(figs.glob(f"{stem}.png")) + sorted(figs.glob(f"{stem}_*.png"))
        if pngs:
            lines += [f"### {caption}", ""]
            lines += [f"![{png.stem}]({os.path.relpath(png, results)})" for png in pngs] + [""]
    for name, title in (("thresholds", "Task-diversity thresholds"), ("dose_levels", "Dose levels per series"),
                        ("batch_levels", "The batch axis: levels per arm and batch size"),
                        ("outcomes", "Outcomes per run"),
                        ("tests", "Hypothesis tests (full table)")):
        md = agg / f"{name}.md"
        if md.exists():
            lines += [f"## {title}", "", md.read_text(), ""]
    lines += ["## Parameters", "", "```yaml", yaml.safe_dump(params, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)

