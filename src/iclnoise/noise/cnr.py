"""The first-order perturbation of a run's dynamics, the formulas (method §13, "A first-order pathwise estimator"):
how a change w_t added at each step t moves θ_T and a metric f(θ_T), carried along the recorded trajectory.

The run is any discrete dynamics θ_{t+1} = Φ_t(θ_t) + ξ_t, given step by step as a function Φ_t and its recorded
state θ_t, and f: θ → R^m (any number of metrics at once). Perturbing the noise by w_t,

    δ_{t+1} = J_t δ_t + w_t,   J_t = ∂Φ_t/∂θ at θ_t,      f̃ − f ≈ ∇f · δ_T   (first order).

Each product is a forward-mode JVP, so no Jacobian is formed. A noise that enters the update itself (gradient noise
through AdamW) is an input u of the step, Φ_t(θ, u) with u = 0 on the record: `propagate` on the map
y = (θ, u) ↦ Φ_t with the tangent (δ_t, u_t) gives δ_{t+1} = J_t δ_t + B_t u_t.

Seed 002's second-order expansion (the drift e_t and ½ D²f[δ_T, δ_T], by which a covariance change moves E f) was
the linearised replay of issues 46 and 67. It was removed: against CNR's ground truth its Spearman ρ was −0.73 for r
where this first order reached 0.96 on the same means, and on the science setting it cost ≈ 20× retraining
(docs/reproductions.md, "Counterfactual noise replay")."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import jvp

Map = Callable[[torch.Tensor], torch.Tensor]


def propagate(phi: Map, theta: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """One step of the perturbation: J δ, the JVP of Φ at θ along δ."""
    return jvp(phi, (theta,), (delta,))[1]


def change(f: Map, theta_T: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """∇f · δ_T: the first-order change of f(θ_T) along δ_T."""
    return jvp(f, (theta_T,), (delta,))[1]
