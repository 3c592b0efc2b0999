"""The SGLD sampler's parts (iclnoise.probes.sgld) against hand-written arithmetic: the kernel's step and MALA ratio,
the mini-batches each chain draws, the observers, and MALA's acceptance on a Gaussian against its known value."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from iclnoise.probes.llc import LLCConfig
from iclnoise.probes.sgld import SGLDStep, chain_generators, run_chains, sgld_chains

pytestmark = [pytest.mark.unit, pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


class Tanh(nn.Module):
    """f(x) = tanh(x·w): a loss with a gradient that is not linear in w."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x, y):
        return torch.tanh(x @ self.w)


def mse(model, x, y):
    return (model(x, y) - y).square().mean()


def hand_chain(w0, X, Y, cfg, chain, mask):
    """Two steps of one chain written out: the mini-batch indices, then the noise, from the chain's own generator;
    U = nβ L_batch + (γ/2)‖w − w*‖²; G = 1 or 1/(√V + δ), V = (1 − α) ∇L² at the first step; the held coordinates
    never move. Returns the two mini-batch losses and the textbook MALA probability of w_0 → w_1 with
    q(w'|w) = N(w − (ε/2) G ∇U(w), ε G) over the moving coordinates."""
    g = chain_generators(cfg.seed, [chain], "cpu")[0]
    nb, eps, gam = cfg.resolved_nbeta(), cfg.epsilon, cfg.gamma
    m = torch.ones_like(w0) if mask is None else mask.double()

    def at(w):
        idx = torch.randint(0, X.shape[0], (cfg.batch,), generator=g)
        w = w.clone().requires_grad_()
        loss = (torch.tanh(X[idx] @ w) - Y[idx]).square().mean()
        (grad,) = torch.autograd.grad(loss, w)
        return loss.detach(), grad, nb * loss.detach() + 0.5 * gam * (w.detach() - w0).square().sum(), \
            nb * grad + gam * (w.detach() - w0)

    w = w0.clone()                                 # chains start at their center; the γ term acts from step 1
    l0, g0, u0, du0 = at(w)
    G = 1.0 if cfg.method == "sgld" else 1 / (((1 - cfg.rmsprop_alpha) * g0 ** 2).sqrt() + cfg.rmsprop_eps)
    xi = torch.randn(w0.shape, generator=g)      # drawn in the default dtype, float32, and (sgld) scaled there
    noise = (xi * math.sqrt(eps)).double() if cfg.method == "sgld" else (eps * G) ** 0.5 * xi.double()
    w1 = w + m * (-0.5 * eps * G * du0 + noise)
    l1, _, u1, du1 = at(w1)
    log_fwd = -(m * xi.double()).square().sum() / 2                 # = −Σ (w1 − w + (ε/2) G ∇U)² / (2εG)
    log_rev = -(m * (w - w1 + 0.5 * eps * G * du1)).square().div(2 * eps * G).sum()
    return w, float(l0), float(l1), min(1.0, math.exp(u0 - u1 + log_rev - log_fwd)), w1


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
def test_two_steps_equal_the_hand_written_chain(method, masked):
    """sgld_chains' losses and MALA probability equal the two steps written out by hand (float64): batch, then
    gradient, drift, preconditioner, noise from the chain's generator; a held coordinate stays where it was (the
    full-set loss observed at w_1 is that of the hand-written w_1)."""
    gen = torch.Generator().manual_seed(1)
    X, w0 = torch.randn(40, 3, generator=gen, dtype=torch.float64), torch.randn(3, generator=gen, dtype=torch.float64)
    Y = torch.tanh(X @ w0) + 0.3 * torch.randn(40, generator=gen, dtype=torch.float64)
    cfg = LLCConfig(seed=3, epsilon=2e-3, gamma=50.0, nbeta=20.0, chains=2, burn_in=0, draws=2, batch=8, n=40,
                    method=method, rmsprop_eps=0.1)
    mask = torch.tensor([1, 0, 1]) if masked else None
    for chain in (0, 1):
        w, l0, l1, acc, w1 = hand_chain(w0, X, Y, cfg, chain, mask)
        ch = sgld_chains(Tanh(torch.zeros(3, dtype=torch.float64)), mse, X, Y, cfg, chains=[chain], centers=[{"w": w0}],
                         masks=None if mask is None else [{"w": mask}], observe=[(X, Y)])
        # float64 throughout; the kernel sums in another order than the hand-written lines: ≲ 10 ε64 relative
        np.testing.assert_allclose(ch.loss[0], [l0, l1], rtol=1e-12)
        np.testing.assert_allclose(ch.accept[0, 0], acc, rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            full = [float(mse(Tanh(v), X, Y)) for v in (w, w1)]
        np.testing.assert_allclose(ch.obs[0, 0], full, rtol=1e-12)


def test_observers_see_each_step_before_the_move():
    """run_chains hands the observers w_t before the kernel moves it, and the acceptance of w_{t−1} → w_t (None at
    t = 0); the w they see at t + 1 is w_t plus the kernel's step."""
    from iclnoise.probes.sgld import Execution, SGLDKernel

    gen = torch.Generator().manual_seed(0)
    X = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    Y = torch.tanh(X @ torch.tensor([0.5, -1.0], dtype=torch.float64))
    cfg = LLCConfig(seed=0, epsilon=1e-3, gamma=10.0, nbeta=5.0, chains=2, burn_in=0, draws=3, batch=30, n=30)
    w0 = {"w": torch.tensor([[0.5, -1.0]] * 2, dtype=torch.float64)}
    kernel = SGLDKernel(cfg, w0)
    seen: list[SGLDStep] = []
    taken: list = []    # the kernel's last step when the observers see w_t: w_t − w_{t−1}

    def observe(s):
        seen.append(SGLDStep(s.t, {k: v.clone() for k, v in s.w.items()}, s.loss, s.accept))
        taken.append(None if kernel.prev is None else kernel.prev[2]["w"].clone())
    run_chains(kernel, Execution(Tanh(torch.zeros(2, dtype=torch.float64)), mse, cfg, 2, 30, True),
               {"w": w0["w"].clone()}, X, Y, chain_generators(0, [0, 1], "cpu"), 3, [observe])
    assert [s.t for s in seen] == [0, 1, 2] and seen[0].accept is None
    assert torch.equal(seen[0].w["w"], w0["w"]) and not torch.equal(seen[1].w["w"], w0["w"])
    assert all(s.accept.shape == (2,) and ((s.accept > 0) & (s.accept <= 1)).all() for s in seen[1:])
    assert all(torch.equal(seen[t - 1].w["w"] + taken[t], seen[t].w["w"]) for t in (1, 2))
    np.testing.assert_allclose([float(s.loss[0]) for s in seen],
                               [float(mse(Tanh(s.w["w"][0]), X, Y)) for s in seen], rtol=1e-12)


class Free(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x, y):
        return self.w


def half_sq(model, x, y):
    return 0.5 * model(x, y).square().sum()


def test_mala_acceptance_on_a_gaussian_equals_its_known_value():
    """U = (a/2) w², a = nβ + γ (loss ½w², w* = 0). SGLD is then w' = (1 − εa/2) w + √ε ξ, whose stationary law is
    N(0, s²), s² = ε / (1 − (1 − εa/2)²); the mean MALA acceptance is E min(1, exp(log α(w, ξ))) over w ~ N(0, s²),
    ξ ~ N(0, 1) independent, with log α = U(w) − U(w') − (w − w' + (ε/2) a w')²/(2ε) + ξ²/2: integrated here by
    4e6 independent draws: 0.9041 (s.e. 8e-5). The chains' mean over 128 × 300 draws (ε a = 1.2: the chain forgets
    in a few steps) measured 0.9023, s.e. over chains 7e-4: the bound 0.004 is 6 s.e."""
    nb, gam, eps = 1.0, 0.5, 0.8
    a = nb + gam
    rng = np.random.default_rng(0)
    s2 = eps / (1 - (1 - eps * a / 2) ** 2)
    w, xi = rng.normal(0, math.sqrt(s2), 4_000_000), rng.standard_normal(4_000_000)
    w2 = (1 - eps * a / 2) * w + math.sqrt(eps) * xi
    la = 0.5 * a * (w ** 2 - w2 ** 2) - (w - w2 + 0.5 * eps * a * w2) ** 2 / (2 * eps) + xi ** 2 / 2
    known = float(np.minimum(1.0, np.exp(la)).mean())
    cfg = LLCConfig(seed=0, epsilon=eps, gamma=gam, nbeta=nb, chains=128, burn_in=30, draws=300, batch=4, n=4)
    X = torch.zeros(4, 1, dtype=torch.float64)
    ch = sgld_chains(Free(), half_sq, X, X[:, 0], cfg)
    ours = float(ch.accept[:, cfg.burn_in - 1:].mean())
    assert abs(ours - known) < 0.004, (ours, known)
    assert 0.5 < known < 0.95                        # a step large enough for the test to see a wrong ratio
