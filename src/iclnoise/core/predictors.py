"""Bayes predictors and behavioural metrics (method §3).

All predictors map (xs (B, K, D), ys (B, K)) to predictions (B, K) where prediction k uses only
(x_1, y_1, ..., x_{k-1}, y_{k-1}, x_k).
"""
from __future__ import annotations

import torch


def _exclusive_cumsum(a: torch.Tensor, dim: int) -> torch.Tensor:
    return a.cumsum(dim) - a


@torch.no_grad()
def dmmse(xs: torch.Tensor, ys: torch.Tensor, pool: torch.Tensor, noise_var: float,
          chunk: int = 16) -> torch.Tensor:
    """dMMSE_M: ŷ_k = t̂_kᵀ x_k, t̂_k = Σ_m softmax_m(−Σ_{j<k}(y_j − t_mᵀx_j)² / 2σ²) t_m.

    The first prediction uses the pool mean (all weights equal). Vectorised over sequences ×
    tasks, looping over the K tokens with a running sum of squared residuals (no (B, K, M)
    tensor). The softmax is shifted by its max and clamped at e^-80 (weights below that are
    < 1e-34 relative: zero in float32, and avoiding denormals makes it 3x faster).
    """
    B, K, D = xs.shape
    M = pool.shape[0]
    pool = pool.to(xs)
    pool_t = pool.T.contiguous()
    pool_1 = torch.cat([pool, torch.ones(M, 1, dtype=xs.dtype, device=xs.device)], 1)
    scale = -0.5 / noise_var
    out = torch.empty(B, K, dtype=xs.dtype, device=xs.device)
    acc, w, r = (torch.empty(min(chunk, B), M, dtype=xs.dtype, device=xs.device) for _ in range(3))
    for s in range(0, B, chunk):
        x = xs[s:s + chunk].transpose(0, 1).contiguous()                 # (K, b, D)
        y = ys[s:s + chunk].T.contiguous()                               # (K, b)
        b = x.shape[1]
        a_, w_, r_ = acc[:b], w[:b], r[:b]
        a_.zero_()
        for k in range(K):
            torch.sub(a_, a_.amin(-1, keepdim=True), out=w_)
            w_.mul_(scale).clamp_(min=-80.0).exp_()
            num_den = w_ @ pool_1                                        # (b, D + 1)
            t_hat = num_den[:, :D] / num_den[:, D:]
            out[s:s + b, k] = (t_hat * x[k]).sum(-1)
            if k < K - 1:
                torch.mm(x[k], pool_t, out=r_)
                r_.sub_(y[k].unsqueeze(1))
                a_.addcmul_(r_, r_)
    return out


@torch.no_grad()
def ridge(xs: torch.Tensor, ys: torch.Tensor, noise_var: float, prior_cov=None) -> torch.Tensor:
    """Ridge (Bayes for q_∞): t̂_k = (XᵀX + σ²I)⁻¹ Xᵀy over the first k−1 pairs; t̂_1 = 0.

    With `prior_cov` = Σβ (D, D; method §13) the generalised ridge, Bayes for t ~ N(0, Σβ):
    t̂_k = Σβ Xᵀ(X Σβ Xᵀ + σ²I)⁻¹ y = (XᵀX + σ² Σβ⁻¹)⁻¹ Xᵀy (push-through identity; Σβ positive definite).
    None: Σβ = I, the isotropic ridge (same arithmetic as Σβ⁻¹ = I without the inverse).
    """
    B, K, D = xs.shape
    dt = torch.float64
    x, y = xs.to(dt), ys.to(dt)
    A = _exclusive_cumsum(x.unsqueeze(-1) * x.unsqueeze(-2), dim=1)      # (B, K, D, D)
    prec = (torch.eye(D, dtype=dt, device=xs.device) if prior_cov is None
            else torch.linalg.inv(torch.as_tensor(prior_cov, dtype=dt, device=xs.device)))
    A = A + noise_var * prec
    b = _exclusive_cumsum(x * y.unsqueeze(-1), dim=1)                     # (B, K, D)
    t_hat = torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)
    return (t_hat * x).sum(-1).to(xs.dtype)


def token_losses(pred: torch.Tensor, ys: torch.Tensor, D: int) -> torch.Tensor:
    """ℓ_k / D: mean over sequences of (ŷ_k − y_k)², normalised by D; shape (K,)."""
    return (pred - ys).square().mean(0) / D


def delta(f: torch.Tensor, g: torch.Tensor, D: int) -> float:
    """Δ(f, g) = mean over sequences and tokens of (f − g)² / D."""
    return float((f - g).square().mean() / D)


def ridge_likeness(d_dmmse: float, d_ridge: float) -> float:
    """r = Δ(f, dMMSE) / (Δ(f, dMMSE) + Δ(f, ridge)); 1 = ridge-like, 0 = dMMSE-like."""
    total = d_dmmse + d_ridge
    return float("nan") if total == 0 else d_dmmse / total


def icl_score(per_token: torch.Tensor, k_early: int, k_late: int) -> float:
    """ℓ_{k_early} − ℓ_{k_late} (1-based token indices, Olsson et al.)."""
    return float(per_token[k_early - 1] - per_token[k_late - 1])
