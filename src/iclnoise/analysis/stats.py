"""Statistics for H1–H5 (method §11, §13): mixed models, paired and equivalence tests, correlations, Holm (the
task-diversity thresholds are in iclnoise.analysis.thresholds).

Every test returns a row with an effect size, its confidence interval, a p-value and a verdict
in words, so tables never report p-values alone.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import optimize, stats

POWER = 0.8   # the power every minimum detectable effect (mde) is stated at
GROUPS = {"cell": "(1|M:seed)", "seed": "(1|seed)"}   # a mixed model's random intercept, as the tests table names it


def with_cells(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with a `cell` column 'M:seed': runs of one cell share initialisation, data stream and task pool
    (method §11, Pairing)."""
    return df.assign(cell=df.M.astype(str) + ":" + df.seed.astype(str))


def pairing(df: pd.DataFrame) -> str:
    """The random intercept the design calls for (method §11, Pairing): 'cell' when conditions share (M, seed) cells
    (some cell holds ≥ 2 runs), else 'seed' (one run per cell: a cell intercept would be the residual)."""
    return "cell" if len(df) and df.groupby(["M", "seed"]).size().max() >= 2 else "seed"


def _fit_mixed(df: pd.DataFrame, formula: str, group: str, reml: bool):
    """MixedLM fit with L-BFGS; Powell if that did not converge to a finite likelihood."""
    import statsmodels.formula.api as smf

    df = with_cells(df) if group == "cell" and "cell" not in df else df
    return _fit_with_fallback(smf.mixedlm(formula, df, groups=df[group]), reml)


def _fit_with_fallback(model, reml: bool):
    """L-BFGS, else Powell. L-BFGS's gradient inverts X'V⁻¹X, which is singular when the group variance sits on
    its boundary (0: no seed effect) and the fit is near exact; Powell needs no gradient and reaches that optimum."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            res = model.fit(reml=reml)
            if res.converged and np.isfinite(res.llf):
                return res
        except np.linalg.LinAlgError:
            pass
        return model.fit(reml=reml, method="powell")


def mixed_model(df: pd.DataFrame, formula: str, group: str = "seed", alpha: float = 0.05,
                reml: bool = True) -> pd.DataFrame:
    """statsmodels MixedLM with a random intercept per `group` ('seed', or 'cell': per (M, seed), `pairing`);
    coefficients with SE, CI, p, a standardized effect (coefficient × sd(predictor) / sd(outcome)) and the mde
    (mde_wald on the fitted SE)."""
    res = _fit_mixed(df, formula, group, reml)
    ci = res.conf_int(alpha)
    y = formula.split("~")[0].strip()
    rows = []
    for term in res.fe_params.index:
        sd_x = df[term].std() if term in df else math.nan
        rows.append({"term": term, "estimate": res.fe_params[term], "se": res.bse_fe[term],
                     "ci_lo": ci.loc[term, 0], "ci_hi": ci.loc[term, 1], "p": res.pvalues[term],
                     "mde": mde_wald(res.bse_fe[term], alpha),
                     "std_effect": res.fe_params[term] * sd_x / df[y].std() if term != "Intercept" else math.nan})
    out = pd.DataFrame(rows)
    out.attrs.update(llf=res.llf, aic=getattr(res, "aic", math.nan), converged=res.converged)
    return out


def _independent_columns(base: np.ndarray, extra: np.ndarray, tol: float = 1e-8) -> tuple[np.ndarray, np.ndarray]:
    """Columns of `base` kept in order while they raise the rank, then the columns of `extra` that raise it further
    (an aliased treatment level, e.g. a noise condition that exists at only one η/B, carries no test)."""
    def grow(cols, cands):
        for c in cands.T:
            trial = np.column_stack(cols + [c])
            if np.linalg.matrix_rank(trial, tol=tol * max(1.0, np.abs(trial).max())) == len(cols) + 1:
                cols.append(c)
        return cols
    kept = grow([], base)
    n_base = len(kept)
    kept = grow(kept, extra)
    return np.column_stack(kept[:n_base]), np.column_stack(kept) if len(kept) > n_base else np.empty((len(base), 0))


def _fit_mixed_arrays(y: np.ndarray, X: np.ndarray, groups: np.ndarray):
    """ML MixedLM with a random intercept per group (L-BFGS, Powell if that did not converge)."""
    import statsmodels.api as sm

    return _fit_with_fallback(sm.MixedLM(y, X, groups), reml=False)


def manipulation_lr_test(df: pd.DataFrame, outcome: str, treatment: str, controls: str,
                         group: str = "seed") -> dict:
    """Likelihood-ratio test (ML MixedLM, random intercept per `group`) of a MANIPULATED treatment, e.g.
    `C(noise)`, beyond `controls`, e.g. `C(eta_b) + C(M)`: outcome ~ controls + treatment vs outcome ~ controls.

    Treatment levels aliased with the controls (a condition that exists at only one η/B level shared by no other
    condition) are dropped, so `df` counts only the contrasts the design identifies; `df = 0` means none is.
    Measured exposure never enters: it responds to the phase the model is in, so regressing on it would let a
    phase-tracking dose read as a cause (issue 17, point 9).

    mde: the smallest shift of r by one condition (the best-determined treatment contrast, SE from the full fit)
    the k-df test detects at 80 % power (mde_wald with k df)."""
    import patsy

    Xc = np.asarray(patsy.dmatrix(controls, df, return_type="dataframe"), float)
    Xt = np.asarray(patsy.dmatrix(f"0 + {treatment}", df, return_type="dataframe"), float)
    Xr, Xf = _independent_columns(Xc, Xt)
    k = Xf.shape[1] - Xr.shape[1]
    if k <= 0:
        return {"lr_stat": math.nan, "df": 0, "p": math.nan, "delta_aic": math.nan, "n": len(df), "mde": math.nan}
    y = df[outcome].to_numpy(float)
    g = (with_cells(df) if group == "cell" else df)[group].to_numpy()
    f, r = _fit_mixed_arrays(y, Xf, g), _fit_mixed_arrays(y, Xr, g)
    lr = max(0.0, 2 * (f.llf - r.llf))
    se = float(np.min(np.asarray(f.bse_fe)[-k:]))
    return {"lr_stat": lr, "df": k, "p": float(stats.chi2.sf(lr, k)), "delta_aic": -lr + 2 * k, "n": len(df),
            "mde": mde_wald(se, k=k)}


def mde_paired_t(sd: float, n: int, alpha: float = 0.05, power: float = POWER) -> float:
    """Minimum detectable effect of the two-sided paired t-test on n differences of sd `sd`: the mean δ at which
    P(|T| > t_{1−α/2, n−1}) = power, T ~ noncentral t(n − 1, δ√n/sd), both tails (statsmodels' TTestPower; the
    textbook (t_{1−α/2} + t_{power})·sd/√n is within 1 % at n ≥ 8 and 10 % low at n = 3)."""
    from statsmodels.stats.power import TTestPower

    if not (n > 1 and sd > 0):
        return math.nan
    return float(TTestPower().solve_power(nobs=n, alpha=alpha, power=power, alternative="two-sided")) * sd


def _ncp(power_at, power: float, lo: float, start: float) -> float:
    """The noncentrality at which `power_at` (increasing) reaches `power`: bracket by doubling from `start`, then
    Brent."""
    hi = start + 1.0
    while power_at(hi) < power:
        lo, hi = hi, 2 * hi
    return float(optimize.brentq(lambda x: power_at(x) - power, lo, hi))


def tost_power(c: float, n: int, alpha: float = 0.05) -> float:
    """Power of the paired TOST (level α per side) at true difference 0 with the margin c·sd/√n: both one-sided tests
    reject when |d̄| + t_{1−α, n−1}·S/√n < m, so with u = S/sd ((n − 1)u² ~ χ²_{n−1}, independent of d̄)
    P = E_u[max(0, 2Φ(c − t·u) − 1)], integrated over u (exact; no statsmodels class computes it)."""
    from scipy import integrate

    df, tc = n - 1, stats.t.ppf(1 - alpha, n - 1)
    dens = lambda u: stats.chi.pdf(u * math.sqrt(df), df) * math.sqrt(df)   # noqa: E731 — density of u
    top = c / tc
    return float(integrate.quad(lambda u: (2 * stats.norm.cdf(c - tc * u) - 1) * dens(u), 0, top, limit=200)[0])


def mde_tost(sd: float, n: int, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest equivalence margin the paired TOST (level α per side) shows with probability `power` when the
    true difference is 0 (tost_power, exact; the union bound 1 − 2·P(one side fails) it replaced overstated it by
    4.4 % at n = 3). Checked against simulation in tests/test_stats.py."""
    if not (n > 1 and sd > 0):
        return math.nan
    tc = stats.t.ppf(1 - alpha, n - 1)
    return _ncp(lambda c: tost_power(c, n, alpha), power, tc, tc) * sd / math.sqrt(n)


def mde_wald(se: float, alpha: float = 0.05, power: float = POWER, k: int = 1) -> float:
    """Minimum detectable coefficient of a Wald / likelihood-ratio test with `k` df whose one coefficient has
    standard error `se` (from the fitted variance components): δ = √λ·se, λ the noncentrality at which a
    χ²_k(λ) exceeds its level-α critical value with probability `power` (k = 1: (z_{1−α/2} + z_power)·se
    up to the far tail)."""
    if not se > 0:
        return math.nan
    crit = stats.chi2.isf(alpha, k)
    return math.sqrt(_ncp(lambda lam: stats.ncx2.sf(crit, k, lam), power, 1e-9, crit)) * se


def mde_spearman(n: int, alpha: float = 0.05, power: float = POWER) -> float:
    """Minimum detectable Spearman ρ at n points: tanh((z_{1−α/2} + z_power)·1.03/√(n − 3)) (the Fisher-z
    approximation `correlation` builds its interval on)."""
    if n < 4:
        return math.nan
    return float(np.tanh((stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)) * 1.03 / math.sqrt(n - 3)))


def paired_test(a: np.ndarray, b: np.ndarray, alpha: float = 0.05) -> dict:
    """Paired t-test of a − b (e.g. late − early, paired by seed): mean difference, its CI,
    Cohen's d_z, the Wilcoxon signed-rank p as a robustness check and the mde (mde_paired_t)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    mean, sd = d.mean(), d.std(ddof=1) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    t = stats.t.ppf(1 - alpha / 2, n - 1) if n > 1 else math.nan
    p = stats.ttest_1samp(d, 0.0).pvalue if n > 1 else math.nan
    w = stats.wilcoxon(d).pvalue if n > 1 and np.any(d != 0) else math.nan
    return {"estimate": mean, "ci_lo": mean - t * se, "ci_hi": mean + t * se, "p": float(p),
            "effect_size": mean / sd if sd and sd > 0 else math.nan, "p_wilcoxon": float(w), "n": n,
            "mde": mde_paired_t(sd, n, alpha) if n > 1 else math.nan}


def paired_effects(values: pd.DataFrame, reference: str = "self", by: tuple[str, ...] = ("counterfactual", "metric"),
                   pair: str = "realisation") -> pd.DataFrame:
    """CNR's ground truth by common random numbers (method §13): per counterfactual c and metric f,
    ΔE f = mean_i (f(c, i) − f(reference, i)) over the realisations i both have (paired: realisation i of every
    counterfactual draws the same data and noise stream), its standard error sd_i / √n (NaN at n = 1), and the
    two means. `values`: a column `value` and the columns of `by` and `pair` (further columns, e.g. run and seed,
    are kept where constant within a group)."""
    keys = [k for k in by if k != "counterfactual"]
    ref = values.loc[values.counterfactual == reference, [*keys, pair, "value"]].rename(columns={"value": "ref"})
    m = values.merge(ref, on=[*keys, pair], how="inner")   # the realisations both have
    m["d"] = m.value - m.ref
    out = m.groupby(list(by), sort=False).agg(n_realisations=("d", "size"), crn_mean=("d", "mean"), sd=("d", "std"),
                                              mean=("value", "mean"), reference_mean=("ref", "mean")).reset_index()
    out["crn_se"] = out.pop("sd") / np.sqrt(out.n_realisations)   # std is NaN at n = 1
    return out


def tost(a: np.ndarray, b: np.ndarray, margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided Welch tests for |mean(a) − mean(b)| < margin (statsmodels' ttost_ind, unequal variances).
    Equivalence is declared when both one-sided p < alpha, i.e. the (1 − 2α) CI of the difference lies inside
    ±margin."""
    from statsmodels.stats.weightstats import ttost_ind

    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a.mean() - b.mean()
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se > 0:
        p, (_, p_lower, dof), (_, p_upper, _) = ttost_ind(a, b, -margin, margin, usevar="unequal")
        tq = stats.t.ppf(1 - alpha, dof)
    else:
        p_lower, p_upper, tq = float(diff <= -margin), float(diff >= margin), 0.0
        p = max(p_lower, p_upper)
    pooled = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    return {"estimate": diff, "ci_lo": diff - tq * se, "ci_hi": diff + tq * se, "p_lower": float(p_lower),
            "p_upper": float(p_upper), "p": float(p), "equivalent": bool(p < alpha), "margin": margin,
            "effect_size": diff / pooled if pooled > 0 else math.nan}


def paired_tost(a: np.ndarray, b: np.ndarray, margin: float, alpha: float = 0.05) -> dict:
    """TOST on paired differences d = a − b (e.g. matched by M and seed; statsmodels' ttost_paired): equivalence
    is declared when both one-sided paired t-tests reject, i.e. the (1 − 2α) CI of mean(d) lies inside ±margin.
    Effect size: Cohen's d_z = mean(d) / sd(d); mde: the smallest margin this design shows (mde_tost)."""
    from statsmodels.stats.weightstats import ttost_paired

    a, b = np.asarray(a, float), np.asarray(b, float)
    d = a - b
    n = len(d)
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    if not se > 0:
        p_lower, p_upper = float(mean <= -margin), float(mean >= margin)
        lo = hi = mean
    else:
        _, (_, p_lower, _), (_, p_upper, _) = ttost_paired(a, b, -margin, margin)
        tq = stats.t.ppf(1 - alpha, n - 1)
        lo, hi = mean - tq * se, mean + tq * se
    p = max(p_lower, p_upper)
    return {"estimate": mean, "ci_lo": lo, "ci_hi": hi, "p_lower": float(p_lower), "p_upper": float(p_upper),
            "p": float(p), "equivalent": bool(p < alpha), "margin": margin,
            "effect_size": mean / sd if sd and sd > 0 else math.nan, "n": n,
            "mde": mde_tost(sd, n, alpha) if n > 1 else math.nan}


def correlation(x: np.ndarray, y: np.ndarray, alpha: float = 0.05) -> dict:
    """Spearman ρ with a Fisher-z CI (SE 1.03/√(n−3), Fieller et al.), and Pearson r with its Fisher-z CI
    tanh(atanh r ± z_{1−α/2}/√(n−3)) (the interval scipy's pearsonr(...).confidence_interval() gives); mde: the
    smallest ρ detectable at 80 % power (mde_spearman)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 4:
        return {"estimate": math.nan, "ci_lo": math.nan, "ci_hi": math.nan, "p": math.nan, "pearson": math.nan,
                "pearson_ci_lo": math.nan, "pearson_ci_hi": math.nan, "pearson_p": math.nan, "n": n, "mde": math.nan}
    rho, p = stats.spearmanr(x, y)
    zq = stats.norm.ppf(1 - alpha / 2)
    z = np.arctanh(np.clip(rho, -0.999999, 0.999999))
    se = 1.03 / math.sqrt(n - 3)
    pr = stats.pearsonr(x, y)
    zp = np.arctanh(np.clip(pr.statistic, -0.999999, 0.999999))
    sp = 1 / math.sqrt(n - 3)
    return {"estimate": float(rho), "ci_lo": float(np.tanh(z - zq * se)), "ci_hi": float(np.tanh(z + zq * se)),
            "p": float(p), "pearson": float(pr.statistic), "pearson_ci_lo": float(np.tanh(zp - zq * sp)),
            "pearson_ci_hi": float(np.tanh(zp + zq * sp)), "pearson_p": float(pr.pvalue), "n": n,
            "mde": mde_spearman(n, alpha)}


def stratified_correlation(x, y, strata, alpha: float = 0.05) -> dict:
    """Spearman ρ within strata (method §11, Within M), combined by Fisher z: z̄ = Σ_s w_s·atanh ρ_s / Σ_s w_s with
    w_s = n_s − 3, SE(z̄) = 1.03/√Σ w_s (Fieller et al.'s variance of atanh ρ_s); estimate tanh z̄, its interval
    tanh(z̄ ± z_{1−α/2}·SE), p = 2Φ(−|z̄|/SE), mde tanh((z_{1−α/2} + z_power)·SE). A stratum enters with ≥ 4 points
    and x and y not constant in it. Two quantities that both move with the stratum (M) but not with each other
    inside it give ρ̄ ≈ 0, where the pooled correlation does not."""
    d = pd.DataFrame({"x": np.asarray(x, float), "y": np.asarray(y, float), "s": np.asarray(strata)})
    d = d[np.isfinite(d.x) & np.isfinite(d.y)]
    zs, ws = [], []
    for _, h in d.groupby("s"):
        if len(h) >= 4 and h.x.nunique() > 1 and h.y.nunique() > 1:
            zs.append(np.arctanh(np.clip(stats.spearmanr(h.x, h.y).statistic, -0.999999, 0.999999)))
            ws.append(len(h) - 3)
    nan = {"estimate": math.nan, "ci_lo": math.nan, "ci_hi": math.nan, "p": math.nan, "n": 0, "strata": len(zs),
           "mde": math.nan}
    if not zs:
        return nan
    w = np.asarray(ws, float)
    z, se = float(np.dot(w, zs) / w.sum()), 1.03 / math.sqrt(w.sum())
    zq = stats.norm.ppf(1 - alpha / 2)
    return {"estimate": float(np.tanh(z)), "ci_lo": float(np.tanh(z - zq * se)), "ci_hi": float(np.tanh(z + zq * se)),
            "p": float(2 * stats.norm.sf(abs(z) / se)), "n": int(w.sum() + 3 * len(w)), "strata": len(zs),
            "mde": float(np.tanh((zq + stats.norm.ppf(POWER)) * se))}


def holm(pvalues) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (statsmodels' multipletests, method holm); NaN entries are left out of
    the family and stay NaN."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], method="holm")[1]
    return out


def _iso_rss(x: np.ndarray, y: np.ndarray, increasing: bool) -> float:
    yo = y[np.argsort(x)]
    return float(((yo - optimize.isotonic_regression(yo, increasing=increasing).x) ** 2).sum())


def monotonicity(cells: pd.DataFrame, n_sim: int = 2000, seed: int = 0) -> dict:
    """Isotonic against linear in log dose: is the response monotone but not a line in log10 dose (a step, a
    saturation)? `cells`: one row per (positive dose, seed) with columns log10_dose, seed, y (e.g. r averaged over
    the ladder's M). On the dose means ȳ_d (k ≥ 3 doses, n seeds): T = RSS_linear − RSS_isotonic, the isotonic fit
    in the direction of the linear slope; effect = T / TSS (the share of the between-dose variance the monotone fit
    gains over the line). p by a parametric bootstrap of the studentized T/σ̂² under the linear fit: ȳ*_d = line_d +
    N(0, σ̂²/n) and σ*² = σ̂²·χ²_df/df independently, σ̂² the residual variance of the additive dose + seed fit of
    the cells (df = (k − 1)(n − 1); a seed's shift common to every dose changes neither RSS);
    p = (1 + #{T*/σ*² ≥ T/σ̂²}) / (1 + n_sim). Measured (experiments/dose_coverage.py, 200 each, 5 doses, 3 seeds, run sd
    0.02): rejects a line in log dose at 0.065 (α 0.05), a step of 0.1 in r between two doses at 0.970."""
    doses = np.sort(cells.log10_dose.unique())
    k = len(doses)
    wide = cells.pivot_table(index="log10_dose", columns="seed", values="y").reindex(doses).dropna(axis=1)
    n = wide.shape[1]
    none = {"estimate": math.nan, "p": math.nan, "n": len(cells), "k": k}
    if k < 3 or n < 2:
        return none
    y = wide.to_numpy(float)
    resid = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + y.mean()
    df = (k - 1) * (n - 1)
    sigma2 = float((resid ** 2).sum() / df)
    ybar = y.mean(1)

    def stat(v):
        slope, icpt = np.polyfit(doses, v, 1)
        return float(((v - slope * doses - icpt) ** 2).sum()) - _iso_rss(doses, v, slope >= 0), slope * doses + icpt

    t, line = stat(ybar)
    tss = float(((ybar - ybar.mean()) ** 2).sum())
    if not sigma2 > 0:
        return none
    rng = np.random.default_rng(seed)
    sims = line + rng.standard_normal((n_sim, k)) * math.sqrt(sigma2 / n)
    s2 = sigma2 * rng.chisquare(df, n_sim) / df
    ts = np.array([stat(v)[0] for v in sims]) / s2
    return {"estimate": t / tss if tss > 0 else math.nan,
            "p": float((1 + (ts >= t / sigma2 - 1e-12).sum()) / (1 + n_sim)), "n": len(cells), "k": k}
