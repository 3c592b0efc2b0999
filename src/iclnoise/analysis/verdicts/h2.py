"""H2: early against late injection at equal realised injected exposure (method §11)."""
from __future__ import annotations

import pandas as pd

from .. import stats
from .gates import gate_books
from .rows import _direction, _row


def h2_early_late(fin: pd.DataFrame, alpha: float, gates: dict, common=None) -> list[dict]:
    """H2: late − early ridge-likeness, two-sided, paired by (seed, M, batch) and then averaged within seed: the
    paired t runs over seeds (the unit: an effect that differs between seeds makes a paired t over (M, seed) pairs
    anticonservative, 0.285 of planted nulls rejected at α = 0.05 in tests/test_h5.py's design). Where a seed has
    more than one (M, batch) pair, the paired t over the pairs is a sensitivity row beside it (outside the Holm
    family). Valid only when the two arms' realised injected exposure (integrated_pne_injected, after clipping)
    agrees within gates['exposure_tol'] by books shown within 5 % of method §6's exposure at the runs' settings
    (gates.gate_books). The arms are the conditions (by name) with schedule early and late: one
    each, else the test does not run (two conditions with one schedule are not averaged)."""
    sched = fin[fin.noise_schedule.isin(["early", "late"])]
    arms = sched.groupby("noise_schedule").noise.unique()
    if set(arms.index) != {"early", "late"}:
        return [_row("H2", "paired t (late − early), two-sided", "r",
                     status="not run: grid has no early/late schedule pair")]
    if max(len(v) for v in arms) > 1:
        return [_row("H2", "paired t (late − early), two-sided", "r", status="not run: more than one condition per "
                     f"schedule ({', '.join(f'{k}: {sorted(v)}' for k, v in arms.items())}); compare them by name")]
    early, late = arms["early"][0], arms["late"][0]
    p = sched.pivot_table(index=["seed", "M", "batch"], columns="noise", values="r").dropna()
    used = sched[sched.set_index(["seed", "M", "batch"]).index.isin(p.index)]
    per = p.groupby(level="seed")[[late, early]].mean()
    several = len(per) < len(p)   # some seed has more than one (M, batch) pair
    fails = common(used) if common else []
    e = used.groupby("noise").integrated_pne_injected.mean()
    if used.integrated_pne_injected.isna().any():
        fails.append(("realised exposure not recorded", "integrated_pne_injected"))
    elif not (min(e) > 0 and max(e) / min(e) - 1 <= gates["exposure_tol"]):
        fails.append(("unequal exposure", f"{early} {e[early]:.3g}, {late} {e[late]:.3g}"))
    fails += gate_books(used)
    words = ("late noise raises ICL more than early", "early noise raises ICL more than late")
    rows = []
    for name, d, fam in ((f"paired t ({late} − {early}){' by seed (mean over M)' if several else ''}, two-sided",
                          per, True),
                         *([(f"sensitivity: paired t ({late} − {early}) by (M, seed), two-sided", p, False)]
                           if several else [])):
        res = stats.paired_test(d[late].to_numpy(), d[early].to_numpy(), alpha)
        rows.append(_row("H2", name, "r", f"{late} − {early}", **res, fails=list(fails), family=fam,
                         words=(_direction(res["estimate"], *words), "no evidence for phase sensitivity")))
    return rows
