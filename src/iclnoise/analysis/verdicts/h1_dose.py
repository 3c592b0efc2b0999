"""H1 as a manipulation: the dose–response rows of a dose series (method §11, iclnoise.analysis.dose)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...core.probe_sections import Stats
from ...core.tasks import M_INF
from .. import dose, stats
from ..convergence import ON_AT_END, passes_as_noise_left
from ..dose import OUTCOMES
from .gates import GATES, gate_books, gate_equal_data, gate_seeds
from .rows import _direction, _row


def h1_dose(out: pd.DataFrame, cfg: Stats) -> list[dict]:
    """H1 as a dose–response (method §11; issue 43), per dose series (iclnoise.analysis.dose: one injected source at ≥ 2
    positive doses, dose 0 = batch noise alone at its batch), over the positive doses inside the operating regime
    (dose.regime: M = ∞ passes the one convergence gate, gates.converged_runs, realised dose within
    GATES['dose_tol'] of target, no run diverged, ≥ GATES['min_seeds'] seeds; the doses left out are named in the
    test):
    - the slope of r per decade of dose at fixed M (dose.r_slope; M the ladder's, run at every dose), a random
      intercept per (M, seed) cell — Holm family; with a seed intercept — a sensitivity row;
    - the slope of log2 M* (r50; midpoint as a sensitivity row) per decade (dose.mstar_slope) at the doses with a
      full M grid — Holm family;
    - the ladder's reading of the r slope as a log2 M* slope (ladder.ladder_conversion, delta method) — derived
      from the r slope, so outside the family;
    - the contrast of the highest in-regime dose against dose 0 (paired t by (M, seed)) — Holm family;
    - log2 M* at the highest in-regime dose with a full M grid against dose 0's (paired t by seed; the CPU plan's
      direct check of the ladder) — Holm family (r50; midpoint a sensitivity row);
    - monotonicity: isotonic against linear in log dose (stats.monotonicity, parametric bootstrap) — a shape check,
      outside the family;
    - the exposure association, secondary: r against the runs' measured log integrated P-NE* (batch noise and
      injected, after clipping) on the same runs and dose 0's — outside the family (measured exposure tracks the
      phase; the dose is the manipulation);
    - what r is made of (method §11, "Outcomes that tell in-context learning from misfit"): r, Δ(f, ridge) and
      Δ(f, dMMSE_M) on the q_M set and on new tasks, and the in-distribution loss, each per decade of total
      exposure at the ladder (dose.total_slope) — outside the family: they read the r rows, they do not add tests;
    - the convergence gate's sensitivity rows, so a reader sees what the gate decided: where M = ∞ failing the gate
      is all that keeps a dose out of the regime, the total-exposure rows again with the gate not applied
      (dose.analyse's gate False); where a dose is inside only because M = ∞'s levelled excess after the noise was
      switched off is read as what the noise left, the rows again with that excess read as failed training — both
      outside the family, named for the doses they admit or leave out.
    Gates: dose 0's seeds (a positive dose with fewer than min_seeds is out of the regime), equal data, dose 0
    inside the regime. No rows at all when the grid has no dose series."""
    rows, done = [], {}
    for key, g in dose.series(dose.dose_runs(out, GATES["convergence_tol"])):
        res = done[key] = dose.analyse(g, cfg.alpha, GATES["dose_tol"], GATES["min_seeds"])
        src, name = key[0], dose.series_name(key)
        left = "; ".join(f"{d:.3g}: {w}" for d, w in zip(res["left_out"].target_dose, res["left_out"].regime))
        where = f"doses {', '.join(f'{d:.3g}' for d in res['doses'])}" + (f" (left out: {left})" if left else "")
        used = out[out.run_id.isin(g.run_id[g.target_dose.isin([0.0, *res["doses"]]) & (g.M != M_INF)])]
        zero = res["levels"][res["levels"].target_dose == 0]
        fails = (gate_seeds(out[out.run_id.isin(g.run_id[(g.target_dose == 0) & (g.M != M_INF)])],
                            GATES["min_seeds"])   # dose 0's: a positive dose with fewer is out of the regime
                 + gate_equal_data(used, GATES["data_tol"]) + gate_books(used))
        if not len(zero) or not zero.in_regime.iloc[0]:
            fails.append(("unconverged", f"{name} dose 0: " + (zero.regime.iloc[0] if len(zero) else "no runs")))
        at = {"name": name, "src": src, "where": where, "m_at": ", ".join(map(str, res["ladder"])) or "none",
              "fails": fails, "alpha": cfg.alpha}
        rows += [*_dose_r_rows(res, at), *_dose_mstar_rows(res, at), *_dose_total_rows(res, at),
                 _dose_ladder_row(res, at), _dose_zero_row(res, at),
                 _dose_exposure_row(out[out.run_id.isin(res["fit"].run_id) | out.run_id.isin(
                     g.run_id[(g.target_dose == 0) & g.M.isin(res["ladder"])])], name, cfg.alpha, fails),
                 _dose_shape_row(res, at), *_dose_outcome_rows(res, at), *_ungated_rows(g, res, at, cfg.alpha),
                 *_strict_rows(g, res, at, cfg.alpha)]
    return rows + _arms_rows(done, cfg.alpha)


ARMS = ("r", "id_loss", "ood_delta_ridge")   # what the arms contrast reads: r, misfit, toward ridge on new tasks


def _arms_rows(done: dict, alpha: float) -> list[dict]:
    """The persistent arm against the arm with the noise switched off before the end (method §11, "What was
    learned, not the noise floor"): for two series that differ only in schedule, one of them on at the end
    (convergence.ON_AT_END), at each positive dose inside both regimes, r, the in-distribution loss and Δ(f, ridge) on
    new tasks (on − off): each seed's mean over the finite M both ran of its (M, seed) differences, a paired t over
    seeds (seeds the unit: an arm effect that differs between seeds would make a t over cells anticonservative).
    Outside the family: a description of what the last part of training without noise changed."""
    rows = []
    for on_key, on in done.items():
        for off_key, off in done.items():
            if on_key[2] not in ON_AT_END or off_key[2] in ON_AT_END or \
                    (*on_key[:2], *on_key[3:]) != (*off_key[:2], *off_key[3:]):
                continue
            a, b = on["fit"], off["fit"]
            for d in sorted(set(on["doses"]) & set(off["doses"])):
                pa_, pb = a[a.target_dose == d], b[b.target_dose == d]
                ms = sorted(set(pa_.M) & set(pb.M))
                for y in ARMS:
                    what = READ[y][0]
                    test = (f"dose-response {dose.series_name(on_key)}: against {dose.series_name(off_key)} at dose "
                            f"{d:.3g}, {y} ({on_key[2]} − {off_key[2]}), each seed's mean over M ∈ "
                            f"{{{', '.join(map(str, ms))}}} of the (M, seed) differences, paired t over seeds")
                    cells = pa_.merge(pb, on=["M", "seed"], suffixes=("_on", "_off"))
                    if y not in a or y not in b or cells[[f"{y}_on", f"{y}_off"]].isna().any().any():
                        rows.append(_row("H1", test, y, family=False, status=f"not run: {y} not recorded on every "
                                         "run"))
                        continue
                    per = (cells[f"{y}_on"] - cells[f"{y}_off"]).groupby(cells.seed).mean().dropna()
                    if len(per) < GATES["min_seeds"]:
                        rows.append(_row("H1", test, y, family=False, status=f"not run: {len(per)} seeds with both "
                                         f"arms at a common M (fewer than {GATES['min_seeds']})"))
                        continue
                    z = stats.paired_test(per.to_numpy(float), np.zeros(len(per)), alpha)
                    rows.append(_row("H1", test, y, f"{on_key[2]} − {off_key[2]}", **z, family=False,
                                     power="could detect a difference of ≥ {mde:.2g}",
                                     words=(f"{what} {_direction(z['estimate'], 'higher', 'lower')} with the noise "
                                            "on to the end than switched off",
                                            f"no evidence that switching the noise off changes {what}")))
    return rows


def _ungated_rows(g: pd.DataFrame, res: dict, at: dict, alpha: float) -> list[dict]:
    """The total-exposure rows (M* slope, decomposition) with the convergence gate at M = ∞ not applied, when that
    admits a dose the gated analysis left out; none otherwise (then without refitting anything)."""
    lv = dose.regime(g, GATES["dose_tol"], GATES["min_seeds"], gate=False)
    if not set(lv.target_dose[lv.in_regime]) & set(res["left_out"].target_dose):
        return []
    free = dose.analyse(g, alpha, GATES["dose_tol"], GATES["min_seeds"], gate=False)
    admitted = sorted(set(free["doses"]) - set(res["doses"]))
    if not admitted:
        return []
    why = "; ".join(res["left_out"].set_index("target_dose").regime.loc[admitted])
    sens = (f"sensitivity, the convergence gate not applied (admits dose {', '.join(f'{d:.3g}' for d in admitted)}: "
            f"{why}): ")
    at = {**at, "sens": sens, "where": f"doses {', '.join(f'{d:.3g}' for d in free['doses'])}"}
    return [*_dose_total_rows(free, at), *_dose_outcome_rows(free, at)]


def _strict_rows(g: pd.DataFrame, res: dict, at: dict, alpha: float) -> list[dict]:
    """The total-exposure rows (M* slope, decomposition) with the stricter reading of the convergence gate, where
    M = ∞ runs that pass only as what the noise left after it was switched off (convergence.passes_as_noise_left)
    count as failed training, when that leaves a dose out; none otherwise (then without refitting anything)."""
    conv = g.converged.fillna(False).astype(bool)
    left = (g.M == M_INF).to_numpy() & passes_as_noise_left(
        (g.ood_loss / g.ood_loss_ridge).astype(float), g.source, g.schedule, conv, GATES["convergence_tol"])
    if not left.any():
        return []
    strict = dose.analyse(g.assign(converged=conv & ~left), alpha, GATES["dose_tol"], GATES["min_seeds"])
    dropped = sorted(set(res["doses"]) - set(strict["doses"]))
    if not dropped:
        return []
    sens = (f"sensitivity, a levelled excess after the noise was switched off read as failed training (leaves out "
            f"dose {', '.join(f'{d:.3g}' for d in dropped)}): ")
    at = {**at, "sens": sens, "where": f"doses {', '.join(f'{d:.3g}' for d in strict['doses'])}"}
    return [*_dose_total_rows(strict, at), *_dose_outcome_rows(strict, at)]


DECADE = "per decade of dose"


def _dose_r_rows(res: dict, at: dict) -> list[dict]:
    """The slope of r per decade of dose at the ladder's M (dose.r_slope): (M, seed) cells the random intercept (in
    the family), a seed intercept the sensitivity row."""
    rows = []
    for key, group, fam in (("r", "cell", True), ("r_seed", "seed", False)):
        test = (f"{'' if fam else 'sensitivity, seed intercept: '}dose-response {at['name']}: MixedLM r ~ log10(dose) "
                f"+ C(M) + {stats.GROUPS[group]}, M ∈ {{{at['m_at']}}}, {at['where']}")
        e = res[key]
        if e is None:
            miss = "r" if fam else "r (1|seed)"
            why = (f"fit failed ({res['failed'][miss]})" if miss in res["failed"] else
                   "no finite M run at dose 0 and every in-regime dose (no ladder)" if len(res["doses"]) >= 2
                   and not res["ladder"] else
                   f"needs ≥ 2 positive doses inside the operating regime and ≥ 2 seeds ({at['where']})")
            rows.append(_row("H1", test, "r", family=fam, status=f"not run: {why}"))
            continue
        rows.append(_row("H1", test, "r", "log10 dose", n=len(res["fit"]), estimate=e.estimate, ci_lo=e.ci_lo,
                         ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=at["fails"], family=fam,
                         power="could detect a slope of ≥ {mde:.2g} in r " + DECADE,
                         words=(f"r {_direction(e.estimate, 'increases', 'decreases')} with the {at['src']} dose",
                                f"no evidence that r changes with the {at['src']} dose")))
    return rows


def _dose_mstar_rows(res: dict, at: dict) -> list[dict]:
    """Per threshold definition (r50 in the family, midpoint a sensitivity row): the slope of log2 M* per decade
    (dose.mstar_slope) and log2 M* at the highest full-grid dose − dose 0 (paired t by seed)."""
    rows, src = [], at["src"]
    for point in ("r50", "midpoint"):
        fam = point == "r50"
        test = (f"dose-response {at['name']}: slope of log2 M* ({point}) on log10(dose), per seed, t over seeds, "
                f"{at['where']}")
        if point in res["mstar"]:
            e, _ = res["mstar"][point]
            rows.append(_row("H1", test, "log2 M*", "log10 dose", n=int(e.n), estimate=e.estimate, ci_lo=e.ci_lo,
                             ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=at["fails"], family=fam,
                             power="could detect ≥ {mde:.2g} octaves of M* " + DECADE,
                             words=(f"M* {_direction(e.estimate, 'rises', 'falls')} with the {src} dose",
                                    f"no evidence that M* moves with the {src} dose")))
        else:
            why = (f"fit failed ({res['failed'][f'M* ({point})']})" if f"M* ({point})" in res["failed"] else
                   "fewer than 2 doses in the regime with a per-seed M* (a full M grid at every such dose)")
            rows.append(_row("H1", test, "log2 M*", family=fam, status=f"not run: {why}"))
        test = (f"dose-response {at['name']}: paired t of log2 M* ({point}) (highest dose with a full M grid − dose 0) "
                "by seed")
        if point in res["mstar_zero"]:
            z, top = res["mstar_zero"][point]
            rows.append(_row("H1", test, "log2 M*", f"dose {top:.3g} − dose 0", **z, fails=at["fails"], family=fam,
                             power="could detect a shift of ≥ {mde:.2g} octaves of M*",
                             words=(f"M* {_direction(z['estimate'], 'higher', 'lower')} at {src} dose {top:.3g} "
                                    "than without injection", f"no evidence that {src} dose {top:.3g} moves M*")))
        else:
            rows.append(_row("H1", test, "log2 M*", family=fam, status="not run: no positive dose in the regime and "
                             "dose 0 both with a per-seed M* (a full M grid) on ≥ 2 common seeds"))
    return rows


def _dose_total_rows(res: dict, at: dict) -> list[dict]:
    """The slope of log2 M* per decade of *total* exposure (batch + injected integrated P-NE*, each dose's mean over
    its runs at the ladder's M; dose 0 included), per seed then t over seeds (dose.mstar_slope): H1's own axis
    (method §11, "The hypothesis's own axis"); r50 in the family, midpoint a sensitivity row. Its mde says what the
    design could have detected on that axis."""
    rows, pre = [], at.get("sens", "")
    for point in ("r50", "midpoint"):
        fam = point == "r50" and not pre
        test = (f"{pre or ('' if fam else 'sensitivity: ')}dose-response {at['name']}: slope of log2 M* ({point}) "
                f"per decade of total exposure (batch + injected), per seed, t over seeds, dose 0 and {at['where']}")
        if point not in res["mstar_total"]:
            why = (f"fit failed ({res['failed'][f'M* total ({point})']})" if f"M* total ({point})" in res["failed"]
                   else "fewer than 2 doses with a per-seed M* (a full M grid) and a recorded total exposure")
            rows.append(_row("H1", test, "log2 M*", family=fam, status=f"not run: {why}"))
            continue
        e, span, _ = res["mstar_total"][point]
        rows.append(_row("H1", f"{test} ({span:.2f} decades)", "log2 M*", "log10 total exposure", n=int(e.n),
                         estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi, p=e.p,
                         effect_size=e.std_effect, mde=e.mde, fails=at["fails"], family=fam,
                         power="could detect ≥ {mde:.2g} octaves of M* per decade of total exposure",
                         words=(f"M* {_direction(e.estimate, 'rises', 'falls')} with total exposure",
                                "no evidence that M* moves with total exposure")))
    return rows


def _dose_ladder_row(res: dict, at: dict) -> dict:
    """The threshold ladder's reading of r's slope as log2 M* per decade (ladder.ladder_conversion): derived from
    r's slope, outside the family; gated on r rising over the ladder at dose 0."""
    loc = res["local"]
    test = (f"dose-response {at['name']}: threshold ladder, log2 M* slope = −(r slope) / (dr/dlog2 M at dose 0 over "
            f"M ∈ {{{at['m_at']}}}, {loc['how']}), delta method")
    if res["ladder_fit"] is None:
        return _row("H1", test, "log2 M*", family=False, status="not run: " + (
            "no r slope" if res["r"] is None else f"no local slope at dose 0 ({loc['n']} seeds with a slope)"))
    c = res["ladder_fit"]
    flat = [] if loc["p"] < at["alpha"] else [("flat ladder", f"dr/dlog2 M at dose 0 = {loc['s']:.3g} ± "
                                              f"{loc['se']:.2g}, p = {loc['p']:.2g}: r does not rise over the ladder")]
    return _row("H1", test, "log2 M*", "log10 dose", n=len(res["fit"]), estimate=c["estimate"], ci_lo=c["ci_lo"],
                ci_hi=c["ci_hi"], p=c["p"], mde=c["mde"], fails=at["fails"] + flat, family=False,
                power="could detect ≥ {mde:.2g} octaves of M* " + DECADE,
                words=(f"M* {_direction(c['estimate'], 'rises', 'falls')} with the {at['src']} dose (read from the "
                       "ladder)", f"no evidence that M* moves with the {at['src']} dose"))


def _dose_zero_row(res: dict, at: dict) -> dict:
    """r at the highest in-regime dose − dose 0, paired by (M, seed) at the ladder's M."""
    top = f"{max(res['doses']):.3g}" if res["doses"] else "–"
    test = f"dose-response {at['name']}: paired t (dose {top} − dose 0) by (M, seed), M ∈ {{{at['m_at']}}}"
    if res["zero"] is None:
        return _row("H1", test, "r", status="not run: fewer than 2 (M, seed) pairs with dose 0")
    z = res["zero"]
    return _row("H1", test, "r", f"dose {top} − dose 0", **z, fails=at["fails"],
                words=(f"r {_direction(z['estimate'], 'higher', 'lower')} at {at['src']} dose {top} than without "
                       "injection", f"no evidence that {at['src']} dose {top} changes r"))


def _dose_shape_row(res: dict, at: dict) -> dict:
    """Isotonic against linear in log dose (stats.monotonicity): a shape check, outside the family."""
    test = f"dose-response {at['name']}: monotonicity, isotonic vs linear in log10(dose), parametric bootstrap"
    mono = res["mono"]
    if mono is None or not np.isfinite(mono["p"]):
        return _row("H1", test, "r", family=False, status="not run: needs ≥ 3 positive doses in the regime and ≥ 2 "
                    "seeds")
    return _row("H1", test, "r", "RSS gain of isotonic over linear / TSS", n=mono["n"], estimate=mono["estimate"],
                effect_size=mono["estimate"], p=mono["p"], fails=at["fails"], family=False, power="",
                words=("monotone but not linear in log dose (a step or saturation)",
                       "no evidence against a line in log dose"))


def _dose_exposure_row(used: pd.DataFrame, name: str, alpha: float, fails) -> dict:
    """The dose series' secondary row: MixedLM r ~ log integrated P-NE* (+ C(M)) + (1|M:seed) (stats.pairing) over
    `used`, outside
    the Holm family (an association: measured exposure also tracks the phase)."""
    d = used[used.integrated_pne.astype(float) > 0]
    d = d.assign(log_exposure=np.log(d.integrated_pne.astype(float)))
    group = stats.pairing(d)
    test = (f"dose-response {name}: association, MixedLM r ~ log(integrated P-NE*) + C(M) + {stats.GROUPS[group]} "
            "(secondary)")
    if d.log_exposure.nunique() < 2 or d.seed.nunique() < 2:
        return _row("H1", test, "r", family=False, status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds")
    try:
        e = stats.mixed_model(d, "r ~ log_exposure" + (" + C(M)" if d.M.nunique() > 1 else ""), group=group,
                              alpha=alpha).set_index("term").loc["log_exposure"]
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", test, "r", family=False, status=f"not run: fit failed ({type(err).__name__})")
    return _row("H1", test, "r", "log integrated P-NE*", n=len(d), estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi,
                p=e.p, effect_size=e.std_effect, mde=e.mde, fails=fails, family=False,
                words=(f"r {_direction(e.estimate, 'increases', 'decreases')} with measured exposure (association)",
                       "no evidence that r changes with measured exposure"))


READ = {   # (outcome, what a rise means, what a fall means)
    "r": ("r", "r rises", "r falls"),
    "id_loss": ("in-distribution loss", "misfit: the in-distribution loss rises", "the in-distribution loss falls"),
    "delta_ridge": ("Δ(f, ridge) on the q_M set", "f moves away from ridge on its training tasks",
                    "f moves toward ridge on its training tasks"),
    "delta_dmmse": ("Δ(f, dMMSE_M) on the q_M set", "f moves away from dMMSE_M", "f moves toward dMMSE_M"),
    "ood_delta_ridge": ("Δ(f, ridge) on new tasks", "f moves away from ridge on new tasks",
                        "more ridge-like: f moves toward ridge on new tasks"),
    "ood_delta_dmmse": ("Δ(f, dMMSE_M) on new tasks", "f moves away from dMMSE_M on new tasks",
                        "f moves toward dMMSE_M on new tasks"),
}


def _dose_outcome_rows(res: dict, at: dict) -> list[dict]:
    """Per outcome of r's decomposition (READ), its slope per decade of total exposure at the ladder
    (dose.total_slope over dose 0 and the in-regime doses): outside the Holm family. r "more ridge-like" reads as
    such only where Δ(f, ridge) on new tasks falls."""
    rows = []
    for y in ("r", *OUTCOMES):
        what, up, down = READ[y]
        test = (f"{at.get('sens', '')}dose-response {at['name']}: decomposition, MixedLM {y} ~ log10(total "
                f"exposure) + C(M) + (1 | M:seed), M ∈ {{{at['m_at']}}}, dose 0 and {at['where']}")
        e = res["decomposition"].get(y)
        if e is None:
            why = (f"fit failed ({res['failed'][f'{y} total']})" if f"{y} total" in res["failed"] else
                   "needs dose 0 and ≥ 1 positive dose inside the regime at the ladder, ≥ 2 seeds, the outcome "
                   "recorded on every run")
            rows.append(_row("H1", test, y, family=False, status=f"not run: {why}"))
            continue
        rows.append(_row("H1", test, y, "log10 total exposure", n=len(res["total_fit"]), estimate=e.estimate,
                         ci_lo=e.ci_lo, ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=at["fails"],
                         family=False, power="could detect a slope of ≥ {mde:.2g} per decade of total exposure",
                         words=(up if e.estimate > 0 else down, f"no evidence that {what} moves with total exposure")))
    return rows
