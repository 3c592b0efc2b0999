"""The exposure measurements of an ensemble's runs on a logging step, each kind in one stacked call
(iclnoise.run.ensemble calls `measure` before its hooks' on_grads)."""
from __future__ import annotations

from typing import Callable

import torch

from ..core.model import mse_loss
from ..core.tasks import Batch, stacked_batch
from ..noise.curvature import stacked_exact_ggn_curvature, stacked_ggn_curvature
from ..noise.exposure import stacked_group_grads
from ..noise.hooks import ExposureLogger, StepContext

# devices where the exact Gauss–Newton curvature of an ensemble's runs is one stacked call; elsewhere each run measures
# its own (on this CPU, one thread, science model, 32 held-out sequences, the stacked call took 2.2× the per-run time:
# 1513 against 686 ms for 18 runs, 220 against 124 ms for 4)
EXACT_STACKED = ("cuda",)


def measure(step: int, batch: Batch, ctxs: dict[int, StepContext], members: list, params: Callable,
            B: int, device: torch.device) -> None:
    """The exposure measurements of the runs whose loggers measure at this step, each kind in one stacked call
    per shape, into their contexts: the group gradients (exposure.stacked_group_grads) and the Gauss–Newton
    diag Ĥ, Hutchinson probes or, on EXACT_STACKED devices, exact (curvature.stacked_ggn_curvature,
    stacked_exact_ggn_curvature), each run's own batch, held-out batch and probe draws, its numbers its own
    measurement's to float32 round-off. A kind one run measures takes the same stacked call (the run's own
    measurement rounds otherwise), so a run measures the same bits alone as in an ensemble. `params(rs)`: the stacked
    parameters of runs rs."""
    grads: dict[int, list[int]] = {}
    curvs: dict[tuple[int, str, int], list[tuple[int, ExposureLogger]]] = {}
    for r in ctxs:
        for h in members[r].hooks:
            if not isinstance(h, ExposureLogger):
                continue
            if h.meter.due(step):
                grads.setdefault(h.meter.n_groups(B), []).append(r)
            stacks = h.curvature == "ggn" or h.curvature == "ggn_exact" and device.type in EXACT_STACKED
            if stacks and h.measures_curvature(step):
                curvs.setdefault((h.n_heldout, h.curvature, h.probes), []).append((r, h))
    model = members[0].model
    for K, rs in grads.items():
        idx = torch.tensor(rs, device=device)
        G = stacked_group_grads(model, mse_loss, params(rs), batch.xs[idx], batch.ys[idx], K)
        for r, g in zip(rs, G):
            ctxs[r].group_grads = g
    for (n, kind, probes), due in curvs.items():
        rs = [r for r, _ in due]
        held = stacked_batch([members[r].heldout for r in rs], step, n)
        scale = 1.0 / due[0][1].D   # mse_loss's 1/D
        hess = (stacked_exact_ggn_curvature(model, params(rs), held.xs, held.ys, scale) if kind == "ggn_exact"
                else stacked_ggn_curvature(model, params(rs), held.xs, held.ys, probes,
                                           [h.probe_generator(step) for _, h in due], scale))
        for r, c in zip(rs, hess):
            ctxs[r].curvature = c
