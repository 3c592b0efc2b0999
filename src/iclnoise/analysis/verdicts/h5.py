"""H5: noise aligned with the task family against the same noise in other shapes, at equal realised injected
exposure (method §13)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as sps

from ...core.probe_sections import Stats
from .. import ladder, stats
from ..thresholds import threshold_with_ci
from .gates import GATES, gate_books
from .rows import _direction, _paired, _row

ALIGNED = "nap"   # H5's treatment: the injected noise shaped by the task family (noise.conditions.<c>.shape)
SHAPE_CONTROLS = {"nap_misaligned": "misaligned", "nap_isotropic": "isotropic", "nap_within_task": "within-task"}


def h5_alignment(fin: pd.DataFrame, cfg: Stats, common) -> list[dict]:
    """H5 (method §13; issue 45): at equal realised injected exposure, does noise aligned with the task family (shape
    'nap') give higher ridge-likeness, and a lower M*, than the same noise in another shape? Per injected source
    and batch with an aligned condition, against each control in the grid: the same spectrum misaligned, isotropic
    and within-task (injected, same source and batch), and no injection (the batch noise alone at that batch).
    Rows per control (_h5_pair): r by seed (Holm family), r by (M, seed) (sensitivity), the M* shift the r
    difference reads as (derived), the distances to ridge and to dMMSE it is made of (derived), and log2 M* by seed
    where each seed has its own M* (Holm family).
    Gates: convergence, seeds, equal data (`common`) and, against an injected control, equal realised injected
    P-NE* (seed means within GATES['shape_exposure_tol']): the shape must be the only difference. The dose is in
    the test's name, so a null says what it was tested at. No rows when the grid has no aligned condition."""
    rows = []
    for (batch, src), inj in fin[fin.noise_shape.isin([ALIGNED, *SHAPE_CONTROLS])].groupby(["batch", "noise_source"]):
        arms = inj.groupby("noise_shape").noise.unique()
        if ALIGNED not in arms:
            continue
        plain = fin[(fin.noise_source == "batch") & (fin.batch == batch)]
        controls = [(shape, SHAPE_CONTROLS[shape], inj[inj.noise_shape == shape]) for shape in SHAPE_CONTROLS
                    if shape in arms] + ([("none", "no injection", plain)] if len(plain) else [])
        for shape, label, ctl in controls:
            at = f"{src} source, batch {batch}"
            if max(len(arms[ALIGNED]), ctl.noise.nunique()) > 1:
                rows.append(_row("H5", f"aligned − {label}, {at}", "r", status="not run: more than one condition "
                                 f"per arm ({sorted(arms[ALIGNED])} against {sorted(ctl.noise.unique())})"))
                continue
            rows += _h5_pair(inj[inj.noise_shape == ALIGNED], ctl, label, at, shape != "none", cfg.alpha, common)
    return rows


def _h5_pair(a: pd.DataFrame, b: pd.DataFrame, label: str, at: str, injected: bool, alpha: float, common) -> list:
    """H5's rows for the aligned arm `a` against the control `b` (h5_alignment), on their common (M, seed):
    - r by seed: each seed's mean over M of r(aligned) − r(control), paired t over seeds — Holm family. Seeds are
      the unit: the effect of a noise shape may differ between seeds (each run sketches its own task covariance),
      and a paired t over (M, seed) pairs then rejects 0.285 of planted nulls at α = 0.05 (sd 0.05 between seeds,
      0.03 between runs, 3 seeds × 4 M; by seed 0.07; tests/test_h5.py);
    - r by (M, seed): paired t over the pairs, as method §13 words it — a sensitivity row (exact only when the
      effect is the same in every seed);
    - log2 M* read from r (ladder.ladder_conversion): shift = −(mean difference) / s, s = ladder.local_slope on both
      arms' runs pooled (uncorrelated with the difference when the arms' run noise is equal), t interval over
      seeds — derived from the first row, outside the family; first order in the shift, valid while the M bracket the
      threshold;
    - what the r difference is made of (_h5_distance_row): Δ to ridge and Δ to dMMSE by seed, outside the family;
    - log2 M* by seed (r50, thresholds.threshold_with_ci: ≥ 5 finite M per seed), paired t — Holm family."""
    pairs = _paired(a, b)
    keys = pairs.set_index(["M", "seed"]).index
    a, b = (x[x.set_index(["M", "seed"]).index.isin(keys)] for x in (a, b))
    dose_ = a.integrated_pne_injected.mean()
    ms = sorted(int(m) for m in pairs.M.unique())
    where = f"{at}, M ∈ {{{', '.join(map(str, ms))}}}, realised injected P-NE* {dose_:.3g}"
    names = {k: f"{k} (aligned − {label}), {where}" for k in
             ("paired t by seed of the mean over M", "sensitivity: paired t by (M, seed)",
              "M* shift read from r, delta method", "paired t of log2 M* (r50) by seed")}
    per = _seed_means(pairs, "r")
    if len(per) < 2:
        why = "not run: fewer than 2 seeds with a common (M, seed)"
        return [_row("H5", n, "log2 M*" if "M*" in n else "r", status=why, family="sensitivity" not in n)
                for n in names.values()]
    fails = (common(pd.concat([a, b])) if common else []) + (_gate_shape_exposure(a, b, label) if injected else [])
    words = (f"r {{}} under aligned noise than {label}", f"no evidence that aligned noise changes r against {label}")
    rows = []
    for n, res, fam in ((names["paired t by seed of the mean over M"],
                         stats.paired_test(per.r_a.to_numpy(), per.r_b.to_numpy(), alpha), True),
                        (names["sensitivity: paired t by (M, seed)"],
                         stats.paired_test(pairs.r_a.to_numpy(), pairs.r_b.to_numpy(), alpha), False)):
        rows.append(_row("H5", n, "r", f"aligned − {label}", **res, fails=fails, family=fam,
                         words=(words[0].format(_direction(res["estimate"], "higher", "lower")), words[1])))
    rows.append(_h5_shift_row(names["M* shift read from r, delta method"], per, pd.concat([a, b]), ms, label, fails,
                              alpha))
    rows += [_h5_distance_row(pairs, col, what, label, where, fails, alpha)
             for col, what in (("delta_ridge", "ridge"), ("delta_dmmse", "dMMSE"))]
    rows.append(_h5_mstar_row(names["paired t of log2 M* (r50) by seed"], a, b, label, fails, alpha))
    return rows


def _gate_shape_exposure(a: pd.DataFrame, b: pd.DataFrame, label: str) -> list:
    """H5 against an injected control: the arms' seed-mean realised injected P-NE* within
    GATES['shape_exposure_tol'], so that only the noise's shape differs, by books shown within 5 % of method §6's
    exposure at the runs' settings (gates.gate_books)."""
    if a.integrated_pne_injected.isna().any() or b.integrated_pne_injected.isna().any():
        return [("realised exposure not recorded", "integrated_pne_injected")]
    e = {"aligned": a.integrated_pne_injected.mean(), label: b.integrated_pne_injected.mean()}
    if not (min(e.values()) > 0 and max(e.values()) / min(e.values()) - 1 <= GATES["shape_exposure_tol"]):
        return [("unequal exposure", ", ".join(f"{k} {v:.3g}" for k, v in e.items()))]
    return gate_books(pd.concat([a, b]))


def _h5_mstar_row(name: str, a: pd.DataFrame, b: pd.DataFrame, label: str, fails, alpha) -> dict:
    """log2 M* by seed (r50, thresholds.threshold_with_ci: ≥ 5 finite M per seed) of the aligned arm `a` against
    the control `b`, paired t over the seeds where both have one — Holm family."""
    th = [threshold_with_ci(x, level=1 - alpha, min_seeds=GATES["min_seeds"], alpha=alpha) for x in (a, b)]
    seeds = sorted(set(th[0].get("log2_per_seed", {})) & set(th[1].get("log2_per_seed", {})))
    if len(seeds) < 2:
        why = "; ".join(f"{w}: {t['reason']}" for w, t in zip(("aligned", label), th) if t["reason"])
        return _row("H5", name, "log2 M*", status=f"not run: no per-seed M* on ≥ 2 common seeds ({why})")
    z = stats.paired_test([th[0]["log2_per_seed"][s] for s in seeds], [th[1]["log2_per_seed"][s] for s in seeds],
                          alpha)
    return _row("H5", name, "log2 M*", f"aligned − {label}", **z,
                fails=fails, power="could detect a shift of ≥ {mde:.2g} octaves of M*",
                words=(f"M* {_direction(z['estimate'], 'higher', 'lower')} under aligned noise than {label}",
                       f"no evidence that aligned noise moves M* against {label}"))


def _seed_means(pairs: pd.DataFrame, col: str) -> pd.DataFrame:
    """Each seed's mean over M of `col` in both arms of the matched `pairs` (columns {col}_a, {col}_b; pairs with
    a missing value left out): H5's unit of replication."""
    return pairs[["seed", f"{col}_a", f"{col}_b"]].dropna().groupby("seed").mean()


def _h5_distance_row(pairs: pd.DataFrame, col: str, what: str, label: str, where: str, fails, alpha) -> dict:
    """What H5's r difference is made of: r = Δ_dMMSE / (Δ_dMMSE + Δ_ridge) (method §3) rises when the model moves
    toward ridge and also when it only moves away from dMMSE (a model fitting neither, r → ½). Each seed's mean over M
    of Δ(aligned) − Δ(control) to `what` (`col` of the matched `pairs`), paired t over seeds; outside the family
    (a reading of the r rows, not a hypothesis of its own)."""
    name = f"decomposition: paired t by seed of the mean over M of Δ to {what} (aligned − {label}), {where}"
    per = _seed_means(pairs, col)
    if len(per) < 2:
        return _row("H5", name, col, family=False, status=f"not run: {col} on fewer than 2 seeds")
    res = stats.paired_test(per[f"{col}_a"].to_numpy(), per[f"{col}_b"].to_numpy(), alpha)
    return _row("H5", name, col, f"aligned − {label}", **res, fails=fails, family=False,
                words=(f"the model {_direction(res['estimate'], 'farther from', 'nearer to')} {what} under aligned "
                       f"noise than {label}", f"no evidence that aligned noise moves the model's distance to {what} "
                       f"against {label}"))


def _h5_shift_row(name: str, per: pd.DataFrame, both: pd.DataFrame, ms: list[int], label: str, fails, alpha) -> dict:
    """The per-seed r difference (`per`: seed → r_a, r_b) read as a shift of log2 M* through the local slope of r
    in log2 M over `ms` (ladder.local_slope on `both` arms' runs), t interval over seeds; gated on r rising there."""
    loc = ladder.local_slope(both, ms)
    d = per.r_a - per.r_b
    n = len(d)
    if not np.isfinite(loc["s"]):
        return _row("H5", name, "log2 M*", family=False, status=f"not run: no local slope ({loc['n']} seeds)")
    c = ladder.ladder_conversion(float(d.mean()), float(d.std(ddof=1) / math.sqrt(n)), loc["s"], loc["se"], alpha)
    t = float(sps.t.ppf(1 - alpha / 2, n - 1))
    flat = [] if loc["p"] < alpha else [("flat ladder", f"dr/dlog2 M = {loc['s']:.3g} ± {loc['se']:.2g}, "
                                                        f"p = {loc['p']:.2g}: r does not rise over these M")]
    return _row("H5", name, "log2 M*", f"aligned − {label}", n=n, estimate=c["estimate"],
                ci_lo=c["estimate"] - t * c["se"], ci_hi=c["estimate"] + t * c["se"],
                p=float(2 * sps.t.sf(abs(c["estimate"]) / c["se"], n - 1)) if c["se"] > 0 else math.nan,
                mde=stats.mde_paired_t(c["se"] * math.sqrt(n), n, alpha), fails=[*fails, *flat], family=False,
                power="could detect a shift of ≥ {mde:.2g} octaves of M*",
                words=(f"M* {_direction(c['estimate'], 'higher', 'lower')} under aligned noise than {label} (read "
                       "from r)", f"no evidence that aligned noise moves M* against {label}"))
