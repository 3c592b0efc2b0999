"""Task priors with shape (method §13): the draws, the isotropic default, the generalised ridge."""
import hashlib

import numpy as np
import pytest
import torch

from iclnoise.core.predictors import ridge
from iclnoise.core.runspec import RunSpec
from iclnoise.core.sections import Data, ParamsError, TaskPrior
from iclnoise.core.tasks import (
    _BATCH,
    _EVAL,
    BatchSampler,
    eval_set,
    prior_cov,
    prior_factor,
    prior_spectrum,
    seed_mix,
    task_pool,
)

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

POWER = TaskPrior(spectrum="power_law", exponent=1.5, basis_seed=11)


def _h(*ts):
    m = hashlib.sha256()
    for t in ts:
        m.update(t.numpy().tobytes())
    return m.hexdigest()[:16]


def _draw_756de2e(gen, pool, B, K, D, noise_var):
    """tasks._draw as it was at 756de2e, before task_prior existed: the reference the isotropic path must equal."""
    if pool is None:
        tasks = torch.randn(B, D, generator=gen)
    else:
        tasks = pool[torch.randint(0, pool.shape[0], (B,), generator=gen)]
    xs = torch.randn(B, K, D, generator=gen)
    ys = torch.einsum("bkd,bd->bk", xs, tasks) + noise_var**0.5 * torch.randn(B, K, generator=gen)
    return xs, ys, tasks


def test_isotropic_prior_draws_todays_tasks_bit_for_bit():
    """No prior draws exactly what 756de2e drew. Pools are NumPy draws, compared by hash (NumPy's generator is the
    same on every CPU); torch's draws are compared with 756de2e's _draw run here (torch.randn's bits depend on the
    CPU kernels, so no fixed hash would hold under make test-float's portable kernels)."""
    assert _h(task_pool(3, 50, 5)) == "3fe171b29704bd66"
    for pool in (None, task_pool(3, 9, 5)):
        b = BatchSampler(pool, 6, 5, 0.125, data_seed=2).batch(7, 32)
        ref = _draw_756de2e(torch.Generator().manual_seed(seed_mix(_BATCH, 0, 2, 7)), pool, 32, 6, 5, 0.125)
        assert all(torch.equal(x, y) for x, y in zip((b.xs, b.ys, b.tasks), ref))
    for kind, code, pool in (("id", 1, task_pool(3, 9, 5)), ("ood", 2, None), ("root", 3, task_pool(3, 1, 5))):
        b = eval_set(kind, 9, 16, 6, 5, 0.125, 3, 4)
        gen = torch.Generator().manual_seed(seed_mix(_EVAL, 4, code, 9 if kind == "id" else 0))
        assert all(torch.equal(x, y) for x, y in zip((b.xs, b.ys, b.tasks), _draw_756de2e(gen, pool, 16, 6, 5, 0.125)))
    d = Data.from_dict({"D": 5, "K": 6, "noise_var": 0.125, "pool_seed": 3})   # absent key: None, the isotropic prior
    assert d.task_prior is None and torch.equal(task_pool(3, 50, 5, d.task_prior), task_pool(3, 50, 5))


def test_spectrum_and_basis():
    lam = prior_spectrum(POWER, 6)
    assert lam.sum() == pytest.approx(6) and np.all(np.diff(lam) < 0)
    assert lam[0] / lam[1] == pytest.approx(2 ** 1.5)
    S = prior_cov(POWER, 6)
    assert np.allclose(np.linalg.eigvalsh(S)[::-1], lam)
    assert not np.allclose(S, np.diag(np.diag(S)), atol=0.1)   # a rotated basis, not the coordinate axes
    ev = TaskPrior.from_dict({"spectrum": "eigenvalues", "eigenvalues": [3, 1, 0.5], "basis_seed": 0})
    assert np.allclose(np.linalg.eigvalsh(prior_cov(ev, 3)), [0.5, 1, 3])
    with pytest.raises(ParamsError, match="data.D = 4 needs 4"):
        prior_spectrum(ev, 4)
    with pytest.raises(ParamsError, match="exponent is missing"):
        TaskPrior.from_dict({"spectrum": "power_law", "basis_seed": 0})
    with pytest.raises(ParamsError, match="must all be > 0"):
        TaskPrior.from_dict({"spectrum": "eigenvalues", "eigenvalues": [1, 0], "basis_seed": 0})


def test_anisotropic_draws_have_the_planted_covariance():
    D, n = 4, 40_000
    S = prior_cov(POWER, D)
    se = np.sqrt((np.outer(np.diag(S), np.diag(S)) + S ** 2) / n)   # sd of a sample covariance entry
    fresh = BatchSampler(None, 2, D, 0.125, data_seed=0, prior=POWER).batch(0, n).tasks.double().numpy()
    pool = task_pool(5, n, D, POWER).double().numpy()
    for t in (fresh, pool):
        assert np.all(np.abs(t.T @ t / n - S) < 5 * se)
    assert np.abs(fresh.T @ fresh / n - np.eye(D)).max() > 20 * se.max()   # far from the isotropic prior
    assert torch.equal(task_pool(5, 7, D, POWER), task_pool(5, n, D, POWER)[:7])   # still nested
    ood = eval_set("ood", 8, 4000, 3, D, 0.125, 5, 1, POWER).tasks.double().numpy()
    assert np.all(np.abs(ood.T @ ood / 4000 - S) < 5 * np.sqrt(n / 4000) * se)


def test_generalised_ridge_is_the_monte_carlo_posterior_mean():
    D, K, s2, S_mc = 3, 4, 0.5, 400_000
    S = prior_cov(POWER, D)
    b = eval_set("ood", 1, 6, K, D, s2, 0, 9, POWER)
    xs, ys = b.xs.double().numpy(), b.ys.double().numpy()
    pred = ridge(b.xs, b.ys, s2, S).double().numpy()                  # ŷ_k from the first k−1 pairs
    iso = ridge(b.xs, b.ys, s2).double().numpy()
    rng = np.random.default_rng(0)
    t = rng.standard_normal((S_mc, D)) @ prior_factor(POWER, D).T     # prior samples
    gap = []
    for i in range(len(xs)):
        X, y, xq = xs[i, :K - 1], ys[i, :K - 1], xs[i, K - 1]
        # closed form in the Σβ Xᵀ(XΣβXᵀ + σ²I)⁻¹y form, float64: the code's precision form agrees
        t_hat = S @ X.T @ np.linalg.solve(X @ S @ X.T + s2 * np.eye(K - 1), y)
        assert pred[i, -1] == pytest.approx(t_hat @ xq, abs=1e-5)
        logw = -((y - t @ X.T) ** 2).sum(1) / (2 * s2)
        w = np.exp(logw - logw.max())
        w /= w.sum()
        f = t @ xq
        mc = w @ f
        se = np.sqrt(np.sum(w ** 2 * (f - mc) ** 2))                  # self-normalised IS standard error
        assert abs(pred[i, -1] - mc) < 4 * se + 1e-6, (i, pred[i, -1], mc, se)
        gap.append(abs(iso[i, -1] - mc) / se)
    assert max(gap) > 10   # the isotropic ridge is not this posterior: the test tells the two apart


def test_params_validation_checks_the_prior_and_training_draws_from_it():
    import copy

    import yaml

    from iclnoise.config import validate_params
    from iclnoise.config.grid import run_spec
    from iclnoise.run.runs import sampler
    with open("params.yaml") as f:
        p = yaml.safe_load(f)
    assert "task_prior" not in p["data"]   # the default run set is the isotropic one, its spec hashes unchanged
    bad = copy.deepcopy(p)
    bad["data"]["task_prior"] = {"spectrum": "eigenvalues", "eigenvalues": [1.0, 2.0], "basis_seed": 0}
    with pytest.raises(ParamsError, match="eigenvalues has 2 values"):
        validate_params(bad)
    bad["data"]["task_prior"] = {"spectrum": "power_law", "exponent": 1.0, "basis_seed": 0, "shape": "x"}
    with pytest.raises(ParamsError, match="shape"):
        validate_params(bad)
    good = copy.deepcopy(p)
    good["data"]["task_prior"] = {"spectrum": "power_law", "exponent": 1.0, "basis_seed": 0}
    good = validate_params(good)
    prior = TaskPrior.from_dict(good["data"]["task_prior"])
    # the training sampler draws its pool (finite M) and its fresh tasks (M = ∞) from the prior in force
    pool = sampler(RunSpec.of(run_spec(good, "M4-B16-none-s0")), "train").pool
    assert torch.equal(pool, task_pool(0, 4, 3, prior)) and not torch.equal(pool, task_pool(0, 4, 3))
    fresh = sampler(RunSpec.of(run_spec(good, "Minf-B16-none-s0")), "train")
    assert fresh.factor is not None
    p["data"]["task_prior"] = None   # null: the isotropic prior
    validate_params(p)


def test_evaluation_measures_against_the_bayes_predictor_of_the_prior_in_force():
    from iclnoise.run.evaluate import _split
    b, dm, rd = _split("id", 4, 32, 6, 3, 0.125, 0, 1, POWER)
    assert torch.equal(rd, ridge(b.xs, b.ys, 0.125, prior_cov(POWER, 3)))
    assert (rd - ridge(b.xs, b.ys, 0.125)).abs().max() > 0.05      # not the isotropic ridge
    assert torch.equal(b.tasks.unique(dim=0).sort(0).values, task_pool(0, 4, 3, POWER).sort(0).values)
    b0, _, rd0 = _split("id", 4, 32, 6, 3, 0.125, 0, 1)
    assert torch.equal(rd0, ridge(b0.xs, b0.ys, 0.125))
