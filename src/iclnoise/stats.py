"""Statistics for H1–H4 (SPEC §11): thresholds, mixed models, paired and equivalence tests, Holm.

Every test returns a row with an effect size, its confidence interval, a p-value and a verdict
in words, so tables never report p-values alone.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import optimize, stats

from .tasks import M_INF


def logistic(x: np.ndarray, x0: float, s: float) -> np.ndarray:
    """r(x) = 1 / (1 + exp(−(x − x0) / s)), x = log2 M: bounded in [0, 1], monotone, r(x0) = 1/2."""
    return 1.0 / (1.0 + np.exp(-(x - x0) / s))


def fit_threshold(M: np.ndarray, r: np.ndarray) -> dict:
    """Least-squares logistic fit of ridge-likeness against log2 M (finite M only); M* = 2^x0.

    Two parameters (location, scale) with asymptotes fixed at 0 (dMMSE-like) and 1 (ridge-like)
    because r is a ratio in [0, 1] and SPEC §11 defines M* at r = 0.5; monotone by construction.
    `in_range` is False when the crossing lies outside the sampled M (an extrapolation).
    """
    M, r = np.asarray(M, float), np.asarray(r, float)
    keep = (M != M_INF) & np.isfinite(r)
    x, y = np.log2(M[keep]), r[keep]
    if len(np.unique(x)) < 3:
        return {"M_star": math.nan, "log2_M_star": math.nan, "scale": math.nan, "in_range": False, "n": int(keep.sum())}
    p0 = (float(np.interp(0.5, np.sort(y), x[np.argsort(y)])) if y.min() < 0.5 < y.max() else float(np.median(x)), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            (x0, s), _ = optimize.curve_fit(logistic, x, y, p0=p0, bounds=([x.min() - 10, 0.05], [x.max() + 10, 20]))
        except (RuntimeError, ValueError):
            return {"M_star": math.nan, "log2_M_star": math.nan, "scale": math.nan, "in_range": False, "n": len(x)}
    return {"M_star": float(2 ** x0), "log2_M_star": float(x0), "scale": float(s),
            "in_range": bool(x.min() <= x0 <= x.max()), "n": len(x)}


def threshold_with_ci(df: pd.DataFrame, n_boot: int = 200, seed: int = 0, level: float = 0.95) -> dict:
    """M* from all runs of one condition and a percentile bootstrap CI resampling seeds."""
    est = fit_threshold(df.M.to_numpy(), df.r.to_numpy())
    rng = np.random.default_rng(seed)
    seeds = df.seed.unique()
    boots = []
    for _ in range(n_boot):
        pick = rng.choice(seeds, len(seeds), replace=True)
        b = pd.concat([df[df.seed == s] for s in pick])
        v = fit_threshold(b.M.to_numpy(), b.r.to_numpy())["log2_M_star"]
        if np.isfinite(v):
            boots.append(v)
    a = (1 - level) / 2
    lo, hi = (np.quantile(boots, [a, 1 - a]) if len(boots) >= 10 else (math.nan, math.nan))
    return {**est, "M_star_lo": float(2 ** lo), "M_star_hi": float(2 ** hi), "n_boot_ok": len(boots),
            "n_seeds": len(seeds)}


def transient_ridge_window(metrics: pd.DataFrame, rel_tol: float = 0.05) -> dict:
    """t_crit = step of minimal OOD loss (step > 0); departure = first later checkpoint whose OOD
    loss exceeds the minimum by more than `rel_tol` × (initial − minimal OOD loss); the window is
    departure − t_crit (NaN when the loss never departs: no transient)."""
    m = metrics.sort_values("step")
    m = m[m.step > 0]
    i = int(m.ood_loss.to_numpy().argmin())
    steps, loss = m.step.to_numpy(), m.ood_loss.to_numpy()
    depth = metrics.sort_values("step").ood_loss.iloc[0] - loss[i]
    later = np.nonzero(loss[i:] > loss[i] + rel_tol * max(depth, 1e-12))[0]
    dep = int(steps[i + later[0]]) if len(later) else None
    return {"t_crit": int(steps[i]), "departure": dep if dep is not None else -1,
            "window": float(dep - steps[i]) if dep is not None else math.nan}


def _fit_mixed(df: pd.DataFrame, formula: str, group: str, reml: bool):
    """MixedLM fit with L-BFGS; Powell only if that did not converge to a finite likelihood."""
    import statsmodels.formula.api as smf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = smf.mixedlm(formula, df, groups=df[group])
        res = model.fit(reml=reml)
        if not (res.converged and np.isfinite(res.llf)):
            res = model.fit(reml=reml, method="powell")
    return res


def mixed_model(df: pd.DataFrame, formula: str, group: str = "seed", alpha: float = 0.05,
                reml: bool = True) -> pd.DataFrame:
    """statsmodels MixedLM with a random intercept per `group`; coefficients with SE, CI, p and
    a standardized effect (coefficient × sd(predictor) / sd(outcome))."""
    res = _fit_mixed(df, formula, group, reml)
    ci = res.conf_int(alpha)
    y = formula.split("~")[0].strip()
    rows = []
    for term in res.fe_params.index:
        sd_x = df[term].std() if term in df else math.nan
        rows.append({"term": term, "estimate": res.fe_params[term], "se": res.bse_fe[term],
                     "ci_lo": ci.loc[term, 0], "ci_hi": ci.loc[term, 1], "p": res.pvalues[term],
                     "std_effect": res.fe_params[term] * sd_x / df[y].std() if term != "Intercept" else math.nan})
    out = pd.DataFrame(rows)
    out.attrs.update(llf=res.llf, aic=getattr(res, "aic", math.nan), converged=res.converged)
    return out


def compare_models(df: pd.DataFrame, full: str, reduced: str, group: str = "seed") -> dict:
    """Likelihood-ratio test (ML fits) and AIC of nested mixed models: does `full` explain variance
    that `reduced` does not?"""
    f, r = _fit_mixed(df, full, group, False), _fit_mixed(df, reduced, group, False)
    k = len(f.fe_params) - len(r.fe_params)
    lr = max(0.0, 2 * (f.llf - r.llf))
    aic_f, aic_r = -2 * f.llf + 2 * (len(f.fe_params) + 2), -2 * r.llf + 2 * (len(r.fe_params) + 2)
    return {"lr_stat": lr, "df": k, "p": float(stats.chi2.sf(lr, k)) if k > 0 else math.nan,
            "aic_full": aic_f, "aic_reduced": aic_r, "delta_aic": aic_f - aic_r}


def paired_test(a: np.ndarray, b: np.ndarray, alpha: float = 0.05) -> dict:
    """Paired t-test of a − b (e.g. late − early, paired by seed): mean difference, its CI,
    Cohen's d_z and the Wilcoxon signed-rank p as a robustness check."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    mean, sd = d.mean(), d.std(ddof=1) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    t = stats.t.ppf(1 - alpha / 2, n - 1) if n > 1 else math.nan
    p = stats.ttest_1samp(d, 0.0).pvalue if n > 1 else math.nan
    w = stats.wilcoxon(d).pvalue if n > 1 and np.any(d != 0) else math.nan
    return {"estimate": mean, "ci_lo": mean - t * se, "ci_hi": mean + t * se, "p": float(p),
            "effect_size": mean / sd if sd and sd > 0 else math.nan, "p_wilcoxon": float(w), "n": n}


def tost(a: np.ndarray, b: np.ndarray, margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided Welch tests for |mean(a) − mean(b)| < margin. Equivalence is declared when
    both one-sided p < alpha, i.e. the (1 − 2α) CI of the difference lies inside ±margin."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a.mean() - b.mean()
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se > 0 else len(a) + len(b) - 2
    p_lower = stats.t.sf((diff + margin) / se, dof) if se > 0 else float(diff <= -margin)
    p_upper = stats.t.cdf((diff - margin) / se, dof) if se > 0 else float(diff >= margin)
    tq = stats.t.ppf(1 - alpha, dof)
    p = max(p_lower, p_upper)
    pooled = math.sqrt((a.var(ddof=1) + b.var(ddof=1)) / 2)
    return {"estimate": diff, "ci_lo": diff - tq * se, "ci_hi": diff + tq * se, "p_lower": float(p_lower),
            "p_upper": float(p_upper), "p": float(p), "equivalent": bool(p < alpha), "margin": margin,
            "effect_size": diff / pooled if pooled > 0 else math.nan}


def paired_tost(a: np.ndarray, b: np.ndarray, margin: float, alpha: float = 0.05) -> dict:
    """TOST on paired differences d = a − b (e.g. matched by M and seed): equivalence is declared when
    both one-sided paired t-tests reject, i.e. the (1 − 2α) CI of mean(d) lies inside ±margin.
    Effect size: Cohen's d_z = mean(d) / sd(d)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    mean, sd = float(d.mean()), float(d.std(ddof=1)) if n > 1 else math.nan
    se, dof = sd / math.sqrt(n) if n > 1 else math.nan, n - 1
    if not se > 0:
        p_lower, p_upper = float(mean <= -margin), float(mean >= margin)
        lo = hi = mean
    else:
        p_lower, p_upper = float(stats.t.sf((mean + margin) / se, dof)), float(stats.t.cdf((mean - margin) / se, dof))
        tq = stats.t.ppf(1 - alpha, dof)
        lo, hi = mean - tq * se, mean + tq * se
    p = max(p_lower, p_upper)
    return {"estimate": mean, "ci_lo": lo, "ci_hi": hi, "p_lower": p_lower, "p_upper": p_upper, "p": p,
            "equivalent": bool(p < alpha), "margin": margin, "effect_size": mean / sd if sd and sd > 0 else math.nan,
            "n": n}


def correlation(x: np.ndarray, y: np.ndarray, alpha: float = 0.05) -> dict:
    """Spearman ρ with a Fisher-z CI (SE 1.03/√(n−3), Fieller et al.), and Pearson r with its CI."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = len(x)
    if n < 4:
        return {"estimate": math.nan, "ci_lo": math.nan, "ci_hi": math.nan, "p": math.nan, "pearson": math.nan, "n": n}
    rho, p = stats.spearmanr(x, y)
    z, zq = np.arctanh(np.clip(rho, -0.999999, 0.999999)), stats.norm.ppf(1 - alpha / 2)
    se = 1.03 / math.sqrt(n - 3)
    pr = stats.pearsonr(x, y)
    return {"estimate": float(rho), "ci_lo": float(np.tanh(z - zq * se)), "ci_hi": float(np.tanh(z + zq * se)),
            "p": float(p), "pearson": float(pr.statistic), "n": n}


def holm(pvalues) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (NaN entries are left out of the family and stay NaN)."""
    p = np.asarray(pvalues, float)
    out = np.full_like(p, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = len(idx)
    order = idx[np.argsort(p[idx])]
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out
