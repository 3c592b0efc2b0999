"""The ensemble's one optimizer over the runs' stacked parameters (iclnoise.run.ensemble): built from
train.optimizer, its state loaded from the members' resume states, run r's state taken out again, and run r's view
of it as an AdamState for its hooks (RunAdam). AdamW and SGD are elementwise, so one optimizer over the stacked
tensors is R optimizers."""
from __future__ import annotations

import logging

import torch

from ..core.sections import Train
from ..noise.exposure import AdamState

log = logging.getLogger(__name__)


def build_optimizer(P: list[torch.Tensor], t: Train, start: int, device: torch.device,
                    graphed: bool) -> tuple[torch.optim.Optimizer, bool]:
    """One optimizer over the stacked parameters `P`: train.optimizer's AdamW, or SGD with undampened heavy-ball
    momentum (v ← β v + g + λ w, w ← w − η v; κ = 1/(1 − β)²). Its lr is Train.lr, set again every step. Returns it
    and whether the step may still be captured in a CUDA graph (`graphed`; not for SGD)."""
    o, lr = t.optimizer, t.lr(start)
    if o.KIND == "sgd_momentum":
        if graphed:
            log.info("train.cuda_graphs: not for sgd_momentum (its momentum buffers appear at the first step); "
                     "the step runs as without it")
        return torch.optim.SGD(P, lr=lr, momentum=o.momentum, dampening=0.0, weight_decay=o.weight_decay,
                               nesterov=False), False
    lr = torch.tensor(lr, device=device) if graphed else lr   # a graph reads lr from the tensor
    return torch.optim.AdamW(P, lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps,
                             fused=device.type in ("cpu", "cuda"), capturable=graphed), graphed


def load_opt_state(opt: torch.optim.Optimizer, names: list[str], P: list[torch.Tensor], saved: list[dict],
                   device: torch.device) -> None:
    """The optimizer state of the members' resume states (`saved`, one per run, every member at one commit),
    stacked into `opt`."""
    fused = device.type in ("cpu", "cuda")
    for n, p in zip(names, P):
        opt.state[p] = {k: torch.stack([s[k][n] for s in saved]).to(device) for k in saved[0] if k != "step"}
        if "step" in saved[0]:
            opt.state[p]["step"] = torch.tensor(float(saved[0]["step"]), dtype=torch.float32,
                                                device=device if fused else "cpu")


def opt_state_of(opt: torch.optim.Optimizer, names: list[str], P: list[torch.Tensor], r: int,
                 step: int) -> dict | None:
    """Run r's optimizer state at `step` (AdamW has made `step` updates; a frozen run's moments were kept)."""
    st = [opt.state.get(p) for p in P]
    if not st[0]:
        return None
    out = {k: {n: s[k][r].clone().cpu() for n, s in zip(names, st)} for k in st[0] if k != "step"}
    return {"step": step, **out} if "step" in st[0] else out   # AdamW's step; SGD has none


class RunAdam:
    """Run r's view of the ensemble's AdamW as an AdamState (iclnoise.noise.exposure): views of its slices, rebuilt only
    when the optimizer's per-tensor state objects change (its first step, a resume); AdamW updates them in
    place, so the views stay current between steps. r = None: every run's, the stacked tensors themselves."""

    def __init__(self, opt: torch.optim.AdamW, stacked: list[torch.Tensor], r: int | None):
        self.opt, self.stacked, self.r = opt, stacked, r
        self.grads = [P.grad if r is None else P.grad[r] for P in stacked]
        self._key: tuple = ()
        self._slices: tuple = (None, None, None)

    def state(self, step: int) -> AdamState:
        """The state before update `step` (AdamW has made `step` updates once it has a state: no device read)."""
        g = self.opt.param_groups[0]
        if "momentum" in g:   # SGD with momentum: no preconditioner (A = I), β its momentum
            return AdamState(g["momentum"], 0.0, 0.0, self.grads, identity=True, stacked=self.r is None)
        sts = [self.opt.state.get(P) for P in self.stacked]
        key = tuple(id(st) if st else 0 for st in sts)  # an empty state (not yet filled) is 0
        if key != self._key:
            self._key = key
            full = all(sts)
            r = slice(None) if self.r is None else self.r
            self._slices = (([st["exp_avg"][r] for st in sts], [st["exp_avg_sq"][r] for st in sts]) if full
                            else (None, None))
        m, v = self._slices
        return AdamState(g["betas"][0], g["betas"][1], g["eps"], self.grads, None if m is None else step, m, v,
                         stacked=self.r is None)
