"""Counterfactual noise replay (iclnoise.noise.cnr) against known answers: linear dynamics with a quadratic metric (the
closed form ½ Σ tr(Jᵀ H J ΔΛ)), the drift a quadratic update map induces, and Hutchinson within its standard error."""
import math

import pytest
import torch

from iclnoise.noise.cnr import bound_terms, exact_change, path, replay

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

P, T = 5, 7


def linear_case(seed=0):
    """θ_{t+1} = A_t θ_t + b_t + ξ_t, f(θ) = (½ θᵀHθ + gᵀθ, cᵀθ); Λ_t = B_t B_tᵀ, Λ̃_t = B̃_t B̃_tᵀ (float64)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    A = [torch.eye(P, dtype=torch.float64) + 0.3 * rn(P, P) for _ in range(T)]
    b = [rn(P) for _ in range(T)]
    H = rn(P, P)
    H = H @ H.T
    gv, c = rn(P), rn(P)
    B, Bt = [0.2 * rn(P, 2) for _ in range(T)], [0.2 * rn(P, 3) for _ in range(T)]
    theta = [rn(P)]
    for t in range(T):
        theta.append(A[t] @ theta[t] + b[t])
    steps = [(lambda x, A=A[t], b=b[t]: A @ x + b, theta[t]) for t in range(T)]
    f = lambda x: torch.stack([0.5 * x @ H @ x + gv @ x, c @ x])  # noqa: E731
    return steps, f, theta[-1], A, H, B, Bt


def closed_form(A, H, B, Bt):
    """½ Σ_t tr(J_{T←t+1}ᵀ H J_{T←t+1} (Λ̃_t − Λ_t)) with dense matrices; the linear metric's change is 0."""
    total, J = 0.0, torch.eye(P, dtype=torch.float64)
    for t in reversed(range(T)):   # J = J_{T←t+1} = A_{T-1} ⋯ A_{t+1}
        total += 0.5 * torch.trace(J.T @ H @ J @ (Bt[t] @ Bt[t].T - B[t] @ B[t].T))
        J = J @ A[t]
    return float(total)


def factors(B, Bt):
    return [[(1.0, w) for w in Bt[t].T] + [(-1.0, w) for w in B[t].T] for t in range(T)]


def test_exact_change_equals_the_closed_form_on_linear_dynamics():
    steps, f, theta_T, A, H, B, Bt = linear_case()
    got = exact_change(steps, f, theta_T, factors(B, Bt))
    want = closed_form(A, H, B, Bt)
    assert abs(want) > 0.05   # a change worth predicting
    # float64: T·P² products of O(10) numbers, rounding ~1e-15 each
    assert got[0].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert abs(got[1].item()) < 1e-12   # a linear metric of linear dynamics: no second-order change
    # the wrong Jacobian (one step later) gives another number: the test sees the propagation
    assert abs(closed_form(A[1:] + A[:1], H, B, Bt) - want) > 1e-3


def test_hutchinson_replay_is_unbiased_within_its_standard_error():
    steps, f, theta_T, A, H, B, Bt = linear_case(1)
    want = closed_form(A, H, B, Bt)
    draw = lambda M: lambda t, gen: M[t] @ torch.randn(M[t].shape[1], generator=gen, dtype=torch.float64)  # noqa
    est = replay(steps, f, theta_T, draw(Bt), draw(B), probes=2000, seed=3)
    assert abs(est.delta[0].item() - want) < 4 * est.se[0].item()
    assert est.se[0] < 0.5 * abs(want)
    lo, hi = est.interval()
    assert lo[0] < want < hi[0]
    # sd_draw: the first-order spread, Var(gᵀδ_T) summed over both noises, here from dense matrices
    grad = torch.func.grad(lambda x: f(x)[0])(theta_T)
    var, J = 0.0, torch.eye(P, dtype=torch.float64)
    for t in reversed(range(T)):
        var += float(grad @ J @ (Bt[t] @ Bt[t].T + B[t] @ B[t].T) @ J.T @ grad)
        J = J @ A[t]
    assert est.sd_draw[0].item() == pytest.approx(math.sqrt(var), rel=0.1)   # 2000 draws: ~2 % sampling error


def test_the_drift_of_a_quadratic_update_map():
    """Noise at step 0, then Φ(θ) = θ + Q[θ, θ] (quadratic), then a linear metric: E f moves by gᵀ Q[ΔΛ] exactly."""
    g = torch.Generator().manual_seed(2)
    Q = 0.5 * torch.randn(P, P, P, generator=g, dtype=torch.float64)
    gv = torch.randn(P, generator=g, dtype=torch.float64)
    phi = lambda x: x + torch.einsum("ijk,j,k->i", Q, x, x)  # noqa: E731
    theta0, w = torch.randn(P, generator=g, dtype=torch.float64), torch.randn(P, 2, generator=g, dtype=torch.float64)
    steps = [(lambda x: x, theta0), (phi, theta0)]
    dL = w @ w.T
    got = exact_change(steps, lambda x: (gv @ x)[None], phi(theta0), [[(1.0, c) for c in w.T], []])
    want = gv @ torch.einsum("ijk,jk->i", Q, dL)   # E[Φ(θ + δ)] − Φ(θ) = Q[Cov δ]: exact for quadratic Φ
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert abs(want.item()) > 0.02


def test_no_noise_change_predicts_nothing_and_bad_probes_are_refused():
    steps, f, theta_T, *_ = linear_case()
    first, second = path(steps, f, theta_T, [None] * T)
    assert torch.equal(first, torch.zeros(2, dtype=torch.float64)) and torch.equal(second, first)
    with pytest.raises(ValueError, match="probes >= 2"):
        replay(steps, f, theta_T, lambda t, g: None, lambda t, g: None, probes=1)


def test_bound_terms():
    a, b = bound_terms([0.1, 0.2], [3.0, 1.0], 2.0)
    assert a == pytest.approx(0.01 * 9 + 0.04 * 1) and b == pytest.approx((0.001 + 0.008) * 4)
