"""H4: geometry, LLC and in-context circuitry against exposure, one Spearman correlation each (method §11)."""
from __future__ import annotations

import pandas as pd

from ...probes.geometry import GEOMETRY_COLUMNS
from ...probes.mech import CIRCUIT_COLUMNS
from .. import stats
from .gates import _gate_llc, _gate_llc_sampler
from .rows import _direction, _row


def h4_rows(fin: pd.DataFrame, exposure: str, alpha: float, gates: dict, common) -> list[dict]:
    """H4: geometry, LLC and in-context circuitry (mech.run_summary) against exposure, one Spearman
    correlation each."""
    rows = []
    for col in ("llc_final", *GEOMETRY_COLUMNS, *CIRCUIT_COLUMNS):
        used = fin[fin[col].notna()]
        if len(used) >= 4 and used.log_exposure.nunique() < 2:
            rows.append(_row("H4", "Spearman correlation", col,
                             status=f"not run: exposure constant where {col} exists"))
        elif len(used) >= 4:
            res = stats.correlation(used.log_exposure, used[col], alpha)
            share = gates["llc_flagged_max"]
            llc_gates = _gate_llc(used, share) + _gate_llc_sampler(used, share) if col == "llc_final" else []
            fails = common(used) + llc_gates
            rows.append(_row("H4", "Spearman correlation", col, f"log {exposure}", n=res["n"], estimate=res["estimate"],
                             ci_lo=res["ci_lo"], ci_hi=res["ci_hi"], p=res["p"], effect_size=res["estimate"],
                             mde=res["mde"], fails=fails, power="could detect |ρ| ≥ {mde:.2g}",
                             words=(_direction(res["estimate"], "positively associated",
                                               "negatively associated"), "no evidence of association")))
        else:
            rows.append(_row("H4", "Spearman correlation", col, status=f"not run: no {col} column"))
    return rows
