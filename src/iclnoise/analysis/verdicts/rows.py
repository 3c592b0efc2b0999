"""The tests table (TESTS_SCHEMA): one row per test (`_row`) and the verdicts written after Holm over the family
(`_verdicts`)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from ...core.sections import OPTIMIZERS
from .. import stats
from .gates import GATE_FIELDS, gate_columns

TESTS_SCHEMA = pa.schema([
    pa.field("hypothesis", pa.string()),
    pa.field("optimizer", pa.string()),   # grid.optimizer: each optimizer's runs are tested on their own
    pa.field("test", pa.string()), pa.field("outcome", pa.string()),
    pa.field("term", pa.string()), pa.field("estimate", pa.float64()), pa.field("ci_lo", pa.float64()),
    pa.field("ci_hi", pa.float64()), pa.field("p", pa.float64()), pa.field("p_holm", pa.float64()),
    pa.field("in_family", pa.bool_()),          # in the Holm family: ran, passed its gates, not a sensitivity row
    pa.field("effect_size", pa.float64()),
    pa.field("mde", pa.float64()),              # minimum detectable effect at 80 % power (TOST: smallest margin shown)
    pa.field("margin", pa.float64()),           # H3: the equivalence margin used
    pa.field("manipulation_effect", pa.float64()),   # H3: the noise manipulation's effect against its control ...
    pa.field("manipulation_ci_lo", pa.float64()), pa.field("manipulation_ci_hi", pa.float64()),   # ... and its CI
    pa.field("n", pa.int64()), pa.field("status", pa.string()),
    pa.field("verdict", pa.string()), *GATE_FIELDS,
])
DETECT = "could detect |effect| ≥ {mde:.2g}"   # what a null states about its power (mde at 80 %)


def _row(h, test, outcome, term="", status="run", n=0, words=("", ""), fails=(), family=True, power=DETECT,
         **vals) -> dict:
    """One test row. `words` = (verdict if the Holm-adjusted test is significant, verdict if not); `fails` = the
    validity gates it failed, records (code, detail); `family`: False for a sensitivity row (never in the Holm
    family); `power`: how a null states its mde. The verdict is written after Holm (`_verdicts`)."""
    base = {k: math.nan for k in ("estimate", "ci_lo", "ci_hi", "p", "p_holm", "effect_size", "mde", "margin",
                                  "manipulation_effect", "manipulation_ci_lo", "manipulation_ci_hi")}
    base.update({k: v for k, v in vals.items() if k in base})
    return {"hypothesis": h, "optimizer": OPTIMIZERS[0],   # hypothesis_tests sets the runs' own
            "test": test, "outcome": outcome, "term": term, **base, "n": n, "status": status,
            "verdict": "", "_fails": list(fails), "_words": words, "_family": family, "_power": power}


def _verdicts(rows: list[dict], alpha: float) -> pd.DataFrame:
    """Holm–Bonferroni over the family: the tests that ran and passed their validity gates (a test that failed
    one, did not run or is a sensitivity row is outside it, in_family False). A family member's verdict follows
    its Holm-adjusted decision and a null states its mde; a test that failed a gate reads 'inconclusive: <gates>'
    whatever its p; a sensitivity row's words follow its own p."""
    for r in rows:   # a test that ran but has no p (a degenerate fit) cannot carry a verdict either
        if r["status"] == "run" and not np.isfinite(r["p"]):
            r["_fails"].append(("degenerate test", "p undefined"))
    fam = np.array([r["status"] == "run" and not r["_fails"] and r["_family"] for r in rows], bool)
    df = pd.DataFrame(rows)
    df["in_family"] = fam
    df["p_holm"] = stats.holm(np.where(fam, df.p.to_numpy(float), np.nan))
    gates = [gate_columns(r["_fails"]) for r in rows]
    for k in gates[0] if gates else ():
        df[k] = [g[k] for g in gates]
    df["gates_passed"] &= df.status == "run"
    verdicts = []
    for i, (r, p) in enumerate(zip(rows, df.p_holm)):
        if r["status"] != "run":
            verdicts.append("")
        elif r["_fails"]:
            verdicts.append(f"inconclusive: {gates[i]['gate_failures']}")
        else:
            p, which = (p, "Holm p") if fam[i] else (r["p"], "sensitivity, not in the Holm family: p")
            sig = bool(np.isfinite(p) and p < alpha)
            power = f"{r['_power'].format(mde=r['mde'])}; " if not sig and np.isfinite(r["mde"]) else ""
            verdicts.append(f"{r['_words'][0] if sig else r['_words'][1]} ({power}{which} = {p:.3g})")
    df["verdict"] = verdicts
    return df[TESTS_SCHEMA.names]


def _direction(est: float, up: str, down: str) -> str:
    return up if est > 0 else down


def _paired(a: pd.DataFrame, b: pd.DataFrame, on=("M", "seed")) -> pd.DataFrame:
    """Rows of `a` and `b` matched on `on`, columns suffixed _a and _b."""
    return a.merge(b, on=list(on), suffixes=("_a", "_b"))
