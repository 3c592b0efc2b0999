"""Noise-aligned preconditioning (NAP, seed 002; issue 45): injected noise shaped by the task family mapped into
parameter space, and its controls, as pure functions and a small value type (iclnoise.noise.injection injects them).

The target is the between-task gradient covariance Σ_b = Cov_τ(E[∇ℓ | τ]). For J tasks of a training batch
(τ_j, the batch's first J distinct tasks) `task_probe` draws m fresh sequences each (new x and label noise, never
trained on); with g_jk the gradient of sequence k of task j, h_j = mean_k g_jk and the law of total covariance,

    Σ_w = Σ_jk (g_jk − h_j)(g_jk − h_j)ᵀ / (J (m − 1))           within-task covariance, unbiased
    Σ_b = Σ_j (h_j − h̄)(h_j − h̄)ᵀ / (J − 1) − Σ_w / m            between-task covariance, unbiased

(the raw covariance of the h_j alone carries Σ_w / m, whose top directions are the within-task ones).
Both are Fᵀ diag(w) F for a (J (m + 1)) × P factor, so their eigenpairs come exactly from its Gram matrix and a
small eigh (`factor_eig`). Each refresh merges its estimate into a rank-r sketch, a running mean over the last
`memory` refreshes, kept at OVERSAMPLE·r eigenpairs of either sign (`TaskSketch.update`), with the untruncated
trace kept beside it. The injected gradient-space covariance (iclnoise.noise's R') of shape

    nap               R' = U diag(λ_r) Uᵀ + λ I,   λ = max(0, Tr Σ̂_b − Σ λ_r) / P   (the trace the top r miss)
    nap_misaligned    Q diag(λ_r) Qᵀ + λ I, Q a random orthonormal P × r basis seeded by the run's seed
    nap_within_task   U_w diag(λ_r) U_wᵀ + λ I, U_w the within-task sketch's top r directions
    nap_isotropic     (Σ λ_r + λ P) / P · I

so the four share the spectrum (nap_isotropic: the trace) and differ in directions only. Noise of source grad
passes through AdamW's A = P: the parameter-space covariance is η² P R' P = η² P (U Σ_r Uᵀ + λ I) P, the seed's
Λ_t (source param adds η A ε with the same covariance). The level is the closed loop's (budget or target: method §5,
§6), so the four realise equal injected P-NE*. `alignment` logs cos_F(R', Σ̂_b⁺), the normalised Frobenius
inner product with the PSD part of the latest refresh's between-task estimate (1: the same matrix up to scale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.model import LossFn
from ..core.tasks import Batch, seed_mix, sequences
from .covariance import CovModel
from .exposure import group_grads

_PROBE, _BASIS = 0x7A5C, 0xB0A5

NAP_SHAPES = ("nap", "nap_misaligned", "nap_within_task", "nap_isotropic")


def distinct_tasks(tasks: torch.Tensor, J: int) -> torch.Tensor:
    """The first J distinct rows of `tasks` (B, D), in order of first appearance (a sorted unique would prefer
    tasks by their first coordinate)."""
    _, inv = torch.unique(tasks, dim=0, return_inverse=True)
    first = torch.full((int(inv.max()) + 1,), len(inv), device=tasks.device).scatter_reduce(
        0, inv, torch.arange(len(inv), device=tasks.device), "amin")
    return tasks[first.sort().values[:J]]


def task_probe(tasks: torch.Tensor, m: int, K: int, noise_var: float, gen: torch.Generator) -> Batch:
    """m fresh sequences of each task (J, D), ordered task by task (iclnoise.core.tasks.sequences)."""
    return sequences(gen, tasks.repeat_interleave(m, dim=0), K, noise_var)


def task_factors(G: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """From per-sequence gradients G (J, m, P): (F_b, w_b) with Σ_b = F_bᵀ diag(w_b) F_b and (F_w, w_w) with
    Σ_w = F_wᵀ diag(w_w) F_w (module docstring); needs J ≥ 2, m ≥ 2."""
    J, m, P = G.shape
    if J < 2 or m < 2:
        raise ValueError(f"the task covariances need ≥ 2 tasks and ≥ 2 sequences per task, got {J} × {m}")
    h = G.mean(1)
    W = (G - h[:, None]).reshape(J * m, P)
    ww = torch.full((J * m,), 1.0 / (J * (m - 1)), dtype=torch.float64, device=G.device)
    wb = torch.cat([torch.full((J,), 1.0 / (J - 1), dtype=torch.float64, device=G.device), -ww / m])
    return (torch.cat([h - h.mean(0), W]), wb), (W, ww)


def factor_eig(F: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All nonzero eigenpairs (U (P, k), ev (k,), descending) of Fᵀ diag(w) F, F (n, P), w of either sign, from the
    n × n Gram matrix (two matrix products over P in F's dtype, no P-sized factorisation; the small eighs in float64):
    with F Fᵀ = V diag(s) Vᵀ, F = V S^½ Qᵀ with Q = Fᵀ V S^-½ orthonormal, so Fᵀ diag(w) F = Q (S^½ Vᵀ diag(w) V S^½) Qᵀ
    and a k × k eigh finishes it (directions with s below 1e-10 of the largest are F's null space)."""
    s, V = torch.linalg.eigh((F @ F.T).double())
    keep = s > float(s.max()) * 1e-10 if len(s) and float(s.max()) > 0 else s > math.inf
    root, V = s[keep].sqrt(), V[:, keep]
    ev, Vm = torch.linalg.eigh(root[:, None] * ((V.T * w.double()) @ V) * root[None])
    ev, Vm = ev.flip(0), Vm.flip(1)
    return F.T @ ((V / root) @ Vm).to(F.dtype), ev.to(F.dtype)


def positive(U: torch.Tensor, ev: torch.Tensor, r: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (at most r) leading eigenpairs with ev > 0 (round-off below 1e-10 of the largest is dropped)."""
    keep = ev > max(0.0, float(ev[0]) * 1e-10) if len(ev) else ev > 0
    U, ev = U[:, keep], ev[keep]
    return (U, ev) if r is None else (U[:, :r].contiguous(), ev[:r])


OVERSAMPLE = 4   # the sketch keeps OVERSAMPLE·r eigenpairs, of either sign, so merged noise can cancel


@dataclass
class TaskSketch:
    """A low-rank sketch U diag(lam) Uᵀ of a covariance, and its untruncated trace, merged across refreshes:
    Σ ← (1 − ρ) Σ + ρ Σ̂ with ρ = 1 / min(n, memory) at the n-th refresh (memory 1: the latest refresh only).
    It keeps the `keep` eigenpairs largest in magnitude, negative ones too (an unbiased estimate's noise is of
    either sign: clipping it at each merge would bias the mean up in every direction); `top(r)` is the PSD part used."""

    U: torch.Tensor
    lam: torch.Tensor
    trace: float = 0.0
    n: int = 0

    def update(self, F: torch.Tensor, w: torch.Tensor, keep: int, memory: int) -> None:
        """Merge Σ̂ = Fᵀ diag(w) F."""
        self.n += 1
        rho = 1.0 / min(self.n, memory)
        wt = w.to(torch.float64) * rho
        rows, tr = F, float((F.double().square().sum(1) * w).sum())
        if rho < 1 and len(self.lam):
            rows = torch.cat([self.lam.abs().sqrt()[:, None] * self.U.T, F])
            wt = torch.cat([(1.0 - rho) * self.lam.sign().double(), wt])
        U, ev = factor_eig(rows, wt)
        big = ev.abs().argsort(descending=True)[:keep].sort().values   # still in descending order of ev
        self.U, self.lam = U[:, big].contiguous(), ev[big]
        self.trace = max(0.0, (1.0 - rho) * self.trace + rho * tr)

    def top(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return positive(self.U, self.lam, r)

    @classmethod
    def empty(cls, P: int, like: torch.Tensor) -> TaskSketch:
        return cls(like.new_zeros(P, 0), like.new_zeros(0))

    def state_dict(self) -> dict:
        return {"U": self.U, "lam": self.lam, "trace": self.trace, "n": self.n}


def random_orthonormal(P: int, r: int, seed: int, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q (P, r) with orthonormal columns, Haar distributed: the QR of a seeded Gaussian (drawn on the CPU in
    float64, so the basis does not depend on the device), columns signed so that diag(R) > 0."""
    g = torch.Generator().manual_seed(seed)
    q, rr = torch.linalg.qr(torch.randn(P, r, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(rr))).to(device=device, dtype=dtype)


def nap_covariance(shape: str, between: TaskSketch, within: TaskSketch, basis: torch.Tensor | None,
                   rank: int) -> CovModel:
    """R' of a NAP shape (module docstring) from the sketches' top `rank` positive eigenpairs; `basis` (P, ≥ rank):
    the misaligned control's Q."""
    U, lam = between.top(rank)
    P, r = U.shape
    lam_iso = max(0.0, between.trace - float(lam.sum())) / P
    d = torch.full((P,), lam_iso, dtype=lam.dtype, device=lam.device)
    if shape == "nap":
        return CovModel(U, lam, d)
    if shape == "nap_misaligned":
        return CovModel(basis[:, :r], lam, d)
    if shape == "nap_within_task":
        Uw = within.top(r)[0]
        return CovModel(Uw, lam[:Uw.shape[1]], d)
    if shape == "nap_isotropic":
        return CovModel(U[:, :0], lam[:0], d + float(lam.sum()) / P)
    raise ValueError(f"unknown NAP shape {shape!r}; allowed: {', '.join(NAP_SHAPES)}")


def frobenius(a: CovModel, b: CovModel) -> float:
    """⟨A, B⟩_F = Tr(A B) of two low-rank-plus-diagonal covariances without forming P × P matrices:
    ‖(U_a √λ_a)ᵀ (U_b √λ_b)‖² + Σ d_a diag(U_b λ_b U_bᵀ) + Σ d_b diag(U_a λ_a U_aᵀ) + Σ d_a d_b."""
    la, lb = a.U * a.lam.sqrt(), b.U * b.lam.sqrt()
    cross = float((la.T.double() @ lb.double()).square().sum()) if la.shape[1] and lb.shape[1] else 0.0
    return (cross + float((a.d.double() * lb.double().square().sum(1)).sum())
            + float((b.d.double() * la.double().square().sum(1)).sum()) + float((a.d.double() * b.d.double()).sum()))


def alignment(a: CovModel, b: CovModel) -> float:
    """cos_F(A, B) = ⟨A, B⟩_F / (‖A‖_F ‖B‖_F) ∈ [0, 1] for PSD A, B; NaN when either is zero."""
    den = math.sqrt(frobenius(a, a) * frobenius(b, b))
    return frobenius(a, b) / den if den > 0 else math.nan


def per_task_grads(model: torch.nn.Module, loss_fn: LossFn, probe: Batch, J: int) -> torch.Tensor:
    """(J, m, P): the flat gradient of each probe sequence (probe ordered task by task, m per task)."""
    G = group_grads(model, loss_fn, probe.xs, probe.ys, len(probe))
    return G.reshape(J, len(probe) // J, -1)


class NapEstimator:
    """The sketches of one run and the covariance of its NAP shape, refreshed from the model at a step (issue 45):
    `tasks` (J) distinct tasks of the step's batch, `per_task` (m) fresh sequences each, `memory` refreshes merged."""

    def __init__(self, shape: str, rank: int, tasks: int, per_task: int, memory: int, K: int, noise_var: float,
                 seed: int):
        if shape not in NAP_SHAPES:
            raise ValueError(f"unknown NAP shape {shape!r}; allowed: {', '.join(NAP_SHAPES)}")
        self.shape, self.rank, self.J, self.m, self.memory = shape, rank, tasks, per_task, memory
        self.K, self.noise_var, self.seed = K, noise_var, seed
        self.between: TaskSketch | None = None
        self.within: TaskSketch | None = None
        self._basis: torch.Tensor | None = None

    def refresh(self, model: torch.nn.Module, loss_fn: LossFn, batch_tasks: torch.Tensor,
                step: int) -> tuple[CovModel, float]:
        """(R', its alignment with the PSD part of this refresh's Σ̂_b); a batch of one task has no between-task
        covariance: R' = 0 (nothing is injected) and NaN."""
        tasks = distinct_tasks(batch_tasks, self.J)
        gen = torch.Generator(device=batch_tasks.device).manual_seed(seed_mix(_PROBE, self.seed, step))
        probe = task_probe(tasks, self.m, self.K, self.noise_var, gen)
        if len(tasks) < 2:
            P = sum(p.numel() for p in model.parameters())
            z = probe.xs.new_zeros(P)
            return CovModel(z[:, None][:, :0], z[:0], z), math.nan
        G = per_task_grads(model, loss_fn, probe, len(tasks))
        (Fb, wb), (Fw, ww) = task_factors(G)
        P = G.shape[2]
        if self.between is None:
            self.between, self.within = TaskSketch.empty(P, G), TaskSketch.empty(P, G)
        self.between.update(Fb, wb, OVERSAMPLE * self.rank, self.memory)
        if self.shape == "nap_within_task":
            self.within.update(Fw, ww, OVERSAMPLE * self.rank, self.memory)
        if self.shape == "nap_misaligned" and self._basis is None:
            self._basis = random_orthonormal(P, self.rank, seed_mix(_BASIS, self.seed), G.device, G.dtype)
        cov = nap_covariance(self.shape, self.between, self.within, self._basis, self.rank)
        Ue, ev = positive(*factor_eig(Fb, wb))
        return cov, alignment(cov, CovModel(Ue, ev, torch.zeros_like(cov.d)))

    def state_dict(self) -> dict:
        return {"between": None if self.between is None else self.between.state_dict(),
                "within": None if self.within is None else self.within.state_dict()}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        def sketch(d):
            return None if d is None else TaskSketch(d["U"].to(device), d["lam"].to(device), d["trace"], d["n"])
        self.between, self.within = sketch(state["between"]), sketch(state["within"])


__all__ = ["NAP_SHAPES", "distinct_tasks", "task_probe", "task_factors", "factor_eig", "positive", "TaskSketch",
           "OVERSAMPLE", "random_orthonormal", "nap_covariance", "frobenius", "alignment", "per_task_grads",
           "NapEstimator"]
