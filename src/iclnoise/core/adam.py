"""Adam's diagonal preconditioner (method §6, §9), defined once.

    a_i = 1 / (sqrt(v̂_i) + δ),   v̂ = v / (1 − β2^t)

A coordinate that never received a gradient has v̂ = 0 in exact arithmetic, but in float32 it can carry
round-off: attention `b_K`, which softmax makes irrelevant, has sqrt(v̂) ≈ 1e-9 of the model's largest
(measured on the default model after 400 steps; every other coordinate is above 6e-4 of it). There a ≈ 1/δ
would turn round-off into 1/δ-sized noise in every A·H·A or A·C·A product. So a = 0 where v̂ = 0 or where
sqrt(v̂) is below the float resolution of the model's largest, sqrt(v̂_i) ≤ ε · max_j sqrt(v̂_j) (ε the dtype's
machine epsilon: such a value is indistinguishable from round-off of the largest gradients). The rule does
not depend on δ: with a large δ, coordinates AdamW really moves keep a ≈ 1/δ (method §9: "coordinates whose
second moment is zero get a = 0"). The maximum is over the whole model, so pass every parameter's v at once.
"""
from __future__ import annotations

import torch


def adam_root(exp_avg_sq: torch.Tensor, step: float, beta2: float) -> torch.Tensor:
    """Flat sqrt(v̂) = sqrt(v / (1 − β2^step))."""
    return (exp_avg_sq.reshape(-1) / (1 - beta2 ** float(step))).sqrt()


def precondition(root: torch.Tensor, eps: torch.Tensor | float, dead_zero: bool = True) -> torch.Tensor:
    """a = 1/(root + eps) from the whole model's flat sqrt(v̂); a = 0 where root ≤ ε_dtype · max(root). The model is
    the last axis: (R, P) roots of R runs give each run its own maximum."""
    a = 1.0 / (root + eps)
    if not dead_zero or root.numel() == 0:
        return a
    return torch.where(root > torch.finfo(root.dtype).eps * root.amax(-1, keepdim=True), a, torch.zeros_like(a))


def adam_a(exp_avg_sq: torch.Tensor, step: float, beta2: float, eps: float, dead_zero: bool = True) -> torch.Tensor:
    """Flat a = 1/(sqrt(v / (1 − β2^step)) + eps) of the whole model's flat v; dead coordinates 0 when `dead_zero`."""
    return precondition(adam_root(exp_avg_sq, step, beta2), eps, dead_zero)


def adam_preconditioner(opt_state: dict, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Flat a from a torch AdamW `state_dict()` (bias-corrected, dead coordinates 0), None before step 1."""
    state, group = opt_state["state"], opt_state["param_groups"][0]
    if not state:
        return None
    b2, eps = group["betas"][1], group["eps"]
    return precondition(torch.cat([adam_root(state[i]["exp_avg_sq"], state[i]["step"], b2)
                                   for i in range(len(params))]), eps)
