"""H1 as an association: outcomes against measured exposure, the batch contrasts and noise beyond η/B (method §11)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import stats
from ..thresholds import threshold_with_ci
from .rows import _direction, _paired, _row


def h1_exposure(plain: pd.DataFrame, exposure: str, alpha: float, common) -> list[dict]:
    """H1 (association): outcomes against measured exposure at matched loss, M a factor (C(M): no shape imposed
    on r against M) and batch size a factor (C(batch): the manipulation that drives exposure, method §11 'Within M'),
    a random intercept per (M, seed) cell where batch sizes share cells (stats.pairing), on the runs without
    injected noise (the plain runs: injected arms are H2's and H3's manipulations, not exposure levels). Measured
    exposure also tracks the phase the model is in, so the rows are worded as associations. Sensitivity rows
    (outside the Holm family) repeat the r fit with a seed intercept and without M = 1, where r sits at its floor
    whatever the noise."""
    group = stats.pairing(plain)
    specs = [("r", False, group), ("ood_loss", False, group), ("r", True, group)]
    specs += [("r", False, "seed")] if group == "cell" else []
    return [_h1_exposure_row(plain, outcome, drop_m1, g, drop_m1 or g != group, exposure, alpha, common)
            for outcome, drop_m1, g in specs]


def _h1_exposure_row(plain: pd.DataFrame, outcome: str, drop_m1: bool, group: str, sens: bool, exposure: str,
                     alpha: float, common) -> dict:
    """One row of h1_exposure: `outcome` ~ log exposure + C(M) + id_loss + C(batch) + (1|`group`)."""
    d = plain[plain.M != 1] if drop_m1 else plain
    covars = " + ".join(c for c, v in (("C(M)", "M"), ("id_loss", "id_loss"), ("C(batch)", "batch"))
                        if d[v].nunique() > 1)
    formula = f"{outcome} ~ log_exposure" + (f" + {covars}" if covars else "")
    shown = formula.replace("log_exposure", f"log({exposure})")
    label = "sensitivity, M ≥ 2: " if drop_m1 else ("sensitivity, seed intercept: " if sens else "")
    name = f"{label}MixedLM {shown} + {stats.GROUPS[group]}, plain runs (no injection)"
    if drop_m1 and len(d) == len(plain):
        return _row("H1", name, outcome, family=False, status="not run: no M = 1 runs to leave out")
    if d.log_exposure.nunique() < 2 or d.seed.nunique() < 2:
        return _row("H1", name, outcome, family=not sens,
                    status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds")
    if d.groupby("batch").log_exposure.nunique().max() < 2:
        return _row("H1", name, outcome, family=not sens, status=f"not run: {exposure} is a function of batch size "
                    "(no variation at fixed batch); the batch contrast is the paired batch rows")
    try:
        e = stats.mixed_model(d, formula, group=group, alpha=alpha).set_index("term").loc["log_exposure"]
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", name, outcome, family=not sens, status=f"not run: fit failed ({type(err).__name__})")
    at = " at fixed batch size" if "C(batch)" in covars else ""
    return _row("H1", name, outcome, f"log {exposure}", n=len(d), estimate=e.estimate, ci_lo=e.ci_lo,
                ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=common(d), family=not sens,
                words=(f"{outcome} {_direction(e.estimate, 'increases', 'decreases')} with measured exposure{at} "
                       "(association)", f"no evidence that {outcome} changes with exposure{at}"))


def h1_batch_pairs(fin: pd.DataFrame, alpha: float, common) -> list[dict]:
    """H1 (manipulation): r at the smaller minus the larger batch size, plain runs paired by (M, seed), at equal
    data (the gate): the batch-size noise manipulation itself, beside the exposure association."""
    plain = fin[fin.noise_source == "batch"]
    sizes = sorted(plain.batch.unique())
    rows = []
    for i, b1 in enumerate(sizes):
        for b2 in sizes[i + 1:]:
            res = batch_effect(plain, b1, b2, alpha)
            name = f"paired t (batch {b1} − batch {b2}), plain runs by (M, seed)"
            if res is None:
                rows.append(_row("H1", name, "r", status="not run: fewer than 2 (M, seed) pairs"))
                continue
            used = plain[plain.batch.isin([b1, b2])]
            rows.append(_row("H1", name, "r", f"batch {b1} − batch {b2}", **res, fails=common(used),
                             words=(f"r {_direction(res['estimate'], 'higher', 'lower')} at batch {b1} than at "
                                    f"batch {b2} (equal data)", "no evidence that batch size changes r")))
            rows += [_batch_mstar_row(used, b1, b2, point, alpha, common) for point in ("r50", "midpoint")]
    return rows


def _batch_mstar_row(used: pd.DataFrame, b1: int, b2: int, point: str, alpha: float, common) -> dict:
    """log2 M* at batch b1 − batch b2, paired by seed (each seed's own threshold, thresholds.threshold_with_ci's
    log2_per_seed): the threshold comparison as a test, not as overlapping intervals. r50 in the family, the
    midpoint a sensitivity row."""
    fam = point == "r50"
    name = (f"{'' if fam else 'sensitivity: '}paired t of log2 M* ({point}) (batch {b1} − batch {b2}) by seed, "
            "plain runs")
    per = [threshold_with_ci(used[used.batch == b], level=1 - alpha, alpha=alpha, point=point).get("log2_per_seed")
           for b in (b1, b2)]
    seeds = sorted(set(per[0] or {}) & set(per[1] or {}))
    if len(seeds) < 2:
        return _row("H1", name, "log2 M*", family=fam,
                    status="not run: fewer than 2 seeds with a threshold at both batch sizes")
    res = stats.paired_test([per[0][k] for k in seeds], [per[1][k] for k in seeds], alpha)
    return _row("H1", name, "log2 M*", f"batch {b1} − batch {b2}", **res, fails=common(used), family=fam,
                power="could detect a shift of ≥ {mde:.2g} octaves of M*",
                words=(f"M* {_direction(res['estimate'], 'higher', 'lower')} at batch {b1} than at batch {b2} "
                       "(equal data)", "no evidence that batch size moves M*"))


def batch_effect(plain: pd.DataFrame, b1: int, b2: int, alpha: float, keys=None) -> dict | None:
    """Paired t of r at batch b1 − batch b2 over the plain runs' common (M, seed) (restricted to `keys` when given);
    None with fewer than 2 pairs."""
    p = _paired(plain[plain.batch == b1], plain[plain.batch == b2])
    if keys is not None:
        p = p[p.set_index(["M", "seed"]).index.isin(keys)]
    return stats.paired_test(p.r_a.to_numpy(), p.r_b.to_numpy(), alpha) if len(p) >= 2 else None


def h1_noise_beyond_eta_b(fin: pd.DataFrame, common=None) -> dict:
    """H1, causal form: does the manipulated noise condition change r beyond the η/B noise temperature?

    LR test (stats.manipulation_lr_test) of r ~ C(η/B level) + C(M) + C(noise) against r ~ C(η/B level) + C(M),
    random intercept per (M, seed) cell where conditions share cells, else per seed (stats.pairing): the treatment
    is what was manipulated (batch size enters through η/B; injected noise and its schedule through the
    condition), so arms are compared at equal η/B and M. Measured P-NE is
    not a regressor: it tracks the phase, and on planted data where log P-NE = log(η/B) + 0.5·phase with no
    effect of noise on r, the old 'P-NE beyond η/B' test rejected 60 of 60 panels; this one rejects at about
    the nominal rate (tests/test_aggregate.py)."""
    name = f"LR test: noise condition beyond η/B, {stats.GROUPS[stats.pairing(fin)]}"
    if fin.seed.nunique() < 2 or fin.noise.nunique() < 2:
        return _row("H1", name, "r", status="not run: needs ≥ 2 seeds and ≥ 2 noise conditions")
    d = fin.assign(eta_b=np.round(np.log(fin.integrated_lr_over_b), 6))
    try:
        res = stats.manipulation_lr_test(d, "r", "C(noise)", "C(eta_b):C(M)", group=stats.pairing(d))
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", name, "r", status=f"not run: fit failed ({type(err).__name__})")
    if not res["df"]:
        return _row("H1", name, "r", status="not run: no two noise conditions share an η/B level")
    fails = common(d, ["eta_b"]) if common else []
    return _row("H1", name, "r", f"C(noise) | η/B, M ({res['df']} df)", n=res["n"], estimate=res["lr_stat"],
                p=res["p"], effect_size=res["delta_aic"], mde=res["mde"], fails=fails,
                power="could detect a condition shifting r by ≥ {mde:.2g}",
                words=("the noise condition changes r beyond η/B", "no evidence that noise changes r beyond η/B"))
