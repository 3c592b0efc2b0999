"""The first-order perturbation formulas (iclnoise.noise.cnr) against a closed form: on linear dynamics, w_t added
after each step moves θ_T by Σ_t J_{T←t+1} w_t and f by ∇f · that; a noise that enters the step as an input moves
it through the input's matrix."""
import pytest
import torch

from iclnoise.noise.cnr import change, propagate

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

P, T = 5, 7


def test_the_first_order_change_is_the_closed_form_on_linear_dynamics():
    """θ_{t+1} = A_t θ_t + b_t + B_t u_t + w_t with f(θ) = (½ θᵀHθ + gᵀθ, cᵀθ), float64: carrying δ with `propagate`
    (the input u_t as a tangent of the map (θ, u) ↦ Φ_t) and reading `change` at θ_T gives ∇f(θ_T) · δ_T with
    δ_T = Σ_t J_{T←t+1} (B_t u_t + w_t) from dense matrices; the Jacobian of the wrong step does not."""
    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    A = [torch.eye(P, dtype=torch.float64) + 0.3 * rn(P, P) for _ in range(T)]
    B = [rn(P, 2) for _ in range(T)]
    b, u, w = [rn(P) for _ in range(T)], [rn(2) for _ in range(T)], [0.1 * rn(P) for _ in range(T)]
    H = rn(P, P)
    H = H @ H.T
    gv, c = rn(P), rn(P)
    f = lambda x: torch.stack([0.5 * x @ H @ x + gv @ x, c @ x])  # noqa: E731
    theta = [rn(P)]
    for t in range(T):
        theta.append(A[t] @ theta[t] + b[t])
    delta = torch.zeros(P, dtype=torch.float64)
    for t in range(T):
        step = lambda y, t=t: A[t] @ y[:P] + b[t] + B[t] @ y[P:]  # noqa: E731
        delta = propagate(step, torch.cat([theta[t], torch.zeros(2, dtype=torch.float64)]),
                          torch.cat([delta, u[t]])) + w[t]
    got = change(f, theta[-1], delta)
    want, J = torch.zeros(P, dtype=torch.float64), torch.eye(P, dtype=torch.float64)
    for t in reversed(range(T)):   # J = J_{T←t+1} = A_{T-1} ⋯ A_{t+1}
        want += J @ (B[t] @ u[t] + w[t])
        J = J @ A[t]
    grad = torch.stack([H @ theta[-1] + gv, c])
    torch.testing.assert_close(delta, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, grad @ want, rtol=1e-12, atol=1e-12)
    assert got.abs().min() > 0.05   # a change worth predicting
    wrong = propagate(lambda y: A[1] @ y, theta[0], want)
    assert (wrong - A[0] @ want).norm() > 1e-3 * want.norm()   # the test sees which step's Jacobian it carries
