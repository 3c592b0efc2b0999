"""Local learning coefficient (method §7): the estimator over localized SGLD chains (iclnoise.probes.sgld), its
diagnostics and its calibration.

    λ̂(w*) = nβ · (E_w[L_n(w)] − L_n(w*)),   w ~ exp(−U(w)),   U(w) = nβ L_n(w) + (γ/2)‖w − w*‖²

E_w is the mean mini-batch loss over the post-burn-in draws of every chain (the loss at the
current w, computed in the same pass as the gradient); L_n(w*) is the full-data loss at w*. The samplers
(`LLCConfig.method`: sgld, rmsprop_sgld), the MALA diagnostic and the weight restriction: iclnoise.probes.sgld.

When λ̂ measures the sampler, not the geometry (method §7): each estimate records the stability ratio
ε (nβ λ_max + γ) / 4 of SGLD's drift on the localized quadratic (λ_max: the top eigenvalue of the Hessian of
L_n at w*, of the moving coordinates' block under a mask; flag `unstable` above 1) and its escape evidence, the
mean sampled loss against the trivial predictor's (output 0) on the same data (flag `escaped`; `shared_level`
adds the run-level test against the other checkpoints' levels).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from torch.func import functional_call

from ..core.model import LossFn
from ..core.probe_sections import LLCConfig
from ..core.runspec import KEY_FIELDS
from .geometry import FlatLoss, lanczos_top, preconditioned
from .sgld import restriction, sgld_chains


@dataclass
class LLCResult:
    llc_mean: float
    llc_std: float
    llc_per_chain: np.ndarray
    init_loss: float
    traces: np.ndarray           # (chains, burn_in + draws) mini-batch losses
    nbeta: float
    mala_accept: float = float("nan")   # mean MALA acceptance over the post-burn-in transitions
    flags: dict = field(default_factory=dict)
    mean_loss: float = float("nan")     # E_w[L]: the mean mini-batch loss over the draws of every chain
    mean_loss_se: float = float("nan")  # its s.e. over chains (sd of the per-chain means / √chains)
    lambda_max: float = float("nan")    # top Hessian eigenvalue of L_n at w* (NaN: not computed)
    stability_ratio: float = float("nan")   # ε (nβ λ_max + γ) / 4
    trivial_loss: float = float("nan")  # L_n of the predictor that outputs 0


@torch.no_grad()
def full_loss(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
              chunk: int = 4096) -> float:
    tot = 0.0
    for s in range(0, xs.shape[0], chunk):
        tot += float(loss_fn(model, xs[s:s + chunk], ys[s:s + chunk])) * xs[s:s + chunk].shape[0]
    return tot / xs.shape[0]


def center_loss(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                center: dict[str, torch.Tensor]) -> float:
    """L_n(w*): the full-data loss of `model`'s shape at the parameters `center`."""
    buffers = dict(model.named_buffers())
    return full_loss(lambda a, b: functional_call(model, (center, buffers), (a, b)), loss_fn, xs, ys)


def check_sampling_set(xs: torch.Tensor, cfg: LLCConfig) -> None:
    """The sampling set holds cfg.n sequences, the n of the posterior (nβ), or a ValueError says both."""
    if xs.shape[0] != cfg.n:
        raise ValueError(f"sampling dataset has {xs.shape[0]} sequences, config says n = {cfg.n}")


def diagnose(traces: np.ndarray, init_loss: float, nbeta: float, burn_in: int) -> dict:
    """Flags: diverged (non-finite or exploding trace), negative estimate, not levelled off.

    Not levelled: a least-squares line through the chain-mean trace over the draws rises (or
    falls) by more than 20 % of E[L] − L(w*) across the draws, with a slope t-statistic > 3.
    """
    draws = traces[:, burn_in:]
    finite = bool(np.isfinite(draws).all())
    exploded = (not finite) or draws.max() > init_loss + 100 * max(abs(init_loss), 1e-3)
    not_levelled = False
    if finite and draws.shape[1] >= 8:
        y = draws.mean(0)
        x = np.arange(len(y), dtype=float)
        slope, icpt = np.polyfit(x, y, 1)
        resid = y - (slope * x + icpt)
        se = math.sqrt(resid.var(ddof=2) / ((x - x.mean()) ** 2).sum())
        gap = abs(y.mean() - init_loss)
        not_levelled = bool(abs(slope) * len(y) > 0.2 * gap and abs(slope) > 3 * se)
    return {"diverged": bool(exploded), "negative": bool(finite and nbeta * (draws.mean() - init_loss) < 0),
            "not_levelled": not_levelled}


def llc_result(loss: np.ndarray, accept: np.ndarray, init: float, cfg: LLCConfig, lambda_max: float = math.nan,
               trivial: float = math.nan) -> LLCResult:
    """λ̂ = nβ (E[L] − L(w*)) of one center's chains: their losses (chains, steps), MALA rates (chains, steps − 1);
    with λ_max and the trivial predictor's loss also the flags `unstable` and `escaped` (`sampler_flags`)."""
    nbeta, C = cfg.resolved_nbeta(), loss.shape[0]
    means = loss[:, cfg.burn_in:].mean(1)
    per_chain = nbeta * (means - init)
    acc = accept[:, max(cfg.burn_in - 1, 0):]
    ratio = stability_ratio(lambda_max, cfg.epsilon, cfg.gamma, nbeta)
    level = float(means.mean())
    flags = {**diagnose(loss, init, nbeta, cfg.burn_in), **sampler_flags(ratio, level, init, trivial)}
    return LLCResult(float(per_chain.mean()), float(per_chain.std(ddof=1)) if C > 1 else 0.0,
                     per_chain, init, loss, nbeta, float(np.nanmean(acc)) if acc.size else float("nan"), flags,
                     level, float(means.std(ddof=1) / math.sqrt(C)) if C > 1 else math.nan, lambda_max, ratio, trivial)


def estimate_llcs(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, cfg: LLCConfig,
                  centers: list[dict[str, torch.Tensor]], vectorize: bool = True, progress: bool = False,
                  masks: list[dict[str, torch.Tensor | None]] | None = None,
                  lambda_max: list[float] | None = None) -> list[LLCResult]:
    """λ̂ at each of `centers` (parameter dicts of `model`'s shape) on the sampling dataset (xs, ys) of
    size n: all chains of all centers in one batched SGLD pass (`sgld_chains`); with `masks` (one per center)
    the restricted λ̂_C of each (center, mask), L(w*) read once per distinct center. Each with its stability
    ratio (λ_max of the Hessian block the chains move, `top_eigenvalue`, unless given per center) and its flags."""
    check_sampling_set(xs, cfg)
    inits = {}
    for c in centers:
        if id(c) not in inits:
            inits[id(c)] = center_loss(model, loss_fn, xs, ys, c)
    lam = lambda_max or [top_eigenvalue(model, loss_fn, xs, ys, c, None if masks is None else masks[j], cfg.seed)
                         for j, c in enumerate(centers)]
    trivial = trivial_loss(loss_fn, xs, ys)
    ch = sgld_chains(model, loss_fn, xs, ys, cfg, vectorize=vectorize, progress=progress, centers=centers,
                     masks=masks)
    C = cfg.chains
    return [llc_result(ch.loss[j * C:(j + 1) * C], ch.accept[j * C:(j + 1) * C], inits[id(c)], cfg, lam[j], trivial)
            for j, c in enumerate(centers)]


def estimate_llc(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                 cfg: LLCConfig, vectorize: bool = True, progress: bool = False) -> LLCResult:
    """λ̂ at the model's current parameters on the sampling dataset (xs, ys) of size n."""
    center = {k: v.detach() for k, v in model.named_parameters()}
    return estimate_llcs(model, loss_fn, xs, ys, cfg, [center], vectorize, progress)[0]


# ---------------------------------------------------------------- when λ̂ measures the sampler (method §7)

STABILITY_ITERS, STABILITY_TOL = 20, 1e-2   # Lanczos for λ_max: the flag needs the ratio to 1 %, not to 1e-3
HESSIAN_SEQUENCES = 256   # λ_max of L on the first ≤ 256 sampling sequences: on the default model (26 400 parameters)
# at steps 5 and 400 of a 400-step M16-B64 run, 29.78 and 42.94 against 29.75 and 42.32 on all 1024, at a quarter of
# the cost (0.6 s against 2.3-3.1 CPU s per checkpoint, 4-5 Lanczos iterations)


def stability_ratio(lambda_max: float, epsilon: float, gamma: float, nbeta: float) -> float:
    """ε (nβ λ_max + γ) / 4 (method §7). Plain SGLD's drift on the localized quadratic multiplies the distance along
    the top eigenvector by 1 − (ε/2)(nβ λ_max + γ) each step: stable while that stays above −1, i.e. ratio < 1.
    (For rmsprop_sgld the step is ε G with a per-coordinate G ≤ 1/δ: the ratio as written understates it.)"""
    return epsilon * (nbeta * lambda_max + gamma) / 4


def top_eigenvalue(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                   center: dict[str, torch.Tensor], mask: dict[str, torch.Tensor | None] | None = None,
                   seed: int = 0) -> float:
    """λ_max of the Hessian of L (on the first HESSIAN_SEQUENCES sequences of (xs, ys)) at `center`, by Lanczos
    (iclnoise.probes.geometry, ≤ STABILITY_ITERS Hessian-vector products); with a `mask` (`restriction`'s format) the
    top eigenvalue of the block of the coordinates it moves, m ⊙ H (m ⊙ v): the chains' own stability limit."""
    f = FlatLoss(model, loss_fn, xs[:HESSIAN_SEQUENCES], ys[:HESSIAN_SEQUENCES])
    f.w0 = torch.cat([center[k].detach().reshape(-1) for k in f.names])
    hvp = f.hvp_at_w0()
    if mask is not None:
        keep = restriction(model, [mask], 1)
        hvp = preconditioned(hvp, torch.cat([keep[k][0].reshape(-1) for k in f.names]).to(f.w0.dtype))
    gen = torch.Generator(device=f.w0.device).manual_seed(seed)
    return lanczos_top(hvp, f.w0.numel(), STABILITY_ITERS, gen, STABILITY_TOL, f.w0.device, f.w0.dtype)["eigenvalue"]


def trivial_loss(loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor) -> float:
    """L_n of the trivial predictor, which outputs 0: for the regression tasks E y² / D = (D + σ²) / D."""
    return full_loss(lambda a, b: torch.zeros_like(b), loss_fn, xs, ys)


def sampler_flags(ratio: float, level: float, init: float, trivial: float) -> dict:
    """`unstable`: stability ratio > 1. `escaped`: the mean sampled loss `level` exceeds the trivial predictor's
    loss while L(w*) is below it (a chain that samples w* 's neighbourhood has E[L] = L(w*) + λ/nβ; one that
    scores worse than predicting 0 has left it). NaN inputs leave a flag off. Run level: `shared_level`."""
    return {"unstable": bool(ratio > 1), "escaped": bool(level > trivial > init)}


def shared_level(level: np.ndarray, level_se: np.ndarray, init: np.ndarray) -> np.ndarray:
    """Per checkpoint j of one run (one sampler setting): True when its mean sampled loss E_j does not follow the
    checkpoint (method §7, `escaped`). Checkpoint k tests j when L(w*) moved detectably, |ΔL*| > 3 s with
    s = √(se_j² + se_k²); j keeps k's level when |ΔE| ≤ max(2 s, |ΔL*| / 10). Chains localized at a λ that
    changes little move their level with L(w*) (ΔE = ΔL* + Δλ/nβ); a level that stays within its s.e., or moves
    by under a tenth of ΔL*, means λ̂ = nβ (c − L(w*)) tracks the loss (Hoogland's release: r = 0.99999).
    Flagged when j keeps the level of at least half the checkpoints that test it (at least one)."""
    E, se, L = (np.asarray(a, dtype=float) for a in (level, level_se, init))
    s = np.sqrt(se[:, None] ** 2 + se[None, :] ** 2)
    dL, dE = np.abs(L[:, None] - L[None, :]), np.abs(E[:, None] - E[None, :])
    tests = dL > 3 * s
    keeps = tests & (dE <= np.maximum(2 * s, dL / 10))
    n = tests.sum(1)
    return (n > 0) & (2 * keeps.sum(1) >= n)


# ---------------------------------------------------------------- per-run pipeline step

# the evidence behind `unstable` and `escaped` (method §7), in llc.parquet and rllc.parquet
SAMPLER_FIELDS = [pa.field("mean_sampling_loss_se", pa.float64()), pa.field("trivial_loss", pa.float64()),
                  pa.field("lambda_max", pa.float64()), pa.field("stability_ratio", pa.float64())]


def sampler_columns(r: LLCResult) -> dict:
    """SAMPLER_FIELDS (and mean_sampling_loss) of one estimate."""
    return {"mean_sampling_loss": r.mean_loss, "mean_sampling_loss_se": r.mean_loss_se, "trivial_loss": r.trivial_loss,
            "lambda_max": r.lambda_max, "stability_ratio": r.stability_ratio}


def flag_shared_levels(rows: list[dict], by: tuple[str, ...] = ()) -> None:
    """Set `escaped` in table rows (dicts with step, mean_sampling_loss(_se), init_loss, escaped) where
    `shared_level` says so, over the checkpoints of each group of equal `by` values (e.g. a component)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in by), []).append(r)
    for g in groups.values():
        shared = shared_level(*(np.array([r[k] for r in g], dtype=float)
                                for k in ("mean_sampling_loss", "mean_sampling_loss_se", "init_loss")))
        for r, s in zip(g, shared):
            r["escaped"] = bool(r["escaped"] or s)


# ---------------------------------------------------------------- calibration (`iclnoise llc-calibrate`)

CALIBRATION_FLAGS = ("diverged", "negative", "not_levelled", "unstable", "escaped")


def calibration_sweep(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, base: LLCConfig,
                      centers: list[dict[str, torch.Tensor]], epsilons: list[float], gammas: list[float],
                      nbetas: list[float | None] = (None,), labels: list | None = None) -> list[dict]:
    """λ̂ at every (nβ, γ, ε) of the sweep (the other settings `base`'s) at each of `centers` (labelled by `labels`,
    default 0, 1, ...): one batched pass per setting, λ_max read once per center. One row per (setting, center) with
    the estimate, its s.e. and every flag, `escaped` including the level test across the centers (`shared_level`)."""
    labels = list(range(len(centers))) if labels is None else labels
    lam = [top_eigenvalue(model, loss_fn, xs, ys, c, None, base.seed) for c in centers]
    rows = []
    for nb in nbetas:
        for g in gammas:
            for e in epsilons:
                cfg = dataclasses.replace(base, epsilon=e, gamma=g, nbeta=nb)
                res = estimate_llcs(model, loss_fn, xs, ys, cfg, centers, lambda_max=lam)
                part = [{"nbeta": r.nbeta, "gamma": g, "epsilon": e, "center": lab, "llc_mean": r.llc_mean,
                         "llc_se": r.llc_std / math.sqrt(cfg.chains), "init_loss": r.init_loss,
                         "mala_accept": r.mala_accept, **sampler_columns(r), **r.flags} for lab, r in zip(labels, res)]
                flag_shared_levels(part)
                rows += part
    return rows


def undefined_centers(rows: list[dict]) -> list:
    """The centers of a `calibration_sweep` where every estimate of a setting that is neither unstable nor diverged is
    negative: E[L] < L(w*), so w* is not near a minimum (e.g. at initialisation), the LLC is not defined there and no
    setting can be clean at it."""
    neg: dict = {}
    for r in rows:
        if not (r["unstable"] or r["diverged"]):
            neg.setdefault(r["center"], []).append(r["negative"])
    return [c for c, v in neg.items() if all(v)]


def choose_setting(rows: list[dict], z: float = 2.0) -> dict | None:
    """The calibrated (nβ, γ, ε) of a `calibration_sweep`: per (nβ, γ), a setting is clean when no estimate at any
    center carries a flag (CALIBRATION_FLAGS), and on the ε-plateau when it and the next smaller ε are clean and
    their estimates agree at every center within z·√(se² + se'²) (the estimate has levelled off in ε: the
    discretisation bias, which grows with ε, is below the chains' noise). The choice: the largest ε on the
    plateau, at the smallest γ that has one (the weakest localization that keeps the chains local), at the first
    nβ of the sweep's order that has one. The `undefined_centers` are left out (with none left, no setting
    qualifies). Sets `clean`, `plateau`, `chosen` in `rows`; returns the chosen setting {nbeta, gamma, epsilon} or
    None when no setting qualifies."""
    settings: dict = {}
    undefined = undefined_centers(rows)
    for r in rows:
        settings.setdefault((r["nbeta"], r["gamma"], r["epsilon"]), [])
        if r["center"] not in undefined:
            settings[r["nbeta"], r["gamma"], r["epsilon"]].append(r)
    clean = {k: not any(r[f] for r in v for f in CALIBRATION_FLAGS) for k, v in settings.items()}
    plateau = {}
    for (nb, g, e), v in settings.items():
        smaller = [k for k in settings if k[:2] == (nb, g) and k[2] < e]
        prev = max(smaller, key=lambda k: k[2]) if smaller else None
        plateau[nb, g, e] = bool(prev and v and clean[nb, g, e] and clean[prev] and all(
            abs(a["llc_mean"] - b["llc_mean"]) <= z * math.hypot(a["llc_se"], b["llc_se"])
            for a, b in zip(v, settings[prev])))
    order = {nb: i for i, nb in enumerate(dict.fromkeys(k[0] for k in settings))}
    ok = [k for k, p in plateau.items() if p]
    best = min(ok, key=lambda k: (order[k[0]], k[1], -k[2])) if ok else None
    for r in rows:
        k = (r["nbeta"], r["gamma"], r["epsilon"])
        r.update(clean=clean[k], plateau=plateau[k], chosen=k == best)
    return None if best is None else {"nbeta": best[0], "gamma": best[1], "epsilon": best[2]}


LLC_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("llc_mean", pa.float64()), pa.field("llc_std", pa.float64()),
    pa.field("llc_se", pa.float64()), pa.field("llc_per_chain", pa.list_(pa.float64())),
    pa.field("init_loss", pa.float64()), pa.field("mean_sampling_loss", pa.float64()),
    pa.field("mala_accept", pa.float64()), *SAMPLER_FIELDS,
    pa.field("diverged", pa.bool_()), pa.field("negative", pa.bool_()), pa.field("not_levelled", pa.bool_()),
    pa.field("unstable", pa.bool_()), pa.field("escaped", pa.bool_()),
    pa.field("method", pa.string()),
    pa.field("epsilon", pa.float64()), pa.field("gamma", pa.float64()), pa.field("nbeta", pa.float64()),
    pa.field("chains", pa.int64()), pa.field("burn_in", pa.int64()), pa.field("draws", pa.int64()),
    pa.field("batch_size", pa.int64()), pa.field("n", pa.int64()),
])
CALIBRATION_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("step", pa.int64()),
    pa.field("nbeta", pa.float64()), pa.field("gamma", pa.float64()), pa.field("epsilon", pa.float64()),
    pa.field("llc_mean", pa.float64()), pa.field("llc_se", pa.float64()), pa.field("init_loss", pa.float64()),
    pa.field("mala_accept", pa.float64()), pa.field("mean_sampling_loss", pa.float64()), *SAMPLER_FIELDS,
    *[pa.field(f, pa.bool_()) for f in CALIBRATION_FLAGS],
    pa.field("clean", pa.bool_()), pa.field("plateau", pa.bool_()), pa.field("chosen", pa.bool_()),
])
TRACE_SCHEMA = pa.schema([pa.field("run_id", pa.string()), pa.field("step", pa.int64()),
                          pa.field("chain", pa.int64()), pa.field("sgld_step", pa.int64()),
                          pa.field("loss", pa.float64())])
