"""Geometry probes against the exact Hessian and closed forms (SPEC §9)."""
import math

import numpy as np
import pytest
import torch

from iclnoise.geometry import FlatLoss, adam_preconditioner, hutchinson_trace, lanczos_top, preconditioned, sam_sharpness
from iclnoise.model import ModelConfig, build_model, mse_loss
from iclnoise.tasks import BatchSampler, task_pool


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = build_model(ModelConfig(D=2, K=3, d_model=4, n_layers=1, n_heads=2, d_mlp=4), 0)
    s = BatchSampler(task_pool(0, 4, 2), 3, 2, 0.125, 0)
    opt = torch.optim.AdamW(m.parameters(), 1e-2)
    for i in range(50):
        b = s.batch(i, 32)
        opt.zero_grad()
        mse_loss(m, b.xs, b.ys).backward()
        opt.step()
    b = s.batch(999, 64)
    m.double()
    f = FlatLoss(m, mse_loss, b.xs.double(), b.ys.double())
    H = torch.autograd.functional.hessian(f, f.w0)
    return m, f, H, opt


def test_hvp_matches_exact_hessian(tiny):
    m, f, H, _ = tiny
    v = torch.randn(f.w0.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(f.hvp(v), H @ v, rtol=1e-8, atol=1e-10)


def test_hutchinson_and_lanczos_against_exact_hessian(tiny):
    m, f, H, _ = tiny
    gen = torch.Generator().manual_seed(2)
    est, se = hutchinson_trace(f.hvp, f.w0.numel(), 200, gen, dtype=torch.float64)
    exact = float(torch.trace(H))
    assert abs(est - exact) < 4 * se, (est, exact, se)
    top = lanczos_top(f.hvp, f.w0.numel(), 60, gen, tol=1e-8, dtype=torch.float64)
    assert top["converged"]
    assert top["eigenvalue"] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-6)


def test_quadratic_with_known_spectrum_is_exact():
    lams = torch.tensor([5.0, 3.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    hvp = lambda v: lams * v  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    est, se = hutchinson_trace(hvp, 5, 4, gen, dtype=torch.float64)       # Rademacher on a diagonal H: zᵀDz = tr D exactly
    assert est == pytest.approx(float(lams.sum())) and se == pytest.approx(0.0, abs=1e-12)
    top = lanczos_top(hvp, 5, 10, gen, tol=1e-10, dtype=torch.float64)
    assert top["eigenvalue"] == pytest.approx(5.0, rel=1e-10) and top["iterations"] <= 5
    a = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    est_p, _ = hutchinson_trace(preconditioned(hvp, a), 5, 3, gen, dtype=torch.float64)
    assert est_p == pytest.approx(float((a * lams * a).sum()))


def test_sam_sharpness_closed_form_on_a_quadratic():
    """For L = ½ wᵀΛw: L(w + ρĝ) − L(w) = ρ‖g‖ + ½ρ² ĝᵀΛĝ with g = Λw."""
    lams = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)

    class Q(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))

        def forward(self, xs, ys):
            return self.w

    f = FlatLoss(Q(), lambda model, xs, ys: 0.5 * (lams * model(xs, ys) ** 2).sum(), None, None)
    g = lams * f.w0
    gh = g / g.norm()
    rho = 0.1
    assert sam_sharpness(f, rho) == pytest.approx(float(rho * g.norm() + 0.5 * rho ** 2 * gh @ (lams * gh)), rel=1e-10)


def test_adam_preconditioner_matches_optimizer_state(tiny):
    m, f, H, opt = tiny
    a = adam_preconditioner(opt.state_dict(), list(m.parameters()))
    st = opt.state[next(iter(m.parameters()))]
    b2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    vhat = st["exp_avg_sq"] / (1 - b2 ** float(st["step"]))
    torch.testing.assert_close(a[:vhat.numel()].double(), (1 / (vhat.sqrt() + eps)).reshape(-1).double())
    assert adam_preconditioner({"state": {}, "param_groups": [{}]}, []) is None
