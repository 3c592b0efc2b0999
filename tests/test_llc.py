"""LLC: known learning coefficients, agreement with devinterp, invariances (SPEC §7)."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from iclnoise.llc import LLCConfig, estimate_llc, select_steps, sgld_chains
from iclnoise.model import ModelConfig, build_model, mse_loss
from iclnoise.tasks import BatchSampler, task_pool


def mse(model, x, y):
    return (model(x, y) - y).square().mean()


class Linear(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def forward(self, x, y):
        return x @ self.w


class Product(nn.Module):
    """f(x) = a·b·x: two parameters, one direction of the true set {ab = c} is flat."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(a)), nn.Parameter(torch.tensor(b))

    def forward(self, x, y):
        return self.a * self.b * x[:, 0]


def test_regular_model_recovers_d_over_2():
    """Linear regression with d = 8 parameters at its least-squares optimum: λ = d/2 = 4."""
    n, d = 1000, 8
    g = torch.Generator().manual_seed(1)
    X = torch.randn(n, d, generator=g)
    Y = X @ torch.randn(d, generator=g) + 0.5 * torch.randn(n, generator=g)
    m = Linear(d)
    m.w.data = torch.linalg.lstsq(X, Y.unsqueeze(1)).solution.squeeze(1)
    r = estimate_llc(m, mse, X, Y, LLCConfig(epsilon=3e-4, gamma=1.0, chains=8, burn_in=200, draws=800, batch=100, n=n))
    se = r.llc_std / math.sqrt(8)
    assert abs(r.llc_mean - 4.0) < 3 * se + 0.3, (r.llc_mean, se)
    assert not any(r.flags.values())


def test_singular_model_has_learning_coefficient_below_d_over_2():
    """f = abx at a true ab = c ≠ 0: K(a, b) ∝ (ab − c)² vanishes on a smooth curve, so only one
    of the d = 2 directions is curved and λ = 1/2 < d/2 = 1 (Watanabe 2009, ch. 2: the RLCT of a
    function with a non-degenerate normal crossing of codimension 1 is 1/2)."""
    n = 1000
    g = torch.Generator().manual_seed(2)
    X = torch.randn(n, 1, generator=g)
    Y = X[:, 0] + 0.5 * torch.randn(n, generator=g)
    c = float(X[:, 0] @ Y / (X[:, 0] @ X[:, 0]))
    r = estimate_llc(Product(1.0, c), mse, X, Y,
                     LLCConfig(epsilon=3e-4, gamma=1.0, chains=8, burn_in=200, draws=800, batch=100, n=n))
    se = r.llc_std / math.sqrt(8)
    assert abs(r.llc_mean - 0.5) < 3 * se + 0.15, (r.llc_mean, se)
    assert r.llc_mean < 0.85


@pytest.fixture(scope="module")
def tiny_checkpoint():
    K, D = 4, 2
    m = build_model(ModelConfig(D=D, K=K, d_model=8, n_layers=1, n_heads=2, d_mlp=8), 0)
    s = BatchSampler(task_pool(0, 4, D), K, D, 0.125, 0)
    opt = torch.optim.Adam(m.parameters(), 3e-3)
    for i in range(300):
        b = s.batch(i, 64)
        opt.zero_grad()
        mse_loss(m, b.xs, b.ys).backward()
        opt.step()
    b = BatchSampler(task_pool(0, 4, D), K, D, 0.125, 0, stream=2).batch(0, 256)
    return m, b.xs, b.ys, K, D


def test_agrees_with_devinterp(tiny_checkpoint):
    """Same checkpoint, data and hyperparameters: estimates agree within the chains' standard errors."""
    datasets = pytest.importorskip("datasets")
    from devinterp.slt.llc import llc as devinterp_llc

    m, xs, ys, K, D = tiny_checkpoint
    n = xs.shape[0]

    class Adapter(nn.Module):  # devinterp 2.0.1 calls model.to(device, print_details=False)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return self.inner(x, y)

        def to(self, *a, print_details=False, **k):
            return super().to(*a, **k)

    def per_token_loss(model, input_ids):  # regression data as float input_ids (SPEC §14)
        x = input_ids[:, :K * D].reshape(-1, K, D).float()
        y = input_ids[:, K * D:].float()
        return ((model(x, y) - y).square().mean(1) / D)[:, None].expand(-1, input_ids.shape[1] - 1)

    ds = datasets.Dataset.from_dict({"input_ids": torch.cat([xs.reshape(n, -1), ys], 1).tolist()}).with_format("torch")
    eps, gamma, nbeta, C, T, B = 1e-4, 100.0, n / math.log(n), 8, 300, 32
    ref = devinterp_llc(Adapter(m), ds, {}, lr=eps, n_beta=nbeta, localization=gamma, num_chains=C, num_draws=T,
                        batch_size=B, num_burnin_steps=0, num_init_loss_batches=n // B, loss_fn=per_token_loss,
                        device="cpu")
    ours = estimate_llc(m, mse_loss, xs, ys, LLCConfig(epsilon=eps, gamma=gamma, nbeta=nbeta, chains=C, burn_in=0,
                                                        draws=T, batch=B, n=n))
    assert float(ref.init_loss) == pytest.approx(ours.init_loss, rel=1e-5)
    se = math.sqrt(float(ref.llc_std) ** 2 / C + ours.llc_std ** 2 / C)
    assert abs(float(ref.llc_mean) - ours.llc_mean) < 3 * se, (float(ref.llc_mean), ours.llc_mean, se)
    assert ours.llc_mean > 0


def test_invariances(tiny_checkpoint):
    m, xs, ys, *_ = tiny_checkpoint
    cfg = LLCConfig(epsilon=1e-4, gamma=100.0, chains=3, burn_in=5, draws=20, batch=32, n=256)
    base = sgld_chains(m, mse_loss, xs, ys, cfg)
    # chain order: running chains [2, 0, 1] gives the same chains, permuted
    perm = sgld_chains(m, mse_loss, xs, ys, cfg, chains=[2, 0, 1])
    np.testing.assert_allclose(perm, base[[2, 0, 1]], rtol=1e-5, atol=1e-7)
    # a chain alone equals the same chain run with others
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg, chains=[1]), base[[1]], rtol=1e-5, atol=1e-7)
    # vmap over chains vs a Python loop
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg, vectorize=False), base, rtol=1e-5, atol=1e-7)
    # splitting each SGLD mini-batch into micro-batches for the gradient
    cfg2 = LLCConfig(**{**cfg.__dict__, "micro_batches": 4})
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg2), base, rtol=1e-4, atol=1e-6)
    # deterministic given the seed, different for another seed
    np.testing.assert_array_equal(sgld_chains(m, mse_loss, xs, ys, cfg), base)
    assert not np.allclose(sgld_chains(m, mse_loss, xs, ys, LLCConfig(**{**cfg.__dict__, "seed": 1})), base)


def test_flags_divergence_and_checkpoint_selection(tiny_checkpoint):
    m, xs, ys, *_ = tiny_checkpoint
    r = estimate_llc(m, mse_loss, xs, ys, LLCConfig(epsilon=1.0, gamma=0.0, chains=2, burn_in=2, draws=10, batch=32, n=256))
    assert r.flags["diverged"]
    assert select_steps([0, 1, 2, 5, 10, 20, 50], 3) == [0, 5, 50]
    assert select_steps([0, 1, 2, 5], 3) == [0, 5]
