"""Essential dynamics (method §8): joint trajectory PCA of behavioural vectors and forms.

Behavioural vector of a checkpoint: the model's K predictions on each of the B root-task
sequences, flattened (B·K); stored by training in root_preds.parquet. For a family of runs the
vectors of every checkpoint of every run are stacked, centred and reduced by an exact (dense) SVD;
dMMSE_M and ridge on the same sequences are projected into the subspace without entering the fit.

Forms. A run's PC trajectory is a curve in log training time τ = log(step + 1), not in checkpoint
index, so every width below is in units of τ and the same run sampled at 20 or 200 checkpoints
has the same forms:

1. smoothing: a local-cubic Gaussian-kernel fit of bandwidth `bandwidth` (in τ), evaluated on a uniform
   τ grid (spacing bandwidth / 10); the curve's velocity and acceleration are the fit's own coefficients
   (β_1, 2β_2), not differences of the smoothed curve. On evenly spaced checkpoints 2β_2 is the
   Gaussian-smoothed γ'' (its Peano kernel is φ ≥ 0), so a sharp turn gives one curvature bump of one
   sign: no side lobes. (Differentiating the fitted value instead applies (3 − s²)φ(s)/2 to γ'', which
   rings: an opposite-sign bump ≈ 1.6 log-step beside every sharp turn, false forms beside turns and
   from turns inside the margins.) A local polynomial has no bias where checkpoints are unevenly spaced,
   and degree 3 reproduces cubics, so velocity is fourth-order accurate and a cubic's curvature exact up
   to the ends (degree 2 gives the clothoid of tests/test_ed.py a false vertex just inside the margin);
2. geometry: for each pair i < j of the leading `n_form_pcs` PCs, signed curvature κ (from the
   smoother's velocity and acceleration), osculating circles and the evolute;
3. events: a vertex is a local extremum of k = arcsinh(κ / κ₀) with prominence at least
   `vertex_prominence` (arcsinh units: 0.5 ≈ κ changing by a factor 1.6 at large κ), κ₀ = median|κ|,
   but at least KAPPA_FLOOR / (arc length inside the margins), so that wiggles of a straight stretch are
   not measured against themselves; a cusp is a local minimum of the speed below `cusp_speed` × the
   median speed where the tangent turns by more than 90° across ± `bandwidth`. Events within `margin`
   of either end of the τ range are dropped (there the derivatives are one-sided), so are vertices
   where the curve stalls (speed below `moving` × its maximum and no speed minimum within ± bandwidth:
   there κ is smoothing bias divided by a small speed; a slow turn, e.g. a smoothed cusp, is a speed
   minimum and stays), and in each pair the strongest event (cusps first, then the largest |κ|) hides
   its smoothing companions within 2 bandwidths (`hides`): every event near a cusp (smoothing turns a
   cusp into a sharp vertex flanked by two of the opposite sign) and same-sign vertices near a vertex
   (a split peak); an opposite-sign vertex near a vertex is a turn back and stays;
4. significance: the B root sequences are resampled with replacement `n_boot` times and each
   replicate is projected on the same components; an event is kept when its statistic (a vertex's
   prominence measured on its own bases; a cusp's turning angle minus 90°) is at least `z_min`
   resampling standard deviations above the value at which the event would vanish. (A bootstrap
   fraction "the event is still there" would not do: replicates are centred on the observed curve,
   so a noise wiggle of the observed curve persists in most of them.)
5. forms: the kept events are clustered greedily: the candidate time at which every pair has an
   event within ± `tolerance` and the events are tightest becomes a form, placed at the median of
   its events (where they occur), which are used up; repeat. Two forms a window (2 × tolerance) apart
   stay two, also when their events fall at different times in different pairs, and a sharp turn or a
   turn inside an end margin makes no other form (measured on planted polygons at 20, 50 and 200
   checkpoints: tests/test_ed_forms.py, experiments/forms_rates.py).

Validity: where checkpoints are further apart in τ than MAX_GAP × bandwidth inside the margins the
smoother cannot see features of the bandwidth's size; the run is flagged `undersampled` and its
forms are "inconclusive: undersampled" rather than absent.
"""
from __future__ import annotations

from itertools import combinations

import numpy as np
import pyarrow as pa

from ..core.predictors import dmmse, ridge
from ..core.probe_sections import ED
from ..core.runspec import KEY_FIELDS
from ..core.sections import Data, Eval
from ..core.tasks import M_INF, eval_set, prior_cov, task_pool

MAX_GAP = 1.5  # largest checkpoint gap inside the margins, in bandwidths, for a run to be analysable
GRID_PER_BANDWIDTH = 10  # grid points per bandwidth of the uniform τ grid
DEGREE = 3  # local-cubic smoother (module docstring, step 1)
KAPPA_FLOOR = 0.2  # κ₀ ≥ KAPPA_FLOOR / arc length inside the margins (module docstring, step 3)

PCS_SCHEMA = pa.schema([pa.field("family", pa.string()), pa.field("kind", pa.string())] + KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("pc", pa.int64()), pa.field("value", pa.float64())])
VAR_SCHEMA = pa.schema([pa.field("family", pa.string()), pa.field("pc", pa.int64()),
                        pa.field("explained_variance_ratio", pa.float64())])
EVENTS_SCHEMA = pa.schema([
    pa.field("family", pa.string()), pa.field("run_id", pa.string()), pa.field("pc_i", pa.int64()),
    pa.field("pc_j", pa.int64()), pa.field("kind", pa.string()), pa.field("log_step", pa.float64()),
    pa.field("step", pa.float64()), pa.field("z", pa.float64()), pa.field("kept", pa.bool_())])
FORMS_SCHEMA = pa.schema([pa.field("family", pa.string())] + KEY_FIELDS + [
    pa.field("form", pa.int64()), pa.field("log_step", pa.float64()), pa.field("step", pa.float64()),
    pa.field("nearest_checkpoint", pa.int64()), pa.field("nearest_stage_step", pa.int64()),
    pa.field("distance_to_stage_log", pa.float64())])
SAMPLING_SCHEMA = pa.schema([pa.field("family", pa.string())] + KEY_FIELDS + [
    pa.field("n_checkpoints", pa.int64()), pa.field("max_gap_log", pa.float64()), pa.field("bandwidth", pa.float64()),
    pa.field("undersampled", pa.bool_()), pa.field("n_forms", pa.int64())])


def log_time(steps) -> np.ndarray:
    """τ = log(step + 1): the curve's parameter (step 0 → 0)."""
    return np.log1p(np.asarray(steps, dtype=np.float64))


def joint_pca(X: np.ndarray, n_pcs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Centred exact SVD of the rows of X: (scores (n, k), components (k, d), mean (d,), explained ratio (k,)).

    Dense LAPACK SVD always (120 × 4096 takes well under a second): a randomized SVD is off by tens
    of degrees on flat spectra. Each component's sign makes its largest-|·| coordinate positive."""
    mean = X.mean(0)
    Xc = np.asarray(X - mean, dtype=np.float64)
    U, S, Vt = np.linalg.svd(Xc, full_matrices=False)
    k = min(n_pcs, len(S))
    U, S, Vt = U[:, :k], S[:k], Vt[:k]
    sign = np.sign(Vt[np.arange(k), np.abs(Vt).argmax(1)])
    sign[sign == 0] = 1
    Vt, U = Vt * sign[:, None], U * sign
    total = float((Xc ** 2).sum())
    return U * S, Vt, mean, S ** 2 / total if total > 0 else np.zeros(k)


def local_poly_weights(tau: np.ndarray, grid: np.ndarray, bandwidth: float, degree: int = 2) -> np.ndarray:
    """(degree + 1, G, n) weights W of the local-polynomial Gaussian-kernel smoother and its derivatives:
    γ̂⁽ʳ⁾(u) = Σ_i W[r, u, i] γ(τ_i) = r! β_r / h^r, β the degree-`degree` least-squares fit of γ_i on
    ((τ_i − u)/h)^0..degree weighted by exp(−(τ_i − u)²/2h²) (method §8). It reproduces polynomials of
    the degree exactly, at the ends too. On dense, even checkpoints 2β_2 (degree 2 or 3) is the
    Gaussian-smoothed γ'' (kernel (s² − 1)φ(s); integrated twice by parts, φ), whereas the second
    derivative of the fitted value β_0 (degree 2: kernel (3 − s²)φ(s)/2) rings: negative lobes at ± √5 h."""
    d = (tau[None, :] - grid[:, None]) / bandwidth
    k = np.exp(-0.5 * d ** 2)
    V = d[..., None] ** np.arange(degree + 1)                                  # (G, n, p): scaled for conditioning
    A = np.einsum("gn,gnp,gnq->gpq", k, V, V)
    beta = np.einsum("gpq,gnq,gn->pgn", np.linalg.inv(A), V, k)               # β = A⁻¹ Vᵀ K γ
    fact = np.cumprod(np.concatenate([[1.0], np.arange(1, degree + 1)]))
    return beta * (fact / bandwidth ** np.arange(degree + 1))[:, None, None]


def smooth_curve(tau: np.ndarray, curve: np.ndarray, bandwidth: float,
                 derivatives: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(grid, smoothed): `curve` (..., n, P) sampled at τ, smoothed onto a uniform τ grid (..., G, P);
    with `derivatives`, (3, ..., G, P): the curve and its first and second τ-derivatives (local_poly_weights)."""
    n_grid = int(np.ceil((tau.max() - tau.min()) / bandwidth * GRID_PER_BANDWIDTH)) + 1
    grid = np.linspace(tau.min(), tau.max(), n_grid)
    W = local_poly_weights(tau, grid, bandwidth, DEGREE)[:3]
    return grid, np.einsum("rgn,...np->r...gp", W, curve) if derivatives else np.einsum("gn,...np->...gp", W[0], curve)


def curvature(x: np.ndarray, y: np.ndarray, dx: np.ndarray, dy: np.ndarray, ddx: np.ndarray,
              ddy: np.ndarray) -> dict[str, np.ndarray]:
    """Speed |γ'|, signed curvature κ = (x'y'' − y'x'')/|γ'|³ and the evolute (centres of the osculating
    circles, γ + N/κ) of the plane curve γ = (x, y) from its derivatives (method §8)."""
    speed = np.hypot(dx, dy)
    s = np.maximum(speed, 1e-300)
    kappa = (dx * ddy - dy * ddx) / s ** 3
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rad = np.where(np.abs(kappa) > 1e-300, 1.0 / kappa, np.inf)
        return {"dx": dx, "dy": dy, "speed": speed, "kappa": kappa,
                "ex": x - rad * dy / s, "ey": y + rad * dx / s}


def plane_geometry(x: np.ndarray, y: np.ndarray, h: float = 1.0) -> dict[str, np.ndarray]:
    """curvature() with the derivatives by central differences along the last axis, a uniform grid of
    spacing h (for curves given exactly; detect_events takes the smoother's own derivatives)."""
    dx, dy = np.gradient(x, h, axis=-1), np.gradient(y, h, axis=-1)
    return curvature(x, y, dx, dy, np.gradient(dx, h, axis=-1), np.gradient(dy, h, axis=-1))


def find_peaks(x: np.ndarray, **kw) -> tuple[np.ndarray, dict]:
    """scipy.signal.find_peaks, imported on first use: scipy.signal takes ~1 s to import, and the probe jobs
    that import this module for its schemas never call it."""
    from scipy.signal import find_peaks as fp

    return fp(x, **kw)


def scaled_curvature(kappa: np.ndarray, inner: np.ndarray, scale: float | None = None) -> np.ndarray:
    """k = arcsinh(κ / median|κ| over `inner`): keeps every extremum of κ but measures large curvatures
    by their ratio, so a vertex's prominence is a relative change of κ. `scale` overrides the median."""
    med = scale if scale is not None else (np.median(np.abs(kappa[inner])) if inner.any() else 0.0)
    return np.arcsinh(kappa / max(med, 1e-300))


def vertices(k: np.ndarray, inner: np.ndarray, prominence: float) -> list[tuple[int, int, int, int]]:
    """Local extrema of the scaled curvature k inside `inner` with prominence ≥ `prominence`:
    (index, sign (+1 max, −1 min), left base, right base) of each."""
    out = []
    for sign in (1, -1):
        idx, prop = find_peaks(sign * k, prominence=prominence)
        out += [(int(i), sign, int(lb), int(rb)) for i, lb, rb in zip(idx, prop["left_bases"], prop["right_bases"])
                if inner[i]]
    return sorted(out)


def cusps(dx: np.ndarray, dy: np.ndarray, inner: np.ndarray, speed_frac: float, window: int) -> np.ndarray:
    """Speed minima below `speed_frac` × median speed (over `inner`) where the tangent turns by more
    than 90° between `window` grid points before and after: the curve stops and goes back."""
    speed = np.hypot(dx, dy)
    med = np.median(speed[inner]) if inner.any() else 0.0
    out = [i for i in find_peaks(-speed)[0]
           if inner[i] and speed[i] <= speed_frac * med and window <= i < len(speed) - window
           and dx[i - window] * dx[i + window] + dy[i - window] * dy[i + window] < 0]
    return np.array(out, dtype=int)


def vertex_prominence(k: np.ndarray, i: int, sign: int, lb: int, rb: int, half: int) -> np.ndarray:
    """Prominence of the extremum near index i in each row of k (R, G), measured on the observed
    vertex's own bases: the extreme value within ± `half` of i minus the higher of the two lowest
    values between it and its left and right bases (sign −1: the same for −k)."""
    k = sign * k
    peak = k[:, max(0, i - half): i + half + 1].max(1)
    return peak - np.maximum(k[:, lb: i + 1].min(1), k[:, i: rb + 1].min(1))


def turning_angle(dx: np.ndarray, dy: np.ndarray, i: int, window: int) -> np.ndarray:
    """Angle (radians) between the tangents `window` grid points before and after i, per row."""
    a, b = np.stack([dx[:, i - window], dy[:, i - window]]), np.stack([dx[:, i + window], dy[:, i + window]])
    cos = (a * b).sum(0) / np.maximum(np.hypot(*a) * np.hypot(*b), 1e-300)
    return np.arccos(np.clip(cos, -1, 1))


def significance(stat: np.ndarray, null: float) -> float:
    """(stat[0] − null) / sd(stat[1:]): how many resampling standard deviations the observed
    statistic stat[0] lies beyond the value `null` at which the event would not exist."""
    sd = float(np.std(stat[1:], ddof=1))
    return float((stat[0] - null) / sd) if sd > 0 else (float("inf") if stat[0] > null else 0.0)


def hides(strong: tuple[float, int | None], weak: tuple[float, int | None], radius: float) -> bool:
    """Whether the stronger event `strong` = (τ, sign of κ, None for a cusp) hides `weak` as its smoothing
    companion (method §8: smoothing must not create events): every event within `radius` of a cusp (a smoothed
    cusp is a sharp vertex flanked by two of the opposite sign), and a vertex of the same sign within
    `radius` of a vertex (one turn's split peak). An opposite-sign vertex near a vertex is a turn back and
    stays: the smoother's derivatives are Gaussian-weighted (local_poly_weights), without side lobes."""
    return abs(strong[0] - weak[0]) <= radius and (strong[1] is None or strong[1] == weak[1])


def detect_events(tau: np.ndarray, curves: np.ndarray, cfg: ED) -> list[dict]:
    """Vertices and cusps of every pair i < j of the leading `n_form_pcs` PCs of the observed curve
    `curves[0]` (n, P) sampled at τ (module docstring, steps 1-4), each with its significance z over
    the resampled curves `curves[1:]` and `kept` = z ≥ `z_min` (without resampled curves z = inf)."""
    curves = curves[None] if curves.ndim == 2 else curves
    grid, sm = smooth_curve(tau, curves, cfg.bandwidth, derivatives=True)
    h, bw = grid[1] - grid[0], cfg.bandwidth
    inner = (grid >= grid[0] + cfg.margin) & (grid <= grid[-1] - cfg.margin)
    window = max(1, int(round(bw / h)))
    events = []
    for i, j in combinations(range(min(cfg.n_form_pcs, sm.shape[-1])), 2):
        g = curvature(*(sm[r, ..., c] for r in range(3) for c in (i, j)))  # every row: one curve
        med = np.median(np.abs(g["kappa"][0][inner])) if inner.any() else 1.0
        k = scaled_curvature(g["kappa"], inner, max(med, KAPPA_FLOOR / max(g["speed"][0][inner].sum() * h, 1e-300)))
        found = [(c, "cusp", np.inf, None) for c in cusps(g["dx"][0], g["dy"][0], inner, cfg.cusp_speed, window)]
        sp = g["speed"][0]
        moving = sp >= cfg.moving * sp[inner].max() if inner.any() else inner
        for m in find_peaks(-sp)[0]:   # a slow turn (a smoothed cusp) is a speed minimum; a stall is not
            moving[max(0, m - window): m + window + 1] = True
        found += [(v[0], "vertex", abs(k[0, v[0]]), v) for v in vertices(k[0], inner, cfg.vertex_prominence)
                  if moving[v[0]]]
        while found:  # the strongest event hides its smoothing companions (`hides`)
            c, kind, _, v = max(found, key=lambda f: (f[2], -f[0]))
            found = [f for f in found if not hides((grid[c], v and v[1]), (grid[f[0]], f[3] and f[3][1]), 2 * bw)]
            if len(k) == 1:
                z = float("inf")
            elif kind == "vertex":
                z = significance(vertex_prominence(k, *v, window // 2), 0.0)
            else:
                z = significance(turning_angle(g["dx"], g["dy"], c, window), np.pi / 2)
            events.append({"pc_i": i + 1, "pc_j": j + 1, "kind": kind, "log_step": float(grid[c]),
                           "z": z, "kept": bool(z >= cfg.z_min)})
    return events


def forms(events: list[dict], n_pcs: int, tolerance: float) -> list[float]:
    """Form times (τ) from kept events: greedily, the candidate time (an event's) at which every pair
    i < j of the leading `n_pcs` PCs has an unused event within ± tolerance, with the smallest total
    distance to those nearest events, becomes a form placed at the median of those events, which
    are then used up; repeat until no candidate remains. Sorted by time. Within a pair, events of one
    sign are already ≥ 2 bandwidths apart (detect_events), so forms that far apart stay distinct."""
    pairs = list(combinations(range(1, n_pcs + 1), 2))
    left = [((e["pc_i"], e["pc_j"]), e["log_step"]) for e in events if e.get("kept", True)]
    out = []
    while True:
        best = None
        for c in sorted({t for _, t in left}):
            chosen = []
            for p in pairs:
                cand = [e for e in left if e[0] == p and abs(e[1] - c) <= tolerance]
                if not cand:
                    break
                chosen.append(min(cand, key=lambda e: abs(e[1] - c)))
            else:
                cost = sum(abs(e[1] - c) for e in chosen)
                if best is None or cost < best[0]:
                    best = (cost, chosen)
        if best is None:
            return sorted(out)
        out.append(float(np.median([t for _, t in best[1]])))
        left = [e for e in left if e not in best[1]]


def max_inner_gap(tau: np.ndarray, margin: float) -> float:
    """The largest distance in τ between neighbouring checkpoints (or a margin edge) inside the margins."""
    lo, hi = tau.min() + margin, tau.max() - margin
    if hi <= lo:
        return float("inf")
    pts = np.concatenate([[lo], np.sort(tau[(tau > lo) & (tau < hi)]), [hi]])
    return float(np.diff(pts).max())


def bootstrap_curves(X: np.ndarray, mean: np.ndarray, comps: np.ndarray, n_seq: int, n_boot: int,
                     seed: int) -> np.ndarray:
    """(1 + n_boot, n, k): the run's PC curve and `n_boot` curves whose behavioural vectors X (n, B·K;
    sequence-major) use B root sequences resampled with replacement, projected on the same components."""
    n, d = X.shape
    K = d // n_seq
    Xc = X - mean
    out = [Xc @ comps.T]
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        cols = (rng.integers(0, n_seq, n_seq)[:, None] * K + np.arange(K)).ravel()
        out.append(Xc[:, cols] @ comps[:, cols].T)
    return np.stack(out)


def predictor_vectors(d: Data, e: Eval, Ms: list[int]) -> dict[str, np.ndarray]:
    """Flattened dMMSE_M (each finite M) and ridge predictions on the root-task sequences."""
    p = d.task_prior
    b = eval_set("root", 1, e.n_root, d.K, d.D, d.noise_var, d.pool_seed, e.eval_seed, p)
    out = {"ridge": ridge(b.xs, b.ys, d.noise_var, None if p is None else prior_cov(p, d.D)).numpy().ravel()}
    for M in Ms:
        if M != M_INF:
            out[f"dmmse_{M}"] = dmmse(b.xs, b.ys, task_pool(d.pool_seed, M, d.D, p), d.noise_var).numpy().ravel()
    return out
