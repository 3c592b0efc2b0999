"""Theorem 1 of seed 002 as a known answer (method §13): deep linear attention trained with preconditioned
Langevin noise Λ = P Σβ P in its readout block.

The claim. Seed 002, Theorem 1: a deep linear attention model ŷq = wᵀ H(φq, {φk, yk}), trained with
preconditioned Langevin dynamics dθ = −P ∇L dt + √(2T) B dW at temperature T, with noise covariance
B Bᵀ = Λ = P Σβ P in the last-layer block, has at stationarity the predictor
    ŷq ≈ φqᵀ Σβ Φ (Φᵀ Σβ Φ + (σ²/T) I)⁻¹ y                                                      (*)
on new prompts: the posterior mean with prior N(0, Σβ) and noise variance σ²/T.

Our reading (what is parameterised how).
- Features are the inputs, φ = x (A1 with the identity feature map); tasks β ~ N(0, Σβ), y = xᵀβ + ε.
- Model: L layers of linear self-attention (no softmax, no MLP) in the reduced parameterisation of
  von Oswald et al. (2023) and Ahn et al. (2023), where layer l's key-query block is Γ_l (D × D) and the
  query's label slot carries the running estimate: t_0 = 0, t_l = t_{l−1} + Γ_l Xᵀ(y − X t_{l−1}) / K,
  ŷq = xqᵀ t_L. The readout block (the theorem's w) is Γ_L: ŷq = xqᵀ t_{L−1} + ⟨Γ_L, xq g_Lᵀ⟩ with
  H = xq g_Lᵀ, g_L = Xᵀ(y − X t_{L−1}) / K. Its rows live in task space, so Λ acts on them: every
  column of Γ_L gets noise N(0, 2ηT P Σ P) per step, independent across columns (Λ = I ⊗ P Σ P).
- P: a constant positive diagonal preconditioner (A2), applied to the readout's gradient; P = I is SGD.
- T: the temperature of the injected noise, in the units of the loss L(Γ) = ½ mean over the training
  prompts of (ŷq − yq)²; one step is Γ ← Γ − η P ∇L, then Γ_L += √(2ηT) P Σ^½ Ξ (Ξ standard normal).
- Gradients are full-batch over a fixed training set of prompts, so the injected noise is the only noise.
- "The learned predictor" at stationarity: the predictor of the parameters averaged over the tail of the
  run (Polyak averaging; exact for the stationary mean in Γ_L, in which ŷ is linear).
- Misaligned Λ: Σ replaced by R Σβ Rᵀ, R a random rotation (same spectrum, so the same trace).

Why (*) cannot hold in general, and what the tests therefore measure. For L = 1 the loss is quadratic in
Γ_1, the Langevin drift is linear, and the stationary mean is the loss minimiser Γ* whatever T and Λ are:
the mean predictor does not depend on the temperature or the shape of the noise at all, while (*) moves
with T (σ²/T → ∞ shrinks it to 0 as T → 0). Only for L ≥ 2 can noise in Γ_L shift the mean, through the
noise-averaged loss seen by the earlier layers. `iclnoise.core.linear_attention` measures, on new prompts, the
distance of the learned predictor to (*) and to the Bayes predictor (σ², T-independent) as T and the
training length vary, aligned vs misaligned; tests/test_linear_attention.py asserts what was measured.

Measured (D = 4, K = 8, σ² = 0.25, power-law Σβ with exponent 2 (λ = 2.81, 0.70, 0.31, 0.18), misaligned
basis ‖Σβ − RΣβRᵀ‖_F = 3.4; Δ on 2048-4096 new prompts; one noise seed per cell, no error bars):
- L = 1, 256 prompts, η = 0.3: the tail-averaged predictor stays at the loss minimiser: Δ(f, f_min) =
  0.0007 / 0.0008 (T = 0.01, aligned / misaligned), 0.0022 / 0.0024 (T = 0.03), while (*) is 0.31 (T = 0.01)
  and 0.19 (T = 0.03) away from f_min. Distance to (*): 0.31 / 0.32 (T = 0.01), 0.20 / 0.21 (T = 0.03);
  to the Bayes predictor 0.32-0.33 throughout (the one-layer class's own error).
- L = 2, 1024 prompts, η = 0.05 (experiments/theorem1.py). No noise: Δ to Bayes 0.124 (1000 and 4000 steps, the
  class's error). The noiseless predictor f0 is already 0.71 / 0.55 / 0.31 / 0.14 from (*) at T = 0.001 /
  0.003 / 0.01 / 0.03, because (*) itself moves (it is 0.83 / 0.67 / 0.42 / 0.21 from Bayes). Langevin,
  2000 steps, seeds 0-2, aligned vs misaligned: Δ to (*) 0.33 0.26 0.34 vs 0.39 0.31 0.32 (T = 0.01),
  0.22 0.11 0.21 vs 0.27 0.15 0.17 (T = 0.03); Δ to Bayes 0.149-0.157 (T = 0.01), 0.15-0.20 (T = 0.03).
  Seed 0 at 1000 / 4000 steps, T = 0.03: 0.29 / 0.15 aligned vs 0.15 / 0.18 misaligned. So the noise moves
  the predictor away from Bayes by seed-dependent amounts but not towards (*) (mean 0.18 aligned, 0.19
  misaligned at T = 0.03 against 0.14 without noise), and the paired aligned − misaligned differences
  (−0.06, −0.05, +0.02 at T = 0.01; −0.05, −0.04, +0.05 at T = 0.03) change sign across seeds. At η = 0.1
  with T ≥ 0.1, or η = 0.3 at any T, the two-layer run diverges, so T near 1 (where (*) is Bayes) is out
  of reach in these units.
So Theorem 1 as stated does not hold for this surrogate: not at L = 1 (provably: the mean ignores T and Λ)
and not in these L = 2 measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .predictors import delta, ridge


@dataclass(frozen=True)
class Langevin:
    """One training run: `layers` L, temperature T, step size η, steps, tail share averaged, noise seed."""
    layers: int
    T: float
    lr: float
    steps: int
    tail: float = 0.5
    seed: int = 0


def predict(gammas: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """ŷq = xqᵀ t_L (B,) for prompts xs (B, K + 1, D), ys (B, K + 1): the last token is the query (its
    label unused); t_l = t_{l−1} + Γ_l Xᵀ(y − X t_{l−1}) / K with gammas (L, D, D), t_0 = 0."""
    X, y, xq = xs[:, :-1], ys[:, :-1], xs[:, -1]
    t = torch.zeros_like(xq)
    for g in gammas:
        r = y - torch.einsum("bkd,bd->bk", X, t)
        t = t + torch.einsum("ij,bj->bi", g, torch.einsum("bkd,bk->bd", X, r)) / X.shape[1]
    return (xq * t).sum(-1)


def posterior_mean(xs: torch.Tensor, ys: torch.Tensor, prior_cov: np.ndarray, noise_var: float) -> torch.Tensor:
    """(*) at the query: xqᵀ Σβ Xᵀ(X Σβ Xᵀ + noise_var I)⁻¹ y over the K context pairs (B,)."""
    return ridge(xs, ys, noise_var, prior_cov)[:, -1]


def one_layer_optimum(prior_cov: np.ndarray, K: int, noise_var: float) -> np.ndarray:
    """The loss minimiser of the one-layer model, closed form for x ~ N(0, I), h = Xᵀy / K:
    Γ* = E[β hᵀ] E[h hᵀ]⁻¹ = Σβ ((K+1)/K Σβ + (tr Σβ + σ²)/K I)⁻¹ (Wishart: E[WAW] = K(K+1)A + K tr(A) I)."""
    D = prior_cov.shape[0]
    return prior_cov @ np.linalg.inv((K + 1) / K * prior_cov + (np.trace(prior_cov) + noise_var) / K * np.eye(D))


def train(xs: torch.Tensor, ys: torch.Tensor, noise_cov: np.ndarray, cfg: Langevin,
          precond: np.ndarray | None = None) -> torch.Tensor:
    """Preconditioned Langevin on the fixed training prompts (xs, ys); returns the tail-averaged Γ (L, D, D).

    noise_cov: Σ of the readout noise Λ = P Σ P (Σβ aligned, R Σβ Rᵀ misaligned); precond: P's diagonal
    (None: P = I). Gradients in float64, full batch."""
    D = xs.shape[-1]
    dt = torch.float64
    xs, ys = xs.to(dt), ys.to(dt)
    p = torch.ones(D, dtype=dt) if precond is None else torch.as_tensor(precond, dtype=dt)
    noise = p[:, None] * torch.as_tensor(np.linalg.cholesky(noise_cov), dtype=dt)      # P Σ^½
    gen = torch.Generator().manual_seed(cfg.seed)
    gammas = torch.zeros(cfg.layers, D, D, dtype=dt, requires_grad=True)
    start = int(cfg.steps * (1 - cfg.tail))
    avg = torch.zeros_like(gammas)
    scale = (2 * cfg.lr * cfg.T) ** 0.5
    for step in range(cfg.steps):
        loss = 0.5 * (predict(gammas, xs, ys) - ys[:, -1]).square().mean()
        (grad,) = torch.autograd.grad(loss, gammas)
        with torch.no_grad():
            grad[-1] = p[:, None] * grad[-1]
            gammas -= cfg.lr * grad
            if cfg.T > 0:
                gammas[-1] += scale * noise @ torch.randn(D, D, generator=gen, dtype=dt)
            if step >= start:
                avg += gammas
    return avg / (cfg.steps - start)


def distances(gammas: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor, prior_cov: np.ndarray, noise_var: float,
              T: float) -> dict[str, float]:
    """Δ (mean squared difference / D, method §3) on new prompts from the learned predictor to (*) at σ²/T
    ('to_theorem') and to the Bayes predictor at σ² ('to_bayes')."""
    D = xs.shape[-1]
    f = predict(gammas, xs.to(gammas.dtype), ys.to(gammas.dtype)).float()
    out = {"to_bayes": delta(f, posterior_mean(xs, ys, prior_cov, noise_var), D)}
    out["to_theorem"] = (delta(f, posterior_mean(xs, ys, prior_cov, noise_var / T), D) if T > 0 else
                         delta(f, torch.zeros_like(f), D))   # σ²/T → ∞: (*) is 0
    return out
