"""Adam's diagonal preconditioner (SPEC §6, §9), defined once.

    a_i = 1 / (sqrt(v̂_i) + δ),   v̂ = v / (1 − β2^t)

A coordinate that never received a gradient (e.g. attention `b_K`, which softmax makes irrelevant)
has v̂ = 0, or float32 round-off of ~1e-20 in practice: there a ≈ 1/δ would turn round-off into
1/δ-sized noise in every A·H·A or A·C·A product. `dead_zero=True` (the default) gives a = 0 where
sqrt(v̂) < δ, i.e. where Adam's own denominator is dominated by δ (SPEC §9: "such coordinates get
a = 0"); on the default model these are exactly the 96 coordinates the audit of issue 18 found.
"""
from __future__ import annotations

import torch


def adam_a(exp_avg_sq: torch.Tensor, step: float, beta2: float, eps: float, dead_zero: bool = True) -> torch.Tensor:
    """Flat a = 1/(sqrt(v / (1 − β2^step)) + eps); a = 0 where v == 0 when `dead_zero`."""
    root = (exp_avg_sq.reshape(-1) / (1 - beta2 ** float(step))).sqrt()
    a = 1.0 / (root + eps)
    return torch.where(root >= eps, a, torch.zeros_like(a)) if dead_zero else a


def adam_preconditioner(opt_state: dict, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Flat a from a torch AdamW `state_dict()` (bias-corrected, dead coordinates 0), None before step 1."""
    state, group = opt_state["state"], opt_state["param_groups"][0]
    if not state:
        return None
    b2, eps = group["betas"][1], group["eps"]
    return torch.cat([adam_a(state[i]["exp_avg_sq"], state[i]["step"], b2, eps) for i in range(len(params))])
