"""Learning-rate schedules and checkpoint schedules (no model imports: cheap for aggregation)."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np


def checkpoint_steps(total: int, n_linear: int, n_log: int) -> list[int]:
    """Union of `n_linear` evenly spaced and `n_log` log-spaced steps in [1, total], plus 0 and total."""
    lin = np.linspace(0, total, n_linear + 1) if n_linear else np.array([])
    log = np.geomspace(1, total, n_log) if n_log and total >= 1 else np.array([])
    return sorted({0, total, *np.round(lin).astype(int).tolist(), *np.round(log).astype(int).tolist()})


def lr_lambda(kind: str, total: int, warmup_frac: float = 0.0, min_lr_frac: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the base lr at update `step`: constant, linear warmup + cosine, or one-cycle triangle."""
    warm = max(1, int(round(warmup_frac * total)))
    if kind == "constant":
        return lambda s: 1.0
    if kind == "warmup_cosine":
        def f(s: int) -> float:
            if s < warm:
                return (s + 1) / warm
            prog = min(1.0, (s - warm) / max(1, total - warm))
            return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog))
        return f
    if kind == "triangle":  # Raventós et al.: linear up to the peak at warmup_frac, linear down to 0
        peak = warm
        return lambda s: (s + 1) / peak if s < peak else max(0.0, (total - s) / max(1, total - peak))
    raise ValueError(f"unknown lr schedule {kind!r}; allowed: constant, warmup_cosine, triangle")
