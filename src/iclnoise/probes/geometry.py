"""Loss-landscape geometry on held-out batches (method §9), per analysis checkpoint.

- Hutchinson trace of the Hessian H and of A·H·A (Adam's diagonal preconditioner a, with a = 0 on
  coordinates that never received a gradient, `iclnoise.core.adam`; A·H·A runs in float64, see
  `precond_trace`): mean of Rademacher zᵀHz over `probes` probes, its standard error and the
  t-based 95 % half-width t_{0.975, probes−1}·se;
- the largest and the smallest algebraic Hessian eigenvalue by one Lanczos run (full
  reorthogonalisation), each with its Ritz residual and whether it met `lanczos_tol`;
- SAM sharpness L(w + ρ g/‖g‖) − L(w) on each of `sam_batches` held-out batches: mean and se.

All estimators work on a flat parameter vector through Hessian-vector products in float32, except A·H·A
(float64): reverse-over-reverse on one retained graph of ∇L at the checkpoint (`FlatLoss.hvp_at_w0`: every
product is one backward pass; faster than forward-over-reverse on CPU, bench/bench_probes.py). Held-out
sequences come from the run's own q_M on the named stream "geometry", which training never uses.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np
import pyarrow as pa
import torch
from scipy import stats
from torch.func import functional_call, grad, jvp

from ..core.adam import adam_a, adam_preconditioner  # noqa: F401  (re-exported: exposure and its tests use them here)
from ..core.probe_sections import Geometry
from ..core.runspec import KEY_FIELDS

HVP = Callable[[torch.Tensor], torch.Tensor]


class FlatLoss:
    """L(w) on a fixed batch as a function of the flat parameter vector w, with ∇L and H·v."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, xs: torch.Tensor, ys: torch.Tensor):
        self.model, self.loss_fn, self.xs, self.ys = model, loss_fn, xs, ys
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [p.numel() for _, p in model.named_parameters()]
        self.buffers = {k: v.detach() for k, v in model.named_buffers()}
        self.w0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, w.split(self.sizes), self.shapes)}

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        params = self.unflatten(w)
        return self.loss_fn(lambda a, b: functional_call(self.model, (params, self.buffers), (a, b)), self.xs, self.ys)

    def grad(self, w: torch.Tensor | None = None) -> torch.Tensor:
        return grad(self)(self.w0 if w is None else w)

    def hvp(self, v: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        """H·v by forward-over-reverse (torch.func): composes with vmap and works at any w."""
        return jvp(grad(self), (self.w0 if w is None else w,), (v,))[1]

    def hvp_at_w0(self) -> HVP:
        """v ↦ H(w0)·v by reverse-over-reverse: the graph of ∇L(w0) is built once (create_graph) and every
        product is one backward pass through it, H v = ∂(∇L · v)/∂w. For many products at one point
        (Hutchinson probes, Lanczos iterations); not under vmap."""
        w = self.w0.clone().requires_grad_()
        with torch.enable_grad():
            g = torch.autograd.grad(self(w), w, create_graph=True)[0]
        return lambda v: torch.autograd.grad(g, w, v, retain_graph=True)[0]


def preconditioned(hvp: HVP, a: torch.Tensor | None) -> HVP:
    """v ↦ A H A v for a diagonal A given as the vector a (identity when None)."""
    return hvp if a is None else (lambda v: a * hvp(a * v))


def hutchinson_trace(hvp: HVP, dim: int, n_probes: int, generator: torch.Generator,
                     device="cpu", dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Tr(H) ≈ mean_k z_kᵀ H z_k with Rademacher z_k; returns (estimate, standard error)."""
    v = np.array(hutchinson_samples(hvp, dim, n_probes, generator, device, dtype))
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


def hutchinson_samples(hvp: HVP, dim: int, n_probes: int, generator: torch.Generator,
                       device="cpu", dtype: torch.dtype = torch.float32) -> list[float]:
    """The per-probe values z_kᵀ H z_k, Rademacher z_k drawn from `generator` (in order, as one draw each)."""
    Z = [torch.randint(0, 2, (dim,), generator=generator, device=device).to(dtype) * 2 - 1 for _ in range(n_probes)]
    return [float(z @ hvp(z)) for z in Z]


def t_halfwidth(se: float, n: int, level: float = 0.95) -> float:
    """Half-width of the t-based interval mean ± t_{(1+level)/2, n−1}·se (NaN for n < 2)."""
    return float(stats.t.ppf(0.5 + level / 2, n - 1) * se) if n > 1 else math.nan


def lanczos(hvp: HVP, dim: int, iters: int, generator: torch.Generator, tol: float = 1e-3,
            device="cpu", dtype: torch.dtype = torch.float32,
            which: tuple[str, ...] = ("max", "min")) -> dict[str, dict]:
    """Largest ("max") and smallest algebraic ("min") eigenvalue by Lanczos with full
    reorthogonalisation; stops when the Ritz residuals ‖H y − θ y‖ of those in `which` are ≤
    tol·max(|θ|, 1e-12·‖T‖) or the Krylov space is exhausted. Each: eigenvalue, residual, iterations, converged."""
    q = torch.randn(dim, generator=generator, device=device).to(dtype)
    Q, alphas, betas = [q / q.norm()], [], []
    out = {}
    for k in range(min(iters, dim)):
        w = hvp(Q[-1])
        alphas.append(float(w @ Q[-1]))
        Qm = torch.stack(Q)
        w = w - Qm.T @ (Qm @ w)
        w = w - Qm.T @ (Qm @ w)  # twice is enough (Kahan–Parlett)
        beta = float(w.norm())
        evals, evecs = np.linalg.eigh(np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1))
        scale = max(abs(evals[0]), abs(evals[-1]), 1e-30)
        done = beta < 1e-10 * scale
        for name, col in (("max", -1), ("min", 0)):
            theta, resid = float(evals[col]), abs(beta * evecs[-1, col])
            ok = done or resid <= tol * max(abs(theta), 1e-12 * scale)
            out[name] = {"eigenvalue": theta, "residual": resid, "iterations": k + 1, "converged": bool(ok)}
        if all(out[k]["converged"] for k in which):
            return out
        betas.append(beta)
        Q.append(w / beta)
    return out


def lanczos_top(hvp: HVP, dim: int, iters: int, generator: torch.Generator, tol: float = 1e-3,
                device="cpu", dtype: torch.dtype = torch.float32) -> dict:
    """The largest eigenvalue's entry of `lanczos`, stopping as soon as it has converged."""
    return lanczos(hvp, dim, iters, generator, tol, device, dtype, which=("max",))["max"]


def sam_sharpness(f: FlatLoss, rho: float) -> float:
    """L(w + ρ g/‖g‖) − L(w) with g = ∇L(w) on the same batch."""
    g = f.grad()
    with torch.no_grad():
        return float(f(f.w0 + rho * g / g.norm().clamp_min(1e-12)) - f(f.w0))


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sd / √n; NaN for one value)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


GEOMETRY_COLUMNS = ["hessian_trace", "top_eigenvalue", "sam_sharpness"]   # a run's summary: its last row
GEOMETRY_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("loss", pa.float64()),
    pa.field("hessian_trace", pa.float64()), pa.field("hessian_trace_se", pa.float64()),
    pa.field("hessian_trace_ci95", pa.float64()),
    pa.field("top_eigenvalue", pa.float64()), pa.field("top_eigenvalue_residual", pa.float64()),
    pa.field("top_eigenvalue_converged", pa.bool_()),
    pa.field("min_eigenvalue", pa.float64()), pa.field("min_eigenvalue_residual", pa.float64()),
    pa.field("min_eigenvalue_converged", pa.bool_()), pa.field("lanczos_iterations", pa.int64()),
    pa.field("sam_sharpness", pa.float64()), pa.field("sam_sharpness_se", pa.float64()),
    pa.field("sam_rho", pa.float64()), pa.field("sam_batches", pa.int64()),
    pa.field("precond_trace", pa.float64()), pa.field("precond_trace_se", pa.float64()),
    pa.field("precond_trace_ci95", pa.float64()), pa.field("n_dead", pa.int64()),
    pa.field("n_heldout", pa.int64()), pa.field("probes", pa.int64()),
])


def precond_trace(model: torch.nn.Module, a: torch.Tensor, batch, n_probes: int,
                  generator: torch.Generator) -> tuple[float, float]:
    """Hutchinson Tr(A·H·A) (mean, se) in float64 on a float64 copy of the model. Coordinates whose
    second moment is float32 round-off (attention b_K: softmax makes its gradient 0 up to round-off,
    so v ~ 1e-20 ≠ 0 and a ≈ 1/δ; adam.py zeroes a only where v == 0) would multiply float32
    round-off in H·v by a² ~ 1e16: on the default model (300 Adam steps) float32 − float64 was
    4.4e6 against a float64 value of 2.0e6 ± 3.1e6; in float64 their contribution is O(1)."""
    from ..core.model import mse_loss

    f = FlatLoss(copy.deepcopy(model).double(), mse_loss, batch.xs.double(), batch.ys.double())
    hvp = preconditioned(f.hvp_at_w0(), a.double())
    return hutchinson_trace(hvp, f.w0.numel(), n_probes, generator, dtype=torch.float64)


def geometry_at(model: torch.nn.Module, a: torch.Tensor | None, batches: list, cfg: Geometry, seed: int) -> dict:
    """Every column of GEOMETRY_SCHEMA except keys and step, for one model; `batches[0]` carries the
    trace and eigenvalue estimates, every batch one SAM sharpness."""
    from ..core.model import mse_loss

    f = FlatLoss(model, mse_loss, batches[0].xs, batches[0].ys)
    dim, n = f.w0.numel(), cfg.probes
    gen = torch.Generator().manual_seed(seed)
    hvp = f.hvp_at_w0()
    tr, tr_se = hutchinson_trace(hvp, dim, n, gen)
    eig = lanczos(hvp, dim, cfg.lanczos_iters, gen, cfg.lanczos_tol)
    if a is not None:
        ptr, ptr_se = precond_trace(model, a, batches[0], n, gen)
    else:
        ptr, ptr_se = math.nan, math.nan
    rho = cfg.sam_rho
    sam, sam_se = mean_se([sam_sharpness(FlatLoss(model, mse_loss, b.xs, b.ys), rho) for b in batches])
    return {"loss": float(f(f.w0)), "hessian_trace": tr, "hessian_trace_se": tr_se,
            "hessian_trace_ci95": t_halfwidth(tr_se, n),
            "top_eigenvalue": eig["max"]["eigenvalue"], "top_eigenvalue_residual": eig["max"]["residual"],
            "top_eigenvalue_converged": eig["max"]["converged"],
            "min_eigenvalue": eig["min"]["eigenvalue"], "min_eigenvalue_residual": eig["min"]["residual"],
            "min_eigenvalue_converged": eig["min"]["converged"], "lanczos_iterations": eig["max"]["iterations"],
            "sam_sharpness": sam, "sam_sharpness_se": sam_se, "sam_rho": rho, "sam_batches": len(batches),
            "precond_trace": ptr, "precond_trace_se": ptr_se, "precond_trace_ci95": t_halfwidth(ptr_se, n),
            "n_dead": int((a == 0).sum()) if a is not None else -1,
            "n_heldout": int(batches[0].xs.shape[0]), "probes": n}
