"""Loss-landscape geometry on held-out batches (SPEC §9): Hessian trace, top eigenvalue, SAM.

All estimators work on a flat parameter vector through Hessian-vector products (forward-over-
reverse with torch.func), optionally in the optimizer's geometry A·H·A with Adam's diagonal
preconditioner A = diag(1 / (sqrt(v̂) + eps)).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch.func import functional_call, grad, jvp

from .io import KEY_FIELDS, read_json, read_parquet, write_parquet

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
        return jvp(grad(self), (self.w0 if w is None else w,), (v,))[1]


def preconditioned(hvp: HVP, a: torch.Tensor | None) -> HVP:
    """v ↦ A H A v for a diagonal A given as the vector a (identity when None)."""
    return hvp if a is None else (lambda v: a * hvp(a * v))


def hutchinson_trace(hvp: HVP, dim: int, n_probes: int, generator: torch.Generator,
                     device="cpu", dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """Tr(H) ≈ mean_k z_kᵀ H z_k with Rademacher z_k; returns (estimate, standard error)."""
    vals = []
    for _ in range(n_probes):
        z = torch.randint(0, 2, (dim,), generator=generator, device=device).to(dtype) * 2 - 1
        vals.append(float(z @ hvp(z)))
    v = np.array(vals)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan


def lanczos_top(hvp: HVP, dim: int, iters: int, generator: torch.Generator, tol: float = 1e-3,
                device="cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Largest eigenvalue by Lanczos with full reorthogonalisation; stops when the Ritz residual
    ‖H y − θ y‖ ≤ tol·|θ|. Returns eigenvalue, residual, iterations and whether it converged."""
    q = torch.randn(dim, generator=generator, device=device).to(dtype)
    q /= q.norm()
    Q, alphas, betas = [q], [], []
    theta, resid, y = math.nan, math.inf, q
    for k in range(min(iters, dim)):
        w = hvp(Q[-1])
        alpha = float(w @ Q[-1])
        alphas.append(alpha)
        Qm = torch.stack(Q)
        w = w - Qm.T @ (Qm @ w)
        w = w - Qm.T @ (Qm @ w)  # twice is enough (Kahan–Parlett)
        beta = float(w.norm())
        T = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
        evals, evecs = np.linalg.eigh(T)
        theta = float(evals[-1])
        resid = abs(beta * evecs[-1, -1])          # ‖H y − θ y‖ for the Ritz vector y
        if resid <= tol * max(abs(theta), 1e-12) or beta < 1e-10:
            return {"eigenvalue": theta, "residual": resid, "iterations": k + 1, "converged": True}
        betas.append(beta)
        Q.append(w / beta)
    return {"eigenvalue": theta, "residual": resid, "iterations": len(alphas), "converged": False}


def sam_sharpness(f: FlatLoss, rho: float) -> float:
    """L(w + ρ g/‖g‖) − L(w) with g = ∇L(w) on the same batch."""
    g = f.grad()
    with torch.no_grad():
        return float(f(f.w0 + rho * g / g.norm().clamp_min(1e-12)) - f(f.w0))


def adam_a(exp_avg_sq: torch.Tensor, step: float, beta2: float, eps: float) -> torch.Tensor:
    """a = 1/(sqrt(v̂) + eps), v̂ = v / (1 − β2^t): Adam's diagonal preconditioner, flattened."""
    return (1.0 / ((exp_avg_sq / (1 - beta2 ** float(step))).sqrt() + eps)).reshape(-1)


def adam_preconditioner(opt_state: dict, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Flat a from an AdamW state_dict (bias-corrected), or None before step 1."""
    state, group = opt_state["state"], opt_state["param_groups"][0]
    if not state:
        return None
    b2, eps = group["betas"][1], group["eps"]
    return torch.cat([adam_a(state[i]["exp_avg_sq"], state[i]["step"], b2, eps) for i in range(len(params))])


GEOMETRY_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("loss", pa.float64()),
    pa.field("hessian_trace", pa.float64()), pa.field("hessian_trace_se", pa.float64()),
    pa.field("top_eigenvalue", pa.float64()), pa.field("top_eigenvalue_residual", pa.float64()),
    pa.field("lanczos_iterations", pa.int64()), pa.field("lanczos_converged", pa.bool_()),
    pa.field("sam_sharpness", pa.float64()), pa.field("sam_rho", pa.float64()),
    pa.field("precond_trace", pa.float64()), pa.field("precond_trace_se", pa.float64()),
    pa.field("n_heldout", pa.int64()), pa.field("seconds", pa.float64()),
])


def geometry_for_run(run_dir: str | Path, cfg: dict, every: int = 1) -> pd.DataFrame:
    """Geometry probes at every k-th checkpoint on a held-out q_M batch (stream 3, never trained on)."""
    from .llc import load_checkpoint_model, select_steps
    from .model import mse_loss
    from .tasks import M_INF, BatchSampler, task_pool

    run_dir = Path(run_dir)
    spec = read_json(run_dir / "run.json")
    d, k = spec["data"], spec["keys"]
    pool = None if k["M"] == M_INF else task_pool(d["pool_seed"], k["M"], d["D"])
    held = BatchSampler(pool, d["K"], d["D"], d["noise_var"], k["seed"], "cpu", stream=3).batch(0, cfg.get("n_heldout", 256))
    rows = []
    for step in select_steps(read_parquet(run_dir / "metrics.parquet").step.tolist(), every):
        t0 = time.time()
        model = load_checkpoint_model(run_dir, step)
        state = torch.load(run_dir / "checkpoints" / f"step_{step:07d}.pt", weights_only=False)
        f = FlatLoss(model, mse_loss, held.xs, held.ys)
        gen = torch.Generator().manual_seed(cfg.get("seed", 0) + step)
        tr, tr_se = hutchinson_trace(f.hvp, f.w0.numel(), cfg.get("probes", 8), gen)
        top = lanczos_top(f.hvp, f.w0.numel(), cfg.get("lanczos_iters", 20), gen, cfg.get("lanczos_tol", 1e-3))
        a = adam_preconditioner(state["optimizer"], list(model.parameters()))
        ptr, ptr_se = (hutchinson_trace(preconditioned(f.hvp, a), f.w0.numel(), cfg.get("probes", 8), gen)
                       if a is not None else (math.nan, math.nan))
        rho = cfg.get("sam_rho", 0.05)
        rows.append({**k, "step": step, "loss": float(f(f.w0)), "hessian_trace": tr, "hessian_trace_se": tr_se,
                     "top_eigenvalue": top["eigenvalue"], "top_eigenvalue_residual": top["residual"],
                     "lanczos_iterations": top["iterations"], "lanczos_converged": top["converged"],
                     "sam_sharpness": sam_sharpness(f, rho), "sam_rho": rho, "precond_trace": ptr,
                     "precond_trace_se": ptr_se, "n_heldout": held.xs.shape[0], "seconds": time.time() - t0})
    df = pd.DataFrame(rows)
    write_parquet(df, run_dir / "geometry.parquet", GEOMETRY_SCHEMA)
    return df


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise geometry", description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--cfg", default="{}", help="JSON: probes, lanczos_iters, lanczos_tol, sam_rho, n_heldout, seed")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    df = geometry_for_run(a.run_dir, json.loads(a.cfg), a.every)
    print(df[["step", "hessian_trace", "hessian_trace_se", "top_eigenvalue", "lanczos_converged", "sam_sharpness",
              "seconds"]].to_string(index=False))
