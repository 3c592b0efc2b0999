"""Nested multi-task in-context linear regression (method §2, §13).

A task is t ~ N(0, I_D), or t = L z with z ~ N(0, I_D) and L Lᵀ = Σβ under a shaped prior (`prior`, a
sections.TaskPrior; None is the isotropic prior and draws exactly as before the key existed); a sequence
is (x_1, y_1, ..., x_K, y_K) with x_k ~ N(0, I_D) and y_k = t·x_k + e_k, e_k ~ N(0, σ²). Pools are nested
prefixes of one task stream drawn from the pool seed, so T_M ⊂ T_M' for M < M' and the root task t_1 is
in every pool. M = M_INF (-1) means a fresh task from the prior for every sequence.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from . import rng
from .runspec import M_INF, m_label, parse_m  # noqa: F401 (M's encoding: sections)
from .sections import ParamsError, TaskPrior  # noqa: F401 (M's encoding: sections)


def seed_mix(*keys: int) -> int:
    """A 63-bit seed from integer keys (SeedSequence hashing, stable across platforms)."""
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, np.uint64)[0] >> 1)


_POOL, _EVAL, _BATCH, _BASIS = 0x9001, 0xE7A1, 0xBA7C, 0xBA515


def prior_spectrum(prior: TaskPrior, D: int) -> np.ndarray:
    """λ of Σβ, float64 (D,): power_law λ_i = D i^(−a) / Σ_j j^(−a) (trace D); eigenvalues as given."""
    if prior.spectrum == "power_law":
        lam = np.arange(1, D + 1, dtype=np.float64) ** -float(prior.exponent)
        return lam * (D / lam.sum())
    lam = np.asarray(prior.eigenvalues, dtype=np.float64)
    if lam.shape != (D,):
        raise ParamsError(f"data.task_prior.eigenvalues has {lam.size} values; data.D = {D} needs {D}")
    return lam


def random_basis(seed: int, D: int) -> np.ndarray:
    """A random orthonormal U (D, D), float64, Haar distributed: Q of the QR of a seeded Gaussian, columns
    signed so that diag(R) > 0 (which makes Q unique)."""
    rng = np.random.Generator(np.random.PCG64(seed_mix(_BASIS, seed)))
    q, r = np.linalg.qr(rng.standard_normal((D, D)))
    return q * np.sign(np.diag(r))


@functools.lru_cache(maxsize=16)
def prior_factor(prior: TaskPrior, D: int) -> np.ndarray:
    """L = U diag(√λ), float64 (D, D), so t = L z, z ~ N(0, I_D) has covariance Σβ = U diag(λ) Uᵀ (method §13)."""
    return random_basis(prior.basis_seed, D) * np.sqrt(prior_spectrum(prior, D))


def prior_cov(prior: TaskPrior | None, D: int) -> np.ndarray:
    """Σβ, float64 (D, D); the identity for the isotropic prior (None)."""
    if prior is None:
        return np.eye(D)
    L = prior_factor(prior, D)
    return L @ L.T


def task_pool(pool_seed: int, M: int, D: int, prior: TaskPrior | None = None) -> torch.Tensor:
    """T_M = the first M tasks of the stream seeded by `pool_seed`, shape (M, D), float32.

    NumPy's Generator draws standard normals sequentially, so pools are prefixes of each other; a shaped
    prior maps the same normals z to L z, row by row, which keeps them prefixes.
    """
    if M == M_INF:
        raise ValueError("M = inf has no finite pool; sample fresh tasks instead")
    rng = np.random.Generator(np.random.PCG64(seed_mix(_POOL, pool_seed)))
    z = rng.standard_normal((M, D))
    return torch.from_numpy(z if prior is None else z @ prior_factor(prior, D).T).float()


def pool_for(M: int, pool_seed: int, D: int, prior: TaskPrior | None = None) -> torch.Tensor | None:
    """The task pool of a run (None for M = ∞)."""
    return None if M == M_INF else task_pool(pool_seed, M, D, prior)


def _factor(prior: TaskPrior | None, D: int, device: torch.device | str) -> torch.Tensor | None:
    """Lᵀ as float32 on `device` (None for the isotropic prior): fresh tasks are z Lᵀ, z ~ N(0, I)."""
    return None if prior is None else torch.from_numpy(prior_factor(prior, D).T.copy()).float().to(device)


@dataclass(frozen=True)
class Batch:
    """xs (B, K, D), ys (B, K), tasks (B, D) — the task behind each sequence."""

    xs: torch.Tensor
    ys: torch.Tensor
    tasks: torch.Tensor

    def __len__(self) -> int:
        return self.xs.shape[0]

    def split(self, n: int) -> list["Batch"]:
        """Split into n equal micro-batches along the sequence axis."""
        return [Batch(x, y, t) for x, y, t in zip(self.xs.chunk(n), self.ys.chunk(n), self.tasks.chunk(n))]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.xs.to(device), self.ys.to(device), self.tasks.to(device))


def _fill(gen: torch.Generator, pool: torch.Tensor | None, factor: torch.Tensor | None, tasks: torch.Tensor,
          xs: torch.Tensor, noise: torch.Tensor) -> None:
    """One batch's draws from `gen`, in order, into tasks (B, D), xs (B, K, D) and the label noise (B, K): tasks
    from `pool`, or (None) fresh tasks z Lᵀ with `factor` = Lᵀ (None: z, isotropic)."""
    if pool is None:
        torch.randn(tasks.shape, generator=gen, out=tasks)
        if factor is not None:
            tasks.copy_(tasks @ factor)
    else:
        torch.index_select(pool, 0, torch.randint(0, pool.shape[0], tasks.shape[:1], generator=gen,
                                                  device=pool.device), out=tasks)
    torch.randn(xs.shape, generator=gen, out=xs)
    torch.randn(noise.shape, generator=gen, out=noise)


def _labels(xs: torch.Tensor, tasks: torch.Tensor, noise: torch.Tensor, noise_var: float) -> torch.Tensor:
    """y_k = t·x_k + σ e_k over any leading batch axes."""
    return torch.einsum("...kd,...d->...k", xs, tasks) + noise_var**0.5 * noise


def _draw(gen: torch.Generator, pool: torch.Tensor | None, B: int, K: int, D: int, noise_var: float,
          device: torch.device | str, factor: torch.Tensor | None = None) -> Batch:
    """A batch from `pool`, or (None) from fresh tasks z Lᵀ with `factor` = Lᵀ (None: z, isotropic)."""
    tasks, xs, noise = (torch.empty(B, D, device=device), torch.empty(B, K, D, device=device),
                        torch.empty(B, K, device=device))
    _fill(gen, pool, factor, tasks, xs, noise)
    return Batch(xs, _labels(xs, tasks, noise, noise_var), tasks)


def sequences(gen: torch.Generator, tasks: torch.Tensor, K: int, noise_var: float) -> Batch:
    """One sequence of each task (B, D): x_k ~ N(0, I_D), y_k = t·x_k + e_k, e_k ~ N(0, σ²) (method §2)."""
    B, D = tasks.shape
    xs = torch.randn(B, K, D, generator=gen, device=tasks.device)
    noise = torch.randn(B, K, generator=gen, device=tasks.device)
    return Batch(xs, _labels(xs, tasks, noise, noise_var), tasks)


class BatchSampler:
    """Training batches drawn on `device`; batch `step` depends only on (stream, data_seed, step).

    Counter-based seeding makes the stream independent of micro-batching (a step's batch is
    drawn whole, then split) and makes resuming trivial: the stream position is the step.
    """

    def __init__(self, pool: torch.Tensor | None, K: int, D: int, noise_var: float, data_seed: int,
                 device: torch.device | str = "cpu", stream: int = 0, prior: TaskPrior | None = None,
                 counter: bool = False):
        self.counter = counter   # draws from the counter-based stream (CounterSampler), else a seeded generator
        self.pool = None if pool is None else pool.to(device)
        self.factor = _factor(prior, D, device)   # fresh tasks' prior (M = ∞); a pool was drawn from it already
        self.K, self.D, self.noise_var, self.data_seed, self.device = K, D, noise_var, data_seed, device
        self.stream = stream  # independent streams from one seed: 0 training, 1 held-out, 2+ probes
        self._gen = torch.Generator(device=device)

    def seeded(self, step: int) -> torch.Generator:
        """The stream's generator at batch `step`."""
        return self._gen.manual_seed(seed_mix(_BATCH, self.stream, self.data_seed, step))

    def batch(self, step: int, size: int) -> Batch:
        if self.counter:
            b = CounterSampler([self]).batch(step, size)
            return Batch(b.xs[0], b.ys[0], b.tasks[0])
        return _draw(self.seeded(step), self.pool, size, self.K, self.D, self.noise_var, self.device, self.factor)


def stacked_batch(samplers: list[BatchSampler], step: int, size: int) -> Batch:
    """Batch `step` of every sampler, stacked: xs (R, size, K, D), ys (R, size, K), tasks (R, size, D). Each run's
    draws come from its own counter-based stream into its slice (bit-identical to its `batch(step, size)`); the
    labels of all runs are one batched call. The samplers share K, D, the noise and the device (one data section)."""
    s0 = samplers[0]
    R, K, D, dev = len(samplers), s0.K, s0.D, s0.device
    tasks, xs, noise = (torch.empty(R, size, D, device=dev), torch.empty(R, size, K, D, device=dev),
                        torch.empty(R, size, K, device=dev))
    for r, s in enumerate(samplers):
        _fill(s.seeded(step), s.pool, s.factor, tasks[r], xs[r], noise[r])
    return Batch(xs, _labels(xs, tasks, noise, s0.noise_var), tasks)


class CounterSampler:
    """The training batches of R runs drawn at once from the counter-based stream (iclnoise.core.rng; train.rng
    counter): one call of a fixed number of tensor ops whatever R is. Run r's batch `step` depends only on its key
    seed_mix(_BATCH, stream, data_seed) and the step: its words [0, B·D) are fresh tasks' normals z (M = ∞; tasks
    z Lᵀ), [B·D, B·D + B) its pool indices (finite M), then xs (B·K·D) and the label noise (B·K), for every run
    alike. The samplers share K, D, the noise, the prior and the device (one data section)."""

    def __init__(self, samplers: list[BatchSampler]):
        s0 = samplers[0]
        self.K, self.D, self.noise_var, self.device, self.factor = s0.K, s0.D, s0.noise_var, s0.device, s0.factor
        same = lambda f: f is s0.factor or f is not None and s0.factor is not None and torch.equal(f, s0.factor)  # noqa: E731
        if not all(same(s.factor) for s in samplers):
            raise ValueError("a CounterSampler's runs share one task prior (one data section)")
        self.keys = rng.run_keys([seed_mix(_BATCH, s.stream, s.data_seed) for s in samplers], s0.device)
        pools = [s.pool for s in samplers]
        self.fresh = torch.tensor([p is None for p in pools], device=s0.device)
        sizes = torch.tensor([0 if p is None else p.shape[0] for p in pools], device=s0.device)
        self.offset = torch.where(self.fresh, 0, sizes.cumsum(0) - sizes)[:, None]   # a fresh run's: unused, in range
        self.size = sizes.clamp(min=1)[:, None]
        finite = [p for p in pools if p is not None]
        self.pool = torch.cat(finite) if finite else None
        self.mixed = bool(finite) and len(finite) < len(pools)

    def batch(self, step: int, size: int) -> Batch:
        """Batch `step` of every run: xs (R, size, K, D), ys (R, size, K), tasks (R, size, D)."""
        R, K, D = self.keys.shape[0], self.K, self.D
        b = rng.bits(self.keys, step, size * (D + 1 + K * D + K))
        z, idx, x, e = b.split([size * D, size, size * K * D, size * K], 1)
        fresh = None
        if self.pool is None or self.mixed:
            fresh = rng.normal(z).view(R, size, D)
            fresh = fresh if self.factor is None else fresh @ self.factor
        tasks = fresh
        if self.pool is not None:
            tasks = self.pool[self.offset + rng.below(idx, self.size)]
            tasks = torch.where(self.fresh[:, None, None], fresh, tasks) if self.mixed else tasks
        xs, noise = rng.normal(x).view(R, size, K, D), rng.normal(e).view(R, size, K)
        return Batch(xs, _labels(xs, tasks, noise, self.noise_var), tasks)


def eval_set(kind: str, M: int, n: int, K: int, D: int, noise_var: float, pool_seed: int,
             eval_seed: int, prior: TaskPrior | None = None) -> Batch:
    """Fixed evaluation sets, generated on the CPU from their own seed (hardware independent).

    kind: 'id' (q_M), 'ood' (q_∞) or 'root' (q_1, the root task t_1 only). The 'ood' and 'root'
    sets do not depend on M, so every run is evaluated on the same sequences.
    """
    kinds = {"id": 1, "ood": 2, "root": 3}
    if kind not in kinds:
        raise ValueError(f"eval kind must be one of {sorted(kinds)}, got {kind!r}")
    if kind == "id" and M == M_INF:
        kind = "ood"
    pool = {"id": lambda: task_pool(pool_seed, M, D, prior), "root": lambda: task_pool(pool_seed, 1, D, prior),
            "ood": lambda: None}[kind]()
    gen = torch.Generator().manual_seed(seed_mix(_EVAL, eval_seed, kinds[kind], M if kind == "id" else 0))
    return _draw(gen, pool, n, K, D, noise_var, "cpu", _factor(prior, D, "cpu"))
