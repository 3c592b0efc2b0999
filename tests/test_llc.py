"""LLC: known learning coefficients (bias), RMSProp-SGLD, MALA diagnostic, agreement with devinterp,
invariances (method §7).

Measured bias, test_known_learning_coefficients (n = 1000, nβ = n / log n = 144.8, γ = 1, 16 chains,
200 burn-in + 600 draws; sgld ε = 3e-4, rmsprop_sgld ε = 1e-4; full batch = the whole set each step,
mini = 100 with replacement), λ̂ (true λ):
  sgld          linear d=4: full 2.02, mini 2.04 (2) | w⁴: 0.244, 0.217 (0.25) | ab: 0.520, 0.519 (0.5)
  rmsprop_sgld  linear d=4: full 2.13, mini 2.12 (2) | w⁴: 0.309, 0.299 (0.25) | ab: 0.550, 0.542 (0.5)
Plain SGLD is within 0.04 everywhere; RMSProp-SGLD overestimates by 6-24 % (its preconditioner follows
the chain's position, and the rule has no correction term for that). Tolerance: 0.1 + 0.05 λ. More
settings (ε, 8 chains x 1500 draws): reference/reproductions/llc_bias.csv.
"""
import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from iclnoise.core.io import read_parquet
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.schedules import select_steps
from iclnoise.core.tasks import BatchSampler, task_pool
from iclnoise.probes.llc import LLCConfig, estimate_llc, estimate_llcs
from iclnoise.probes.sgld import mala_log_ratio, sgld_chains

pytestmark = [pytest.mark.usefixtures("one_thread")]


def mse(model, x, y):
    return (model(x, y) - y).square().mean()


class Linear(nn.Module):
    """f(x) = w·x, d parameters: regular, λ = d/2."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def forward(self, x, y):
        return x @ self.w


class Quartic(nn.Module):
    """f(x) = w²·x with truth y = 0: K(w) = w⁴·E[x²], λ = 1/4 (∫ exp(−n w⁴) dw ∝ n^(−1/4))."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.0))

    def forward(self, x, y):
        return self.w ** 2 * x[:, 0]


class Product(nn.Module):
    """f(x) = a·b·x with truth ab = c ≠ 0: K ∝ (ab − c)² vanishes on a smooth curve, one of the two
    directions is flat and λ = 1/2 < d/2 = 1 (Watanabe 2009, ch. 2)."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(a)), nn.Parameter(torch.tensor(b))

    def forward(self, x, y):
        return self.a * self.b * x[:, 0]


def known_model(name: str, n: int = 1000, seed: int = 0):
    """(model at w*, X, Y, true λ) of a model with a known learning coefficient."""
    g = torch.Generator().manual_seed(seed)
    if name == "linear_d4":
        X = torch.randn(n, 4, generator=g)
        Y = X @ torch.randn(4, generator=g) + 0.5 * torch.randn(n, generator=g)
        m = Linear(4)
        m.w.data = torch.linalg.lstsq(X, Y.unsqueeze(1)).solution.squeeze(1)
        return m, X, Y, 2.0
    if name == "quartic":
        X = torch.randn(n, 1, generator=g)
        return Quartic(), X, torch.zeros(n), 0.25
    if name == "product":
        X = torch.randn(n, 1, generator=g)
        return Product(1.0, 1.0), X, X[:, 0].clone(), 0.5
    raise ValueError(name)


KNOWN = ("linear_d4", "quartic", "product")
BIAS_CFG = dict(gamma=1.0, chains=16, burn_in=200, draws=600, n=1000, seed=0)
BIAS_EPS = {"sgld": 3e-4, "rmsprop_sgld": 1e-4}
BATCHES = {"full": 1000, "mini": 100}


@pytest.mark.validation
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
def test_known_learning_coefficients(method):
    """Bias on known λ, full- and mini-batch: every estimate within 0.1 of λ (settings in BIAS_CFG)."""
    torch.manual_seed(0)
    for name in KNOWN:
        m, X, Y, lam = known_model(name)
        for bname, b in BATCHES.items():
            r = estimate_llc(m, mse, X, Y, LLCConfig(**BIAS_CFG, epsilon=BIAS_EPS[method], batch=b, method=method))
            assert abs(r.llc_mean - lam) < 0.1 + 0.05 * lam, (name, bname, method, r.llc_mean, lam)
            assert not r.flags["diverged"] and not r.flags["negative"], (name, bname, r.flags)
            assert 0.5 < r.mala_accept <= 1.0, (name, bname, r.mala_accept)


@pytest.mark.unit
@pytest.mark.numerics
def test_regular_model_matches_the_discrete_time_closed_form():
    """Full-batch SGLD on a quadratic loss is a linear Gaussian recursion whose stationary law is exact:
    with P = 2nβA + γI (A = XᵀX/n, eigenvalues a_i, p_i = 2nβa_i + γ) the chain's covariance is
    (P (I − εP/4))⁻¹, so E[λ̂] = Σ nβ a_i / (p_i (1 − ε p_i / 4)). At γ = 300, ε = 1e-3 that is far from
    both d/2 = 2 and the ε → 0 limit Σ nβ a_i / p_i, so the check pins nβ, γ and ε."""
    m, X, Y, _ = known_model("linear_d4")
    cfg = LLCConfig(seed=0, epsilon=1e-3, gamma=300.0, chains=8, burn_in=300, draws=1000, batch=1000, n=1000)
    nb = cfg.resolved_nbeta()
    a = torch.linalg.eigvalsh(X.T @ X / X.shape[0]).double().numpy()
    p = 2 * nb * a + cfg.gamma
    target = float((nb * a / (p * (1 - cfg.epsilon * p / 4))).sum())
    r = estimate_llc(m, mse, X, Y, cfg)
    assert abs(r.llc_mean - target) < 0.05, (r.llc_mean, target)
    assert abs(target - float((nb * a / p).sum())) > 0.1 and target < 1.5


@pytest.mark.unit
@pytest.mark.numerics
def test_mala_acceptance_matches_an_independent_numpy_chain():
    """Standard Gaussian target U = ‖w‖²/2 in d = 10 (loss ½‖w‖², nβ = 1, γ = 0, full batch): the
    mean MALA acceptance of our chains equals that of a NumPy ULA chain with the textbook MALA ratio,
    and it falls with ε."""
    d = 10

    class Free(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(d))

        def forward(self, x, y):
            return self.w

    def half_sq(model, x, y):
        return 0.5 * model(x, y).square().sum()

    X, Y = torch.zeros(4, 1), torch.zeros(4)
    rng = np.random.default_rng(0)
    for eps in (0.2, 0.8):
        cfg = LLCConfig(seed=0, epsilon=eps, gamma=0.0, nbeta=1.0, chains=16, burn_in=100, draws=400, batch=4, n=4)
        ours = estimate_llc(Free(), half_sq, X, Y, cfg).mala_accept
        w = np.zeros((4000, d))
        acc = []
        for t in range(500):
            w2 = w - 0.5 * eps * w + math.sqrt(eps) * rng.standard_normal(w.shape)
            log_fwd = -((w2 - w + 0.5 * eps * w) ** 2).sum(1) / (2 * eps)
            log_rev = -((w - w2 + 0.5 * eps * w2) ** 2).sum(1) / (2 * eps)
            la = 0.5 * (w ** 2).sum(1) - 0.5 * (w2 ** 2).sum(1) + log_rev - log_fwd
            if t >= 100:
                acc.append(np.minimum(1.0, np.exp(la)).mean())
            w = w2
        ref = float(np.mean(acc))
        assert abs(ours - ref) < 0.03, (eps, ours, ref)
    assert estimate_llc(Free(), half_sq, X, Y, LLCConfig(epsilon=0.05, gamma=0.0, nbeta=1.0, chains=4, burn_in=20,
                                                          draws=100, batch=4, n=4, seed=0)).mala_accept > 0.97


@pytest.mark.unit
@pytest.mark.numerics
def test_mala_log_ratio_is_zero_for_a_flat_potential_and_an_exact_reverse():
    """U constant and ∇U = 0: the proposal is symmetric, so log α = 0 whatever the step."""
    step = {"w": torch.randn(3, 5, dtype=torch.float64)}
    fwd_sq = (step["w"] ** 2).sum(1) / (2 * 0.1)
    zero = {"w": torch.zeros(3, 5, dtype=torch.float64)}
    la = mala_log_ratio(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), fwd_sq, step, zero,
                        None, 0.1)
    # float64: two 5-term sums of s²/(2ε) ≲ 100, each within 5·ε64·100 ≈ 1e-13 (float32 steps gave 1e-5)
    np.testing.assert_allclose(la.numpy(), 0.0, atol=1e-12)


@pytest.mark.unit
@pytest.mark.numerics
def test_rmsprop_with_large_delta_is_sgld_with_a_smaller_step():
    """G = 1/(√V + δ) ≈ 1/δ when δ ≫ √V: RMSProp-SGLD at ε·δ follows plain SGLD at ε."""
    m, X, Y, _ = known_model("linear_d4")
    base = dict(gamma=1.0, chains=2, burn_in=0, draws=50, batch=100, n=1000, seed=0)
    plain = sgld_chains(m, mse, X, Y, LLCConfig(epsilon=1e-3, **base)).loss
    rms = sgld_chains(m, mse, X, Y, LLCConfig(epsilon=1e-3 * 1e4, method="rmsprop_sgld", rmsprop_eps=1e4,
                                              **base)).loss
    np.testing.assert_allclose(rms, plain, rtol=2e-3)
    with pytest.raises(ValueError, match="allowed"):
        LLCConfig(epsilon=1e-3, method="sgnht", **base)


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


@pytest.fixture(scope="module")
def tiny_checkpoint64(tiny_checkpoint):
    """The same checkpoint and data in float64: the invariance tests compare different code paths (stacked,
    vmap, loop, micro-batches, one or many centers), whose float32 round-off depends on the CPU's kernels."""
    m, xs, ys, K, D = tiny_checkpoint
    return copy.deepcopy(m).double(), xs.double(), ys.double(), K, D


@pytest.mark.validation
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
def test_agrees_with_devinterp(tiny_checkpoint, method):
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

    def per_token_loss(model, input_ids):  # regression data as float input_ids (method §14)
        x = input_ids[:, :K * D].reshape(-1, K, D).float()
        y = input_ids[:, K * D:].float()
        return ((model(x, y) - y).square().mean(1) / D)[:, None].expand(-1, input_ids.shape[1] - 1)

    ds = datasets.Dataset.from_dict({"input_ids": torch.cat([xs.reshape(n, -1), ys], 1).tolist()}).with_format("torch")
    eps, gamma, nbeta, C, T, B = 1e-4, 100.0, n / math.log(n), 8, 300, 32
    if method == "rmsprop_sgld":
        eps = 1e-5
    ref = devinterp_llc(Adapter(m), ds, {}, lr=eps, n_beta=nbeta, localization=gamma, num_chains=C, num_draws=T,
                        batch_size=B, num_burnin_steps=0, num_init_loss_batches=n // B, loss_fn=per_token_loss,
                        device="cpu", sampling_method="rmsprop_sgld" if method == "rmsprop_sgld" else "sgmcmc_sgld")
    ours = estimate_llc(m, mse_loss, xs, ys, LLCConfig(epsilon=eps, gamma=gamma, nbeta=nbeta, chains=C, burn_in=0,
                                                        draws=T, batch=B, n=n, method=method, seed=0))
    # float32 both (devinterp casts to float): a mean of 1024 squares, each from a forward of ~30 rounding steps,
    # in batches of 32 vs 256: ≤ (30 + log2 1024)·ε32 ≈ 5e-6 each side (measured: 0 apart, 4e-8 from float64)
    assert float(ref.init_loss) == pytest.approx(ours.init_loss, rel=1e-5)
    se = math.sqrt(float(ref.llc_std) ** 2 / C + ours.llc_std ** 2 / C)
    assert abs(float(ref.llc_mean) - ours.llc_mean) < 3 * se, (float(ref.llc_mean), ours.llc_mean, se)
    assert ours.llc_mean > 0


@pytest.mark.unit
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
def test_invariances(tiny_checkpoint64, method):
    m, xs, ys, *_ = tiny_checkpoint64
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=3, burn_in=5, draws=20, batch=32, n=256, method=method)
    ch = sgld_chains(m, mse_loss, xs, ys, cfg)
    base = ch.loss
    assert ch.accept.shape == (3, 24) and np.isfinite(ch.accept).all() and (ch.accept <= 1).all()
    # float64 (tiny_checkpoint64). Losses: ~10 ε64 per step, 25 contracting steps (γ = 100) → ≲ 1e-13 relative,
    # rtol 1e-11; MALA: log α is a difference of float64 sums of size ~P/2 ≈ 300, ε64·300 ≈ 7e-14, atol 1e-11.
    # A permuted or re-seeded chain is off by 0.3-0.8 relative. Measured (3 CPU settings): loss 4e-16, accept 7e-14.
    tol, atol_acc = dict(rtol=1e-11, atol=1e-13), dict(rtol=0, atol=1e-11)
    # chain order: running chains [2, 0, 1] gives the same chains, permuted
    perm = sgld_chains(m, mse_loss, xs, ys, cfg, chains=[2, 0, 1])
    np.testing.assert_allclose(perm.loss, base[[2, 0, 1]], **tol)
    np.testing.assert_allclose(perm.accept, ch.accept[[2, 0, 1]], **atol_acc)
    # a chain alone equals the same chain run with others
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg, chains=[1]).loss, base[[1]], **tol)
    # vmap over chains vs a Python loop
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg, vectorize=False).loss, base, **tol)
    # splitting each SGLD mini-batch into micro-batches for the gradient
    cfg2 = LLCConfig(**{**cfg.__dict__, "micro_batches": 4})
    np.testing.assert_allclose(sgld_chains(m, mse_loss, xs, ys, cfg2).loss, base, **tol)
    # deterministic given the seed (same code path, same machine: bitwise), different for another seed
    np.testing.assert_array_equal(sgld_chains(m, mse_loss, xs, ys, cfg).loss, base)
    assert not np.allclose(sgld_chains(m, mse_loss, xs, ys, LLCConfig(**{**cfg.__dict__, "seed": 1})).loss, base)


@pytest.mark.unit
@pytest.mark.numerics
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
def test_many_checkpoints_in_one_pass_equal_one_at_a_time(tiny_checkpoint64, method):
    """The batched pass over several w* (a run's checkpoints, iclnoise.run.probing) gives each the estimate, the
    traces and the MALA rate it gets alone: the same generators, only the summation order differs (float64)."""
    m, xs, ys, *_ = tiny_checkpoint64
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=3, burn_in=5, draws=20, batch=32, n=256, method=method)
    w = {k: v.detach() for k, v in m.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    centers = [w, {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in w.items()},
               {k: 0.5 * v for k, v in w.items()}]
    together = estimate_llcs(m, mse_loss, xs, ys, cfg, centers)
    for c, r in zip(centers, together):
        alone = build_model(m.cfg, 1).double()
        alone.load_state_dict({**alone.state_dict(), **c})
        a = estimate_llc(alone, mse_loss, xs, ys, cfg)
        # float64 bounds as in test_invariances; λ̂ = nβ (E L − L(w*)) with nβ = 46, L ~ 1: 46·1e-13 < 1e-10
        assert r.init_loss == pytest.approx(a.init_loss, rel=1e-12)
        np.testing.assert_allclose(r.traces, a.traces, rtol=1e-11, atol=1e-13)
        assert r.llc_mean == pytest.approx(a.llc_mean, rel=1e-10, abs=1e-10)
        assert r.mala_accept == pytest.approx(a.mala_accept, abs=1e-11)
    assert len({round(r.llc_mean, 3) for r in together}) == 3  # the centers are really different


@pytest.mark.unit
@pytest.mark.numerics
def test_flags_divergence_and_checkpoint_selection(tiny_checkpoint):
    m, xs, ys, *_ = tiny_checkpoint
    r = estimate_llc(m, mse_loss, xs, ys, LLCConfig(seed=0, epsilon=1.0, gamma=0.0, chains=2, burn_in=2, draws=10,
                                                    batch=32, n=256))
    assert r.flags["diverged"]
    assert select_steps([0, 1, 2, 5, 10, 20, 50], 3) == [0, 5, 50]
    assert select_steps([0, 1, 2, 5], 3) == [0, 5]


@pytest.mark.unit
def test_steps_at_snaps_a_published_schedule_to_our_checkpoints():
    from iclnoise.core.schedules import checkpoint_steps, steps_at

    ours = checkpoint_steps(500_000, 10_000, 100)
    got = steps_at(ours, 200, 100)
    want = checkpoint_steps(500_000, 200, 100)
    assert len(got) == len(set(min(ours, key=lambda s: abs(s - w)) for w in want))
    assert max(min(abs(g - w) for g in got) for w in want) <= 25      # every wanted step within half a spacing
    assert got[0] == 0 and got[-1] == 500_000


@pytest.mark.unit
@pytest.mark.numerics
def test_full_batch_uses_the_whole_set_and_matches_the_loop():
    """batch ≥ n: every chain sees the whole set each step (shared, not copied); the loss trace at step 0
    is the full-data loss, and vmap equals the Python loop."""
    m, X, Y, _ = known_model("linear_d4", n=200)
    m, X, Y = m.double(), X.double(), Y.double()   # vmap vs direct call and loop: compare in float64
    cfg = LLCConfig(seed=0, epsilon=1e-3, gamma=1.0, chains=3, burn_in=0, draws=10, batch=200, n=200)
    ch = sgld_chains(m, mse, X, Y, cfg)
    # mean of 200 squared 4-term residuals (|y|/|r| ≈ 4): ≲ (4·4 + log2 200)·ε64 ≈ 1e-14 relative
    np.testing.assert_allclose(ch.loss[:, 0], float(mse(m, X, Y)), rtol=1e-12)
    np.testing.assert_allclose(sgld_chains(m, mse, X, Y, cfg, vectorize=False).loss, ch.loss, rtol=1e-11)


@pytest.mark.unit
@pytest.mark.numerics
def test_llc_for_run_is_byte_identical_on_rerun(tiny, tmp_path):
    """The per-run step reads checkpoints through iclnoise.run.runs, writes no wall-clock column, and a rerun
    rewrites llc.parquet byte for byte (issue 20)."""
    from iclnoise.config.grid import run_spec
    from iclnoise.run.probing import llc_for_run
    from iclnoise.run.train import train_run

    run = tmp_path / "run"
    train_run(run_spec(tiny, "M4-B16-none-s0"), run, progress=False)
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=2, burn_in=2, draws=8, batch=16, n=64)
    df = llc_for_run(run, cfg, every=3, progress=False)
    first = (run / "llc.parquet").read_bytes()
    llc_for_run(run, cfg, every=3, progress=False)
    assert (run / "llc.parquet").read_bytes() == first
    assert "seconds" not in df and df.mala_accept.between(0, 1).all() and (df.method == "sgld").all()



@pytest.mark.unit
@pytest.mark.numerics
def test_a_checkpoint_with_nan_weights_is_named_not_a_linalg_error(tiny, tmp_path):
    """Issue 68 (12): a checkpoint holding NaN weights (its manifest rewritten to match) stopped the LLC probe with a
    LinAlgError naming no file. Now reading it raises CorruptFileError naming the checkpoint and what to do, and
    llc.parquet is not written."""
    import hashlib

    import torch

    from iclnoise.config.grid import run_spec
    from iclnoise.core.io import CorruptFileError, write_json
    from iclnoise.run.probing import llc_for_run
    from iclnoise.run.runs import checkpoint_path, manifest
    from iclnoise.run.train import train_run

    run = tmp_path / "run"
    train_run(run_spec(tiny, "M4-B16-none-s0"), run, progress=False)
    listed = manifest(run)
    step = max(listed)
    path = checkpoint_path(run, step)
    state = torch.load(path, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))
    torch.save(state, path)
    write_json({str(s): hashlib.sha256(checkpoint_path(run, s).read_bytes()).hexdigest() for s in listed},
               run / "checkpoints.json")
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=2, burn_in=2, draws=8, batch=16, n=64)
    with pytest.raises(CorruptFileError) as e:
        llc_for_run(run, cfg, every=1, progress=False)
    assert f"{path} holds non-finite weights ({name})" in str(e.value) and f"run directory {run}" in str(e.value)
    assert not (run / "llc.parquet").exists()

@pytest.mark.unit
@pytest.mark.numerics
def test_stacked_chains_equal_the_loop_with_full_batch(tiny_checkpoint64):
    """The hooked model runs all chains as stacked parameters (no vmap); with batch ≥ n every chain sees the
    whole set, and the chains equal a Python loop over chains (float64; bounds as in test_invariances)."""
    m, xs, ys, *_ = tiny_checkpoint64
    assert m.stacks_runs
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=2, burn_in=2, draws=8, batch=256, n=256)
    ch = sgld_chains(m, mse_loss, xs, ys, cfg)
    np.testing.assert_allclose(ch.loss[:, 0], float(mse_loss(m, xs, ys)), rtol=1e-12)
    loop = sgld_chains(m, mse_loss, xs, ys, cfg, vectorize=False)
    np.testing.assert_allclose(loop.loss, ch.loss, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(loop.accept, ch.accept, rtol=0, atol=1e-11)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_killed_llc_job_resumes_from_its_finished_passes(tiny, tmp_path, monkeypatch):
    """A job killed after its first batched pass leaves that pass in llc.partial.parquet; the rerun estimates
    only the other checkpoints and writes the same llc.parquet, byte for byte, as an uninterrupted job (each
    checkpoint's chains draw from their own seeded generators, whichever pass they are in). A partial file
    written under other sampler settings is not reused. Also: `at: {steps: [...]}` picks the nearest."""
    from iclnoise.config.grid import run_spec
    from iclnoise.run import probing as probes
    from iclnoise.run.train import train_run

    run = tmp_path / "run"
    train_run(run_spec(tiny, "M4-B16-none-s0"), run, progress=False)
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=2, burn_in=2, draws=8, batch=16, n=64)
    monkeypatch.setattr(probes, "LAUNCH_SEQUENCES", {"cpu": 32})  # one checkpoint per pass
    at = {"steps": [0, 19, 41, 60]}
    full = probes.llc_for_run(run, cfg, progress=False, at=at)
    assert list(full.step) == [0, 20, 40, 60]
    whole = (run / "llc.parquet").read_bytes()
    (run / "llc.parquet").unlink()

    calls, real = [], probes.estimate_llcs

    def killed_on_third_pass(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(probes, "estimate_llcs", killed_on_third_pass)
    with pytest.raises(KeyboardInterrupt):
        probes.llc_for_run(run, cfg, progress=False, at=at)
    assert len(read_parquet(run / "llc.partial.parquet")) == 2 and not (run / "llc.parquet").exists()
    calls.clear()
    monkeypatch.setattr(probes, "estimate_llcs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    probes.llc_for_run(run, cfg, progress=False, at=at)
    assert len(calls) == 2                                   # only the two checkpoints not yet estimated
    assert (run / "llc.parquet").read_bytes() == whole
    assert not list(run.glob("llc*.partial.*"))
    # a partial file of other settings is estimated afresh
    monkeypatch.setattr(probes, "estimate_llcs", killed_on_third_pass)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        probes.llc_for_run(run, cfg, progress=False, at=at)
    calls.clear()
    monkeypatch.setattr(probes, "estimate_llcs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    probes.llc_for_run(run, LLCConfig(**{**cfg.__dict__, "draws": 9}), progress=False, at=at)
    assert len(calls) == 4


# ---------------------------------------------------------------- when λ̂ measures the sampler (method §7, issue 44)

def planted_quadratic(a=(2.0, 1.0, 0.5, 0.25), n=256, seed=0):
    """Linear model on X with orthogonal columns, XᵀX/n = diag(a): the MSE's Hessian is 2 diag(a), λ_max = 2 max a."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, len(a), generator=g, dtype=torch.float64)).Q
    X = (U * torch.tensor(a, dtype=torch.float64).mul(n).sqrt()).float()
    Y = X @ torch.randn(len(a), generator=g) + 0.5 * torch.randn(n, generator=g)
    m = Linear(len(a))
    m.w.data = torch.linalg.lstsq(X, Y.unsqueeze(1)).solution.squeeze(1)
    return m, X, Y, 2 * max(a)


@pytest.mark.unit
@pytest.mark.numerics
def test_unstable_turns_on_at_the_predicted_step_size():
    """Planted λ_max = 4: Lanczos finds it, and the stability ratio ε (nβ λ_max + γ)/4 crosses 1 at
    ε* = 4 / (nβ λ_max + γ). Below ε* (0.9 ε*) the chains stay finite and the estimate is not flagged; above it
    (1.1 ε*) the top direction's drift factor 1 − (ε/2)(nβ λ_max + γ) is below −1, the chains blow up, and the
    estimate is flagged `unstable` (and diverged)."""
    from iclnoise.probes.llc import stability_ratio, top_eigenvalue

    m, X, Y, lam = planted_quadratic()
    w = {k: v.detach() for k, v in m.named_parameters()}
    # float32 HVPs through 4 orthogonal columns of 256 rows (llc.HESSIAN_SEQUENCES: all of them): relative error
    # ~1e-6; Lanczos stops at tol 1e-2
    assert top_eigenvalue(m, mse, X, Y, w) == pytest.approx(lam, rel=1e-2)
    base = dict(gamma=10.0, chains=4, burn_in=50, draws=200, batch=256, n=256, seed=0)
    nb = LLCConfig(epsilon=1e-3, **base).resolved_nbeta()
    eps_star = 4 / (nb * lam + base["gamma"])
    assert stability_ratio(lam, eps_star, base["gamma"], nb) == pytest.approx(1.0)
    below = estimate_llc(m, mse, X, Y, LLCConfig(epsilon=0.9 * eps_star, **base))
    above = estimate_llc(m, mse, X, Y, LLCConfig(epsilon=1.1 * eps_star, **base))
    assert below.stability_ratio == pytest.approx(0.9, rel=1e-2)
    assert above.stability_ratio == pytest.approx(1.1, rel=1e-2)
    assert not below.flags["unstable"] and not below.flags["diverged"] and np.isfinite(below.traces).all()
    assert above.flags["unstable"] and above.flags["diverged"]
    # the mask's block: moving only w_1 (a = 1.0) the restricted chains' limit is 2·1.0, not 4
    assert top_eigenvalue(m, mse, X, Y, w, {"w": torch.tensor([0, 1, 0, 0])}) == pytest.approx(2.0, rel=1e-2)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_chain_worse_than_the_trivial_predictor_is_flagged_escaped():
    """Linear d = 4 at its least-squares w*: the trivial predictor (0) scores E y² = ‖w_true‖² + 0.25 (0.38 here), w*
    about 0.25.
    A localized chain has E[L] = L(w*) + d/(2 nβ): at nβ = n / log n that is 0.014 above L(w*), not escaped; at
    nβ = 0.25 and no localization it is 8 above, worse than predicting 0: escaped (ε = 0.05 there, so the chains
    relax, in ~2 / (ε nβ 2a) = 80 steps, within the burn-in)."""
    m, X, Y, _ = known_model("linear_d4")
    base = dict(epsilon=1e-3, gamma=0.0, chains=4, burn_in=100, draws=300, batch=1000, n=1000, seed=0)
    ok = estimate_llc(m, mse, X, Y, LLCConfig(**base))
    hot = estimate_llc(m, mse, X, Y, LLCConfig(**{**base, "nbeta": 0.25, "epsilon": 0.05}))
    assert ok.trivial_loss == pytest.approx(float(Y.square().mean()), rel=1e-5)
    assert ok.mean_loss < ok.trivial_loss and not ok.flags["escaped"]
    assert hot.mean_loss > hot.trivial_loss > hot.init_loss and hot.flags["escaped"]
    # w* = the trivial predictor itself (the quartic's w = 0, truth 0): L(w*) = trivial, never escaped
    q, Xq, Yq, _ = known_model("quartic")
    assert not estimate_llc(q, mse, Xq, Yq, LLCConfig(**{**base, "gamma": 1.0})).flags["escaped"]


@pytest.mark.unit
@pytest.mark.numerics
def test_shared_level_flags_a_level_that_does_not_follow_the_checkpoint():
    """Planted levels over 5 checkpoints whose L(w*) falls 1.0 → 0.2: chains that track w* (E = L* + λ/nβ, λ/nβ
    from 0.05 to 0.3) are not flagged; chains that sit at one level c (E = 1.11 ± noise, Hoogland's release) are,
    at every checkpoint; a run whose L(w*) does not move (a plateau) tests nothing."""
    from iclnoise.probes.llc import shared_level

    L = np.array([1.0, 0.8, 0.6, 0.4, 0.2])
    se = np.full(5, 0.002)
    assert not shared_level(L + np.linspace(0.05, 0.3, 5), se, L).any()
    assert shared_level(1.11 + np.array([0.001, -0.002, 0.003, 0.0, 0.004]), se, L).all()
    assert not shared_level(np.full(5, 0.5), se, np.full(5, 0.4)).any()
    # one checkpoint of five at 1.11 while the others track: it keeps the level of one of the four that test it (a
    # coincidence with checkpoint 0's 1.10), not of half: none is flagged
    E = L + 0.1
    E[2] = 1.11
    assert not shared_level(E, se, L).any()


@pytest.mark.validation
@pytest.mark.numerics
def test_calibration_keeps_the_known_learning_coefficient():
    """`llc-calibrate`'s choice (the largest unflagged ε whose estimate agrees with the next smaller ε's within
    2 s.e., at the smallest such γ) on models with a known λ. Measured (n = 1000, nβ = n / log n):
      product (λ = 1/2), γ = 10, 8 chains, 1500 burn-in + 600 draws: ε 1e-4 / 3e-4 / 1e-3 → 0.478 / 0.516 / 0.599
        (s.e. 0.021 / 0.013 / 0.011); chosen 3e-4: 1.2 s.e. from λ; the largest clean ε (1e-3) is 9 s.e. off.
        (At γ = 1 the flat direction relaxes in 2/(εγ) ≈ 7000 steps: every small ε is not levelled.)
        (At γ = 1 every small ε is also not levelled; at γ = 30 with 800 + 400 steps the 2 s.e. rule chose 1e-3,
        3.4 s.e. off: the step test's power is the smaller ε's noise, so the chains must be long enough.)
      w⁴ (λ = 1/4), γ = 1, 16 chains, 300 + 600: ε 1e-3 / 3e-3 / 1e-2 → 0.239 / 0.264 / diverged; chosen 3e-3:
        1.1 s.e. from λ. (At γ = 100 λ̂ is 0.03-0.07, localization-biased and unflagged: the smallest γ is chosen.)
    The bound asserted: 2 s.e. (the choice tolerates a 2 s.e. step in ε, so its bias is of that order)."""
    from iclnoise.probes.llc import calibration_sweep, choose_setting

    for name, base, eps, gammas in (
            ("product", dict(chains=8, burn_in=1500, draws=600), [1e-4, 3e-4, 1e-3], [10.0]),
            ("quartic", dict(chains=16, burn_in=300, draws=600), [1e-3, 3e-3, 1e-2], [1.0])):
        m, X, Y, lam = known_model(name)
        cfg = LLCConfig(epsilon=1e-3, gamma=1.0, batch=1000, n=1000, seed=0, **base)
        rows = calibration_sweep(m, mse, X, Y, cfg, [{k: v.detach() for k, v in m.named_parameters()}], eps, gammas)
        choice = choose_setting(rows)
        chosen = [r for r in rows if r["chosen"]]
        assert choice is not None and len(chosen) == 1, (name, rows)
        r = chosen[0]
        assert r["plateau"] and r["clean"] and choice["epsilon"] == r["epsilon"] and choice["gamma"] == min(gammas)
        assert abs(r["llc_mean"] - lam) < 2 * r["llc_se"], (name, r)
        # a larger clean ε exists and misses λ: the ε-plateau, not cleanliness alone, made the choice
        worse = [q for q in rows if q["clean"] and q["epsilon"] > r["epsilon"] and q["gamma"] == r["gamma"]]
        if name == "product":
            assert worse and all(abs(q["llc_mean"] - lam) > 3 * q["llc_se"] for q in worse)


@pytest.mark.unit
@pytest.mark.numerics
def test_calibration_leaves_out_a_checkpoint_where_every_stable_estimate_is_negative():
    """A checkpoint at initialisation (E[L] < L(w*) at every stable setting: not near a minimum, the LLC undefined)
    flags `negative` at every setting; counted, it leaves no setting clean (the default run's step 5 did). It is left
    out and the choice is that of the other checkpoints; a checkpoint negative at one stable setting only is kept."""
    from iclnoise.probes.llc import CALIBRATION_FLAGS, choose_setting, undefined_centers

    def row(center, eps, llc, **flags):
        return {"nbeta": 100.0, "gamma": 100.0, "epsilon": eps, "center": center, "llc_mean": llc, "llc_se": 0.5,
                **{f: False for f in CALIBRATION_FLAGS}, **flags}

    def sweep(first_negative_at_1e4=True):
        return [row(5, 1e-4, -3.0, negative=first_negative_at_1e4), row(5, 3e-4, -2.8, negative=True),
                row(5, 1e-3, 15.0, unstable=True),           # positive, but past the stability limit
                *(row(c, e, v) for c, v in ((300, 30.0), (2500, 45.0)) for e in (1e-4, 3e-4)),
                row(300, 1e-3, 80.0, unstable=True), row(2500, 1e-3, 120.0, unstable=True)]

    rows = sweep()
    assert undefined_centers(rows) == [5]
    assert choose_setting(rows) == {"nbeta": 100.0, "gamma": 100.0, "epsilon": 3e-4}
    assert [r["chosen"] for r in rows if r["center"] == 5] == [False, True, False]   # every row gets the marks
    kept = sweep(first_negative_at_1e4=False)
    assert undefined_centers(kept) == [] and choose_setting(kept) is None
    assert choose_setting([r for r in rows if r["center"] == 5]) is None   # nothing left: no choice


@pytest.mark.unit
@pytest.mark.numerics
def test_llc_tables_record_the_stability_ratio_and_flag_a_checkpoint_past_the_limit(tiny, tmp_path):
    """llc.parquet (and the calibration sweep) carry λ_max, the ratio ε (nβ λ_max + γ)/4 and the flags. With ε set
    so the ratio of the last checkpoint is 1.5 (from its λ_max at a small ε), that checkpoint is `unstable` and the
    ratio of every row scales with ε as the formula says. `llc-calibrate` writes its sweep and choice."""
    import json

    from iclnoise.config.grid import run_spec
    from iclnoise.run.probing import calibrate_for_run, llc_for_run
    from iclnoise.run.train import train_run

    run = tmp_path / "run"
    train_run(run_spec(tiny, "M4-B16-none-s0"), run, progress=False)
    cfg = LLCConfig(seed=0, epsilon=1e-4, gamma=100.0, chains=2, burn_in=2, draws=8, batch=16, n=64)
    df = llc_for_run(run, cfg, every=3, progress=False)
    nb = cfg.resolved_nbeta()
    np.testing.assert_allclose(df.stability_ratio, 1e-4 * (nb * df.lambda_max + 100.0) / 4, rtol=1e-12)
    assert (df.lambda_max > 0).all() and not df.unstable.any() and (df.trivial_loss > 0).all()
    last = df.iloc[-1]
    eps = 1.5 * 4 / (nb * last.lambda_max + 100.0)
    hot = llc_for_run(run, LLCConfig(**{**cfg.__dict__, "epsilon": eps}), every=3, progress=False)
    np.testing.assert_allclose(hot.lambda_max, df.lambda_max, rtol=1e-12)   # same checkpoints, same Lanczos seed
    assert hot.stability_ratio.iloc[-1] == pytest.approx(1.5) and hot.unstable.iloc[-1]
    assert (hot.unstable == (hot.stability_ratio > 1)).all()
    table, choice = calibrate_for_run(run, cfg, [20, 60], [3e-5, 1e-4], [100.0])
    assert set(table.step) == {20, 60} and len(table) == 4 and {"unstable", "escaped", "plateau"} <= set(table)
    saved = json.loads((run / "llc_calibration.json").read_text())
    assert saved["choice"] == choice and saved["steps"] == [20, 60]
    assert read_parquet(run / "llc_calibration.parquet").chosen.sum() == 2 * (choice is not None)   # a row per step


@pytest.mark.unit
def test_figure_4_marks_estimates_that_measure_the_sampler(tmp_path, monkeypatch):
    """Figure 4: an unstable or escaped estimate is never joined to the trusted line; it is a cross with its own
    legend entry, apart from the hollow markers of diverged / negative / not levelled estimates."""
    import pandas as pd
    from matplotlib.collections import PathCollection

    from iclnoise.output.figures import llc as figs
    from iclnoise.output.figures import style

    steps = [0, 10, 100, 1000]
    df = pd.DataFrame([{"run_id": "M4-B16-none-s0", "M": 4, "seed": 0, "batch": 16, "noise": "none", "step": s,
                        "llc_mean": 1.0 + i, "llc_se": 0.1, "diverged": False, "negative": i == 0,
                        "not_levelled": False, "unstable": i == 2, "escaped": i == 3} for i, s in enumerate(steps)])
    shown = {}
    real_save = style.save_figure

    def grab(fig, path, data=None):
        ax = fig.axes[0]
        dots = [c for c in ax.collections if isinstance(c, PathCollection)]   # scatter markers (not the band)
        shown.update(line=[list(map(float, ln.get_xdata())) for ln in ax.get_lines()],
                     filled=[c.get_offsets().tolist() for c in dots if c.get_facecolors().size],   # the crosses
                     hollow=[c.get_offsets().tolist() for c in dots if not c.get_facecolors().size],
                     labels=[t.get_text() for t in ax.get_legend().get_texts()])
        real_save(fig, path, data)

    monkeypatch.setattr(style, "save_figure", grab)
    figs.fig_llc_over_training(df, None, tmp_path / "fig04")
    assert shown["line"] == [[11.0]]                           # only step 10 is trusted: joined (alone)
    assert shown["filled"] == [[[101.0, 3.0], [1001.0, 4.0]]] and shown["hollow"] == [[[1.0, 1.0]]]
    assert "flagged: unstable / escaped (measures the sampler)" in shown["labels"]
    assert "flagged: diverged / negative / not levelled" in shown["labels"]
