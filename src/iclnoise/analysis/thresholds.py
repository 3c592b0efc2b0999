"""Task-diversity thresholds M* (method §11) and the transient-ridge window: the r = 0.5 crossing of a logistic in
log2 M (`threshold_with_ci`) and the anchor's crossover, where the late pull on new tasks turns from dMMSE_M to
ridge (`crossover_threshold` on `pull_slopes`); both with an interval across seeds.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import optimize, stats

from ..core.runspec import M_INF


def logistic(x: np.ndarray, x0: float, s: float) -> np.ndarray:
    """r(x) = 1 / (1 + exp(−(x − x0) / s)), x = log2 M: bounded in [0, 1], monotone, r(x0) = 1/2."""
    return 1.0 / (1.0 + np.exp(-(x - x0) / s))


def logistic4(x: np.ndarray, floor: float, ceiling: float, x0: float, s: float) -> np.ndarray:
    """r(x) = floor + (ceiling − floor) · logistic(x; x0, s): a sigmoid in x = log2 M whose plateaus are free,
    because real ridge-likeness curves level off below 1 (and above 0)."""
    return floor + (ceiling - floor) * logistic(x, x0, s)


def crossing(floor: float, ceiling: float, x0: float, s: float, level: float = 0.5) -> float:
    """x at which logistic4 equals `level`: x0 + s · log((level − floor) / (ceiling − level)); NaN unless the
    curve passes through `level` (floor < level < ceiling)."""
    if not floor < level < ceiling:
        return math.nan
    return float(x0 + s * math.log((level - floor) / (ceiling - level)))


def _logistic4_jac(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    """∂ logistic4 / ∂(floor, ceiling, x0, s), one row per x."""
    f, c, x0, s = p
    g = logistic(x, x0, s)
    dg = (c - f) * g * (1 - g)
    return np.column_stack([1 - g, g, -dg / s, -dg * (x - x0) / s ** 2])


def _profile_start(x: np.ndarray, y: np.ndarray, x0s: np.ndarray, ss: np.ndarray) -> np.ndarray:
    """Best (floor, ceiling, x0, s) on a grid of (x0, s): for fixed x0, s the plateaus are a linear least-squares
    problem (y ≈ a + b·g), solved in closed form for every grid point at once."""
    X0, S = np.meshgrid(x0s, ss, indexing="ij")
    g = logistic(x[None, None, :], X0[..., None], S[..., None])
    gc, yc = g - g.mean(-1, keepdims=True), y - y.mean()
    var = (gc ** 2).sum(-1)
    cov = (gc * yc).sum(-1)
    rss = (yc ** 2).sum() - np.where(var > 1e-12, cov ** 2 / np.maximum(var, 1e-12), 0.0)
    i, j = np.unravel_index(np.argmin(rss), rss.shape)
    b = cov[i, j] / var[i, j] if var[i, j] > 1e-12 else 0.0
    a = y.mean() - b * g[i, j].mean()
    return np.array([a, a + b, X0[i, j], S[i, j]])


NO_THRESHOLD = {"M_star": math.nan, "log2_M_star": math.nan, "floor": math.nan, "ceiling": math.nan,
                "x0": math.nan, "scale": math.nan, "in_range": False, "p_rise": math.nan}


def fit_threshold(M: np.ndarray, r: np.ndarray, alpha: float | None = 0.05) -> dict:
    """Task-diversity threshold: least-squares fit of r = logistic4(log2 M) (finite M only), M* = 2^x where the
    fitted curve crosses r = 0.5 (method §11).

    Floor and ceiling are free, so a curve that plateaus at 0.6 has its crossing where the data cross, not where
    a 0-to-1 sigmoid would put its midpoint. Fitting: closed-form plateaus on a grid of (location, scale), then
    bounded least squares from the best grid point. Bounds: plateaus in [−0.5, 1.5], location within 2 octaves of
    the grid, scale from a tenth of the finest grid spacing to the whole span of the grid.

    `reason` is '' when M* exists, else why there is none (checked in this order):
    'too few M' (< 5 distinct finite M), 'fit failed', 'flat' (the fit does not beat a constant: F-test of the
    3 extra parameters, p ≥ alpha; `alpha` None: not tested, p_rise is still reported), 'no rise' (the fitted
    curve falls), 'fit at bound (<parameter>)', 'r does not cross 0.5' (both plateaus on one side), 'crossing
    outside the grid'.
    """
    M, r = np.asarray(M, float), np.asarray(r, float)
    keep = (M != M_INF) & (M > 0) & np.isfinite(r)
    x, y = np.log2(M[keep]), r[keep]
    n, ux = len(x), np.unique(x)
    out = {**NO_THRESHOLD, "n": n}
    if len(ux) < 5:
        return {**out, "reason": f"too few M ({len(ux)} distinct finite M < 5)"}
    span, step = ux[-1] - ux[0], np.diff(ux).min()
    lo = np.array([-0.5, -0.5, ux[0] - 2, 0.1 * step])
    hi = np.array([1.5, 1.5, ux[-1] + 2, span])
    res = _fit_logistic4(x, y, lo, hi)
    if res is None:
        return {**out, "reason": "fit failed"}
    f, c, x0, s = (float(v) for v in res.x)
    p_rise = _p_rise(float((res.fun ** 2).sum()), float(((y - y.mean()) ** 2).sum()), n)
    xs = crossing(f, c, x0, s)
    out.update(floor=f, ceiling=c, x0=x0, scale=s, p_rise=p_rise, log2_M_star=xs, M_star=2.0 ** xs,
               in_range=bool(ux[0] <= xs <= ux[-1]) if np.isfinite(xs) else False)
    near = np.abs(res.x - lo) < 1e-4 * (hi - lo), np.abs(res.x - hi) < 1e-4 * (hi - lo)
    at_bound = [name for name, a, b in zip(("floor", "ceiling", "location", "scale"), *near) if a or b]
    reason = _why_no_threshold(res.success, p_rise, alpha, at_bound, out)
    if reason:
        out.update(M_star=math.nan, log2_M_star=math.nan, in_range=False)
    return {**out, "reason": reason}


def _fit_logistic4(x: np.ndarray, y: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Bounded least squares of logistic4 on (x, y) from the best point of a (location, scale) grid spanning the
    bounds (`_profile_start`): scipy's OptimizeResult, None where least squares raised."""
    p0 = _profile_start(x, y, np.linspace(lo[2], hi[2], 41), np.geomspace(lo[3], hi[3], 16))
    p0 = np.clip(p0, lo + 1e-6 * (hi - lo), hi - 1e-6 * (hi - lo))
    try:
        return optimize.least_squares(lambda p: logistic4(x, *p) - y, p0, jac=lambda p: _logistic4_jac(p, x),
                                      bounds=(lo, hi), method="trf", x_scale=hi - lo)
    except (ValueError, np.linalg.LinAlgError):
        return None


def _p_rise(rss: float, tss: float, n: int) -> float:
    """p of the F-test of logistic4 (4 parameters, residual sum of squares rss) against a constant (tss) on n
    points: F = ((tss − rss) / 3) / (rss / (n − 4)) on (3, n − 4) degrees of freedom."""
    if tss <= 0:
        return 1.0
    if rss <= 1e-15 * tss:
        return 0.0
    return float(stats.f.sf((tss - rss) / 3 / (rss / (n - 4)), 3, n - 4)) if n > 4 else math.nan


def _why_no_threshold(success: bool, p_rise: float, alpha: float | None, at_bound: list[str], fit: dict) -> str:
    """fit_threshold's `reason` after a fit, '' when the fitted crossing is an M* (the order in its docstring)."""
    f, c, xs = fit["floor"], fit["ceiling"], fit["log2_M_star"]
    if not success:
        return "fit failed"
    if alpha is not None and not p_rise < alpha:
        return f"flat (no significant rise: F-test p = {p_rise:.2g})"
    if c <= f:
        return "no rise (r falls with M)"
    if at_bound:
        return f"fit at bound ({', '.join(at_bound)})"
    if not np.isfinite(xs):
        return f"r does not cross 0.5 (fitted floor {f:.2f}, ceiling {c:.2f})"
    if not fit["in_range"]:
        return f"crossing outside the grid (extrapolated M* = {2.0 ** xs:.3g})"
    return ""


def midpoint(fit: dict, grid: np.ndarray) -> dict:
    """The logistic midpoint of a fit_threshold result: M at half-way between the fitted floor and ceiling
    (log2 M = x0), which is where r = 0.5 only when floor + ceiling = 1; with the default's ceiling ≈ 0.73, r = 0.5
    lies at 69 % of the rise. Same reasons as the fit, except those about crossing r = 0.5; 'midpoint outside the
    grid' when x0 is (`grid`: the log2 M of the fit's points)."""
    reason = "" if fit["reason"].startswith(("r does not cross 0.5", "crossing outside the grid")) else fit["reason"]
    x0 = fit["x0"]
    if not reason and not (np.isfinite(x0) and grid.min() <= x0 <= grid.max()):
        reason = f"midpoint outside the grid (extrapolated M = {2.0 ** x0:.3g})"
    ok = not reason
    return {**fit, "log2_M_star": x0 if ok else math.nan, "M_star": 2.0 ** x0 if ok else math.nan, "in_range": ok,
            "reason": reason}


def threshold_with_ci(df: pd.DataFrame, level: float = 0.95, min_seeds: int = 3, alpha: float = 0.05,
                      point: str = "r50") -> dict:
    """M* of one condition with a t-interval over seeds: log2 M* is fitted per seed and the interval is
    mean ± t_{n−1} · sd / √n of those n per-seed values (M* reported as 2^mean, the geometric mean). `point`:
    'r50', where the fitted r crosses 0.5, or 'midpoint', half-way between the fitted floor and ceiling
    (`midpoint`); both from the same fits.

    Seeds differ in their own thresholds, so the seed is the unit of replication; a percentile bootstrap over
    2-10 seeds under-covers (50-84 % at nominal 95 %, issue 17). Measured coverage on planted grids with
    seed-to-seed sd 0.3 in log2 M* (tests/test_stats.py): floor 0.05, ceiling 0.6, r noise 0.03, 13 M:
    0.965 at 3 and at 5 seeds (200 grids, every grid with an interval); floor 0, ceiling 0.9, noise 0.05, 11 M:
    0.957 at 3 seeds, 0.946 at 5 (300 grids). On noisy plateaus (ceiling 0.6, noise 0.06) 14-18 % of grids get
    no interval (a per-seed fit on a bound) and the rest cover 0.95-0.965.
    No interval with fewer than `min_seeds` seeds or when a per-seed fit has no threshold; then M* is the fit to
    all runs pooled. With an interval, `log2_per_seed` maps each seed to its log2 M* (the dose–response's input).
    No M* at all when the pooled fit has none (`reason` says why).

    Whether r rises at all is decided once, by the F-test of the pooled fit (seeds × M points). The per-seed fits
    only locate each seed's crossing and keep every other check: on a 5-M grid a per-seed F-test has 3 and 1
    degrees of freedom (critical F 216 at 0.05), so it withheld intervals from curves that plainly rise
    (the default's batch 64 seeds: r 0.00 → 0.54 monotone, p 0.05-0.14)."""
    if point not in ("r50", "midpoint"):
        raise ValueError(f"threshold point {point!r}: allowed r50, midpoint")
    grid = np.log2(df.M[(df.M != M_INF) & (df.M > 0)].to_numpy(float))

    def fit(g, a):
        f = fit_threshold(g.M.to_numpy(), g.r.to_numpy(), a)
        return midpoint(f, grid) if point == "midpoint" else f
    pooled = fit(df, alpha)
    seeds = sorted(df.seed.unique())
    per = {s: fit(g, None) for s, g in df.groupby("seed")}
    failed = {s: f["reason"] for s, f in per.items() if f["reason"]}
    out = {**pooled, "M_star_lo": math.nan, "M_star_hi": math.nan, "log2_se": math.nan, "n_seeds": len(seeds),
           "n_seeds_fit": len(per) - len(failed), "interval": "pooled fit",
           "seeds_failed": " | ".join(f"seed {s}: {v}" for s, v in failed.items())}
    if pooled["reason"]:
        out["reason"] = f"no threshold: {pooled['reason']}"
        return out
    if len(seeds) < min_seeds:
        out["reason"] = f"no interval: insufficient seeds ({len(seeds)} < {min_seeds})"
        return out
    if failed:
        out["reason"] = f"no interval: per-seed fit without threshold ({out['seeds_failed']})"
        return out
    v = np.array([per[s]["log2_M_star"] for s in seeds])
    k = len(v)
    mean, se, tq = t_interval(v, level)
    return {**out, "M_star": 2.0 ** mean, "log2_M_star": mean, "M_star_lo": 2.0 ** (mean - tq * se),
            "M_star_hi": 2.0 ** (mean + tq * se), "log2_se": se, "interval": f"t-interval over {k} per-seed fits",
            "reason": "", "log2_per_seed": dict(zip(seeds, v.tolist()))}


def t_interval(v: np.ndarray, level: float) -> tuple[float, float, float]:
    """(mean, se, t) of values over seeds: se = sd / √n (ddof 1), t the two-sided `level` quantile of Student's t
    with n − 1 degrees of freedom; the interval is mean ± t · se."""
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), float(stats.t.ppf(0.5 + level / 2, len(v) - 1))


def pull_slopes(traj: pd.DataFrame, late: float = 0.5, min_points: int = 3) -> pd.DataFrame:
    """Late-training pull of each run (M, seed) toward dMMSE_M or ridge on new tasks (method §3, §11: the anchor's
    threshold). Per checkpoint, from Δ on the OOD set (q_∞):

        d = ln Δ_ood(f, ridge) − ln Δ_ood(f, dMMSE_M) = −logit r_ood,
        r_ood = Δ(f, dMMSE_M) / (Δ(f, dMMSE_M) + Δ(f, ridge))   (ridge-likeness on new tasks),

    and the pull β is the least-squares slope of d against ln S (S = sequences seen) over the late checkpoints,
    S ≥ late · S_end. β > 0: more data moves the model toward dMMSE_M; β < 0: toward ridge. The log ratio is
    unchanged when both distances shrink by a common factor (the model's own error falling), so β reads the
    direction between the two predictors, not overall progress; on new tasks they stay far apart at every finite
    M, so neither distance sits at the model's error floor.

    `traj`: one row per checkpoint with M, seed, sequences, ood_delta_dmmse, ood_delta_ridge (M = ∞ rows and
    non-positive or missing Δ are dropped). Returns M, seed, slope, n (late checkpoints used); slope NaN with
    fewer than `min_points` late checkpoints."""
    dm, dr = (pd.to_numeric(traj[c], errors="coerce") for c in ("ood_delta_dmmse", "ood_delta_ridge"))
    t = traj[(traj.M != M_INF) & (dm > 0) & (dr > 0)]   # Δ not logged (None / NaN): no row, no pull
    rows = []
    for (M, seed), g in t.groupby(["M", "seed"]):
        g = g[g.sequences >= late * g.sequences.max()]
        x = np.log(g.sequences.to_numpy(float))
        d = np.log(g.ood_delta_ridge.to_numpy(float)) - np.log(g.ood_delta_dmmse.to_numpy(float))
        xc = x - x.mean()
        ok = len(x) >= min_points and (xc ** 2).sum() > 0
        rows.append({"M": M, "seed": seed, "slope": float(xc @ (d - d.mean()) / (xc @ xc)) if ok else math.nan,
                     "n": len(x)})
    return pd.DataFrame(rows, columns=["M", "seed", "slope", "n"]).astype({"slope": float, "n": int})


def sign_change(x: np.ndarray, b: np.ndarray) -> tuple[float, str]:
    """Where a pull that should fall with x = log2 M changes sign from + to −: the decreasing isotonic
    (least-squares) fit of b on x, then linear interpolation between the last x where the fit is > 0 and the next
    one. Noise that breaks monotonicity is pooled by the fit, so there is one crossing at most. Returns (x*, '')
    or (NaN, reason): every fitted pull of one sign, i.e. the crossing is outside the grid."""
    o = np.argsort(x)
    x, b = np.asarray(x, float)[o], np.asarray(b, float)[o]
    fit = optimize.isotonic_regression(b, increasing=False).x
    pos = np.flatnonzero(fit > 0)
    if not len(pos):
        return math.nan, "pull toward ridge at every M (M* below the grid)"
    i = pos[-1]
    if i == len(x) - 1:
        return math.nan, "pull toward dMMSE_M at every M (M* above the grid)"
    return float(x[i] + (x[i + 1] - x[i]) * fit[i] / (fit[i] - fit[i + 1])), ""


# The crossing is interpolated linearly between the grid points around it, which is biased where the pull is not
# symmetric about it (shared by every seed, so it does not average out): the interval adds GAP_SHARE × the width of
# that grid gap (log2 M) in quadrature. Measured in crossover_threshold's docstring.
GAP_SHARE = 0.35
CROSSOVER_NONE = {"M_star": math.nan, "log2_M_star": math.nan, "M_star_lo": math.nan, "M_star_hi": math.nan,
                  "log2_se": math.nan, "in_range": False, "n_seeds": 0, "n_seeds_fit": 0, "p_sign": math.nan,
                  "slope_first": math.nan, "slope_last": math.nan, "interval": "seed means", "seeds_failed": ""}


def crossover_threshold(slopes: pd.DataFrame, level: float = 0.95, min_seeds: int = 3, alpha: float = 0.05,
                        min_m: int = 5) -> dict:
    """The anchor's task-diversity threshold (Raventós et al.; method §11): M* where more data stops pulling the
    model toward dMMSE_M and starts pulling it toward ridge, from the late pulls β(M, seed) of `pull_slopes`.

    Per seed, x*_s = sign_change(log2 M, β_s); M* = 2^mean over seeds and the interval in log2 M is
    mean ± √((t_{n−1} · sd / √n)² + (GAP_SHARE · gap)²), gap = the width of the grid interval holding the mean: the
    linear interpolation across a gap is biased where the pull is asymmetric, by the same amount in every seed.
    Measured (issue 42, experiments/crossover_coverage.py: asymmetric pulls, run noise growing away from x*, crossings
    inside grid gaps, 200 grids per cell): log2 M* reads +0.19 to +0.22 octave high; coverage of the nominal 95 %
    interval 0.950 (8 M, 3 seeds), 0.983 / 0.960 / 0.990 (uneven grid {1, 4, ..., 64, 256}, 3 / 4 / 6 seeds), against
    0.911, 0.932 / 0.904 / 0.879 for the t-interval alone.

    Whether the sign changes at all is decided once, on the seed-mean pulls: their crossing x̄ splits the grid, and
    per seed u_s = mean β below x̄, v_s = mean β above it; the change is significant when both one-sided t-tests
    over seeds reject (u > 0 and v < 0; p_sign = the larger p). Without it there is no M*, and `reason` says why:
    'too few M' (< min_m distinct finite M with a pull), 'too few seeds' (< 2: no test), the crossing outside the
    grid (all seed-mean pulls of one sign), 'no significant sign change'.
    No interval (M* from the seed means) with < min_seeds seeds or when a seed's own pulls do not change sign.
    No pull at all (`slopes` empty: Δ on new tasks not logged) is a reason too, not an error.
    slope_first, slope_last: the seed-mean pull at the smallest and the largest M."""
    if not len(slopes):
        return {**CROSSOVER_NONE, "reason": "no threshold: no pull (Δ on new tasks not logged)"}
    b = slopes[np.isfinite(slopes.slope.astype(float)) & (slopes.M != M_INF)].assign(
        x=lambda d: np.log2(d.M.astype(float)))
    seeds = sorted(b.seed.unique())
    mean = b.groupby("x").slope.mean()
    out = {**CROSSOVER_NONE, "n_seeds": len(seeds),
           "slope_first": float(mean.iloc[0]) if len(mean) else math.nan,
           "slope_last": float(mean.iloc[-1]) if len(mean) else math.nan}
    if len(mean) < min_m:
        return {**out, "reason": f"no threshold: too few M ({len(mean)} distinct finite M with a pull < {min_m})"}
    if len(seeds) < 2:
        return {**out, "reason": f"no threshold: too few seeds ({len(seeds)} < 2) to test the sign change"}
    xbar, why = sign_change(mean.index.to_numpy(), mean.to_numpy())
    if why:
        return {**out, "reason": f"no threshold: {why}"}
    p = _sign_change_p(b, xbar)
    out.update(p_sign=p, M_star=2.0 ** xbar, log2_M_star=xbar, in_range=True)
    if not p < alpha:
        return {**out, "M_star": math.nan, "log2_M_star": math.nan, "in_range": False,
                "reason": f"no threshold: no significant sign change of the pull (p = {p:.2g})"}
    per = {s: sign_change(g.x.to_numpy(), g.slope.to_numpy()) for s, g in b.groupby("seed")}
    failed = {s: why for s, (_, why) in per.items() if why}
    out.update(n_seeds_fit=len(per) - len(failed), seeds_failed=" | ".join(f"seed {s}: {w}" for s, w in failed.items()))
    if len(seeds) < min_seeds:
        return {**out, "reason": f"no interval: insufficient seeds ({len(seeds)} < {min_seeds})"}
    if failed:
        return {**out, "reason": f"no interval: a seed's pull does not change sign ({out['seeds_failed']})"}
    return {**out, **_crossover_interval(np.array([per[s][0] for s in seeds]), np.sort(b.x.unique()), level)}


def _sign_change_p(b: pd.DataFrame, xbar: float) -> float:
    """p of the sign change at xbar over seeds (`b`: seed, x = log2 M, slope): per seed u_s = mean β below xbar and
    v_s = mean β above it; the larger p of the one-sided t-tests u > 0 and v < 0 (NaN with < 2 seeds on a side)."""
    per_seed = b.groupby("seed")
    u = per_seed.apply(lambda g: g.slope[g.x < xbar].mean()).dropna()
    v = per_seed.apply(lambda g: g.slope[g.x > xbar].mean()).dropna()
    p_u = stats.ttest_1samp(u, 0.0, alternative="greater").pvalue if len(u) > 1 else math.nan
    p_v = stats.ttest_1samp(v, 0.0, alternative="less").pvalue if len(v) > 1 else math.nan
    return float(max(p_u, p_v)) if np.isfinite([p_u, p_v]).all() else math.nan


def _crossover_interval(xs: np.ndarray, grid: np.ndarray, level: float) -> dict:
    """M* and its interval from the per-seed crossings xs (log2 M): the t-interval widened in quadrature by
    GAP_SHARE × the width of the grid gap holding the mean (crossover_threshold)."""
    k = len(xs)
    m, se, tq = t_interval(xs, level)
    j = int(np.clip(np.searchsorted(grid, m), 1, len(grid) - 1))
    half = math.hypot(tq * se, GAP_SHARE * (grid[j] - grid[j - 1]))
    return {"M_star": 2.0 ** m, "log2_M_star": m, "M_star_lo": 2.0 ** (m - half),
            "M_star_hi": 2.0 ** (m + half), "log2_se": se,
            "interval": f"t-interval over {k} per-seed crossings, widened by {GAP_SHARE} × the grid gap", "reason": ""}


WINDOWS = {"last_half": 0.5, "last_two_thirds": 1 / 3, "last_third": 2 / 3}   # pull window: S ≥ late · S_end


def crossover_windows(traj: pd.DataFrame, **at) -> dict:
    """crossover_threshold with the pull read over the last ½ (the estimate), ⅔ and ⅓ of training (WINDOWS), and
    whether the conclusion (a threshold inside the grid, or none) is the same in every window with enough late
    checkpoints for a pull: `window_detail` says where it is not. Keys: crossover_threshold's of the last half,
    M_star[_lo, _hi]_<window> for the other two, `window_consistent` and `window_detail`."""
    est = {w: crossover_threshold(pull_slopes(traj, late), **at) for w, late in WINDOWS.items()}
    out = dict(est["last_half"])
    for w in ("last_two_thirds", "last_third"):
        out.update({f"M_star_{w}": est[w]["M_star"], f"M_star_lo_{w}": est[w]["M_star_lo"],
                    f"M_star_hi_{w}": est[w]["M_star_hi"]})
    found = {w: not e["reason"].startswith("no threshold") for w, e in est.items()}
    readable = [found[w] for w, e in est.items()   # a window too short for a pull (< 3 checkpoints) says nothing
                if not e["reason"].startswith(("no threshold: too few M", "no threshold: no pull"))]
    out["window_consistent"] = len(set(readable)) <= 1
    said = {w: f"M* {e['M_star']:.3g}" if found[w] else e["reason"].removeprefix("no threshold: ")
            for w, e in est.items()}
    out["window_detail"] = "" if out["window_consistent"] else ", ".join(
        f"{w.replace('_', ' ')}: {v}" for w, v in said.items())
    return out


def transient_ridge_window(metrics: pd.DataFrame, rel_tol: float = 0.05) -> dict:
    """t_crit = step of minimal OOD loss (step > 0); departure = first later checkpoint whose OOD
    loss exceeds the minimum by more than `rel_tol` × (initial − minimal OOD loss); the window is
    departure − t_crit (NaN when the loss never departs: no transient). A run with no checkpoint after
    step 0 (diverged at its first update) has no dip: t_crit = departure = −1, window NaN."""
    m = metrics.sort_values("step")
    m = m[m.step > 0]
    if m.empty:
        return {"t_crit": -1, "departure": -1, "window": math.nan}
    i = int(m.ood_loss.to_numpy().argmin())
    steps, loss = m.step.to_numpy(), m.ood_loss.to_numpy()
    depth = metrics.sort_values("step").ood_loss.iloc[0] - loss[i]
    later = np.nonzero(loss[i:] > loss[i] + rel_tol * max(depth, 1e-12))[0]
    dep = int(steps[i + later[0]]) if len(later) else None
    return {"t_crit": int(steps[i]), "departure": dep if dep is not None else -1,
            "window": float(dep - steps[i]) if dep is not None else math.nan}
