"""Preconditioned noise exposure (method §6): gradient-noise covariance, Adam's preconditioner, P-NE.

At a logged step t, with B the batch, η_t the learning rate and A_t = diag(a), a = 1/(sqrt(v̂_t) + δ):

    diag(C_t) ≈ m · Var_k(ĝ_k)          K group gradients of m sequences each (m = 1: per-example)
    NE_t      = η_t · κ · Σ_i a_i² C_ii / B        κ = 1 for AdamW (dampened momentum; method §6)
    Curv_t    = Tr(A_t Ĥ A_t) = Σ_i a_i² Ĥ_ii      Ĥ = Gauss–Newton (default) or Hessian diagonal, Hutchinson
                                                   probes on a held-out batch (never trained on), measured on
                                                   logged steps; A_t is the step's own (injection's closed loop)
    P-NE*_t   = NE_t / max(ε, Curv_t);   integrated exposure = Σ_t P-NE*_t · (steps the row stands for)
    seed-001 form: η_t² · Tr(A C A) / B;  B_simple = Tr(C) / |G|²  with |G|² = |ḡ|² − Tr(C)/B (unbiased)

Injected noise (iclnoise.noise) adds its own covariance R' to C/B; `ne_total` counts both, and the
post-clip columns multiply by c², c the factor gradient clipping applied to the step. The injected
columns of a row are exact sums over the steps the row stands for (logged per step by the injector),
so integrals of injected exposure are exact, not point values times an interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch.func import functional_call, grad, vmap

from ..core.adam import precondition
from ..core.model import LossFn
from ..core.runspec import KEY_FIELDS


def group_grads(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                groups: int) -> torch.Tensor:
    """(groups, P): the flat gradient of the mean loss over each of `groups` equal slices of the batch,
    all slices in one vmapped pass (groups = batch size gives per-example gradients)."""
    B = xs.shape[0]
    if B % groups:
        raise ValueError(f"batch {B} is not divisible into {groups} gradient groups")
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def loss(p, x, y):
        return loss_fn(lambda a, b: functional_call(model, (p, buffers), (a, b)), x, y)

    m = B // groups
    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs.reshape(groups, m, *xs.shape[1:]),
                                               ys.reshape(groups, m, *ys.shape[1:]))
    return torch.cat([g[n].reshape(groups, -1) for n in names], dim=1)


def stacked_group_grads(model: torch.nn.Module, loss_fn: LossFn, params: dict[str, torch.Tensor], xs: torch.Tensor,
                        ys: torch.Tensor, groups: int) -> torch.Tensor:
    """(R, groups, P): `group_grads` of R runs in one vmapped pass, `params` stacked along a leading run axis on a
    model that stacks runs (iclnoise.core.model.ICLTransformer), xs (R, B, ...), ys (R, B, ...). The gradient of the sum
    of the runs' losses is every run's own gradient (run r's loss depends on run r's slice alone), so run r's rows
    equal its own `group_grads` to float32 round-off (batched against single matmuls)."""
    R, B = xs.shape[:2]
    if B % groups:
        raise ValueError(f"batch {B} is not divisible into {groups} gradient groups")
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def loss(p, x, y):
        return loss_fn(lambda a, b: functional_call(model, (p, buffers), (a, b)), x, y).sum()

    m = B // groups
    g = vmap(grad(loss), in_dims=(None, 1, 1))({n: p.detach() for n, p in params.items()},
                                               xs.reshape(R, groups, m, *xs.shape[2:]),
                                               ys.reshape(R, groups, m, *ys.shape[2:]))
    return torch.cat([g[n].transpose(0, 1).reshape(R, groups, -1) for n in params], dim=2)


@dataclass
class GradNoise:
    """Sample statistics of K group gradients of m sequences each.

    mean: ḡ (the batch gradient); diag: diag(Ĉ) of the per-example covariance; factor F (K, P) with
    FᵀF = Ĉ = m · Σ_k (ĝ_k − ḡ)(ĝ_k − ḡ)ᵀ / (K − 1), so spectra come from a K × P matrix."""

    mean: torch.Tensor
    diag: torch.Tensor
    factor: torch.Tensor
    m: int

    @property
    def trace(self) -> float:
        return float(self.diag.sum())


def grad_noise(G: torch.Tensor, m: int) -> GradNoise:
    """GradNoise from the (K, P) group-gradient matrix; needs K ≥ 2."""
    K = G.shape[0]
    if K < 2:
        raise ValueError("the noise covariance needs at least 2 gradient groups")
    mean = G.mean(0)
    factor = (G - mean) * math.sqrt(m / (K - 1))
    return GradNoise(mean, factor.square().sum(0), factor, m)


def b_simple(mean_sq: float, trace: float, batch: int) -> float:
    """Gradient noise scale Tr(C)/|G|² (McCandlish et al.) from |ḡ|² (`mean_sq`) and Tr(C), |G|² estimated without
    the Tr(C)/B bias; NaN when the noise swamps the signal (|ḡ|² ≤ Tr(C)/B)."""
    g2 = mean_sq - trace / batch
    return trace / g2 if g2 > 0 else math.nan


def spectrum_parts(factor: torch.Tensor, a: torch.Tensor | None,
                   r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: the leading r eigenvalues of A Ĉ A = (F A)ᵀ(F A), Tr of the Gram matrix (F A)(F A)ᵀ and its
    squared Frobenius norm (spectrum_summary reads them). Exact thin SVD of the K × P matrix when K is small,
    randomised (torch.svd_lowrank) otherwise."""
    FA = factor if a is None else factor * a
    K = FA.shape[0]
    s = torch.linalg.svdvals(FA) if K <= 4 * r else torch.svd_lowrank(FA, q=min(r + 8, K), niter=4)[1]
    gram = FA @ FA.T
    return s.square()[:r], torch.trace(gram), gram.square().sum()


def spectrum_summary(lam: np.ndarray, gram_trace: float, gram_sq: float) -> tuple[np.ndarray, float, float]:
    """(λ, tail index, participation ratio) from spectrum_parts' values read on the host: tail index α, the slope of
    −log λ_i against log i over the positive leading eigenvalues (λ_i ∝ i^−α); participation ratio (Σλ)² / Σλ² over
    the whole spectrum, Tr(gram)² / |gram|²_F (1 = one direction, P = isotropic)."""
    pr = gram_trace ** 2 / gram_sq if gram_sq > 0 else math.nan
    pos = lam[lam > lam[0] * 1e-12] if len(lam) and lam[0] > 0 else lam[:0]
    alpha = float(-np.polyfit(np.log(np.arange(1, len(pos) + 1)), np.log(pos), 1)[0]) if len(pos) >= 3 else math.nan
    return lam, alpha, pr


def leading_eigs(factor: torch.Tensor, a: torch.Tensor | None, r: int) -> tuple[np.ndarray, float, float]:
    """Leading r eigenvalues of A Ĉ A, their tail index and the participation ratio (spectrum_parts, then
    spectrum_summary)."""
    lam, tr, sq = spectrum_parts(factor, a, r)
    return spectrum_summary(lam.double().cpu().numpy(), float(tr), float(sq))


@dataclass
class AdamState:
    """One run's AdamW as the exposure formulas read it: settings and per-parameter tensors, in parameter order.
    `step`, `exp_avg`, `exp_avg_sq` are None before the first update; `eps` may differ per parameter (one value
    per parameter group in torch). An ensemble run's tensors are views of its slice of the stacked state; `stacked`:
    the whole ensemble's, every tensor with a leading run axis (R, ...). The learning rate is not here: a step's η_t
    is StepContext.lr (iclnoise.core.sections.Train.lr)."""

    beta1: float
    beta2: float
    eps: float | list[float]
    grads: list[torch.Tensor]
    step: int | None = None
    exp_avg: list[torch.Tensor] | None = None
    exp_avg_sq: list[torch.Tensor] | None = None
    identity: bool = False   # no preconditioner (SGD with momentum: A = I; beta1 is its momentum)
    stacked: bool = False    # tensors (R, ...) of R runs: preconditioner gives (R, P)

    @classmethod
    def of_torch(cls, opt: torch.optim.Optimizer) -> AdamState:
        """The state of a live torch Adam(W) (its groups share β and the learning rate)."""
        params = [p for g in opt.param_groups for p in g["params"]]
        eps = [g["eps"] for g in opt.param_groups for _ in g["params"]]
        g0, sts = opt.param_groups[0], [opt.state.get(p) or {} for p in params]
        have = all("exp_avg_sq" in st for st in sts)
        return cls(g0["betas"][0], g0["betas"][1], eps if len(set(eps)) > 1 else eps[0],
                   [p.grad for p in params], int(sts[0]["step"]) if have else None,
                   [st["exp_avg"] for st in sts] if have else None, [st["exp_avg_sq"] for st in sts] if have else None)


def preconditioner(adam: AdamState, fallback_grads: bool = True) -> torch.Tensor | None:
    """Flat a = 1/(sqrt(v̂) + δ) from a run's live Adam(W) state (bias-corrected second moment; a = 0 on
    coordinates whose root is below the float resolution of the largest, iclnoise.core.adam).

    Before the first update there is no v; then v̂_1 = g² is what the first update will use, so the
    current gradients stand in (or None when `fallback_grads` is False or there are none). SGD: a = 1.
    A stacked state (R runs) gives (R, P), run r's row its own a."""
    flat = (lambda t: t.reshape(t.shape[0], -1)) if adam.stacked else (lambda t: t.reshape(-1))  # noqa: E731
    if adam.identity:
        return torch.cat([flat(torch.ones_like(g)) for g in adam.grads], -1)
    if adam.exp_avg_sq is not None:   # one foreach pass: this runs every injecting step
        bc = [1 - adam.beta2 ** float(adam.step)] * len(adam.exp_avg_sq)
        roots = torch._foreach_sqrt(torch._foreach_div(adam.exp_avg_sq, bc))
    elif fallback_grads and all(g is not None for g in adam.grads):
        roots = [g.detach().abs() for g in adam.grads]   # before its first update: sqrt(v̂_1) = |g|
    else:
        return None
    roots = [flat(r) for r in roots]
    eps = torch.cat([torch.full_like(r, e) for r, e in zip(roots, adam.eps)], -1) if isinstance(adam.eps, list) \
        else adam.eps
    return precondition(torch.cat(roots, -1), eps)


def kappa(setting: float | str | None, beta1: float, optimizer: str = "adamw") -> float:
    """κ, the long-run diffusion factor of the optimizer's momentum β1 (method §6), unless `setting` (params
    exposure.kappa) is a number: 1 for Adam/AdamW, whose momentum is dampened (m ← β1 m + (1 − β1) g, so one
    gradient moves the weights by η·A·g in total whatever β1); 1/(1 − β1)² for undampened heavy-ball momentum
    (optimizer sgd_momentum: v ← β1 v + g, so one gradient moves the weights by η g / (1 − β1) in total; it would
    overstate AdamW's diffusion 100× at β1 = 0.9). `calibrated` starts from AdamW's 1 and is replaced by
    `calibrated_kappa`; None is the optimizer's value."""
    if isinstance(setting, (int, float)):
        return float(setting)
    return 1.0 / (1.0 - beta1) ** 2 if optimizer == "sgd_momentum" else 1.0


def ne_unit(lr: float, kappa_: float | torch.Tensor, a: torch.Tensor, diag: torch.Tensor) -> float | torch.Tensor:
    """NE of a covariance with diagonal `diag` in gradient space: η · κ · Σ_i a_i² diag_i. Flat a, diag (P,) give a
    float; stacked (R, P) rows of R runs (κ a float or (R,)) give their (R,) values in float64, the same arithmetic."""
    aca = (a.square() * diag).sum(-1)
    return lr * kappa_ * (float(aca) if aca.dim() == 0 else aca.double())


def pne_columns(lr: float, kappa_: float, batch: int, trace_aca: float, curv: float, floor: float, clip_coef: float,
                ne_injected: float, pne_injected_postclip: float) -> dict[str, float]:
    """The exposure columns of one row (method §6), from Σ a² diag(C) (`trace_aca`: the measured diag C at this
    step's A), Curv and the injector's interval means:

        NE = η κ Σ a² diag(C) / B,   NE_total = NE + NE_inj,   P-NE* = NE_total / max(floor, Curv)
        after clipping (factor c): NE_post = c² NE + P-NE*_inj,post · max(floor, Curv),  P-NE*_post = NE_post / den
        simple forms: (η/κ) · NE  (= η² Σ a² (C/B + R'), the per-step update variance)."""
    ne = lr * kappa_ * trace_aca / batch   # ne_unit's arithmetic
    den = max(floor, curv)
    ne_total = ne + ne_injected
    ne_post = clip_coef ** 2 * ne + pne_injected_postclip * den
    simple = lr / kappa_
    return {"trace_aca": trace_aca, "ne": ne, "ne_injected": ne_injected,
            "ne_total": ne_total, "ne_simple": simple * ne_total, "pne": ne_total / den, "ne_postclip": ne_post,
            "pne_postclip": ne_post / den, "pne_injected_postclip": pne_injected_postclip,
            "ne_simple_postclip": simple * ne_post}


def budget_scale(target: float | torch.Tensor, curv: float | torch.Tensor, unit: float | torch.Tensor,
                 grad_sq: float | torch.Tensor, trace_r: float | torch.Tensor,
                 clip: float | torch.Tensor | None) -> torch.Tensor:
    """Scale s of injected noise N(0, s R') whose post-clip P-NE* is `target` at this step.

    Injected P-NE* = s · unit · c² / curv with unit = η κ Σ a² R'_ii and c the clipping factor. Without
    clipping s = target · curv / unit. With clipping at norm G the expected squared norm is |g|² + s·Tr R',
    so c² = G² / (|g|² + s Tr R') once clipped, and s · unit · G² = target · curv · (|g|² + s Tr R') gives
    s = target·curv·|g|² / (unit·G² − target·curv·Tr R') (∞ when unreachable: the caller caps it).
    Elementwise in float64: floats give a 0-d tensor, (R,) tensors the R runs' scales; clip None or ∞: unclipped."""
    target, curv, unit, grad_sq, trace_r = (torch.as_tensor(x, dtype=torch.float64)
                                            for x in (target, curv, unit, grad_sq, trace_r))
    clip = torch.as_tensor(math.inf if clip is None else clip, dtype=torch.float64)
    s = target * curv / unit
    den = unit * clip ** 2 - target * curv * trace_r
    s = torch.where(clip.isinf() | (grad_sq + s * trace_r <= clip ** 2), s,
                    torch.where(den > 0, target * curv * grad_sq / den, math.inf))
    return torch.where((unit <= 0) | (curv <= 0) | (target <= 0), 0.0, s)


def refresh_interval(interval: int, curv_old: float, curv_new: float, rse: float, tol: float, most: int) -> int:
    """The next refresh interval of diag Ĥ in an injection window (exposure.curvature_tol, method §6's closed loop).

    drift = |Curv_new − Curv_old| / Curv_new − 2·rse, both Curv at this step's A (old and new Ĥ), rse their
    combined Hutchinson relative standard error (what the estimates differ by without any change in Ĥ):
    the interval halves when drift > tol, doubles when drift < tol / 2, and stays within [1, most]."""
    if not (curv_new > 0 and math.isfinite(curv_old)):
        return 1
    drift = abs(curv_new - curv_old) / curv_new - 2 * (rse if math.isfinite(rse) else 0.0)
    nxt = interval // 2 if drift > tol else 2 * interval if drift < tol / 2 else interval
    return min(most, max(1, nxt))


def injected_dose_se(steps_curv: np.ndarray, pne_se: np.ndarray) -> float:
    """Standard error of a run's integrated injected P-NE* from the curvature's Hutchinson error (issue 43):
    each step's P-NE* divides by Curv from the latest diag Ĥ, so its error δ_t = P-NE*_t · rse of that Ĥ is
    shared by every step that uses the same measurement and independent between measurements:
    SE = sqrt(Σ_m (Σ_{t uses m} δ_t)²)."""
    if len(steps_curv) == 0:
        return 0.0
    per = pd.Series(pne_se).groupby(np.asarray(steps_curv)).sum().to_numpy(float)
    return float(np.sqrt(np.nansum(per ** 2)))


def update_innovation_variance(adam: AdamState, G: torch.Tensor, batch: int, lr: float) -> torch.Tensor | float:
    """Σ_i Var(Δw_i) of one AdamW update at learning rate `lr` from the current state, for batch-B gradient noise.

    The K group gradients (rows of G, means over m = B/K sequences, noise C/m) are first shrunk towards
    their mean, ḡ + (g_k − ḡ)·√(m/B), so each carries batch-B noise C/B; the AdamW update rule
    (bias-corrected moments, the v update included) is applied to each from the same state and the
    variance across them taken. Shrinking before the update, not after, keeps Adam's nonlinearity
    (g² enters v) at the batch's noise level. A 0-d tensor (the host reads it when it needs it); NaN before step 1."""
    b1, b2 = adam.beta1, adam.beta2
    eps = adam.eps[0] if isinstance(adam.eps, list) else adam.eps
    if adam.exp_avg is None:
        return math.nan
    m = torch.cat([t.reshape(-1) for t in adam.exp_avg])
    v = torch.cat([t.reshape(-1) for t in adam.exp_avg_sq])
    t = float(adam.step) + 1
    K = G.shape[0]
    mean = G.mean(0)
    G = mean + (G - mean) * math.sqrt(1.0 / K)   # m/B = 1/K
    m1 = (b1 * m + (1 - b1) * G) / (1 - b1 ** t)
    v1 = (b2 * v + (1 - b2) * G.square()) / (1 - b2 ** t)
    u = lr * m1 / (v1.sqrt() + eps)  # weight decay shifts every row alike: no variance
    return u.var(0, unbiased=True).sum()


def calibrated_kappa(observed: list[float], predicted: list[float], beta1: float) -> float:
    """κ from the regression through the origin of observed update innovation variance on its prediction
    η²·Σ a² C / B (slope κ_step), converted to long-run diffusion: momentum m_t = β1 m_{t−1} + innovation is an
    AR(1) whose long-run variance is the innovation variance / (1 − β1)², so κ = κ_step / (1 − β1)².
    (PyTorch's AdamW feeds (1 − β1)·g into m: κ_step ≈ (1 − β1)², κ ≈ 1; heavy-ball momentum gives 1/(1 − β1)².)"""
    o, p = np.asarray(observed, float), np.asarray(predicted, float)
    ok = np.isfinite(o) & np.isfinite(p) & (p > 0)
    if not ok.any():
        return math.nan
    return float((o[ok] * p[ok]).sum() / np.square(p[ok]).sum()) / (1.0 - beta1) ** 2


EIG_FIELD = pa.field("aca_eigs", pa.list_(pa.float64()))  # leading eigenvalues of A Ĉ A (per-example C)
EXPOSURE_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()),            # the update the row measures (0-based)
    pa.field("interval", pa.int64()),        # steps this row stands for in integrals
    pa.field("lr", pa.float64()), pa.field("kappa", pa.float64()),   # κ in use (calibrated: running estimate)
    pa.field("update_var", pa.float64()),    # observed Σ Var(Δw) of one update for batch-B noise
    pa.field("update_var_pred", pa.float64()),  # its prediction η² Σ a² C / B (κ_step = ratio)
    pa.field("groups", pa.int64()),
    pa.field("group_size", pa.int64()),
    pa.field("grad_norm", pa.float64()),     # |ḡ|, batch gradient before injection and clipping
    pa.field("trace_c", pa.float64()),       # Tr(Ĉ), per-example gradient covariance
    pa.field("trace_aca", pa.float64()),     # Σ a_i² Ĉ_ii
    pa.field("b_simple", pa.float64()),
    pa.field("ne", pa.float64()),            # batch noise only: η κ Σ a² C / B
    pa.field("ne_injected", pa.float64()),   # injected noise η κ Σ a² sR'_ii: exact mean over the row's steps
    pa.field("ne_total", pa.float64()),      # before clipping
    pa.field("ne_simple", pa.float64()),     # seed-001 form η² Σ a² (C/B + R')_ii, before clipping
    pa.field("curv", pa.float64()), pa.field("curv_se", pa.float64()),   # Tr(A Ĥ A), held-out batch
    pa.field("pne", pa.float64()),           # P-NE* before clipping
    pa.field("clip_coef", pa.float64()),     # c: factor clipping applied to this step's gradient
    pa.field("clip_frac", pa.float64()),     # fraction of the steps since the last row that were clipped
    pa.field("ne_postclip", pa.float64()), pa.field("pne_postclip", pa.float64()),
    pa.field("pne_injected_postclip", pa.float64()),  # realised injected P-NE* after clipping, exact interval mean
    pa.field("pne_injected_var", pa.float64()),  # variance of the interval's injected P-NE* sum from diag Ĥ's error
    pa.field("ne_simple_postclip", pa.float64()),
    EIG_FIELD, pa.field("tail_index", pa.float64()), pa.field("participation_ratio", pa.float64()),
])


SUMMARY_COLUMNS = ["integrated_pne", "integrated_pne_preclip", "integrated_ne", "integrated_ne_injected",
                   "integrated_pne_injected", "integrated_ne_simple", "integrated_pne_injected_se"]


def summarize(df: pd.DataFrame) -> dict:
    """Per-run integrals Σ_rows x · interval of the exposure series (post-clip unless named pre-clip). Rows tile
    the run (intervals add up to its steps); injected columns are exact interval means of per-step values, so
    their integrals are exact sums over steps."""
    if df.empty:
        return {k: math.nan for k in SUMMARY_COLUMNS}
    w = df.interval.to_numpy(float)
    s = lambda c: float((df[c].to_numpy(float) * w).sum())  # noqa: E731
    return {"integrated_pne": s("pne_postclip"), "integrated_pne_preclip": s("pne"),
            "integrated_ne": s("ne_postclip"), "integrated_ne_injected": s("ne_injected"),
            "integrated_pne_injected": s("pne_injected_postclip"), "integrated_ne_simple": s("ne_simple_postclip"),
            "integrated_pne_injected_se": float(np.sqrt(df.pne_injected_var.sum())) if "pne_injected_var" in df
            else math.nan}   # rows written before issue 43 carry no variance
