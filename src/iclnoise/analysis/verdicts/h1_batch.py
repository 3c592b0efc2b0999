"""H1 on the natural noise's own axis (method §11, "The batch axis"; issue 70 item 5): M* and r's decomposition
against total exposure across batch sizes, at equal data and, apart, at equal steps."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from ...core.tasks import M_INF
from .. import dose
from ..thresholds import t_interval, threshold_with_ci
from .gates import _gate_equal_steps, convergence, gate_convergence
from .rows import _direction, _row

BATCH_LEVELS_SCHEMA = pa.schema([   # aggregate/batch_levels.parquet: one row per (optimizer, arm, batch size)
    pa.field("optimizer", pa.string()), pa.field("arm", pa.string()), pa.field("batch", pa.int64()),
    pa.field("total_exposure", pa.float64()),   # the batch size's mean integrated P-NE* (h1_batch_axis's x)
    pa.field("n_runs", pa.int64()), pa.field("n_seeds", pa.int64()),
    pa.field("r16", pa.float64()), pa.field("r16_lo", pa.float64()), pa.field("r16_hi", pa.float64()),
    *[pa.field(f"M_star_{p}{k}", pa.float64()) for p in ("r50", "midpoint") for k in ("", "_lo", "_hi")],
    pa.field("converged", pa.bool_()),   # its M = ∞ runs pass the convergence gate (gates.gate_convergence)
])


def batch_arms(every: pd.DataFrame, least: int = 3) -> dict[str, pd.DataFrame]:
    """The plain runs (no injection, finite M, not diverged) of each arm with ≥ `least` batch sizes (at two, the
    paired batch rows of h1_batch_pairs say it already): 'equal data', every batch size at the sequence budget;
    'equal steps B_t', the runs trained batch B_t's steps (a source-none condition with steps_as_batch: B_t) with
    batch B_t's own runs. Empty arms are left out."""
    plain = every[every.noise_source == "batch"]
    steps = plain.steps_as_batch.fillna(0).astype(int)
    arms = {"equal data": plain[steps == 0]}
    for bt in sorted(set(steps) - {0}):
        arms[f"equal steps (batch {bt}'s)"] = plain[(steps == bt) | ((steps == 0) & (plain.batch == bt))]
    return {k: a for k, a in arms.items() if len(a) and a.batch.nunique() >= least}


def compared(runs: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """An arm's runs where its batch sizes are compared, and the batch sizes left out with why. M* depends on the
    grid it is fitted on and exposure moves with M, so batch sizes are compared on one grid. A batch size short of
    the arm's (M, seed) grid (the union over its batch sizes: one still training, or a run that diverged) is left
    out while ≥ 3 batch sizes hold the whole grid; otherwise every batch size is kept on the M they all have."""
    cells = {b: set(zip(h.M, h.seed)) for b, h in runs.groupby("batch")}
    grid = set().union(*cells.values())
    whole = [b for b, c in cells.items() if c == grid]
    if 3 <= len(whole) < len(cells):
        short = {b: f"{len(c)} of the {len(grid)} (M, seed) runs the others have" for b, c in cells.items()
                 if c != grid}
        return runs[runs.batch.isin(whole)], short
    shared = set.intersection(*(set(h.M) for _, h in runs.groupby("batch")))
    return runs[runs.M.isin(shared)], {}


def arm_exposure(d: pd.DataFrame) -> pd.Series:
    """Each batch size's mean total integrated P-NE* over an arm's compared runs `d` (compared); empty when its
    batch sizes share no M."""
    return d.groupby("batch").integrated_pne.mean().astype(float)


def h1_batch_axis(every: pd.DataFrame, alpha: float, common, decompose: bool = True) -> list[dict]:
    """Per arm (batch_arms): the slope of log2 M* per decade of total exposure across batch sizes (_mstar_row) —
    r50 in the Holm family, midpoint a sensitivity row; and r's decomposition per decade of total exposure
    (dose.total_slope, (M, seed) cells the random intercept) over the runs where they are compared (compared), outside
    the family (left out with decompose=False: the M* rows alone, as a power simulation reads them). A batch size
    whose M = ∞ runs fail the convergence gate is left out and named, while ≥ 3 converged batch sizes remain; the
    rows over all of them follow as sensitivity rows with that gate not applied (as a dose series' gated-out doses).
    With fewer, the rows over all of them stand, gated. No rows without an arm of ≥ 3 batch sizes, but an
    equal-steps arm still short of three says so; rows 'not run' without an exposure record."""
    rows = []
    for arm, runs in batch_arms(every, least=1).items():
        name = f"batch axis at {arm}, batch {', '.join(map(str, sorted(runs.batch.unique())))}"
        test = f"{name}: slope of log2 M* per decade of total exposure"
        at_steps = arm != "equal data"
        if runs.batch.nunique() < 3:
            if at_steps:   # at equal data the paired batch rows read two batch sizes
                rows.append(_row("H1", test, "log2 M*", status=f"not run: {runs.batch.nunique()} batch size(s) "
                                 "trained at equal steps (needs ≥ 3)"))
            continue

        def gates(used, at_steps=at_steps):   # an equal-steps arm is gated on its steps, not on equal data
            fails = common(used)
            return [f for f in fails if f[0] != "unequal data"] + _gate_equal_steps(used) if at_steps else fails
        if not runs.integrated_pne.notna().all():
            rows.append(_row("H1", test, "log2 M*",
                             status="not run: total exposure not recorded (exposure logging off)"))
            continue
        d, short = compared(runs)
        total = arm_exposure(d)
        if not len(total):
            rows.append(_row("H1", test, "log2 M*",
                             status="not run: no M run at every batch size, so no total exposure they share"))
            continue
        d = d.assign(log10_total=lambda x: np.log10(x.batch.map(total)))
        failed = {b: f[1] for b, g in d.groupby("batch") for f in gates(g) if f[0] == "unconverged"}
        kept = d[~d.batch.isin(failed)]
        if not failed or kept.batch.nunique() < 3:   # the rows over every batch size, gated as they stand
            rows += _arm_rows(d, arm, short, gates, alpha, decompose)
            continue
        rows += _arm_rows(kept, arm, {**short, **{b: f"unconverged ({why})" for b, why in failed.items()}}, gates,
                          alpha, decompose)
        admits = "; ".join(f"batch {b}: {why}" for b, why in failed.items())

        def ungated(used, gates=gates):
            return [f for f in gates(used) if f[0] != "unconverged"]
        rows += _arm_rows(d, arm, short, ungated, alpha, decompose,
                          pre=f"sensitivity, the convergence gate not applied (admits {admits}): ")
    return rows


def _arm_rows(d: pd.DataFrame, arm: str, short: dict, gates, alpha: float, decompose: bool,
              pre: str | None = None) -> list[dict]:
    """One arm's rows over its runs `d` (log10_total each batch size's x; `short`: batch sizes left out, with why):
    the M* slope by r50 and by midpoint (_mstar_row) and, with decompose, r's decomposition; `pre` names sensitivity
    rows (then none is in the family)."""
    rows = [_mstar_row(d, arm, point, alpha, gates, short, pre) for point in ("r50", "midpoint")]
    if not decompose:
        return rows
    name = f"{pre or ''}batch axis at {arm}, batch {', '.join(map(str, sorted(d.batch.unique())))}" + "".join(
        f" (left out: batch {b}, {why})" for b, why in short.items())
    res = {"failed": {}}
    dec = dose.decomposition(d, alpha, res)
    for y in ("r", *dose.OUTCOMES):
        test = f"{name}: decomposition, MixedLM {y} ~ log10(total exposure) + C(M) + (1 | M:seed)"
        if y not in dec:
            why = res["failed"].get(f"{y} total", "the outcome not recorded on every run, or < 2 seeds")
            rows.append(_row("H1", test, y, family=False, status=f"not run: {why}"))
            continue
        e = dec[y]
        rows.append(_row("H1", test, y, "log10 total exposure", n=len(d), estimate=e.estimate, ci_lo=e.ci_lo,
                         ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=gates(d),
                         family=False, power="could detect a slope of ≥ {mde:.2g} per decade of total exposure",
                         words=(f"{y} {_direction(e.estimate, 'rises', 'falls')} with total exposure across "
                                "batch sizes", f"no evidence that {y} moves with total exposure")))
    return rows


def _mstar_row(d: pd.DataFrame, arm: str, point: str, alpha: float, common, short: dict | None = None,
               pre: str | None = None) -> dict:
    """The slope of log2 M* per decade of total exposure over an arm's batch sizes (`d`: its compared runs,
    log10_total each batch size's x; `short`: batch sizes compared left out, with why): each batch size's per-seed M*
    (threshold_with_ci); a batch size without one (no threshold, a seed's fit without one, < 3 seeds) is left out
    and named with why, as are those in `short`; each seed present at
    every batch size left in gets its least-squares slope, t over seeds (dose.mstar_slope). Run on ≥ 3 batch sizes
    and ≥ 2 such seeds; the row names the batch sizes it rests on and their span in decades."""
    fam = point == "r50" and pre is None
    per, out = [], dict(short or {})
    for b, g in d.groupby("batch"):
        est = threshold_with_ci(g, level=1 - alpha, alpha=alpha, point=point)
        seeds = est.get("log2_per_seed")
        if seeds:
            per += [{"batch": b, "log10_dose": float(g.log10_total.iloc[0]), "seed": s, "log2_M_star": v}
                    for s, v in seeds.items()]
        else:
            out[b] = est["reason"] or "no per-seed M*"
    per = pd.DataFrame(per, columns=["batch", "log10_dose", "seed", "log2_M_star"])
    used = sorted(per.batch.unique())
    per = per[per.seed.isin(per.groupby("seed").batch.nunique().loc[lambda k: k == len(used)].index)]
    x = per.groupby("batch").log10_dose.first()
    span = float(x.max() - x.min()) if len(x) else 0.0
    left = "; ".join(f"{b}: {why}" for b, why in out.items())
    head = pre if pre is not None else "" if fam else "sensitivity: "
    test = (f"{head}batch axis at {arm}, batch {', '.join(map(str, used or sorted(out)))}: "
            f"slope of log2 M* ({point}) per decade of total exposure, per seed, t over seeds ({span:.2f} decades, "
            f"M {', '.join(f'{m:g}' for m in sorted(d.M.unique()))}{'; left out: batch ' + left if left else ''})")
    if len(used) < 3 or per.seed.nunique() < 2:
        return _row("H1", test, "log2 M*", family=fam, status=f"not run: a per-seed M* at {len(used)} batch size(s) "
                    f"on {per.seed.nunique()} common seed(s) (needs ≥ 3 batch sizes, ≥ 2 seeds)")
    e = dose.mstar_slope(per, alpha)
    return _row("H1", test, "log2 M*", "log10 total exposure", n=int(e.n), estimate=e.estimate,
                ci_lo=e.ci_lo, ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde,
                fails=common(d[d.batch.isin(used)]), family=fam,
                power="could detect ≥ {mde:.2g} octaves of M* per decade of total exposure",
                words=(f"M* {_direction(e.estimate, 'rises', 'falls')} with the batch noise's total exposure",
                       "no evidence that M* moves with the batch noise's total exposure"))


def batch_levels(out: pd.DataFrame, alpha: float, min_seeds: int) -> pd.DataFrame:
    """aggregate/batch_levels.parquet (BATCH_LEVELS_SCHEMA; figure 6 on the batch axis): per optimizer, arm
    (batch_arms) and batch size, its mean total exposure (arm_exposure), r at M = 16 with its t-interval over seeds,
    and M* by r50 and by midpoint from its full M grid with their intervals (threshold_with_ci). Empty without an
    arm of ≥ 3 batch sizes. M* is fitted on the arm's compared runs (compared), as the slope's, so a batch size
    still training has no row; without an interval (no per-seed M*) it is the pooled fit, which the slope leaves out.
    `converged`: its M = ∞ runs pass the convergence gate (a batch size the slope leaves out for it)."""
    rows = []
    conv = convergence(out)
    for opt, o in out.groupby("optimizer"):
        for arm, runs in batch_arms(o[(o.M != M_INF) & ~o.diverged]).items():
            d = compared(runs)[0]
            total = arm_exposure(d)
            for b, h in d.groupby("batch"):
                row = {"optimizer": opt, "arm": arm, "batch": int(b), "n_runs": len(h), "n_seeds": h.seed.nunique(),
                       "total_exposure": float(total.get(b, np.nan)), "converged": not gate_convergence(h, conv)}
                r16 = h[h.M == 16].groupby("seed").r.mean().dropna()
                m, se, t = t_interval(r16, 1 - alpha) if len(r16) >= 2 else (r16.mean(), np.nan, np.nan)
                row.update(r16=m, r16_lo=m - t * se, r16_hi=m + t * se)
                for point in ("r50", "midpoint"):
                    est = threshold_with_ci(h, level=1 - alpha, min_seeds=min_seeds, alpha=alpha, point=point)
                    row.update({f"M_star_{point}{k}": est[f"M_star{k}"] for k in ("", "_lo", "_hi")})
                rows.append(row)
    return pd.DataFrame(rows, columns=BATCH_LEVELS_SCHEMA.names)
