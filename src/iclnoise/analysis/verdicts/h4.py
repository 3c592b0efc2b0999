"""H4: geometry, LLC and in-context circuitry against exposure, within M (method §11, Within M)."""
from __future__ import annotations

import pandas as pd

from ...probes.geometry import GEOMETRY_COLUMNS
from ...probes.mech import CIRCUIT_COLUMNS
from .. import stats
from .gates import _gate_llc, _gate_llc_sampler
from .rows import _direction, _row

WITHIN = "Spearman correlation within M (Fisher z over M strata)"
POOLED = "descriptive, pooled over M: Spearman correlation"


def h4_rows(fin: pd.DataFrame, exposure: str, alpha: float, gates: dict, common) -> list[dict]:
    """H4: geometry, LLC and in-context circuitry (mech.run_summary) against exposure. Both move with M, so the
    test is the correlation within M (stats.stratified_correlation), in the Holm family; the pooled correlation is
    a descriptive row outside it."""
    rows = []
    for col in ("llc_final", *GEOMETRY_COLUMNS, *CIRCUIT_COLUMNS):
        used = fin[fin[col].notna()]
        if len(used) < 4:
            rows.append(_row("H4", WITHIN, col, status=f"not run: no {col} column"))
            continue
        if used.log_exposure.nunique() < 2:
            rows.append(_row("H4", WITHIN, col, status=f"not run: exposure constant where {col} exists"))
            continue
        share = gates["llc_flagged_max"]
        fails = common(used) + (_gate_llc(used, share) + _gate_llc_sampler(used, share) if col == "llc_final" else [])
        within = stats.stratified_correlation(used.log_exposure, used[col], used.M, alpha)
        for test, res, fam in ((WITHIN, within, True), (POOLED, stats.correlation(used.log_exposure, used[col], alpha),
                                                        False)):
            if fam and not res["strata"]:
                rows.append(_row("H4", test, col, status="not run: no M with ≥ 4 runs and varying exposure"))
                continue
            where = " within M" if fam else " (pooled over M)"
            rows.append(_row("H4", test, col, f"log {exposure}", n=res["n"], estimate=res["estimate"],
                             ci_lo=res["ci_lo"], ci_hi=res["ci_hi"], p=res["p"], effect_size=res["estimate"],
                             mde=res["mde"], fails=fails, family=fam, power="could detect |ρ| ≥ {mde:.2g}",
                             words=(_direction(res["estimate"], "positively associated", "negatively associated")
                                    + where, "no evidence of association" + where)))
    return rows
