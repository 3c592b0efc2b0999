"""Localized SGLD chains (method §7) in three parts, kept apart as devinterp keeps its optimizer, its sampling loop and
its callbacks:

- the update kernel (`SGLDKernel`): one SGLD or RMSProp-SGLD step of every row, and the MALA acceptance probability of
  the step before;
- the execution strategy (`Execution`): every row's mini-batch and its loss and gradient at the row's own
  parameters, in one call of a model that runs stacked parameters (`stacks_runs`, iclnoise.core.model), a vmap over
  rows,
  or a Python loop;
- observers (`LossTrace`, `Acceptance`, `FullLosses`): what the chains leave behind, read at every step before the
  move.

`sgld_chains` runs them over the rows (centers × chains): the whole-network λ̂ (iclnoise.probes.llc) and, with one mask
per center and the φ datasets observed, the refined λ̂_C and the susceptibilities (iclnoise.probes.refined). The
estimators and the sampler's diagnostics (stability ratio, escape evidence: iclnoise.probes.llc) read what the observers
leave.

Target w ~ exp(−U(w)), U(w) = nβ L_n(w) + (γ/2)‖w − w*‖². Kernels (`LLCConfig.method`), both per coordinate with a
preconditioner G (G = 1 for plain SGLD):

    sgld:          w ← w − (ε/2) (nβ ∇L_batch(w) + γ (w − w*)) + √ε ξ,                 ξ ~ N(0, I)
    rmsprop_sgld:  V ← α V + (1 − α) ∇L_batch(w)²,   G = 1 / (√V + δ)
                   w ← w − (ε/2) G (nβ ∇L_batch(w) + γ (w − w*)) + √(ε G) ξ

(the RMSProp rule is devinterp 2.0.1's `rmsprop_sgld`: V accumulates the squared loss gradient, not
scaled by nβ, updated before it is used; defaults α = 0.99, δ = 0.1).

Each chain owns a generator seeded by (seed, chain), so results do not depend on how many chains run together, in
which order, or how they are batched.

MALA diagnostic (as devinterp's `MalaAcceptanceRate`): for every pair of consecutive SGLD steps
w_t → w_{t+1}, the Metropolis-adjusted acceptance probability that step would have had as a
Langevin proposal q(w'|w) = N(w − (ε/2) G ∇U(w), ε G):

    a_t = min(1, exp(U(w_t) − U(w_{t+1}) + log q(w_t | w_{t+1}) − log q(w_{t+1} | w_t)))

with U and ∇U read on each step's own mini-batch (no extra pass) and G the preconditioner of
step t at both ends. Its mean over the draws says how far the discretisation is from exact:
near 1 the step is small for the target; falling towards 0 the chain is not sampling U.

Weight restriction (method §7, refined LLC; iclnoise.probes.refined): with a 0/1 mask m per coordinate a chain moves
only the coordinates with m = 1 and holds the others at w* exactly,

    w ← w + m ⊙ step,

which samples the posterior of the restricted coordinates given the others at w*; U, the noise term Σξ²/2 and
the reverse proposal term of the MALA ratio sum over the moving coordinates only. The noise is drawn for every
coordinate all the same, so a chain sees the same random numbers with or without a mask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.func import functional_call, grad_and_value, vmap
from tqdm import tqdm

from ..core.model import LossFn
from ..core.probe_sections import LLCConfig


@dataclass
class Chains:
    """What the chains leave behind: mini-batch losses (chains, steps), MALA acceptance
    probabilities (chains, steps − 1) of the transitions t → t + 1, and the full-set losses of the
    `observe` datasets at every post-burn-in w_t (datasets, chains, draws), None without them."""
    loss: np.ndarray
    accept: np.ndarray
    obs: np.ndarray | None = None


def chain_generators(seed: int, chains: list[int], device) -> list[torch.Generator]:
    """One generator per chain, seeded by (seed, chain) alone."""
    gens = []
    for c in chains:
        g = torch.Generator(device=device)
        g.manual_seed(int(np.random.SeedSequence([seed, c, 0x5C1D]).generate_state(1)[0]))
        gens.append(g)
    return gens


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


# ---------------------------------------------------------------- the update kernel

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


class SGLDKernel:
    """The update kernel: localized SGLD or RMSProp-SGLD (`cfg.method`) around w0 (the rows' centers), restricted
    to the coordinates `keep` moves (None: all), with the MALA acceptance probability of each transition."""

    def __init__(self, cfg: LLCConfig, w0: dict[str, torch.Tensor], keep: dict | None = None):
        self.cfg, self.w0, self.keep = cfg, w0, keep
        self.nbeta = cfg.resolved_nbeta()
        self.sq_avg = {k: torch.zeros_like(v) for k, v in w0.items()} if cfg.method == "rmsprop_sgld" else None
        self.prev = None   # (U_t, Σξ²/2, step, G) of the last transition, for the MALA ratio

    def potential(self, w: dict, grads: dict, loss: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """∇U(w_t) and U(w_t) per row, from the rows' mini-batch losses and their gradients."""
        dist = {k: v - self.w0[k] for k, v in w.items()}
        drift = {k: grads[k] * self.nbeta + self.cfg.gamma * dist[k] for k in w}
        u = self.nbeta * loss.double() + 0.5 * self.cfg.gamma * sum(d.reshape(d.shape[0], -1).double().square().sum(1)
                                                                    for d in dist.values())
        return drift, u

    def acceptance(self, drift: dict, u: torch.Tensor) -> torch.Tensor | None:
        """The MALA acceptance probability of the last transition w_{t−1} → w_t per row (None before the first)."""
        if self.prev is None:
            return None
        u_prev, fwd_sq, step, precond = self.prev
        return mala_log_ratio(u_prev, u, fwd_sq, step, drift, precond, self.cfg.epsilon, self.keep).clamp(max=0.0).exp()

    def preconditioner(self, grads: dict) -> dict | None:
        """G of this step: None (= 1) for sgld; for rmsprop_sgld, V updated with this step's gradient, then
        1 / (√V + δ)."""
        if self.sq_avg is None:
            return None
        a = self.cfg.rmsprop_alpha
        for k, g in grads.items():
            self.sq_avg[k].mul_(a).addcmul_(g, g, value=1 - a)
        return {k: 1.0 / (v.sqrt() + self.cfg.rmsprop_eps) for k, v in self.sq_avg.items()}

    def move(self, w: dict, grads: dict, drift: dict, u: torch.Tensor, gens: list[torch.Generator]) -> None:
        """w_t → w_{t+1} in place, one noise draw per row from its own generator; held coordinates stay at w*."""
        eps, keep = self.cfg.epsilon, self.keep
        precond = self.preconditioner(grads)
        step, fwd_sq = {}, torch.zeros(len(gens), dtype=torch.float64, device=u.device)
        for k, v in w.items():
            # ξ in torch's default dtype (float32) whatever w's; plain SGLD scales it there, RMSProp-SGLD in G's dtype
            noise = torch.stack([torch.randn(v.shape[1:], generator=g, device=v.device) for g in gens])
            if keep is not None:
                noise = noise.where(keep[k], 0.0)
            fwd_sq += 0.5 * noise.reshape(len(gens), -1).double().square().sum(1)
            if precond is None:
                step[k] = drift[k] * (-0.5 * eps) + noise * math.sqrt(eps)
            else:
                step[k] = precond[k] * drift[k] * (-0.5 * eps) + (precond[k] * eps).sqrt() * noise
            if keep is not None:   # held coordinates stay at w* exactly, whatever the drift (even NaN)
                step[k] = step[k].where(keep[k], 0.0)
            v.add_(step[k])
        self.prev = (u, fwd_sq, step, precond)


# ---------------------------------------------------------------- the execution strategy

class Execution:
    """Every row's mini-batch and its loss and gradient at the row's own parameters w[k][row]: the rows in one call of
    a model that runs stacked parameters, a vmap over rows, or (vectorize=False) a Python loop; the same numbers up
    to float summation order. `cfg.micro_batches` splits each gradient's batch (memory only)."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, cfg: LLCConfig, rows: int, n: int, vectorize: bool):
        self.model, self.loss_fn, self.cfg, self.rows, self.n = model, loss_fn, cfg, rows, n
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
        self.full_batch = cfg.batch >= n   # the whole sampling set every step; otherwise batches with replacement
        self.how = ("loop" if not vectorize else
                    "stacked" if getattr(model, "stacks_runs", False) and cfg.micro_batches == 1 else "vmap")

    def draw(self, xs: torch.Tensor, ys: torch.Tensor, gens: list[torch.Generator]):
        """This step's mini-batch of every row, from the row's generator (full batch: one shared copy of the data)."""
        if self.full_batch:
            return xs, ys
        idx = torch.stack([torch.randint(0, self.n, (self.cfg.batch,), generator=g, device=xs.device) for g in gens])
        return xs[idx], ys[idx]

    def loss_at(self, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(lambda a, b: functional_call(self.model, (params, self.buffers), (a, b)), x, y)

    def grad_loss(self, params: dict, x: torch.Tensor, y: torch.Tensor):
        """(∇L, L) of one row, the batch in cfg.micro_batches parts weighted by their sizes."""
        if self.cfg.micro_batches == 1:
            return grad_and_value(self.loss_at)(params, x, y)
        g_tot, l_tot = None, 0.0
        for xm, ym in zip(x.chunk(self.cfg.micro_batches), y.chunk(self.cfg.micro_batches)):
            g, l_ = grad_and_value(self.loss_at)(params, xm, ym)
            wgt = xm.shape[0] / x.shape[0]
            g_tot = {k: v * wgt for k, v in g.items()} if g_tot is None else {k: g_tot[k] + v * wgt
                                                                              for k, v in g.items()}
            l_tot = l_tot + l_ * wgt
        return g_tot, l_tot

    def grad(self, w: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The gradients (rows, ...) and mini-batch losses (rows,) of every row on its batch (x, y from `draw`)."""
        if self.how == "stacked":   # the model runs stacked parameters (rows, ...)
            with torch.enable_grad():
                leaves = {k: v.detach().requires_grad_() for k, v in w.items()}
                if self.full_batch:
                    x, y = x.expand(self.rows, *x.shape), y.expand(self.rows, *y.shape)
                loss = self.loss_at(leaves, x, y)
                return dict(zip(leaves, torch.autograd.grad(loss.sum(), list(leaves.values())))), loss.detach()
        if self.how == "vmap":
            return vmap(self.grad_loss, in_dims=(0, None, None) if self.full_batch else 0)(w, x, y)
        outs = [self.grad_loss({k: v[c] for k, v in w.items()}, x if self.full_batch else x[c],
                               y if self.full_batch else y[c]) for c in range(self.rows)]
        return {k: torch.stack([o[0][k] for o in outs]) for k in w}, torch.stack([o[1] for o in outs])

    def full_loss(self, w: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every row's loss on the whole set (x, y) at w, in chunks of the SGLD batch size (float64, on the CPU)."""
        tot = 0.0
        for xc, yc in zip(x.split(self.cfg.batch), y.split(self.cfg.batch)):
            if self.how == "loop":
                l_ = torch.stack([self.loss_at({k: v[c] for k, v in w.items()}, xc, yc) for c in range(self.rows)])
            elif self.how == "stacked":
                l_ = self.loss_at(w, xc.expand(self.rows, *xc.shape), yc.expand(self.rows, *yc.shape))
            else:
                l_ = vmap(self.loss_at, in_dims=(0, None, None))(w, xc, yc)
            tot = tot + l_.double() * (xc.shape[0] / x.shape[0])
        return tot.cpu()


# ---------------------------------------------------------------- observers

@dataclass
class SGLDStep:
    """What observers see at step t, before the move: the rows' parameters w_t, their mini-batch losses at w_t, and
    the MALA acceptance probability of w_{t−1} → w_t (None at t = 0)."""
    t: int
    w: dict
    loss: torch.Tensor
    accept: torch.Tensor | None


class LossTrace:
    """The mini-batch loss of every row at every step, (rows, steps): E_w[L] of λ̂ and the traces."""

    def __init__(self, rows: int, steps: int):
        self.loss = torch.empty(rows, steps, dtype=torch.float64)

    def __call__(self, s: SGLDStep) -> None:
        self.loss[:, s.t] = s.loss.detach().double().cpu()


class Acceptance:
    """The MALA acceptance probability of every row's transitions t → t + 1, (rows, steps − 1)."""

    def __init__(self, rows: int, steps: int):
        self.accept = torch.empty(rows, max(steps - 1, 0), dtype=torch.float64)

    def __call__(self, s: SGLDStep) -> None:
        if s.accept is not None:
            self.accept[:, s.t - 1] = s.accept.cpu()


class FullLosses:
    """Every row's full-set loss on each dataset at every post-burn-in w_t, (datasets, rows, draws): the losses ℓ_q,
    ℓ_q' the susceptibilities' φ and Δ are made of (iclnoise.probes.refined)."""

    def __init__(self, datasets: list[tuple[torch.Tensor, torch.Tensor]], execution: Execution, burn_in: int,
                 draws: int):
        self.datasets, self.execution, self.burn_in = datasets, execution, burn_in
        self.obs = torch.empty(len(datasets), execution.rows, draws, dtype=torch.float64)

    def __call__(self, s: SGLDStep) -> None:
        if s.t >= self.burn_in:
            for i, (x, y) in enumerate(self.datasets):
                self.obs[i, :, s.t - self.burn_in] = self.execution.full_loss(s.w, x, y)


# ---------------------------------------------------------------- the chains

def run_chains(kernel: SGLDKernel, execution: Execution, w: dict, xs: torch.Tensor, ys: torch.Tensor,
               gens: list[torch.Generator], steps: int, observers: list[Callable[[SGLDStep], None]],
               progress: bool = False) -> None:
    """`steps` SGLD steps of every row from w (moved in place): per step the rows' batches and gradients
    (`execution`), the observers at w_t, then the kernel's move to w_{t+1}."""
    for t in tqdm(range(steps), disable=not progress, desc="SGLD", mininterval=5):
        grads, loss = execution.grad(w, *execution.draw(xs, ys, gens))
        with torch.no_grad():
            drift, u = kernel.potential(w, grads, loss)
            seen = SGLDStep(t, w, loss, kernel.acceptance(drift, u))
            for observe in observers:
                observe(seen)
            kernel.move(w, grads, drift, u, gens)


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
    (iclnoise.probes.refined). `observe`: datasets (x, y) whose full-set loss is read at every post-burn-in w_t."""
    chains = list(range(cfg.chains)) if chains is None else chains
    centers = centers or [{k: v.detach() for k, v in model.named_parameters()}]
    if masks is not None and len(masks) != len(centers):
        raise ValueError(f"{len(masks)} masks for {len(centers)} centers: one mask per center")
    rows, steps = len(chains) * len(centers), cfg.burn_in + cfg.draws
    w0 = {k: torch.stack([c[k].detach() for c in centers]).repeat_interleave(len(chains), 0)
          for k, _ in model.named_parameters()}
    kernel = SGLDKernel(cfg, w0, None if masks is None else restriction(model, masks, len(chains)))
    execution = Execution(model, loss_fn, cfg, rows, xs.shape[0], vectorize)
    gens = [g for _ in centers for g in chain_generators(cfg.seed, chains, xs.device)]
    trace, accept = LossTrace(rows, steps), Acceptance(rows, steps)
    losses = FullLosses(observe, execution, cfg.burn_in, cfg.draws) if observe else None
    run_chains(kernel, execution, {k: v.clone() for k, v in w0.items()}, xs, ys, gens, steps,
               [trace, accept] + ([losses] if losses else []), progress)
    return Chains(trace.loss.numpy(), accept.accept.numpy(), None if losses is None else losses.obs.numpy())
