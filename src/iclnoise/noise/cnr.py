"""Counterfactual noise replay, the formulas (method §13, CNR; seed 002 §4): the change of E f(θ_T) had a run's
noise covariance been Λ̃_t instead of Λ_t, from the recorded trajectory, without retraining.

The run is any discrete dynamics θ_{t+1} = Φ_t(θ_t) + ξ_t with ξ_t zero-mean of covariance Λ_t (in parameter space,
per step: for SGD-like noise Λ_t = η_t² A_t R'_t A_t), given as functions: `steps[t] = (Φ_t, θ_t)` with θ_t the
recorded state, and a metric f: θ → R^m (any number of metrics at once). Perturbing the noise by w_t,

    δ_{t+1} = J_t δ_t + w_t,              J_t = ∂Φ_t/∂θ at θ_t          (first order: the JVP)
    e_{t+1} = J_t e_t + ½ D²Φ_t[δ_t, δ_t]                              (the drift the noise induces)
    f̃ − f ≈ ∇f·δ_T  +  ∇f·e_T + ½ D²f[δ_T, δ_T],

and for zero-mean w independent across steps with E[w_t w_tᵀ] = Λ̃_t − Λ_t the first term vanishes in expectation
and the second is seed 002's

    Δ E f = ½ Σ_t tr(J_{T←t+1}ᵀ ∇²f J_{T←t+1} (Λ̃_t − Λ_t))  +  ∇f · Σ_s J_{T←s+1} ½ D²Φ_s[ΔC_s],
    ΔC_s = Σ_{t<s} J_{s←t+1} (Λ̃_t − Λ_t) J_{s←t+1}ᵀ  (the change of the state covariance at s).

Every product is a forward-mode JVP (a JVP of a JVP for D²), so no Jacobian or Hessian is formed. A noise that
enters the update itself (gradient noise through Adam) is an input u of the step, Φ_t(θ, u) with u = 0 on the
record: `propagate` on the map y = (θ, u) ↦ Φ_t, tangent (δ_t, u_t) and drift tangent (e_t, 0), gives
δ_{t+1} = J_t δ_t + B_t u_t and e_{t+1} = J_t e_t + ½ D²Φ_t[(δ_t, u_t), (δ_t, u_t)]: the input's own second order
(for Adam, v's growth by (1 − β2) u²) is in the drift.

Two estimators of the same quantity:
- `exact_change`: Λ̃_t − Λ_t given by signed factors Σ_i s_i w_i w_iᵀ; one path per (t, i): exact to rounding
  (the known answer on quadratic models, small problems only);
- `replay`: Hutchinson over noise draws: per probe, one path driven by u_t ~ N(0, Λ̃_t) and one by v_t ~ N(0, Λ_t),
  Δ̂ = mean(second(u) − second(v)), u and v drawn from the same random stream (paired: for Λ̃ = c Λ, u = √c v,
  which removes most of the probes' variance); its standard error from the pairs' spread, and the spread a single
  realisation adds (`sd_draw`, from the first-order terms of the same paths).

Approximations (what the prediction ignores; seed 002's bound E[(f̂ − f)²] ≤ C1 Σ η_t² ‖Λ̃_t − Λ_t‖²_F
+ C2 Σ η_t³ L² prices the first two):
1. the expansion stops at second order in the noise change: terms of third and higher order (D³Φ, the change of
   J_t along the perturbed path) are dropped, which is exact for linear Φ and quadratic f, and bounded by the
   Lipschitz constant L of the Hessian otherwise;
2. the derivatives are taken on the recorded (noisy) trajectory, standing for the mean trajectory the expansion
   is about: the difference is O(noise) × L;
3. the two noises are treated as independent (a retraining with the same seeds couples them: its realised change
   scatters less than `sd_draw` says, so the interval is conservative there);
4. whatever the caller's Φ_t leaves out is the caller's approximation, stated where Φ_t is built (for AdamW,
   iclnoise.run.replay: the state (θ, m, v), the clip factor held, a sub-sampled gradient Jacobian);
5. the expansion's range is the map's: for Adam, |δg_i| ≪ √v̂_i on every coordinate, which the early steps
   (v̂ from one or two batches, a = 1/(√v̂ + ε) up to 1e6 measured) and parameter noise shaped by that a leave at
   once; past it the tangent map is expansive where AdamW itself renormalises (README, "Counterfactual noise
   replay", for the measurements).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import jvp, vmap

Map = Callable[[torch.Tensor], torch.Tensor]
Step = tuple[Map, torch.Tensor]   # (Φ_t, θ_t)
Draw = Callable[[int, torch.Generator], torch.Tensor | None]   # (t, generator) → a noise draw at step t


@dataclass(frozen=True)
class Estimate:
    """CNR's predicted change of E f per metric: `delta` (second order), `se` (from the probes), `sd_draw` (the
    spread of one realisation around it from the noise draws), over `probes` probes; `interval` at z."""

    delta: torch.Tensor
    se: torch.Tensor
    sd_draw: torch.Tensor
    probes: int

    def interval(self, z: float = 1.96) -> tuple[torch.Tensor, torch.Tensor]:
        half = z * (self.se.square() + self.sd_draw.square()).sqrt()
        return self.delta - half, self.delta + half


def _jvp2(fn: Map, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Dfn[v], D²fn[v, v]) at x: a JVP of a JVP."""
    _, (d1, d2) = jvp(lambda y: jvp(fn, (y,), (v,)), (x,), (v,))
    return d1, d2


def propagate(phi: Map, theta: torch.Tensor, delta: torch.Tensor | None,
              e: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One step of the perturbation: (J δ, J e + ½ D²Φ[δ, δ]) at θ (None: no perturbation yet)."""
    if delta is None:
        return None, e
    jd, d2 = _jvp2(phi, theta, delta)
    return jd, 0.5 * d2 if e is None else jvp(phi, (theta,), (e,))[1] + 0.5 * d2


def propagate1(phi: Map, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """One step of the perturbation to first order: J δ at θ (propagate's first term, one forward-mode product)."""
    return jvp(phi, (theta,), (delta,))[1]


def metric_terms(f: Map, theta_T: torch.Tensor, delta: torch.Tensor | None,
                 e: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇f·δ_T, ∇f·e_T + ½ D²f[δ_T, δ_T]): the first- and second-order change of f."""
    if delta is None:
        zero = torch.zeros_like(f(theta_T))
        return zero, zero
    df, d2f = _jvp2(f, theta_T, delta)
    return df, 0.5 * d2f if e is None else jvp(f, (theta_T,), (e,))[1] + 0.5 * d2f


def path(steps: Sequence[Step], f: Map, theta_T: torch.Tensor, noise: Sequence[torch.Tensor | None],
         start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) order change of f(θ_T) when w_t = noise[t - start] is added after step t, t ≥ start (None:
    nothing added): first = ∇f·δ_T, second = ∇f·e_T + ½ D²f[δ_T, δ_T] (module docstring)."""
    delta = e = None
    for t in range(start, len(steps)):
        delta, e = propagate(*steps[t], delta, e)
        w = noise[t - start]
        if w is not None:
            delta = w.clone() if delta is None else delta + w
    return metric_terms(f, theta_T, delta, e)


def exact_change(steps: Sequence[Step], f: Map, theta_T: torch.Tensor,
                 factors: Sequence[Sequence[tuple[float, torch.Tensor]]]) -> torch.Tensor:
    """Δ E f to second order, exactly: factors[t] lists (s_i, w_i) with Λ̃_t − Λ_t = Σ_i s_i w_i w_iᵀ; one path
    per (t, i) (T × rank paths: for small problems and known answers)."""
    total = torch.zeros_like(f(theta_T))
    for t, cols in enumerate(factors):
        if not cols:
            continue
        s = torch.tensor([c[0] for c in cols], dtype=theta_T.dtype)
        w = torch.stack([c[1] for c in cols])
        second = vmap(lambda v: path(steps, f, theta_T, [v] + [None] * (len(steps) - t - 1), start=t)[1])(w)
        total = total + (s.view(-1, *[1] * (second.dim() - 1)) * second).sum(0)
    return total


def replay(steps: Sequence[Step], f: Map, theta_T: torch.Tensor, draw_cf: Draw, draw_base: Draw, probes: int,
           seed: int = 0) -> Estimate:
    """Δ E f by Hutchinson over noise draws: draw_cf(t, gen) ~ N(0, Λ̃_t), draw_base(t, gen) ~ N(0, Λ_t) (either may
    return None: no noise at t); `probes` ≥ 2 paths of each."""
    if probes < 2:
        raise ValueError(f"replay needs probes >= 2 for its standard error, got {probes}")
    T, zero = len(steps), torch.zeros_like(theta_T)
    batched = vmap(lambda noise: path(steps, f, theta_T, noise))   # every probe's path at once

    def run(draw):   # both noises from the same stream: paired draws (u = √c v when Λ̃ = c Λ)
        gen = torch.Generator().manual_seed(seed)
        noise = [torch.stack([_or(draw(t, gen), zero) for _ in range(probes)]) for t in range(T)]
        return batched(noise)

    return estimate(*run(draw_cf), *run(draw_base))


def estimate(fu: torch.Tensor, su: torch.Tensor, fv: torch.Tensor, sv: torch.Tensor) -> Estimate:
    """The Estimate from paired paths (probes, metrics): first- and second-order terms driven by the counterfactual
    noise (fu, su) and by the run's own (fv, sv), probe k of both from the same draws."""
    probes = su.shape[0]
    se = ((su - sv).var(0) / probes).sqrt()
    return Estimate(su.mean(0) - sv.mean(0), se, (fu.square().mean(0) + fv.square().mean(0)).sqrt(), probes)


def _or(x: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if x is None else x


def bound_terms(lrs: Sequence[float], dcov_fro: Sequence[float], lipschitz: float) -> tuple[float, float]:
    """Seed 002's two sums, (Σ η_t² ‖Λ̃_t − Λ_t‖²_F, Σ η_t³ L²): E[(f̂ − f)²] ≤ C1·first + C2·second."""
    return (math.fsum(e * e * d * d for e, d in zip(lrs, dcov_fro)),
            math.fsum(e ** 3 * lipschitz ** 2 for e in lrs))
