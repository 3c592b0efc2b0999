"""Exposure estimators against closed forms (linear regression) and exact matrices (tiny transformer)."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from iclnoise.core.adam import adam_preconditioner
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.noise.curvature import (
    exact_ggn_curvature,
    exact_ggn_diag,
    ggn_curvature,
    hessian_curvature,
    stacked_exact_ggn_curvature,
    stacked_ggn_curvature,
)
from iclnoise.noise.exposure import (
    AdamState,
    b_simple,
    grad_noise,
    group_grads,
    injected_dose_se,
    leading_eigs,
    pne_columns,
    preconditioner,
    refresh_interval,
    stacked_group_grads,
    summarize,
)


class Linear(nn.Module):
    """f(x) = wᵀx; per-example loss ½(wᵀx − y)², per-example gradient (wᵀx − y) x."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, xs, ys):
        return xs @ self.w


def half_mse(fm, xs, ys):
    return 0.5 * (fm(xs, ys) - ys).square().mean()


def linreg_case(P=6, sigma2=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(P, generator=g, dtype=torch.float64)
    delta = 0.7 * torch.randn(P, generator=g, dtype=torch.float64)
    model = Linear(t + delta).double()
    # x ~ N(0, I), e ~ N(0, σ²): Cov g = (|δ|² + σ²) I + δδᵀ (Isserlis), E g = δ
    C = (delta.square().sum() + sigma2) * torch.eye(P, dtype=torch.float64) + torch.outer(delta, delta)

    def batch(B, i):
        gi = torch.Generator().manual_seed(1000 + i)
        xs = torch.randn(B, P, generator=gi, dtype=torch.float64)
        ys = xs @ t + math.sqrt(sigma2) * torch.randn(B, generator=gi, dtype=torch.float64)
        return xs, ys

    return model, C, delta, batch


@pytest.mark.unit
@pytest.mark.parametrize("groups", [16, 256])  # micro-batch groups of 16 sequences, and per-example
def test_diag_and_trace_of_c_match_the_closed_form_within_sampling_error(groups):
    model, C, _, batch = linreg_case()
    ests = []
    for i in range(40):
        xs, ys = batch(256, i)
        n = grad_noise(group_grads(model, half_mse, xs, ys, groups), 256 // groups)
        ests.append(n.diag.numpy())
    ests = np.array(ests)
    mean, se = ests.mean(0), ests.std(0, ddof=1) / math.sqrt(len(ests))
    truth = C.diag().numpy()
    assert np.all(np.abs(mean - truth) < 4 * se + 1e-9), (mean, truth, se)
    tr, tr_se = ests.sum(1).mean(), ests.sum(1).std(ddof=1) / math.sqrt(len(ests))
    assert abs(tr - truth.sum()) < 4 * tr_se
    assert tr_se / truth.sum() < 0.05  # and the check has teeth: a 20 % error would fail


@pytest.mark.unit
def test_group_gradients_average_to_the_batch_gradient():
    model, _, _, batch = linreg_case()
    xs, ys = batch(64, 0)
    G = group_grads(model, half_mse, xs, ys, 8)
    model.zero_grad()
    half_mse(model, xs, ys).backward()
    torch.testing.assert_close(G.mean(0), model.w.grad)


@pytest.mark.unit
def test_b_simple_matches_its_formula():
    model, C, delta, batch = linreg_case()
    vals = []
    for i in range(20):
        xs, ys = batch(2048, i)
        n = grad_noise(group_grads(model, half_mse, xs, ys, 64), 32)
        vals.append(b_simple(float(n.mean.square().sum()), n.trace, 2048))
    truth = float(torch.trace(C) / delta.square().sum())
    assert np.mean(vals) == pytest.approx(truth, rel=0.1)


@pytest.mark.unit
def test_leading_eigenvalues_match_a_dense_eigendecomposition():
    g = torch.Generator().manual_seed(0)
    F = torch.randn(12, 30, generator=g, dtype=torch.float64)
    a = torch.rand(30, generator=g, dtype=torch.float64) + 0.5
    M = (F * a).T @ (F * a)
    ev = np.sort(np.linalg.eigvalsh(M.numpy()))[::-1]
    lam, alpha, pr = leading_eigs(F, a, 5)
    np.testing.assert_allclose(lam, ev[:5], rtol=1e-8)
    assert pr == pytest.approx(ev.sum() ** 2 / (ev ** 2).sum(), rel=1e-8)
    # a planted power law λ_i = i^-2 gives tail index 2
    U = torch.linalg.qr(torch.randn(30, 10, generator=g, dtype=torch.float64))[0]
    Fp = (U * torch.arange(1, 11, dtype=torch.float64).pow(-1.0)).T  # singular values i^-1 → λ = i^-2
    assert leading_eigs(Fp, None, 10)[1] == pytest.approx(2.0, abs=1e-6)


@pytest.fixture(scope="module")
def tiny_model():
    # gpt2 init: the model these checks' precision bounds (se < 10 % of the trace at 4000 probes) were set on
    cfg = ModelConfig(D=2, K=3, d_model=4, n_layers=1, n_heads=1, d_mlp=4, attn_init="gpt2")
    model = build_model(cfg, 0).double()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(16, 3, 2, generator=g, dtype=torch.float64)
    ys = torch.randn(16, 3, generator=g, dtype=torch.float64)
    w0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    a = torch.rand(w0.numel(), generator=g, dtype=torch.float64) + 0.5
    return model, xs, ys, w0, a


def _flat(model, fn):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def f(w):
        params = {n: t.view(s) for n, t, s in zip(names, w.split(sizes), shapes)}
        return fn(lambda x, y: torch.func.functional_call(model, params, (x, y)))
    return f


@pytest.fixture
def three_runs(tiny):
    """Three float32 runs of the tests' model with their own weights (init seeds), stacked, and their own batches."""
    m = tiny["model"]
    cfg = ModelConfig(D=5, K=8, **{k: m[k] for k in ("d_model", "d_mlp", "n_layers", "n_heads")})
    models = [build_model(cfg, seed) for seed in (0, 1, 2)]
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(3, 16, 8, 5, generator=g), torch.randn(3, 16, 8, generator=g)
    names = [n for n, _ in models[0].named_parameters()]
    return models, {n: torch.stack([dict(mod.named_parameters())[n].detach() for mod in models]) for n in names}, xs, ys


@pytest.mark.numerics
@pytest.mark.unit
def test_stacked_group_gradients_equal_each_runs_own(three_runs):
    """Each run's group gradients of one stacked pass equal its own group_grads to float32 round-off (measured:
    ≤ 1.6e-7 of the largest entry), per-example and in groups; a run's rows are not another run's."""
    models, params, xs, ys = three_runs
    for groups in (4, 16):
        G = stacked_group_grads(models[0], mse_loss, params, xs, ys, groups)
        assert G.shape[:2] == (3, groups)
        for r, mod in enumerate(models):
            own = group_grads(mod, mse_loss, xs[r], ys[r], groups)
            torch.testing.assert_close(G[r], own, rtol=1e-5, atol=1e-5 * float(own.abs().max()))
        assert not torch.allclose(G[1], group_grads(models[0], mse_loss, xs[1], ys[1], groups), atol=1e-3)
    with pytest.raises(ValueError, match="not divisible into 5"):
        stacked_group_grads(models[0], mse_loss, params, xs, ys, 5)


@pytest.mark.numerics
@pytest.mark.unit
def test_stacked_gauss_newton_probes_equal_each_runs_own(tiny, three_runs):
    """Three runs with their own weights, held-out batches and probe streams, measured in one stacked call: each
    run's Jᵀu samples, diag Ĥ and Curv(A) equal its own ggn_curvature to float32 round-off (measured: ≤ 4e-7 of the
    largest entry), from the same probe draws (a run given another run's stream is far off)."""
    models, params, xs, ys = three_runs
    P, g = tiny["exposure"]["curvature_probes"], torch.Generator().manual_seed(4)
    stacked = stacked_ggn_curvature(models[0], params, xs, ys, P, [torch.Generator().manual_seed(s) for s in (5, 6, 7)],
                                    0.2)
    a = torch.rand(stacked[0].left.shape[1], generator=g) + 0.5
    for r, (mod, seed) in enumerate(zip(models, (5, 6, 7))):
        own = ggn_curvature(mod, xs[r], ys[r], P, torch.Generator().manual_seed(seed), 0.2)
        assert stacked[r].scale == own.scale
        scale = float(own.left.abs().max())
        torch.testing.assert_close(stacked[r].left, own.left, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(stacked[r].diag, own.diag, rtol=1e-4, atol=1e-5 * float(own.diag.abs().max()))
        assert stacked[r].at(a) == pytest.approx(own.at(a), rel=1e-5)
    other = ggn_curvature(models[1], xs[1], ys[1], P, torch.Generator().manual_seed(5), 0.2)
    assert not torch.allclose(stacked[1].left, other.left, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.numerics
@pytest.mark.unit
def test_stacked_exact_gauss_newton_equals_each_runs_own(three_runs):
    """The exact Gauss–Newton samples of three runs with their own weights and held-out batches, in one stacked call:
    each run's per-sequence samples, diag Ĥ and Curv(A) equal its own exact_ggn_curvature to float32 round-off; a
    run given another's weights is far off."""
    models, params, xs, ys = three_runs
    stacked = stacked_exact_ggn_curvature(models[0], params, xs, ys, 0.2)
    a = torch.rand(stacked[0].left.shape[1], generator=torch.Generator().manual_seed(4)) + 0.5
    for r, mod in enumerate(models):
        own = exact_ggn_curvature(mod, xs[r], ys[r], 0.2)
        assert stacked[r].scale == own.scale and stacked[r].left.shape == own.left.shape
        torch.testing.assert_close(stacked[r].left, own.left, rtol=1e-5, atol=1e-6 * float(own.left.abs().max()))
        assert stacked[r].at(a) == pytest.approx(own.at(a), rel=1e-5)
    other = exact_ggn_curvature(models[0], xs[1], ys[1], 0.2)
    assert not torch.allclose(stacked[1].diag, other.diag, rtol=1e-2)


@pytest.mark.unit
def test_exact_gauss_newton_diagonal_is_the_full_jacobians(tiny_model):
    """exact_ggn_diag (per-sequence Jacobians, DoseReference's curvature) equals diag((2 / (D N)) JᵀJ) from the whole
    batch's Jacobian, to float64 round-off: each output depends on its own sequence only."""
    model, xs, ys, w0, _ = tiny_model
    J = torch.autograd.functional.jacobian(_flat(model, lambda fm: fm(xs, ys)), w0).reshape(-1, w0.numel())
    G = 2.0 / (xs.shape[-1] * J.shape[0]) * J.T @ J
    diag = exact_ggn_diag(model, xs, ys, 1.0 / xs.shape[-1])
    assert diag.dtype == torch.float64
    torch.testing.assert_close(diag, torch.diagonal(G), rtol=1e-10, atol=1e-14 * float(G.diagonal().max()))


@pytest.mark.unit
def test_exact_curvature_keeps_each_sequence_and_the_batch_spread(tiny_model):
    """exact_ggn_curvature (exposure.curvature ggn_exact): its diag is exact_ggn_diag's; its samples are the
    sequences' own exact diagonals (exact_ggn_diag of each sequence alone), so Curv at A and its standard error are
    the mean and the spread over the held-out sequences of Σ a² diag_i."""
    model, xs, ys, w0, a = tiny_model
    ls = 1.0 / xs.shape[-1]
    c = exact_ggn_curvature(model, xs, ys, ls)
    diag = exact_ggn_diag(model, xs, ys, ls)
    torch.testing.assert_close(c.diag.double(), diag, rtol=1e-5, atol=1e-7 * float(diag.abs().max()))
    each = torch.stack([exact_ggn_diag(model, xs[i:i + 1], ys[i:i + 1], ls) for i in range(xs.shape[0])])
    per = (each * a.double().square()).sum(1)
    est, se = c.at(a)
    assert est == pytest.approx(float(per.mean()), rel=1e-5)
    assert se == pytest.approx(float(per.std() / xs.shape[0] ** 0.5), rel=1e-4)


@pytest.mark.unit
def test_curvature_estimators_match_exact_hessian_and_gauss_newton(tiny_model):
    model, xs, ys, w0, a = tiny_model
    H = torch.autograd.functional.hessian(_flat(model, lambda fm: mse_loss(fm, xs, ys)), w0)
    J = torch.autograd.functional.jacobian(_flat(model, lambda fm: fm(xs, ys)), w0).reshape(-1, w0.numel())
    G = 2.0 / (xs.shape[-1] * J.shape[0]) * J.T @ J   # mse_loss = mean (f − y)² / D
    A = torch.diag(a)
    for est_fn, exact in ((lambda gen: hessian_curvature(model, mse_loss, xs, ys, 4000, gen).at(a), A @ H @ A),
                          (lambda gen: ggn_curvature(model, xs, ys, 4000, gen, 1.0 / xs.shape[-1]).at(a), A @ G @ A)):
        est, se = est_fn(torch.Generator().manual_seed(0))
        truth = float(torch.trace(exact))
        assert abs(est - truth) < 4 * se, (est, truth, se)
        assert se < 0.1 * abs(truth)
    # a = None is the plain trace
    est, se = ggn_curvature(model, xs, ys, 4000, torch.Generator().manual_seed(1), 0.5).at(None)
    assert abs(est - float(torch.trace(G))) < 4 * se


@pytest.mark.unit
def test_live_preconditioner_matches_the_checkpointed_one(tiny_model):
    model = tiny_model[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        mse_loss(model, tiny_model[1], tiny_model[2]).backward()
        opt.step()
    want = adam_preconditioner(opt.state_dict(), list(model.parameters()))
    torch.testing.assert_close(preconditioner(AdamState.of_torch(opt)), want)


@pytest.mark.unit
def test_summaries_integrate_rows_over_their_intervals():
    import pandas as pd
    df = pd.DataFrame({"interval": [10, 10, 5], "pne_postclip": [1.0, 2.0, 4.0], "pne": [1, 1, 1],
                       "ne_postclip": [0, 0, 1.0], "ne_injected": [1.0, 0, 0], "ne_simple_postclip": [0, 0, 0],
                       "pne_injected_postclip": [0.5, 0, 0]})
    s = summarize(df)
    assert s["integrated_pne"] == 10 + 20 + 20 and s["integrated_pne_preclip"] == 25 and s["integrated_ne"] == 5
    assert s["integrated_pne_injected"] == 5


@pytest.mark.unit
def test_kappa_is_the_optimizers_long_run_diffusion_factor():
    """AdamW's dampened momentum: κ = 1 by default (not the heavy-ball 1/(1 − β1)² = 100 at β1 = 0.9)."""
    from iclnoise.noise.exposure import kappa
    assert kappa(None, 0.99) == 1.0 and kappa("calibrated", 0.9) == 1.0 and kappa(2.5, 0.9) == 2.5


@pytest.mark.numerics
@pytest.mark.unit
def test_preconditioner_uses_each_param_groups_own_eps_and_zeroes_dead_coordinates():
    a_, b_ = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a_], "eps": 1e-8}, {"params": [b_], "eps": 1e-1}], lr=1e-3)
    a_.grad, b_.grad = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([3.0, 4.0])
    opt.step()
    root = torch.tensor([1.0, 0.0, 2.0, 3.0, 4.0])   # sqrt(v̂_1) = |g|
    want = 1 / (root + torch.tensor([1e-8, 1e-8, 1e-8, 1e-1, 1e-1]))
    want[1] = 0                                        # never-updated coordinate: a = 0, not 1/δ
    torch.testing.assert_close(preconditioner(AdamState.of_torch(opt)), want)


@pytest.mark.numerics
@pytest.mark.unit
def test_dead_coordinates_are_the_zero_or_round_off_second_moments_whatever_eps():
    """a = 0 exactly where v̂ = 0 or sqrt(v̂) is below float32 resolution of the largest (ε32 · max, the b_K of the
    default model sits at ~1e-9 of it); with a large δ, coordinates AdamW really moves keep a = 1/(sqrt(v̂) + δ)
    (the old rule, sqrt(v̂) < δ, dropped them from NE, Curv and the preconditioned trace)."""
    from iclnoise.core.adam import adam_a
    root = torch.tensor([0.5, 2e-3, 1e-5, 1e-7, 5e-10, 0.0])   # real, real, real (small), real (tiny), round-off, zero
    v = root.square()
    for eps in (1e-8, 1e-3, 1e-1):
        a = adam_a(v, 1e9, 0.999, eps)                         # step → ∞: v̂ = v
        live = torch.tensor([True, True, True, True, False, False])
        torch.testing.assert_close(a[live], 1 / (root[live] + eps))
        assert (a[~live] == 0).all(), (eps, a)
    assert (adam_a(torch.zeros(4), 10, 0.999, 1e-8) == 0).all()   # nothing moved: every coordinate dead


@pytest.mark.unit
@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_update_variance_matches_real_adamw_steps_and_calibrates_kappa_to_one(beta1):
    """The functional AdamW update equals torch's on each group gradient; the calibrated κ is the long-run
    diffusion factor of an EMA-momentum optimizer, 1 for every β1 (the filter's DC gain)."""
    import copy

    from iclnoise.noise.exposure import calibrated_kappa, update_innovation_variance
    model, _, _, batch = linreg_case()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(beta1, 0.999), weight_decay=0.01)
    for i in range(300):
        xs, ys = batch(64, 5000 + i)
        opt.zero_grad()
        half_mse(model, xs, ys).backward()
        opt.step()
    obs, pred = [], []
    for i in range(8):
        xs, ys = batch(64, 9000 + i)
        G = group_grads(model, half_mse, xs, ys, 16)
        real = []
        shrunk = G.mean(0) + (G - G.mean(0)) / 4  # batch-64 noise from groups of 4: √(m/B) = 1/4
        for g in shrunk:  # brute force: a real AdamW step from a copy of the state with this gradient
            m2, o2 = copy.deepcopy(model), None
            o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, betas=(beta1, 0.999), weight_decay=0.01)
            o2.load_state_dict(copy.deepcopy(opt.state_dict()))
            m2.w.grad = g.clone()
            o2.step()
            real.append((m2.w - model.w).detach())
        v = float(update_innovation_variance(AdamState.of_torch(opt), G, 64, 1e-3))
        assert v == pytest.approx(float(torch.stack(real).var(0).sum()), rel=1e-6)
        a = preconditioner(AdamState.of_torch(opt), fallback_grads=False)
        noise = grad_noise(G, 4)
        obs.append(v)
        pred.append(1e-6 * float((a.square() * noise.diag).sum()) / 64)
    assert calibrated_kappa(obs, pred, beta1) == pytest.approx(1.0, rel=0.05)


@pytest.mark.numerics
@pytest.mark.unit
def test_pne_columns_by_hand():
    """One exposure row's arithmetic (method §6) against numbers worked by hand: a = (1, 2), diag C = (3, 4),
    η = 0.1, κ = 1, B = 2 → NE = 0.1·(1·3 + 4·4)/2 = 0.95; Curv 0.5; injected NE 0.2 → P-NE* = 1.15/0.5 = 2.3;
    clip factor 0.5 and injected post-clip P-NE* 0.3 → NE_post = 0.25·0.95 + 0.3·0.5 = 0.3875, P-NE*_post 0.775;
    a Curv below the floor divides by the floor."""
    a, diag = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    aca = float((a.square() * diag).sum())
    c = pne_columns(0.1, 1.0, 2, aca, 0.5, 1e-12, 0.5, 0.2, 0.3)
    want = {"trace_aca": 19.0, "ne": 0.95, "ne_total": 1.15, "pne": 2.3, "ne_postclip": 0.3875,
            "pne_postclip": 0.775, "ne_simple": 0.1 * 1.15, "ne_simple_postclip": 0.1 * 0.3875}
    for k, v in want.items():
        assert c[k] == pytest.approx(v, rel=1e-6), k
    assert pne_columns(0.1, 1.0, 2, aca, -3.0, 0.01, 1.0, 0.0, 0.0)["pne"] == pytest.approx(95.0, rel=1e-6)


@pytest.mark.validation
def test_integrated_dose_se_matches_the_spread_of_real_hutchinson_curvatures(tiny_model):
    """A run's booked dose Σ_t ne_t / Ĉurv_m(t), with 4 diag Ĥ measurements (32 GGN probes each, held for 3, 5, 1
    and 7 steps): over 200 independent probe draws the booked dose spreads as injected_dose_se predicts from each
    draw's own per-step SE (pne · rse, shared within a measurement). Measured: predicted / observed 0.98; the
    bound 20 % allows the delta method's bias at rse ≈ 0.15 and the sampling error of an SD from 200 draws (5 %)."""
    model, xs, ys, _, a = tiny_model
    hold, ne = [3, 5, 1, 7], 1e-3
    doses, ses = [], []
    for rep in range(200):
        steps, pne, se = [], [], []
        for m, n in enumerate(hold):
            curv, cse = ggn_curvature(model, xs, ys, 32, torch.Generator().manual_seed(rep * 10 + m), 0.5).at(a)
            steps += [m] * n
            pne += [ne / curv] * n
            se += [ne / curv * cse / curv] * n
        doses.append(sum(pne))
        ses.append(injected_dose_se(np.array(steps), np.array(se)))
    ratio = np.mean(ses) / np.std(doses, ddof=1)
    assert 0.8 < ratio < 1.2, ratio
    # steps sharing one measurement add their errors; independent measurements add in quadrature
    assert injected_dose_se(np.array([0, 0, 1]), np.array([1.0, 1.0, 1.0])) == pytest.approx(math.sqrt(5))
    assert injected_dose_se(np.array([]), np.array([])) == 0.0


@pytest.mark.unit
def test_refresh_interval_follows_the_drift_beyond_hutchinson_noise():
    # drift 20 % against tol 5 %: halve; none: double; capped at [1, most]
    assert refresh_interval(8, 0.8, 1.0, 0.0, 0.05, 25) == 4
    assert refresh_interval(8, 1.0, 1.0, 0.0, 0.05, 25) == 16
    assert refresh_interval(16, 1.0, 1.0, 0.0, 0.05, 25) == 25
    assert refresh_interval(1, 0.5, 1.0, 0.0, 0.05, 25) == 1
    # between tol/2 and tol: kept
    assert refresh_interval(8, 0.96, 1.0, 0.0, 0.05, 25) == 8
    # a 20 % difference that two estimates with a combined rse of 0.1 make without any change is no drift
    assert refresh_interval(8, 0.8, 1.0, 0.1, 0.05, 25) == 16
    # no previous estimate or a zero curvature: start over at one step
    assert refresh_interval(8, math.nan, 1.0, 0.0, 0.05, 25) == 1
    assert refresh_interval(8, 1.0, 0.0, 0.0, 0.05, 25) == 1
