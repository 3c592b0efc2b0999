"""Validity gates every verdict passes before it may read as a finding (method §11): convergence of the M = ∞ runs
to ridge, enough seeds, equal data and steps, matched exposure, LLC diagnostics; their records in the tests table."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from ...core.sections import OPTIMIZERS
from ...core.tasks import M_INF
from ..convergence import CONVERGENCE_TOL, FALL_SHARE, converged_runs

GATE_RECORD = pa.struct([pa.field("code", pa.string()), pa.field("detail", pa.string())])
GATE_FIELDS = [pa.field("gates_passed", pa.bool_()), pa.field("gate_failures", pa.string()),
               pa.field("gate_records", pa.list_(GATE_RECORD))]
CONDITION = ["batch", "noise", "optimizer"]   # a condition: its runs differ in M and seed only (method §13)
CONVERGENCE_SCHEMA = pa.schema([
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("optimizer", pa.string()),
    pa.field("n_inf_runs", pa.int64()),
    pa.field("ood_loss_over_ridge", pa.float64()),   # the worst M = ∞ run's final OOD loss over ridge's
    pa.field("ood_loss_fall", pa.float64()),   # that run's fall over the last third of training (ood_loss_fall)
    pa.field("still_falling", pa.bool_()),     # some M = ∞ run still falling at the end (converged_runs)
    pa.field("converged", pa.bool_()),         # passes the one convergence gate (`converged_runs`)
    pa.field("noise_floor", pa.bool_()),       # passes as a levelled excess under injected noise still on at the end
    pa.field("noise_left", pa.bool_()),        # ... or as what injected noise left after it was switched off
])
# Validity gates (issue 13): thresholds every verdict must pass before it may read as a finding.
GATES = {
    "convergence_tol": CONVERGENCE_TOL,   # the one convergence gate (analysis.convergence): every verdict and the
    "fall_share": FALL_SHARE,             # dose regime read these
    "min_seeds": 3,            # fewer seeds: no interval, no verdict ("insufficient seeds")
    "r_low": 0.25,             # r must span low (some M with seed-mean r ≤ r_low) ...
    "r_high": 0.75,            # ... to high (some M with seed-mean r ≥ r_high) for a threshold to be a transition
    "data_tol": 0.01,          # compared arms saw the same number of sequences within 1 %
    "exposure_tol": 0.10,      # H2: early and late realised injected exposure within 10 %
    "h3_exposure_tol": 0.25,   # H3: the arms' seed-mean realised integrated P-NE* within 25 % (the emulation is
                               # open loop: low-rank + diagonal covariance, each arm under its own preconditioner)
    "llc_flagged_max": 0.25,   # LLC verdicts: at most 25 % of the tested (final) estimates not levelled / negative /
                               # diverged; estimates at initialisation (no minimum there) do not enter
    "dose_tol": 0.05,          # dose–response (issue 43): a dose's realised dose within 5 % of its target (else
                               # saturated / off target)
    "shape_exposure_tol": 0.05,   # H5 (issue 45): an injected control's seed-mean realised injected P-NE* within
                                  # 5 % of the aligned arm's, so that only the noise's shape differs
}
NO_MANIPULATION = "the noise manipulation has no measurable effect to compare sources on"   # H3's gate code
Fail = tuple[str, str]   # a failed gate: (code, detail)


def gate_text(fails) -> str:
    """'code (detail); code (detail)': the gate records in words (gate_failures)."""
    return "; ".join(f"{c} ({d})" if d else c for c, d in fails)


def gate_columns(fails) -> dict:
    """The GATE_FIELDS of a row that failed `fails` (records (code, detail))."""
    fails = list(fails)
    return {"gates_passed": not fails, "gate_failures": gate_text(fails),
            "gate_records": [{"code": c, "detail": d} for c, d in fails]}


def condition_name(batch, noise, optimizer=OPTIMIZERS[0]) -> str:
    """A (batch, noise, optimizer) condition's name in metrics.json and the report: 'noise/B64', with
    '/sgd_momentum' for an optimizer other than AdamW (as in run ids)."""
    return f"{noise}/B{int(batch)}" + ("" if optimizer == OPTIMIZERS[0] else f"/{optimizer}")


def optimizer_note(optimizer) -> str:
    """' (sgd_momentum)' after the name of a test or condition whose runs did not train with AdamW, '' for AdamW
    (as in run ids), so a one-optimizer grid reads as before grid.optimizer."""
    return "" if optimizer == OPTIMIZERS[0] else f" ({optimizer})"


def convergence(out: pd.DataFrame, tol: float = GATES["convergence_tol"]) -> pd.DataFrame:
    """Per (batch, noise, optimizer) condition: its worst M = ∞ run (the highest OOD loss over ridge's; diverged
    runs count as ∞) and whether every M = ∞ run passes the one convergence gate (converged_runs; issue 13: the
    transformer must reach the Bayes predictor for q∞, or level off at an excess injected noise explains). A ratio
    that cannot be formed (a NaN ood_loss_ridge) makes the worst NaN, and NaN is not converged: no run leaves the
    gate unread."""
    rows = []
    for (B, noise, opt), g in out.groupby(CONDITION):
        c = converged_runs(g[g.M == M_INF], tol)
        worst = float(c.ratio.max()) if len(c) and not c.ratio.isna().any() else math.nan
        at = c.ratio.idxmax() if len(c) and np.isfinite(worst) else None
        rows.append({"batch": B, "noise": noise, "optimizer": opt, "n_inf_runs": len(c), "ood_loss_over_ridge": worst,
                     "ood_loss_fall": float(c.fall[at]) if at is not None else math.nan,
                     "still_falling": bool(c.falling.any()),
                     "converged": bool(len(c) and c.converged.all() and np.isfinite(worst)),
                     "noise_floor": bool(c.noise_floor.any()), "noise_left": bool(c.noise_left.any())})
    return pd.DataFrame(rows, columns=CONVERGENCE_SCHEMA.names)


def gate_convergence(runs: pd.DataFrame, conv: pd.DataFrame) -> list[Fail]:
    """A condition converged when its M = ∞ runs did. A condition run at some M only (noise.conditions.<c>.M,
    e.g. an early/late pair at one M) has no M = ∞ run of its own: the batch-noise runs at its batch size, the
    same model, data, budget and optimizer without injection, stand for it. Not for a condition trained another
    batch size's steps (steps_as_batch): it saw other data than they did, so it needs M = ∞ runs of its own."""
    c = conv.set_index(CONDITION)
    steps = runs.steps_as_batch.fillna(0) if "steps_as_batch" in runs else pd.Series(0, index=runs.index)
    other = {(int(b), n, o) for b, n, o, k in zip(runs.batch, runs.noise, runs.optimizer, steps) if k}
    bad = []
    for key in sorted({(int(b), n, o) for b, n, o in zip(runs.batch, runs.noise, runs.optimizer)}):
        row = c.loc[key] if key in c.index else None
        if (row is None or not row.n_inf_runs) and key in other:
            bad.append(f"{condition_name(*key)}: no M = ∞ run of its own (it trained another batch size's steps, "
                       "so batch noise's M = ∞ runs saw other data)")
        elif row is None or not row.n_inf_runs:
            ref = (key[0], "none", key[2])
            row = c.loc[ref] if ref in c.index and c.loc[ref].n_inf_runs else None
            if row is None:
                bad.append(f"{condition_name(*key)}: no M = ∞ run, nor batch-noise M = ∞ runs at batch {key[0]}")
            elif not row.converged:
                bad.append(f"{condition_name(*key)}: no M = ∞ run; batch noise's at batch {key[0]} "
                           f"{over_ridge(row.ood_loss_over_ridge)}")
        elif not row.converged:
            bad.append(f"{condition_name(*key)}: M = ∞ OOD loss {over_ridge(row.ood_loss_over_ridge)}"
                       f"{_failed_how(row)}")
    return [("unconverged", ", ".join(bad))] if bad else []


def over_ridge(ratio: float) -> str:
    """The worst M = ∞ run's OOD loss over ridge's in words; NaN names the missing input."""
    return (f"{ratio:.2f}× ridge's" if not math.isnan(ratio)
            else "over ridge's not finite (a NaN ood_loss_ridge in a run's last row)")


def _failed_how(row) -> str:
    """Why a convergence row failed the gate, beyond its worst ratio: an M = ∞ run still falling, or levelled."""
    if row.get("still_falling", False):
        return f", still falling at the end (the worst run fell {row.ood_loss_fall:.3f} × ridge's over the last third)"
    if np.isfinite(row.get("ood_loss_fall", math.nan)):
        return ", levelled short of ridge with no injected noise to explain it"
    return ""


def gate_books(runs: pd.DataFrame) -> list[Fail]:
    """Compared injected exposures rest on books shown within 5 % of method §6's definition at the runs' settings
    (noise.dose_check.books_unchecked, the outcomes' `books_unchecked`); tables from before the column pass (null)."""
    if "books_unchecked" not in runs:
        return []
    bad = runs[runs.books_unchecked.astype("string").fillna("") != ""]
    named = sorted({f"{condition_name(b, n, o)}: {w}" for b, n, o, w in
                    zip(bad.batch, bad.noise, bad.optimizer, bad.books_unchecked)})
    return [("unchecked books", "; ".join(named) + ", not shown within 5 % of method §6's exposure")] if named else []


def gate_seeds(runs: pd.DataFrame, min_seeds: int) -> list[Fail]:
    """A condition needs at least `min_seeds` seeds."""
    k = runs.seed.nunique()
    return [("insufficient seeds", f"{k} < {min_seeds}")] if k < min_seeds else []


def gate_equal_data(runs: pd.DataFrame, tol: float, strata: list[str] | None = None) -> list[Fail]:
    """Compared arms must have seen the same number of training sequences (within each stratum)."""
    groups = runs.groupby(strata) if strata else [(None, runs)]
    for _, g in groups:
        lo, hi = g.sequences.min(), g.sequences.max()
        if not (lo > 0 and hi / lo - 1 <= tol):
            return [("unequal data", f"sequences seen {lo:,}–{hi:,}")]
    return []


def _gate_equal_steps(runs: pd.DataFrame) -> list[Fail]:
    """Compared arms must have trained the same number of optimizer steps (H3 at matched exposure trajectories)."""
    lo, hi = runs.steps.min(), runs.steps.max()
    return [] if lo == hi else [("unequal steps", f"{lo:,}–{hi:,}")]


def _gate_matched_exposure(a: pd.DataFrame, b: pd.DataFrame, names: tuple[str, str], tol: float) -> list[Fail]:
    """H3 (method §1): the two arms' realised exposure, seed-mean integrated P-NE*, within a factor 1 + tol."""
    if a.integrated_pne.isna().any() or b.integrated_pne.isna().any():
        return [("realised exposure not recorded", "integrated_pne")]
    ea, eb = a.integrated_pne.mean(), b.integrated_pne.mean()
    ok = min(ea, eb) > 0 and max(ea, eb) / min(ea, eb) - 1 <= tol
    return [] if ok else [("unmatched exposure", f"{names[0]} {ea:.3g}, {names[1]} {eb:.3g} integrated P-NE*")]


def _gate_llc(runs: pd.DataFrame, max_share: float) -> list[Fail]:
    """The estimates a verdict uses (each run's final LLC) must be reliable: at most `max_share` of them flagged.
    Flags earlier in training do not enter: at initialisation the model is not near a minimum, where the LLC
    is defined, and a negative estimate there is expected (metrics.json keeps the share over all estimates)."""
    flags = runs.llc_final_flagged.dropna().astype(bool)
    n, k = len(flags), int(flags.sum())
    if not n:
        return [("LLC diagnostics", "no estimates")]
    return [("LLC diagnostics", f"{k} of {n} final estimates not levelled / negative / diverged")] \
        if k / n > max_share else []


def _gate_llc_sampler(runs: pd.DataFrame, max_share: float) -> list[Fail]:
    """method §7 (issue 44): at most `max_share` of the final LLC estimates unstable (stability ratio > 1) or escaped
    (the chains left w*'s neighbourhood), counted apart from _gate_llc's flags; runs whose llc.parquet predates
    the flags (null) do not enter."""
    if "llc_final_sampler" not in runs:
        return []
    flags = runs.llc_final_sampler.dropna().astype(bool)
    n, k = len(flags), int(flags.sum())
    return [("LLC measures the sampler", f"{k} of {n} final estimates unstable / escaped")] \
        if n and k / n > max_share else []
