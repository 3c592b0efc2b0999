"""Curvature of the loss on held-out data for noise exposure (method §6): Hutchinson samples of the Gauss–Newton
or Hessian diagonal, one run or a stack of runs in one call, and the exact Gauss–Newton diagonal as their check."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.func import functional_call, vmap

from ..core.model import LossFn
from ..probes.geometry import FlatLoss


def _rademacher(shape: tuple, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=generator, device=like.device).to(like.dtype) * 2 - 1


def _mean_se(vals: torch.Tensor) -> torch.Tensor:
    """(mean, standard error of the mean) of the samples, float64 on their device (SE NaN for one sample)."""
    v = vals.double()
    se = v.std() / math.sqrt(len(v)) if len(v) > 1 else v.new_tensor(math.nan)
    return torch.stack([v.mean(), se])


@dataclass
class Curvature:
    """Hutchinson samples of diag(Ĥ), one per probe, as products left_k ⊙ right_k · scale, so that
    Curv = Tr(A Ĥ A) = Σ_i a_i² Ĥ_ii can be evaluated at any diagonal A (method §6: the closed loop divides by a
    curvature with the A of the step it scales; Ĥ is measured on logged steps, A moves every step).

    Gauss–Newton: left = right = Jᵀu_k (Rademacher u_k over the N outputs), scale 2 loss_scale / N, E = diag(G);
    Hessian: left = z_k, right = H z_k (Rademacher z_k over parameters), scale 1, E = diag(H)."""

    left: torch.Tensor    # (probes, P)
    right: torch.Tensor   # (probes, P)
    scale: float = 1.0

    @property
    def diag(self) -> torch.Tensor:
        return (self.left * self.right).mean(0) * self.scale

    def at(self, a: torch.Tensor | None) -> tuple[float, float]:
        """(Tr(A Ĥ A), its standard error over probes); a = None gives Tr(Ĥ)."""
        curv, se = self.at_device(a).tolist()
        return curv, se

    def at_device(self, a: torch.Tensor | None) -> torch.Tensor:
        """`at`'s two values as a float64 (2,) tensor on the device, not read."""
        left, right = (self.left, self.right) if a is None else (self.left * a, self.right * a)
        return _mean_se((left * right).sum(1) * self.scale)


def hessian_curvature(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, probes: int,
                      generator: torch.Generator) -> Curvature:
    """Hutchinson samples z ⊙ H z of the Hessian diagonal, all probes in one vmapped forward-over-reverse pass."""
    f = FlatLoss(model, loss_fn, xs, ys)
    Z = _rademacher((probes, f.w0.numel()), generator, f.w0)
    return Curvature(Z, vmap(f.hvp)(Z))


def ggn_curvature(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, probes: int,
                  generator: torch.Generator, loss_scale: float = 1.0) -> Curvature:
    """Samples of the Gauss–Newton diagonal for L = loss_scale · mean_n (f_n − y_n)² over N outputs,
    G = (2 loss_scale / N) JᵀJ: (Jᵀu_k)² · 2 loss_scale / N with Rademacher u_k over the outputs (E[u uᵀ] = I),
    one vmapped vector-Jacobian product per probe. Non-negative, so every Tr(A G A) estimate is too."""
    f = FlatLoss(model, None, xs, ys)
    out, vjp_fn = torch.func.vjp(lambda w: functional_call(model, (f.unflatten(w), f.buffers), (xs, ys)), f.w0)
    U = _rademacher((probes, *out.shape), generator, out)
    JtU = vmap(vjp_fn)(U)[0]
    return Curvature(JtU, JtU, 2 * loss_scale / out.numel())


def exact_ggn_diag(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
    """The Gauss–Newton diagonal exactly, in float64: diag G = (2 loss_scale / N) Σ_n J_n² for L = loss_scale ·
    mean_n (f_n − y_n)² over the N outputs of the batch (method §6). Each sequence's outputs depend on its own input
    only, so the Jacobian is taken per sequence (vmap over sequences of its K-output jacrev): K backward passes of
    one sequence each, not N of the whole batch; the same numbers as the batch's full Jacobian. A check of the
    Hutchinson estimate (`ggn_curvature`), which the closed loop uses; the loop never calls this."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(q, x, y):
        return functional_call(model, (q, buffers), (x[None], y[None]))[0]

    J = vmap(torch.func.jacrev(one), in_dims=(None, 0, 0))(params, xs, ys)
    diag = torch.cat([J[n].double().square().reshape(-1, p.numel()).sum(0) for n, p in params.items()])
    return diag * 2 * loss_scale / ys.numel()


def exact_ggn_curvature(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor,
                        loss_scale: float = 1.0) -> Curvature:
    """The Gauss–Newton diagonal exactly (`exact_ggn_diag`'s numbers), kept per held-out sequence so that Curv at
    any A carries the batch's sampling error: sample i is (2 loss_scale / K) Σ_{k ∈ i} J_k², K outputs per sequence,
    whose mean over sequences is diag G; Curv's standard error is then the spread of Σ a² · sample_i over the
    sequences (what another held-out batch would change), not a probe error. Per-sequence Jacobians (vmap of
    jacrev): K backward passes of one sequence each, about what K Hutchinson probes of the whole batch cost."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(q, x, y):
        return functional_call(model, (q, buffers), (x[None], y[None]))[0]

    J = vmap(torch.func.jacrev(one), in_dims=(None, 0, 0))(params, xs, ys)
    per = torch.cat([J[n].square().reshape(xs.shape[0], -1, p.numel()).sum(1) for n, p in params.items()], 1)
    return Curvature(per, torch.ones_like(per), 2 * loss_scale * xs.shape[0] / ys.numel())


def stacked_exact_ggn_curvature(model: torch.nn.Module, params: dict[str, torch.Tensor], xs: torch.Tensor,
                                ys: torch.Tensor, loss_scale: float = 1.0) -> list[Curvature]:
    """`exact_ggn_curvature` of R runs in one call: `params` stacked along a leading run axis (R, ...) on a model that
    stacks runs, xs (R, N, ...), ys (R, N, ...). Run r's outputs depend on its own parameters only, so the Jacobian of
    the K outputs summed over the runs holds every run's own Jacobian in its slice: K backward passes per sequence for
    all runs at once (vmap over sequences of jacrev). Run r's samples equal its own `exact_ggn_curvature` to float32
    round-off."""
    names, (R, N) = list(params), xs.shape[:2]
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def one(q, x, y):   # x (R, ...): one sequence of every run; the runs' K outputs summed over the runs
        return functional_call(model, (q, buffers), (x[:, None], y[:, None]))[:, 0].sum(0)

    J = vmap(torch.func.jacrev(one), in_dims=(None, 1, 1))({n: p.detach() for n, p in params.items()}, xs, ys)
    per = torch.cat([J[n].square().sum(1).transpose(0, 1).reshape(R, N, -1) for n in names], 2)   # (R, N, P)
    return [Curvature(f, torch.ones_like(f), 2 * loss_scale * N / ys[0].numel()) for f in per]


def stacked_ggn_curvature(model: torch.nn.Module, params: dict[str, torch.Tensor], xs: torch.Tensor, ys: torch.Tensor,
                          probes: int, generators: list[torch.Generator], loss_scale: float = 1.0) -> list[Curvature]:
    """`ggn_curvature` of R runs in one call: `params` stacked along a leading run axis (R, ...) on a model that
    stacks runs (iclnoise.core.model.ICLTransformer), xs (R, N, ...), ys (R, N, ...). Run r's probes are drawn from
    generators[r] exactly as `ggn_curvature` draws them, and the runs' Jacobians are blocks of one block-diagonal
    Jacobian, so one vmapped vector-Jacobian product per probe gives every run's Jᵀu_k: run r's samples equal
    its own `ggn_curvature` to float32 round-off (batched against single matmuls)."""
    names, R = list(params), xs.shape[0]
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    out, vjp_fn = torch.func.vjp(lambda p: functional_call(model, (p, buffers), (xs, ys)),
                                 {n: p.detach() for n, p in params.items()})
    U = torch.stack([_rademacher((probes, *out.shape[1:]), g, out) for g in generators], 1)   # (probes, R, ...)
    JtU = vmap(vjp_fn)(U)[0]
    flat = torch.cat([JtU[n].transpose(0, 1).reshape(R, probes, -1) for n in names], 2)       # (R, probes, P)
    return [Curvature(f, f, 2 * loss_scale / out[0].numel()) for f in flat]
