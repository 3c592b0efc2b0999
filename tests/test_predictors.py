"""dMMSE and ridge against brute force and closed forms (method §3)."""
import math

import numpy as np
import pytest
import torch

from iclnoise.core.predictors import delta, dmmse, icl_score, ridge, ridge_likeness, token_losses
from iclnoise.core.tasks import M_INF, eval_set, task_pool

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

SIG2 = 0.125


def brute_dmmse(xs, ys, pool, s2):
    """Posterior mean over a finite pool, one prefix at a time, in float64 with explicit loops."""
    B, K, D = xs.shape
    out = np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            logw = np.array([-sum((ys[b, j] - t @ xs[b, j]) ** 2 for j in range(k)) / (2 * s2) for t in pool])
            w = np.exp(logw - logw.max())
            w /= w.sum()
            out[b, k] = (w @ pool) @ xs[b, k]
    return out


def brute_ridge(xs, ys, s2):
    B, K, D = xs.shape
    out = np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            X, y = xs[b, :k], ys[b, :k]
            t = np.linalg.solve(X.T @ X + s2 * np.eye(D), X.T @ y) if k else np.zeros(D)
            out[b, k] = t @ xs[b, k]
    return out


@pytest.fixture
def seqs():
    b = eval_set("id", 5, 6, 5, 3, SIG2, pool_seed=1, eval_seed=2)
    return b.xs.double(), b.ys.double(), task_pool(1, 5, 3).double()


def test_dmmse_matches_brute_force(seqs):
    xs, ys, pool = seqs
    got = dmmse(xs, ys, pool, SIG2, chunk=4).numpy()
    np.testing.assert_allclose(got, brute_dmmse(xs.numpy(), ys.numpy(), pool.numpy(), SIG2), rtol=1e-9, atol=1e-10)


def test_dmmse_single_task_is_that_task(seqs):
    xs, ys, pool = seqs
    got = dmmse(xs, ys, pool[:1], SIG2)
    np.testing.assert_allclose(got.numpy(), (xs @ pool[0]).numpy(), atol=1e-12)


def test_dmmse_first_prediction_is_pool_mean(seqs):
    xs, ys, pool = seqs
    got = dmmse(xs, ys, pool, SIG2)[:, 0]
    np.testing.assert_allclose(got.numpy(), (xs[:, 0] @ pool.mean(0)).numpy(), atol=1e-12)


def test_ridge_matches_brute_force_and_lstsq(seqs):
    xs, ys, _ = seqs
    got = ridge(xs, ys, SIG2).numpy()
    np.testing.assert_allclose(got, brute_ridge(xs.numpy(), ys.numpy(), SIG2), rtol=1e-9, atol=1e-12)
    # ridge = least squares on the augmented system [X; σ I] t = [y; 0]
    X, y = xs[0, :4].numpy(), ys[0, :4].numpy()
    A = np.vstack([X, math.sqrt(SIG2) * np.eye(3)])
    t, *_ = np.linalg.lstsq(A, np.concatenate([y, np.zeros(3)]), rcond=None)
    assert got[0, 4] == pytest.approx(t @ xs[0, 4].numpy(), abs=1e-10)
    assert np.all(got[:, 0] == 0)


def test_dmmse_approaches_ridge_as_pool_grows():
    b = eval_set("ood", M_INF, 256, 8, 4, SIG2, pool_seed=0, eval_seed=3)
    r = ridge(b.xs, b.ys, SIG2)
    gaps = [delta(dmmse(b.xs, b.ys, task_pool(0, M, 4), SIG2), r, 4) for M in (1, 16, 256, 4096, 32768)]
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 0.05 * gaps[0]


def test_dmmse_is_bayes_optimal_in_distribution():
    """On q_M sequences dMMSE_M beats ridge; on q_∞ sequences ridge beats dMMSE_M (M small)."""
    pool = task_pool(0, 4, 4)
    ind = eval_set("id", 4, 2048, 8, 4, SIG2, 0, 5)
    ood = eval_set("ood", M_INF, 2048, 8, 4, SIG2, 0, 5)
    lid = [token_losses(f, ind.ys, 4).mean() for f in (dmmse(ind.xs, ind.ys, pool, SIG2), ridge(ind.xs, ind.ys, SIG2))]
    lood = [token_losses(f, ood.ys, 4).mean() for f in (dmmse(ood.xs, ood.ys, pool, SIG2), ridge(ood.xs, ood.ys, SIG2))]
    assert lid[0] < lid[1] and lood[1] < lood[0]
    # ridge's late-token loss approaches the noise floor σ²/D
    assert token_losses(ridge(ood.xs, ood.ys, SIG2), ood.ys, 4)[-1] < 3 * SIG2 / 4


def test_metrics_definitions():
    f, g = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    assert delta(f, g, D=2) == pytest.approx((1 + 4) / 2 / 2)
    assert ridge_likeness(0.0, 1.0) == 0.0 and ridge_likeness(1.0, 0.0) == 1.0
    assert math.isnan(ridge_likeness(0.0, 0.0))
    assert icl_score(torch.tensor([3.0, 2.0, 1.0]), 1, 3) == 2.0
