"""Local learning coefficient by localized SGLD (SPEC §7), all chains batched with torch.func.

    λ̂(w*) = nβ · (E_w[L_n(w)] − L_n(w*)),   w ~ exp(−U(w)),   U(w) = nβ L_n(w) + (γ/2)‖w − w*‖²

Samplers (`LLCConfig.method`), both per coordinate with a preconditioner G (G = 1 for plain SGLD):

    sgld:          w ← w − (ε/2) (nβ ∇L_batch(w) + γ (w − w*)) + √ε ξ,                 ξ ~ N(0, I)
    rmsprop_sgld:  V ← α V + (1 − α) ∇L_batch(w)²,   G = 1 / (√V + δ)
                   w ← w − (ε/2) G (nβ ∇L_batch(w) + γ (w − w*)) + √(ε G) ξ

(the RMSProp rule is devinterp 2.0.1's `rmsprop_sgld`: V accumulates the squared loss gradient, not
scaled by nβ, updated before it is used; defaults α = 0.99, δ = 0.1).

E_w is the mean mini-batch loss over the post-burn-in draws of every chain (the loss at the
current w, computed in the same pass as the gradient); L_n(w*) is the full-data loss at w*.
Each chain owns a generator seeded by (seed, chain), so results do not depend on how many
chains run together, in which order, or how they are batched: one call of a model that runs stacked
parameters (`stacks_runs`, iclnoise.model), a vmap over chains, or a Python loop.

MALA diagnostic (as devinterp's `MalaAcceptanceRate`): for every pair of consecutive SGLD steps
w_t → w_{t+1}, the Metropolis-adjusted acceptance probability that step would have had as a
Langevin proposal q(w'|w) = N(w − (ε/2) G ∇U(w), ε G):

    a_t = min(1, exp(U(w_t) − U(w_{t+1}) + log q(w_t | w_{t+1}) − log q(w_{t+1} | w_t)))

with U and ∇U read on each step's own mini-batch (no extra pass) and G the preconditioner of
step t at both ends. Its mean over the draws says how far the discretisation is from exact:
near 1 the step is small for the target; falling towards 0 the chain is not sampling U.

Weight restriction (SPEC §7, refined LLC; iclnoise.refined): with a 0/1 mask m per coordinate a chain moves
only the coordinates with m = 1 and holds the others at w* exactly,

    w ← w + m ⊙ step,

which samples the posterior of the restricted coordinates given the others at w*; U, the noise term Σξ²/2 and
the reverse proposal term of the MALA ratio sum over the moving coordinates only. The noise is drawn for every
coordinate all the same, so a chain sees the same random numbers with or without a mask.

When λ̂ measures the sampler, not the geometry (SPEC §7): each estimate records the stability ratio
ε (nβ λ_max + γ) / 4 of SGLD's drift on the localized quadratic (λ_max: the top eigenvalue of the Hessian of
L_n at w*, of the moving coordinates' block under a mask; flag `unstable` above 1) and its escape evidence, the
mean sampled loss against the trivial predictor's (output 0) on the same data (flag `escaped`; `shared_level`
adds the run-level test against the other checkpoints' levels).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import torch
from torch.func import functional_call, grad_and_value, vmap
from tqdm import tqdm

from .geometry import FlatLoss, lanczos_top, preconditioned
from .sections import (
    KEY_FIELDS,
    LLCConfig,  # the typed llc.sampler section, importable from here
)

LossFn = Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]
log = logging.getLogger(__name__)

# thin re-exports for modules that still import them from here (use iclnoise.runs)


@dataclass
class Chains:
    """What the chains leave behind: mini-batch losses (chains, steps), MALA acceptance
    probabilities (chains, steps − 1) of the transitions t → t + 1, and the full-set losses of the
    `observe` datasets at every post-burn-in w_t (datasets, chains, draws), None without them."""
    loss: np.ndarray
    accept: np.ndarray
    obs: np.ndarray | None = None


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


def _chain_generators(seed: int, chains: list[int], device) -> list[torch.Generator]:
    gens = []
    for c in chains:
        g = torch.Generator(device=device)
        g.manual_seed(int(np.random.SeedSequence([seed, c, 0x5C1D]).generate_state(1)[0]))
        gens.append(g)
    return gens


def mala_log_ratio(u_t: torch.Tensor, u_next: torch.Tensor, fwd_sq: torch.Tensor, step: dict, g_next: dict,
                   precond: dict | None, epsilon: float, keep: dict | None = None) -> torch.Tensor:
    """log of the MALA acceptance ratio of the transition w_t → w_{t+1} = w_t + step, per chain.

    u_t, u_next: U at both ends, (C,); fwd_sq: Σ ξ²/2 of the noise that made the step (= −log q
    forward up to the shared constant); g_next: ∇U(w_{t+1}); precond: G of step t (None = 1);
    keep: the moving coordinates (bool, like step; None = all), the only ones the sum runs over.
    log q(w_t | w_{t+1}) = −Σ (−step + (ε/2) G ∇U(w_{t+1}))² / (2 ε G).
    """
    rev = torch.zeros_like(u_t, dtype=torch.float64)
    for k, s in step.items():
        g = 1.0 if precond is None else precond[k]
        r = -s + 0.5 * epsilon * g * g_next[k]
        if keep is not None:
            r = r.where(keep[k], 0.0)
        rev += (r.square() / g).reshape(r.shape[0], -1).double().sum(1) / (2 * epsilon)
    return u_t.double() - u_next.double() - rev + fwd_sq


def restriction(model: torch.nn.Module, masks: list[dict[str, torch.Tensor | None]], rows: int) -> dict:
    """Stacked bool masks (groups·rows, *shape) per parameter, group-major: a parameter a mask dict does not
    name is held (0), one it maps to None moves whole, a 0/1 tensor of its shape moves where it is 1."""
    names = dict(model.named_parameters())
    if unknown := {k for g in masks for k in g} - set(names):
        raise KeyError(f"masks name parameters the model does not have: {sorted(unknown)}")
    out = {}
    for k, p in names.items():
        m = [torch.zeros(p.shape, dtype=torch.bool, device=p.device) if k not in g else
             torch.ones(p.shape, dtype=torch.bool, device=p.device) if g[k] is None else
             g[k].to(p.device).bool().expand(p.shape) for g in masks]
        out[k] = torch.stack(m).repeat_interleave(rows, 0)
    return out


def sgld_chains(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                cfg: LLCConfig, chains: list[int] | None = None, vectorize: bool = True,
                progress: bool = False, centers: list[dict[str, torch.Tensor]] | None = None,
                masks: list[dict[str, torch.Tensor | None]] | None = None,
                observe: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Chains:
    """Run localized SGLD (or RMSProp-SGLD) chains from the model's parameters, or from each of
    `centers` (several w*, e.g. the checkpoints of a run, sampled in one batched pass).

    Rows are center-major: row j·C + c is chain c around centers[j], with the generator chain c has
    alone, so one call over many centers equals separate calls up to float summation order.
    `masks` (one per center, `restriction`) restricts group j's chains to the coordinates its mask
    moves: a center repeated with different masks samples all components of one w* in one pass
    (iclnoise.refined). `observe`: datasets (x, y) whose full-set loss is read at every post-burn-in w_t."""
    chains = list(range(cfg.chains)) if chains is None else chains
    centers = centers or [{k: v.detach() for k, v in model.named_parameters()}]
    if masks is not None and len(masks) != len(centers):
        raise ValueError(f"{len(masks)} masks for {len(centers)} centers: one mask per center")
    Cc, steps, n = len(chains), cfg.burn_in + cfg.draws, xs.shape[0]
    C = Cc * len(centers)
    nbeta, eps, gamma = cfg.resolved_nbeta(), cfg.epsilon, cfg.gamma
    rms = cfg.method == "rmsprop_sgld"
    full_batch = cfg.batch >= n     # the whole sampling set every step; otherwise batches with replacement
    w0 = {k: torch.stack([c[k].detach() for c in centers]).repeat_interleave(Cc, 0)
          for k, _ in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    w = {k: v.clone() for k, v in w0.items()}
    sq_avg = {k: torch.zeros_like(v) for k, v in w.items()} if rms else None
    gens = [g for _ in centers for g in _chain_generators(cfg.seed, chains, xs.device)]
    keep = None if masks is None else restriction(model, masks, Cc)

    def loss_at(params, x, y):
        return loss_fn(lambda a, b: functional_call(model, (params, buffers), (a, b)), x, y)

    def grad_loss(params, x, y):
        if cfg.micro_batches == 1:
            return grad_and_value(loss_at)(params, x, y)
        g_tot, l_tot = None, 0.0
        for xm, ym in zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches)):
            g, l_ = grad_and_value(loss_at)(params, xm, ym)
            wgt = xm.shape[0] / x.shape[0]
            g_tot = {k: v * wgt for k, v in g.items()} if g_tot is None else {k: g_tot[k] + v * wgt
                                                                              for k, v in g.items()}
            l_tot = l_tot + l_ * wgt
        return g_tot, l_tot

    def stacked_grad(params, x, y):  # every chain in one call: the model runs stacked parameters (C, ...)
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
            if full_batch:
                x, y = x.expand(C, *x.shape), y.expand(C, *y.shape)
            loss = loss_at(leaves, x, y)
            return dict(zip(leaves, torch.autograd.grad(loss.sum(), list(leaves.values())))), loss.detach()

    if not vectorize:
        batched = None
    elif getattr(model, "stacks_runs", False) and cfg.micro_batches == 1:
        batched = stacked_grad
    else:
        batched = vmap(grad_loss, in_dims=(0, None, None)) if full_batch else vmap(grad_loss)
    def rows_loss(x, y):  # full-set loss of every row at the current w, in chunks of the SGLD batch size
        tot = 0.0
        for xc, yc in zip(x.split(cfg.batch), y.split(cfg.batch)):
            if not vectorize:
                l_ = torch.stack([loss_at({k: v[c] for k, v in w.items()}, xc, yc) for c in range(C)])
            elif batched is stacked_grad:
                l_ = loss_at(w, xc.expand(C, *xc.shape), yc.expand(C, *yc.shape))
            else:
                l_ = vmap(loss_at, in_dims=(0, None, None))(w, xc, yc)
            tot = tot + l_.double() * (xc.shape[0] / x.shape[0])
        return tot.cpu()

    losses = torch.empty(C, steps, dtype=torch.float64)
    accept = torch.empty(C, max(steps - 1, 0), dtype=torch.float64)
    obs = torch.empty(len(observe), C, cfg.draws, dtype=torch.float64) if observe else None
    prev = None   # (U_t, Σξ²/2, step, G) of the last transition, for the MALA ratio
    for t in tqdm(range(steps), disable=not progress, desc="SGLD", mininterval=5):
        if full_batch:    # one copy of the data shared by every chain
            bx, by = xs, ys
        else:
            idx = torch.stack([torch.randint(0, n, (cfg.batch,), generator=g, device=xs.device) for g in gens])
            bx, by = xs[idx], ys[idx]
        if vectorize:
            grads, loss = batched(w, bx, by)
        else:
            outs = [grad_loss({k: v[c] for k, v in w.items()}, bx if full_batch else bx[c], by if full_batch else by[c])
                    for c in range(C)]
            grads = {k: torch.stack([o[0][k] for o in outs]) for k in w}
            loss = torch.stack([o[1] for o in outs])
        losses[:, t] = loss.detach().double().cpu()
        with torch.no_grad():
            if obs is not None and t >= cfg.burn_in:
                for i, (ox, oy) in enumerate(observe):
                    obs[i, :, t - cfg.burn_in] = rows_loss(ox, oy)
            dist = {k: v - w0[k] for k, v in w.items()}
            drift = {k: grads[k] * nbeta + gamma * dist[k] for k in w}                 # ∇U(w_t)
            u = nbeta * loss.double() + 0.5 * gamma * sum(d.reshape(C, -1).double().square().sum(1)
                                                          for d in dist.values())
            if prev is not None:
                accept[:, t - 1] = mala_log_ratio(prev[0], u, prev[1], prev[2], drift, prev[3], eps, keep) \
                    .clamp(max=0.0).exp().cpu()
            if rms:
                for k in w:
                    sq_avg[k].mul_(cfg.rmsprop_alpha).addcmul_(grads[k], grads[k], value=1 - cfg.rmsprop_alpha)
                precond = {k: 1.0 / (sq_avg[k].sqrt() + cfg.rmsprop_eps) for k in w}
            else:
                precond = None
            step, fwd_sq = {}, torch.zeros(C, dtype=torch.float64, device=u.device)
            for k, v in w.items():
                noise = torch.stack([torch.randn(v.shape[1:], generator=g, device=v.device) for g in gens])
                if keep is not None:
                    noise = noise.where(keep[k], 0.0)
                fwd_sq += 0.5 * noise.reshape(C, -1).double().square().sum(1)
                if precond is None:
                    step[k] = drift[k] * (-0.5 * eps) + noise * math.sqrt(eps)
                else:
                    step[k] = precond[k] * drift[k] * (-0.5 * eps) + (precond[k] * eps).sqrt() * noise
                if keep is not None:   # held coordinates stay at w* exactly, whatever the drift (even NaN)
                    step[k] = step[k].where(keep[k], 0.0)
                v.add_(step[k])
            prev = (u, fwd_sq, step, precond)
    return Chains(losses.numpy(), accept.numpy(), None if obs is None else obs.numpy())


@torch.no_grad()
def full_loss(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
              chunk: int = 4096) -> float:
    tot = 0.0
    for s in range(0, xs.shape[0], chunk):
        tot += float(loss_fn(model, xs[s:s + chunk], ys[s:s + chunk])) * xs[s:s + chunk].shape[0]
    return tot / xs.shape[0]


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
    if xs.shape[0] != cfg.n:
        raise ValueError(f"sampling dataset has {xs.shape[0]} sequences, config says n = {cfg.n}")
    buffers = dict(model.named_buffers())
    inits = {}
    for c in centers:
        if id(c) not in inits:
            inits[id(c)] = full_loss(lambda a, b, c=c: functional_call(model, (c, buffers), (a, b)), loss_fn, xs, ys)
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


# ---------------------------------------------------------------- when λ̂ measures the sampler (SPEC §7)

STABILITY_ITERS, STABILITY_TOL = 20, 1e-2   # Lanczos for λ_max: the flag needs the ratio to 1 %, not to 1e-3
HESSIAN_SEQUENCES = 256   # λ_max of L on the first ≤ 256 sampling sequences: on the default model (26 400 parameters)
# at steps 5 and 400 of a 400-step M16-B64 run, 29.78 and 42.94 against 29.75 and 42.32 on all 1024, at a quarter of
# the cost (0.6 s against 2.3-3.1 CPU s per checkpoint, 4-5 Lanczos iterations)


def stability_ratio(lambda_max: float, epsilon: float, gamma: float, nbeta: float) -> float:
    """ε (nβ λ_max + γ) / 4 (SPEC §7). Plain SGLD's drift on the localized quadratic multiplies the distance along
    the top eigenvector by 1 − (ε/2)(nβ λ_max + γ) each step: stable while that stays above −1, i.e. ratio < 1.
    (For rmsprop_sgld the step is ε G with a per-coordinate G ≤ 1/δ: the ratio as written understates it.)"""
    return epsilon * (nbeta * lambda_max + gamma) / 4


def top_eigenvalue(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                   center: dict[str, torch.Tensor], mask: dict[str, torch.Tensor | None] | None = None,
                   seed: int = 0) -> float:
    """λ_max of the Hessian of L (on the first HESSIAN_SEQUENCES sequences of (xs, ys)) at `center`, by Lanczos
    (iclnoise.geometry, ≤ STABILITY_ITERS Hessian-vector products); with a `mask` (`restriction`'s format) the top
    eigenvalue of the block of the coordinates it moves, m ⊙ H (m ⊙ v): the chains' own stability limit."""
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
    checkpoint (SPEC §7, `escaped`). Checkpoint k tests j when L(w*) moved detectably, |ΔL*| > 3 s with
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

# the evidence behind `unstable` and `escaped` (SPEC §7), in llc.parquet and rllc.parquet
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
