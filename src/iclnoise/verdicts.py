"""Validity gates and verdicts of the hypothesis tests H1–H5 (SPEC §11, §13; issues 13, 42 and 45).

Every verdict carries validity gates (GATES): convergence of the M = ∞ runs to ridge, enough seeds, equal
data (H3 at matched steps: equal steps) and equal realised exposure between compared arms, LLC diagnostics, and
for H3 a noise manipulation with a measurable effect. A failed gate is a record (code, detail) in the table's
`gate_records` (and `gate_failures` reads them as 'code (detail); ...'); a verdict that fails a gate reads
'inconclusive: <gates>'. The Holm family is the tests that ran and passed their gates (`in_family`; sensitivity
rows stay out); each verdict follows its Holm-adjusted decision, with direction words only for significant
effects, and a null states the minimum detectable effect at 80 % power of its design (`mde`).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
from scipy import stats as sps

from . import dose, stats
from .geometry import GEOMETRY_COLUMNS
from .mech import CIRCUIT_COLUMNS
from .sections import OPTIMIZERS, Stats
from .tasks import M_INF
from .thresholds import threshold_with_ci

GATE_RECORD = pa.struct([pa.field("code", pa.string()), pa.field("detail", pa.string())])
GATE_FIELDS = [pa.field("gates_passed", pa.bool_()), pa.field("gate_failures", pa.string()),
               pa.field("gate_records", pa.list_(GATE_RECORD))]
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
CONDITION = ["batch", "noise", "optimizer"]   # a condition: its runs differ in M and seed only (SPEC §13)
CONVERGENCE_SCHEMA = pa.schema([
    pa.field("batch", pa.int64()), pa.field("noise", pa.string()), pa.field("optimizer", pa.string()),
    pa.field("n_inf_runs", pa.int64()),
    pa.field("ood_loss_over_ridge", pa.float64()), pa.field("converged", pa.bool_()),
])
# Validity gates (issue 13): thresholds every verdict must pass before it may read as a finding.
GATES = {
    "convergence_tol": 0.15,   # every M = ∞ run ends with OOD loss ≤ (1 + tol) × ridge's
    "min_seeds": 3,            # fewer seeds: no interval, no verdict ("insufficient seeds")
    "r_low": 0.25,             # r must span low (some M with seed-mean r ≤ r_low) ...
    "r_high": 0.75,            # ... to high (some M with seed-mean r ≥ r_high) for a threshold to be a transition
    "data_tol": 0.01,          # compared arms saw the same number of sequences within 1 %
    "exposure_tol": 0.10,      # H2: early and late realised injected exposure within 10 %
    "h3_exposure_tol": 0.25,   # H3: the arms' seed-mean realised integrated P-NE* within 25 % (the emulation is
                               # open loop: low-rank + diagonal covariance, each arm under its own preconditioner)
    "llc_flagged_max": 0.25,   # LLC verdicts: at most 25 % of the tested (final) estimates not levelled / negative /
                               # diverged; estimates at initialisation (no minimum there) do not enter
    "regime_tol": 0.10,        # dose–response (issue 43): a dose is in the operating regime where M = ∞ ends with OOD
                               # loss ≤ (1 + tol) × ridge's ...
    "dose_tol": 0.05,          # ... and its realised dose is within 5 % of the target (else saturated / off target)
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
    """Per (batch, noise, optimizer) condition: the worst M = ∞ run's final OOD loss over ridge's (diverged runs
    count as ∞); converged when it is ≤ 1 + tol (issue 13: the transformer must reach the Bayes predictor for q∞)."""
    rows = []
    for (B, noise, opt), g in out.groupby(CONDITION):
        inf = g[g.M == M_INF]
        ratio = np.array(inf.ood_loss / inf.ood_loss_ridge, dtype=float)
        ratio[inf.diverged.to_numpy(bool) | inf.ood_loss.isna().to_numpy()] = np.inf
        worst = float(np.nanmax(ratio)) if np.isfinite(ratio).any() or np.isinf(ratio).any() else math.nan
        rows.append({"batch": B, "noise": noise, "optimizer": opt, "n_inf_runs": len(inf), "ood_loss_over_ridge": worst,
                     "converged": bool(worst <= 1 + tol)})
    return pd.DataFrame(rows, columns=CONVERGENCE_SCHEMA.names)


def gate_convergence(runs: pd.DataFrame, conv: pd.DataFrame) -> list[Fail]:
    """A condition converged when its M = ∞ runs did. A condition run at some M only (noise.conditions.<c>.M,
    e.g. an early/late pair at one M) has no M = ∞ run of its own: the batch-noise runs at its batch size, the
    same model, data, budget and optimizer without injection, stand for it."""
    c = conv.set_index(CONDITION)
    bad = []
    for key in sorted({(int(b), n, o) for b, n, o in zip(runs.batch, runs.noise, runs.optimizer)}):
        row = c.loc[key] if key in c.index else None
        if row is None or not row.n_inf_runs:
            ref = (key[0], "none", key[2])
            row = c.loc[ref] if ref in c.index and c.loc[ref].n_inf_runs else None
            if row is None:
                bad.append(f"{condition_name(*key)}: no M = ∞ run, nor batch-noise M = ∞ runs at batch {key[0]}")
            elif not row.converged:
                bad.append(f"{condition_name(*key)}: no M = ∞ run; batch noise's at batch {key[0]} "
                           f"{row.ood_loss_over_ridge:.2f}× ridge's")
        elif not row.converged:
            bad.append(f"{condition_name(*key)}: M = ∞ OOD loss {row.ood_loss_over_ridge:.2f}× ridge's")
    return [("unconverged", ", ".join(bad))] if bad else []


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
    """H3 (SPEC §1): the two arms' realised exposure, seed-mean integrated P-NE*, within a factor 1 + tol."""
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
    """SPEC §7 (issue 44): at most `max_share` of the final LLC estimates unstable (stability ratio > 1) or escaped
    (the chains left w*'s neighbourhood), counted apart from _gate_llc's flags; runs whose llc.parquet predates
    the flags (null) do not enter."""
    if "llc_final_sampler" not in runs:
        return []
    flags = runs.llc_final_sampler.dropna().astype(bool)
    n, k = len(flags), int(flags.sum())
    return [("LLC measures the sampler", f"{k} of {n} final estimates unstable / escaped")] \
        if n and k / n > max_share else []


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


def hypothesis_tests(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame | None = None) -> pd.DataFrame:
    """H1–H5 on each optimizer's runs apart (grid.optimizer, SPEC §13: runs under another optimizer are another
    arm, so no test pools them; rows carry their optimizer), with one Holm family over all of them."""
    conv = convergence(out, GATES["convergence_tol"]) if conv is None else conv
    groups = list(out.groupby("optimizer")) or [(OPTIMIZERS[0], out)]
    return _verdicts([{**r, "optimizer": opt} for opt, o in groups for r in _tests(o, cfg, conv)], cfg.alpha)


def _tests(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame) -> list[dict]:
    """The rows of H1–H5 on `out`, runs of one optimizer, before Holm (_verdicts)."""
    alpha = cfg.alpha
    gates = GATES
    every = out[(out.M != M_INF) & ~out.diverged].copy()
    every["log2M"] = np.log2(every.M)
    # H1, H2 and H4 compare runs at the sequence budget; an arm that trains another batch's steps
    # (steps_as_batch) sees more sequences and enters H3 only
    fin = every[every.steps_as_batch.fillna(0) == 0].copy()

    def common(runs, strata=None):
        return (gate_convergence(runs, conv) + gate_seeds(runs, gates["min_seeds"])
                + gate_equal_data(runs, gates["data_tol"], strata))

    exposure = "integrated_pne" if fin.integrated_pne.notna().all() and len(fin) else "integrated_lr_over_b"
    fin["log_exposure"] = np.log(fin[exposure])
    rows = h1_exposure(fin[fin.noise_source == "batch"], exposure, alpha, common)
    rows += h1_batch_pairs(fin, alpha, common)
    rows.append(h1_noise_beyond_eta_b(fin, common))
    rows += h2_early_late(fin, alpha, gates, common)
    rows += h3_rows(every, fin, cfg, conv)
    rows += h1_dose(out, cfg)   # nothing without a dose series in the grid
    rows += h5_alignment(fin, cfg, common)   # nothing without an aligned (nap) condition in the grid
    # H4: geometry, LLC and in-context circuitry (mech.run_summary) against exposure
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


def h1_exposure(plain: pd.DataFrame, exposure: str, alpha: float, common) -> list[dict]:
    """H1 (association): outcomes against measured exposure at matched loss, M a factor (C(M): no shape imposed
    on r against M), random intercept per seed, on the runs without injected noise (the plain runs: injected
    arms are H2's and H3's manipulations, not exposure levels). Measured exposure also tracks the phase the model
    is in, so the rows are worded as associations. A sensitivity row (outside the Holm family) repeats the r fit
    without M = 1, where r sits at its floor whatever the noise."""
    rows = []
    for outcome, drop_m1 in (("r", False), ("ood_loss", False), ("r", True)):
        d = plain[plain.M != 1] if drop_m1 else plain
        covars = " + ".join(c for c, v in (("C(M)", "M"), ("id_loss", "id_loss")) if d[v].nunique() > 1)
        formula = f"{outcome} ~ log_exposure" + (f" + {covars}" if covars else "")
        shown = formula.replace("log_exposure", f"log({exposure})")
        name = f"{'sensitivity, M ≥ 2: ' if drop_m1 else ''}MixedLM {shown} + (1|seed), plain runs (no injection)"
        if drop_m1 and len(d) == len(plain):
            rows.append(_row("H1", name, outcome, status="not run: no M = 1 runs to leave out"))
            continue
        if d.log_exposure.nunique() < 2 or d.seed.nunique() < 2:
            rows.append(_row("H1", name, outcome, status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds"))
            continue
        try:
            e = stats.mixed_model(d, formula, alpha=alpha).set_index("term").loc["log_exposure"]
        except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
            rows.append(_row("H1", name, outcome, status=f"not run: fit failed ({type(err).__name__})"))
            continue
        rows.append(_row("H1", name, outcome, f"log {exposure}", n=len(d), estimate=e.estimate, ci_lo=e.ci_lo,
                         ci_hi=e.ci_hi, p=e.p, effect_size=e.std_effect, mde=e.mde, fails=common(d),
                         family=not drop_m1,
                         words=(f"{outcome} {_direction(e.estimate, 'increases', 'decreases')} with measured "
                                f"exposure (association)", f"no evidence that {outcome} changes with exposure")))
    return rows


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
    return rows


def batch_effect(plain: pd.DataFrame, b1: int, b2: int, alpha: float, keys=None) -> dict | None:
    """Paired t of r at batch b1 − batch b2 over the plain runs' common (M, seed) (restricted to `keys` when given);
    None with fewer than 2 pairs."""
    p = _paired(plain[plain.batch == b1], plain[plain.batch == b2])
    if keys is not None:
        p = p[p.set_index(["M", "seed"]).index.isin(keys)]
    return stats.paired_test(p.r_a.to_numpy(), p.r_b.to_numpy(), alpha) if len(p) >= 2 else None


def h3_rows(every: pd.DataFrame, fin: pd.DataFrame, cfg: Stats, conv: pd.DataFrame) -> list[dict]:
    """H3: batch noise at batch b vs injected noise emulating b at a larger batch B: TOST on the differences paired
    by (M, seed), so the spread across M does not enter the error. SPEC §1 asks for matched exposure trajectories:
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


def h1_noise_beyond_eta_b(fin: pd.DataFrame, common=None) -> dict:
    """H1, causal form: does the manipulated noise condition change r beyond the η/B noise temperature?

    LR test (stats.manipulation_lr_test) of r ~ C(η/B level) + C(M) + C(noise) against r ~ C(η/B level) + C(M),
    random intercept per seed: the treatment is what was manipulated (batch size enters through η/B; injected
    noise and its schedule through the condition), so arms are compared at equal η/B and M. Measured P-NE is
    not a regressor: it tracks the phase, and on planted data where log P-NE = log(η/B) + 0.5·phase with no
    effect of noise on r, the old 'P-NE beyond η/B' test rejected 60 of 60 panels; this one rejects at about
    the nominal rate (tests/test_aggregate.py)."""
    name = "LR test: noise condition beyond η/B"
    if fin.seed.nunique() < 2 or fin.noise.nunique() < 2:
        return _row("H1", name, "r", status="not run: needs ≥ 2 seeds and ≥ 2 noise conditions")
    d = fin.assign(eta_b=np.round(np.log(fin.integrated_lr_over_b), 6))
    try:
        res = stats.manipulation_lr_test(d, "r", "C(noise)", "C(eta_b):C(M)")
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", name, "r", status=f"not run: fit failed ({type(err).__name__})")
    if not res["df"]:
        return _row("H1", name, "r", status="not run: no two noise conditions share an η/B level")
    fails = common(d, ["eta_b"]) if common else []
    return _row("H1", name, "r", f"C(noise) | η/B, M ({res['df']} df)", n=res["n"], estimate=res["lr_stat"],
                p=res["p"], effect_size=res["delta_aic"], mde=res["mde"], fails=fails,
                power="could detect a condition shifting r by ≥ {mde:.2g}",
                words=("the noise condition changes r beyond η/B", "no evidence that noise changes r beyond η/B"))


def h2_early_late(fin: pd.DataFrame, alpha: float, gates: dict, common=None) -> list[dict]:
    """H2: late − early ridge-likeness, two-sided, paired by (seed, M, batch) and then averaged within seed: the
    paired t runs over seeds (the unit: an effect that differs between seeds makes a paired t over (M, seed) pairs
    anticonservative, 0.285 of planted nulls rejected at α = 0.05 in tests/test_h5.py's design). Where a seed has
    more than one (M, batch) pair, the paired t over the pairs is a sensitivity row beside it (outside the Holm
    family). Valid only when the two arms' realised injected exposure (integrated_pne_injected, after clipping)
    agrees within gates['exposure_tol']. The arms are the conditions (by name) with schedule early and late: one
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


def h1_dose(out: pd.DataFrame, cfg: Stats) -> list[dict]:
    """H1 as a dose–response (SPEC §11; issue 43), per dose series (iclnoise.dose: one injected source at ≥ 2
    positive doses, dose 0 = batch noise alone at its batch), over the positive doses inside the operating regime
    (dose.regime: M = ∞ converges within GATES['regime_tol'], realised dose within GATES['dose_tol'] of target, no
    run diverged; the doses left out are named in the test):
    - the slope of r per decade of dose at fixed M (dose.r_slope; M the ladder's, run at every dose) — Holm family;
    - the slope of log2 M* (r50; midpoint as a sensitivity row) per decade (dose.mstar_slope) at the doses with a
      full M grid — Holm family;
    - the ladder's reading of the r slope as a log2 M* slope (dose.ladder_conversion, delta method) — derived
      from the r slope, so outside the family;
    - the contrast of the highest in-regime dose against dose 0 (paired t by (M, seed)) — Holm family;
    - log2 M* at the highest in-regime dose with a full M grid against dose 0's (paired t by seed; the CPU plan's
      direct check of the ladder) — Holm family (r50; midpoint a sensitivity row);
    - monotonicity: isotonic against linear in log dose (dose.monotonicity, parametric bootstrap) — a shape check,
      outside the family;
    - the exposure association, secondary: r against the runs' measured log integrated P-NE* (batch noise and
      injected, after clipping) on the same runs and dose 0's — outside the family (measured exposure tracks the
      phase; the dose is the manipulation).
    Gates: seeds, equal data, dose 0 inside the regime. No rows at all when the grid has no dose series."""
    rows = []
    for (src, shape, batch, _), g in dose.series(dose.dose_runs(out, GATES["regime_tol"])):
        res = dose.analyse(g, cfg.alpha, GATES["dose_tol"], GATES["min_seeds"])
        name = f"{src} ({shape}), batch {batch}"
        left = "; ".join(f"{d:.3g}: {w}" for d, w in zip(res["left_out"].target_dose, res["left_out"].regime))
        where = f"doses {', '.join(f'{d:.3g}' for d in res['doses'])}" + (f" (left out: {left})" if left else "")
        used = out[out.run_id.isin(g.run_id[g.target_dose.isin([0.0, *res["doses"]]) & (g.M != M_INF)])]
        zero = res["levels"][res["levels"].target_dose == 0]
        fails = gate_seeds(used, GATES["min_seeds"]) + gate_equal_data(used, GATES["data_tol"])
        if not len(zero) or not zero.in_regime.iloc[0]:
            fails.append(("unconverged", f"{name} dose 0: " + (zero.regime.iloc[0] if len(zero) else "no runs")))
        at = {"name": name, "src": src, "where": where, "m_at": ", ".join(map(str, res["ladder"])) or "none",
              "fails": fails, "alpha": cfg.alpha}
        rows += [_dose_r_row(res, at), *_dose_mstar_rows(res, at), _dose_ladder_row(res, at), _dose_zero_row(res, at),
                 _dose_exposure_row(out[out.run_id.isin(res["fit"].run_id) | out.run_id.isin(
                     g.run_id[(g.target_dose == 0) & g.M.isin(res["ladder"])])], name, cfg.alpha, fails),
                 _dose_shape_row(res, at)]
    return rows


DECADE = "per decade of dose"


def _dose_r_row(res: dict, at: dict) -> dict:
    """The slope of r per decade of dose at the ladder's M (dose.r_slope)."""
    test = f"dose-response {at['name']}: MixedLM r ~ log10(dose) + C(M) + (1|seed), M ∈ {{{at['m_at']}}}, {at['where']}"
    if res["r"] is None:
        why = (f"fit failed ({res['failed']['r']})" if "r" in res["failed"] else
               f"needs ≥ 2 positive doses inside the operating regime and ≥ 2 seeds ({at['where']})")
        return _row("H1", test, "r", status=f"not run: {why}")
    e = res["r"]
    return _row("H1", test, "r", "log10 dose", n=len(res["fit"]), estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi,
                p=e.p, effect_size=e.std_effect, mde=e.mde, fails=at["fails"],
                power="could detect a slope of ≥ {mde:.2g} in r " + DECADE,
                words=(f"r {_direction(e.estimate, 'increases', 'decreases')} with the {at['src']} dose",
                       f"no evidence that r changes with the {at['src']} dose"))


def _dose_mstar_rows(res: dict, at: dict) -> list[dict]:
    """Per threshold definition (r50 in the family, midpoint a sensitivity row): the slope of log2 M* per decade
    (dose.mstar_slope) and log2 M* at the highest full-grid dose − dose 0 (paired t by seed)."""
    rows, src = [], at["src"]
    for point in ("r50", "midpoint"):
        fam = point == "r50"
        test = (f"dose-response {at['name']}: slope of log2 M* ({point}) on log10(dose), per seed, t over seeds, "
                f"{at['where']}")
        if point in res["mstar"]:
            e, k = res["mstar"][point]
            rows.append(_row("H1", test, "log2 M*", "log10 dose", n=k, estimate=e.estimate, ci_lo=e.ci_lo,
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


def _dose_ladder_row(res: dict, at: dict) -> dict:
    """The threshold ladder's reading of r's slope as log2 M* per decade (dose.ladder_conversion): derived from
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
    """Isotonic against linear in log dose (dose.monotonicity): a shape check, outside the family."""
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
    """The dose series' secondary row: MixedLM r ~ log integrated P-NE* (+ C(M)) + (1|seed) over `used`, outside
    the Holm family (an association: measured exposure also tracks the phase)."""
    test = f"dose-response {name}: association, MixedLM r ~ log(integrated P-NE*) + C(M) + (1|seed) (secondary)"
    d = used[used.integrated_pne.astype(float) > 0]
    d = d.assign(log_exposure=np.log(d.integrated_pne.astype(float)))
    if d.log_exposure.nunique() < 2 or d.seed.nunique() < 2:
        return _row("H1", test, "r", family=False, status="not run: needs ≥ 2 exposure levels and ≥ 2 seeds")
    try:
        e = stats.mixed_model(d, "r ~ log_exposure" + (" + C(M)" if d.M.nunique() > 1 else ""), alpha=alpha
                              ).set_index("term").loc["log_exposure"]
    except Exception as err:  # noqa: BLE001 — a singular design is a result to report, not a crash
        return _row("H1", test, "r", family=False, status=f"not run: fit failed ({type(err).__name__})")
    return _row("H1", test, "r", "log integrated P-NE*", n=len(d), estimate=e.estimate, ci_lo=e.ci_lo, ci_hi=e.ci_hi,
                p=e.p, effect_size=e.std_effect, mde=e.mde, fails=fails, family=False,
                words=(f"r {_direction(e.estimate, 'increases', 'decreases')} with measured exposure (association)",
                       "no evidence that r changes with measured exposure"))



ALIGNED = "nap"   # H5's treatment: the injected noise shaped by the task family (noise.conditions.<c>.shape)
SHAPE_CONTROLS = {"nap_misaligned": "misaligned", "nap_isotropic": "isotropic", "nap_within_task": "within-task"}


def h5_alignment(fin: pd.DataFrame, cfg: Stats, common) -> list[dict]:
    """H5 (SPEC §13; issue 45): at equal realised injected exposure, does noise aligned with the task family (shape
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
    - r by (M, seed): paired t over the pairs, as SPEC §13 words it — a sensitivity row (exact only when the
      effect is the same in every seed);
    - log2 M* read from r (dose.ladder_conversion): shift = −(mean difference) / s, s = dose.local_slope on both
      arms' runs pooled (uncorrelated with the difference when the arms' run noise is equal), t interval over
      seeds — derived from the first row, outside the family; first order in the shift, valid while the M
      bracket the threshold;
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
    fails = common(pd.concat([a, b])) if common else []
    if injected:
        e = {"aligned": dose_, label: b.integrated_pne_injected.mean()}
        if a.integrated_pne_injected.isna().any() or b.integrated_pne_injected.isna().any():
            fails.append(("realised exposure not recorded", "integrated_pne_injected"))
        elif not (min(e.values()) > 0 and max(e.values()) / min(e.values()) - 1 <= GATES["shape_exposure_tol"]):
            fails.append(("unequal exposure", ", ".join(f"{k} {v:.3g}" for k, v in e.items())))
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
    th = [threshold_with_ci(x, level=1 - alpha, min_seeds=GATES["min_seeds"], alpha=alpha) for x in (a, b)]
    seeds = sorted(set(th[0].get("log2_per_seed", {})) & set(th[1].get("log2_per_seed", {})))
    if len(seeds) < 2:
        why = "; ".join(f"{w}: {t['reason']}" for w, t in zip(("aligned", label), th) if t["reason"])
        rows.append(_row("H5", names["paired t of log2 M* (r50) by seed"], "log2 M*",
                         status=f"not run: no per-seed M* on ≥ 2 common seeds ({why})"))
        return rows
    z = stats.paired_test([th[0]["log2_per_seed"][s] for s in seeds], [th[1]["log2_per_seed"][s] for s in seeds],
                          alpha)
    rows.append(_row("H5", names["paired t of log2 M* (r50) by seed"], "log2 M*", f"aligned − {label}", **z,
                     fails=fails, power="could detect a shift of ≥ {mde:.2g} octaves of M*",
                     words=(f"M* {_direction(z['estimate'], 'higher', 'lower')} under aligned noise than {label}",
                            f"no evidence that aligned noise moves M* against {label}")))
    return rows


def _seed_means(pairs: pd.DataFrame, col: str) -> pd.DataFrame:
    """Each seed's mean over M of `col` in both arms of the matched `pairs` (columns {col}_a, {col}_b; pairs with
    a missing value left out): H5's unit of replication."""
    return pairs[["seed", f"{col}_a", f"{col}_b"]].dropna().groupby("seed").mean()


def _h5_distance_row(pairs: pd.DataFrame, col: str, what: str, label: str, where: str, fails, alpha) -> dict:
    """What H5's r difference is made of: r = Δ_dMMSE / (Δ_dMMSE + Δ_ridge) (SPEC §3) rises when the model moves
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
    in log2 M over `ms` (dose.local_slope on `both` arms' runs), t interval over seeds; gated on r rising there."""
    loc = dose.local_slope(both, ms)
    d = per.r_a - per.r_b
    n = len(d)
    if not np.isfinite(loc["s"]):
        return _row("H5", name, "log2 M*", family=False, status=f"not run: no local slope ({loc['n']} seeds)")
    c = dose.ladder_conversion(float(d.mean()), float(d.std(ddof=1) / math.sqrt(n)), loc["s"], loc["se"], alpha)
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
