"""Counter-based random draws for many runs at once (method §4, "Random streams").

A run's draw at step t is a pure function of (its key, t, the index of the value): bits = mix64(base + (i+1)·γ) with
base = mix64(key + (t+1)·γ), mix64 the SplitMix64 finaliser and γ = 0x9E3779B97F4A7C15, all in wrapping 64-bit
integer arithmetic. So R runs' draws are one call of a few tensor ops whatever R is, and a run's values do not
depend on R, on its ensemble mates or on the device's generator state. Normals by Box–Muller from one 64-bit word
(24 bits per uniform: |z| ≤ 5.9), uniform integers in [0, n) as (bits ≫ 1) mod n (bias below n/2⁶³).
"""
from __future__ import annotations

import math

import torch

GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def _i64(u: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    u &= MASK64
    return u - (1 << 64) if u >> 63 else u


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 bit patterns: z ← (z ⊕ z≫30)·M1; z ← (z ⊕ z≫27)·M2; z ⊕ z≫31 (mod 2⁶⁴)."""
    z = (z ^ _shr(z, 30)) * _i64(_M1)
    z = (z ^ _shr(z, 27)) * _i64(_M2)
    return z ^ _shr(z, 31)


def bits(keys: torch.Tensor, step: int, n: int) -> torch.Tensor:
    """(R, n) int64: run r's values 0..n−1 at `step`, mix64(mix64(keys[r] + (step+1)·γ) + (i+1)·γ)."""
    base = mix64(keys + _i64((step + 1) * GAMMA))
    i = torch.arange(1, n + 1, device=keys.device, dtype=torch.int64) * _i64(GAMMA)
    return mix64(base[:, None] + i)


def normal(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normals from 64-bit words `b` (any shape): Box–Muller, √(−2 ln u₁) cos 2πu₂, with u₁ ∈ (0, 1] from the
    high and u₂ ∈ [0, 1) from the low 32 bits (24 of each)."""
    u1 = (_shr(b, 40) + 1).to(torch.float64) * 2.0 ** -24
    u2 = ((b >> 8) & 0xFFFFFF).to(torch.float64) * 2.0 ** -24
    return ((-2.0 * u1.log()).sqrt() * (2 * math.pi * u2).cos()).to(dtype)


def below(b: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Uniform integers in [0, n) from 64-bit words `b` ((bits ≫ 1) mod n; n broadcasts against b)."""
    return torch.remainder(_shr(b, 1), n)


def run_keys(seeds: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """(R,) int64 keys from 63-bit seeds (tasks.seed_mix of a run's stream and seed)."""
    return torch.tensor(seeds, dtype=torch.int64, device=device)
