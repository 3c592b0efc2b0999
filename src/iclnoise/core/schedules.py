"""Learning-rate schedules and checkpoint schedules, and which checkpoints a probe reads (no model imports: the
Snakefile's cost check and the aggregate import it)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

MERGE_FRACTION = 0.4  # two scheduled steps closer than this fraction of the local spacing are one


def checkpoint_steps(total: int, n_linear: int, n_log: int) -> list[int]:
    """Union of `n_linear` evenly spaced and `n_log` log-spaced steps in [1, total], plus 0 and total,
    without near-duplicates: going up, a step closer to the last kept one than MERGE_FRACTION × the
    local spacing (the smaller of the linear spacing total / n_linear and the log spacing
    step × (ratio − 1)) is dropped, except `total`, which replaces the kept one instead. So 296 and
    312 (8 linear + 12 log over 2500 steps) are one checkpoint, and early log steps stay dense."""
    lin = np.linspace(0, total, n_linear + 1) if n_linear else np.array([])
    log = np.geomspace(1, total, n_log) if n_log and total >= 1 else np.array([])
    cand = sorted({0, total, *np.round(lin).astype(int).tolist(), *np.round(log).astype(int).tolist()})
    lin_gap = total / n_linear if n_linear else math.inf
    ratio = total ** (1 / (n_log - 1)) if n_log > 1 and total > 1 else math.inf
    kept = [cand[0]]
    for s in cand[1:]:
        gap = min(lin_gap, kept[-1] * (ratio - 1)) if math.isfinite(ratio) else lin_gap
        if s - kept[-1] >= max(1.0, MERGE_FRACTION * gap) if math.isfinite(gap) else True:
            kept.append(s)
        elif s == total:
            kept[-1] = total
    return kept


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


def checkpoints_until(total: int, n_linear: int, n_log: int, stop: int) -> list[int]:
    """The checkpoint_steps of a `total`-step schedule up to `stop`, plus `stop` itself: the analysis
    checkpoints of a run stopped early (train.budget.stop_at)."""
    return sorted({s for s in checkpoint_steps(total, n_linear, n_log) if s <= stop} | {stop})


def steps_at(available: list[int], linear: int = 0, log: int = 0, steps: list[int] = ()) -> list[int]:
    """The available checkpoints nearest to `linear` evenly spaced and `log` log-spaced steps of
    [0, last checkpoint] and to the listed `steps` up to the last checkpoint (a published schedule on our
    checkpoints); duplicates dropped."""
    avail = np.asarray(sorted(available))
    last = int(avail[-1])
    wanted = (checkpoint_steps(last, linear, log) if linear or log else []) + [s for s in steps if s <= last]
    return sorted({int(avail[np.abs(avail - w).argmin()]) for w in wanted})


def refined_steps(llc_steps: Sequence[int], n: int) -> list[int]:
    """`n` of the LLC's checkpoints past step 0 (all of them when there are fewer): the first, the last and evenly
    spaced ones between, by index (early, middle, last for n = 3)."""
    steps = sorted(s for s in llc_steps if s > 0) or sorted(llc_steps)
    if n >= len(steps):
        return steps
    return sorted({steps[int(i)] for i in np.round(np.linspace(0, len(steps) - 1, n))})


def select_steps(steps: list[int], every: int) -> list[int]:
    """Every `every`-th checkpoint (from the first) plus always the last."""
    steps = sorted(steps)
    chosen = steps[::max(1, every)]
    return chosen if chosen[-1] == steps[-1] else chosen + [steps[-1]]
