"""H3: injected noise against the batch noise it emulates, equivalence by TOST with the manipulation's own effect
beside it (method §11)."""
from __future__ import annotations

import math

import pandas as pd

from ...core.probe_sections import Stats
from .. import stats
from .gates import (
    GATES,
    NO_MANIPULATION,
    _gate_equal_steps,
    _gate_matched_exposure,
    gate_convergence,
    gate_equal_data,
    gate_seeds,
)
from .h1 import batch_effect
from .rows import _paired, _row


def h3_rows(every: pd.DataFrame, fin: pd.DataFrame, cfg: Stats, conv: pd.DataFrame) -> list[dict]:
    """H3: batch noise at batch b vs injected noise emulating b at a larger batch B: TOST on the differences paired
    by (M, seed), so the spread across M does not enter the error. method §1 asks for matched exposure trajectories:
    an arm at equal steps (steps_as_batch) is gated on equal steps, one at equal data on equal data; both on matched
    realised exposure.

    The margin is stated against the manipulation's own effect (issue 42): the equivalence the test can show must
    be small next to what the noise does. Manipulation = plain batch b − plain batch B, paired by the same (M, seed)
    (batch_effect); margin = stats.equivalence_fraction × |its mean|, or stats.equivalence_margin where the user set
    one (a smallest effect of interest; null: derived). When the manipulation's CI covers 0 there is nothing to
    compare sources on, and the row is gated (NO_MANIPULATION) whichever the margin."""
    alpha, gates, rows = cfg.alpha, GATES, []
    plain = fin[fin.noise_source == "batch"]
    for cond, inj in every[every.noise_source.isin(["grad", "param"]) & (every.emulate_batch > 0)].groupby("noise"):
        b, B = int(inj.emulate_batch.iloc[0]), int(inj.batch.iloc[0])
        bat = plain[plain.batch == b]
        pairs = _paired(bat, inj)
        if len(pairs) < 2:
            continue
        keys = pairs.set_index(["M", "seed"]).index
        a, c = bat[bat.set_index(["M", "seed"]).index.isin(keys)], inj[inj.set_index(["M", "seed"]).index.isin(keys)]
        used = pd.concat([a, c])
        at_steps = bool((inj.steps_as_batch == b).all())
        fails = (gate_convergence(used, conv) + gate_seeds(used, gates["min_seeds"])
                 + (_gate_equal_steps(used) if at_steps else gate_equal_data(used, gates["data_tol"]))
                 + _gate_matched_exposure(a, c, (f"batch {b}", cond), gates["h3_exposure_tol"]))
        man = batch_effect(plain, b, B, alpha, keys)
        if man is None:
            fails.append((NO_MANIPULATION, f"no plain batch-{B} runs at the arms' (M, seed)"))
            effect = {}
        else:
            effect = {"manipulation_effect": man["estimate"], "manipulation_ci_lo": man["ci_lo"],
                      "manipulation_ci_hi": man["ci_hi"]}
            if not man["p"] < alpha:
                fails.append((NO_MANIPULATION, f"batch {b} − batch {B} = {man['estimate']:+.3g} "
                                               f"[{man['ci_lo']:+.3g}, {man['ci_hi']:+.3g}], p = {man['p']:.2g}"))
        fixed = cfg.equivalence_margin is not None
        margin = (cfg.equivalence_margin if fixed
                  else cfg.equivalence_fraction * abs(man["estimate"]) if man is not None else math.nan)
        res = stats.paired_tost(pairs.r_a.to_numpy(), pairs.r_b.to_numpy(), margin if margin > 0 else 0.0, alpha)
        stated = "stated" if fixed else f"{cfg.equivalence_fraction:g} × |batch {b} − batch {B}|"
        rows.append(_row("H3", f"paired TOST (margin ±{margin:.2g}: {stated}), equal {'steps' if at_steps else 'data'}",
                         "r", f"batch {b} − {cond}", **{**res, "margin": margin}, **effect, fails=fails,
                         power="could show ±{mde:.2g} at 80 % power",
                         words=(f"equivalent within ±{margin:.2g}", f"equivalence within ±{margin:.2g} not shown")))
    if not rows:
        rows.append(_row("H3", "TOST", "r", status="not run: no injected condition emulating a batch size in the grid"))
    return rows
