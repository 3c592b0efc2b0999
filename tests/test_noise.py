"""Noise injection: covariance shapes, PSD clipping, source equivalence, schedules, the controller, resume."""
import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import with_dose_references
from test_exposure import half_mse, linreg_case

import iclnoise.run.ensemble as ens
from iclnoise.config import read_yaml, validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet
from iclnoise.core.model import ModelConfig, build_model
from iclnoise.core.runspec import RunSpec
from iclnoise.core.sections import Exposure
from iclnoise.core.tasks import Batch
from iclnoise.noise import CovModel, parameter_mask, psd_clip, restricted, shaped_covariance, target_at
from iclnoise.noise.exposure import AdamState, grad_noise, group_grads, injected_dose_se, preconditioner, summarize
from iclnoise.noise.hooks import ExposureState, NoiseMeter, StepContext
from iclnoise.noise.injection import MAX_LOG_SCALE, SATURATION, NoiseInjector, closed_loop_scale
from iclnoise.run.train import train_ensemble, train_run

pytestmark = [pytest.mark.numerics]


def random_noise(K=6, P=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(K, P, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, P, dtype=torch.float64)
    return grad_noise(G, m=4)


@pytest.mark.unit
def test_draws_have_the_requested_low_rank_plus_diagonal_covariance():
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))[0]
    cov = CovModel(U, torch.tensor([3.0, 1.0], dtype=torch.float64), torch.linspace(0.1, 0.6, 6, dtype=torch.float64))
    draws = torch.stack([cov.sample(g) for _ in range(40000)])
    emp = draws.T @ draws / len(draws)
    target = cov.dense()
    assert torch.allclose(emp, target, atol=0.06), (emp - target).abs().max()
    assert not torch.allclose(emp, torch.diag(target.diag()), atol=0.06)  # the off-diagonal part is really there


@pytest.mark.unit
@pytest.mark.parametrize("shape", ["isotropic", "diagonal", "lowrank"])
def test_shapes_keep_the_trace_and_lowrank_at_full_rank_is_exact(shape):
    n = random_noise()
    cov, clipped = shaped_covariance(n, 0.5, shape, rank=5)  # K − 1 = 5: the sample covariance has rank 5
    C = n.factor.T @ n.factor
    assert clipped == pytest.approx(0, abs=1e-10)  # round-off only
    assert float(cov.diag().sum()) == pytest.approx(0.5 * float(torch.trace(C)), rel=1e-9)
    if shape == "lowrank":
        torch.testing.assert_close(cov.dense(), 0.5 * C)
    if shape == "diagonal":
        torch.testing.assert_close(cov.dense(), torch.diag(0.5 * C.diag()))


@pytest.mark.unit
def test_truncated_lowrank_keeps_the_top_directions_and_the_diagonal():
    n = random_noise()
    cov, clipped = shaped_covariance(n, 1.0, "lowrank", rank=2)
    C = (n.factor.T @ n.factor).numpy()
    ev, V = np.linalg.eigh(C)
    np.testing.assert_allclose(np.sort(cov.lam.numpy())[::-1], ev[::-1][:2], rtol=1e-8)
    # the diagonal correction restores diag(C) wherever it is non-negative; the rest is clipped and logged
    d_raw = C.diagonal() - (cov.U.square() * cov.lam).sum(1).numpy()
    np.testing.assert_allclose(cov.diag().numpy(), np.where(d_raw >= 0, C.diagonal(), C.diagonal() - d_raw))
    assert clipped == pytest.approx(-d_raw[d_raw < 0].sum())


@pytest.mark.unit
def test_psd_clip_removes_exactly_the_negative_directions():
    g = torch.Generator().manual_seed(3)
    U = torch.linalg.qr(torch.randn(8, 4, generator=g, dtype=torch.float64))[0]
    lam = torch.tensor([2.0, -1.0, 0.5, -0.25], dtype=torch.float64)
    R = (U * lam) @ U.T
    cov_c, removed = psd_clip(U, lam, torch.zeros(8, dtype=torch.float64))
    R_c = cov_c.dense()
    ev, V = torch.linalg.eigh(R)
    proj = (V * ev.clamp(min=0)) @ V.T            # the PSD projection of R
    torch.testing.assert_close(R_c, proj)
    assert removed == pytest.approx(float(torch.trace(R_c - R)))  # the logged residual is what was removed
    assert removed == pytest.approx(1.25)
    # a target batch above the current one: everything is negative, nothing is injected, all is logged
    n = random_noise()
    cov, clipped = shaped_covariance(n, 1 / 64 - 1 / 32, "lowrank", rank=3)
    assert float(cov.diag().abs().max()) == 0 and clipped == pytest.approx(n.trace / 64)


@pytest.mark.unit
def test_psd_clip_projects_the_whole_matrix_not_its_parts():
    """R = −uuᵀ + 2I is PSD (eigenvalues 1 and 2): nothing is removed, although its low-rank part is negative
    (clipping the parts separately removed 1.0); and a truly indefinite R loses exactly its negative part."""
    u = torch.zeros(5, 1, dtype=torch.float64)
    u[0, 0] = 1.0
    cov, removed = psd_clip(u, torch.tensor([-1.0], dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64))
    assert removed == pytest.approx(0.0, abs=1e-12)
    torch.testing.assert_close(cov.dense(), -u @ u.T + 2 * torch.eye(5, dtype=torch.float64))
    cov, removed = psd_clip(u, torch.tensor([-3.0], dtype=torch.float64), torch.full((5,), 2.0, dtype=torch.float64))
    assert removed == pytest.approx(1.0) and float(torch.linalg.eigvalsh(cov.dense()).min()) > -1e-12

def _ctx(model, opt, xs, ys, step, lr, mb):
    return StepContext(step, 10_000, model, AdamState.of_torch(opt), Batch(xs, ys, xs[:, 0]), mb, lr, half_mse, None)


def _injection_spec(source, emulate, B, shape="diagonal", every=10 ** 9):  # tests set the covariance themselves
    spec = run_spec(validate_params(read_yaml("params.yaml")), f"Minf-B{B}-none-s0")
    spec["train"].update(steps=10 ** 6, grad_clip=None)
    spec["noise"] = {"source": source, "shape": shape, "schedule": "constant", "emulate_batch": emulate}
    spec["exposure"] = {"enabled": True, "every": every, "groups": B, "per_example": True, "kappa": None,
                        "curvature": "ggn", "curvature_probes": 2, "curvature_every": 25, "heldout": 8, "floor": 1e-12,
                        "eig_rank": 2}
    return spec


def _meter(spec):
    m = NoiseMeter(Exposure.from_dict(spec["exposure"]), spec["train"]["steps"])
    m.extra = set()  # tests set the covariance themselves: never due
    return m


def _injector(spec):
    return NoiseInjector(RunSpec.of(spec), _meter(spec), ExposureState(), torch.device("cpu"))


@pytest.mark.unit
def test_gradient_injection_emulating_a_smaller_batch_matches_its_update_noise():
    """One AdamW update from a shared state: batch 8 versus batch 32 + injection emulating 8. The update
    noise Σ_i Var(Δw_i) / a_i² (preconditioned space) agrees within 10 %, and differs from plain batch 32."""
    torch.manual_seed(0)
    model, _, _, batch = linreg_case(P=6)
    model = model.float()
    lr = 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for i in range(200):  # warm v so one step barely moves it
        xs, ys = (t.float() for t in batch(32, 10_000 + i))
        opt.zero_grad()
        half_mse(model, xs, ys).backward()
        opt.step()
    state0, w0 = copy.deepcopy(opt.state_dict()), model.w.detach().clone()
    a = preconditioner(AdamState.of_torch(opt))

    def updates(B, inject_to=None, reps=1500):
        out = []
        inj = None
        for r in range(reps):
            model.w.data.copy_(w0)
            opt.load_state_dict(copy.deepcopy(state0))
            xs, ys = (t.float() for t in batch(B, 50_000 + r))
            opt.zero_grad()
            half_mse(model, xs, ys).backward()
            if inject_to:
                if inj is None:  # the covariance is measured once, on a large batch at w0 (per-example)
                    spec = _injection_spec("grad", inject_to, B)
                    inj = _injector(spec)
                    bx, by = (t.float() for t in batch(4096, 7))
                    inj.cov, _ = shaped_covariance(grad_noise(group_grads(model, half_mse, bx, by, 4096), 1),
                                                   1 / inject_to - 1 / B, "diagonal")
                ctx = _ctx(model, opt, xs, ys, r + 1, lr, B)
                inj.on_grads(ctx)
            opt.step()
            if inject_to:
                inj.on_update(ctx)
            out.append((model.w.detach() - w0).numpy())
        return np.array(out)

    def noise_power(u):
        return float((u.var(0, ddof=1) / a.numpy() ** 2).sum())

    small, big, emulated = noise_power(updates(8)), noise_power(updates(32)), noise_power(updates(32, inject_to=8))
    assert emulated == pytest.approx(small, rel=0.10), (small, emulated, big)
    assert big < 0.5 * small  # the comparison can tell batch 8 from batch 32


@pytest.mark.validation
def test_parameter_injection_has_covariance_eta2_A_R_A():
    n = random_noise(K=8, P=5)
    spec = _injection_spec("param", 4, 16)
    spec["noise"].update(shape="lowrank", rank=7)
    inj = _injector(spec)
    inj.cov, _ = shaped_covariance(n, 1 / 4 - 1 / 16, "lowrank", rank=7)
    model = torch.nn.Linear(5, 1, bias=False).double()
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.state[model.weight] = {"step": torch.tensor(10.0), "exp_avg": torch.zeros(1, 5, dtype=torch.float64),
                               "exp_avg_sq": torch.linspace(0.5, 4.0, 5, dtype=torch.float64).view(1, 5)}
    a = preconditioner(AdamState.of_torch(opt))
    lr, draws = 0.1, []
    for step in range(1, 20001):
        w = model.weight.detach().clone()
        ctx = StepContext(step, 10 ** 6, model, AdamState.of_torch(opt), None, 16, lr, half_mse, None)
        inj.on_grads(ctx)
        inj.on_update(ctx)
        draws.append((model.weight.detach() - w).reshape(-1))
    Z = torch.stack(draws)
    target = lr ** 2 * (a[:, None] * inj.cov.dense() * a[None, :])
    assert torch.allclose(Z.T @ Z / len(Z), target, rtol=0.08, atol=0.03 * float(target.diag().max()))


@pytest.mark.validation
def test_isotropic_parameter_noise_is_isotropic_in_parameter_space():
    """source param, shape isotropic: Cov ζ = τ² I with τ² P = η² Tr(A R' A) (method §5), not ∝ A²."""
    n = random_noise(K=8, P=5)
    spec = _injection_spec("param", 4, 16, shape="isotropic")
    inj = _injector(spec)
    inj.cov, _ = shaped_covariance(n, 1 / 4 - 1 / 16, "isotropic")
    model = torch.nn.Linear(5, 1, bias=False).double()
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.state[model.weight] = {"step": torch.tensor(10.0), "exp_avg": torch.zeros(1, 5, dtype=torch.float64),
                               "exp_avg_sq": torch.linspace(0.5, 4.0, 5, dtype=torch.float64).view(1, 5)}
    a = preconditioner(AdamState.of_torch(opt))
    draws = []
    for step in range(1, 20001):
        w = model.weight.detach().clone()
        ctx = StepContext(step, 10 ** 6, model, AdamState.of_torch(opt), None, 16, 0.1, half_mse, None)
        inj.on_grads(ctx)
        inj.on_update(ctx)
        draws.append((model.weight.detach() - w).reshape(-1))
    Z = torch.stack(draws)
    tau2 = 0.1 ** 2 * float((a.square() * inj._diag).sum()) / 5
    emp = Z.T @ Z / len(Z)
    torch.testing.assert_close(emp, tau2 * torch.eye(5, dtype=torch.float64), rtol=0.06, atol=0.04 * tau2)
    assert float(a.max() / a.min()) > 2  # A is far from isotropic, so a ∝ A² covariance would fail


def _early_late(tiny, tmp_path, clip, share=0.2):
    """early and late runs whose budget is `share` of the batch noise's post-clip P-NE* over a window (under clipping
    the injected exposure per step saturates, exposure.budget_scale). A fifth is not always reachable late: the late
    run realised 0.50-1.00 of it over seeds 0-3 under either random stream; a twentieth 0.987-1.009 (early
    0.999-1.007 at both)."""
    p = copy.deepcopy(tiny)
    p["train"]["budget"] = {"mode": "steps", "steps": 80}
    p["train"]["grad_clip"] = clip
    train_run(run_spec(p, "M4-B16-none-s0"), tmp_path / "none", progress=False)
    budget = share * 0.4 * float((lambda e: (e.pne_postclip * e.interval).sum())(
        read_parquet(tmp_path / "none/exposure.parquet")))
    for name in ("early", "late"):
        p["noise"]["conditions"][name].update(fraction=0.4, budget=budget)
    out = {"budget": budget}
    for name in ("early", "late"):
        rd = tmp_path / name
        train_run(run_spec(p, f"M4-B16-{name}-s0"), rd, progress=False)
        out[name] = (read_parquet(rd / "injection.parquet"), read_parquet(rd / "exposure.parquet"))
    return out


@pytest.mark.unit
def test_early_and_late_reach_equal_realised_exposure_after_clipping(tiny, tmp_path):
    """Budget E of injected P-NE* after clipping (a twentieth of the batch noise's over the window), 32-step windows,
    clipping at 0.3 (active on most steps, and differently early and late): both schedules realise E within
    2 %, hence each other; the exposure rows never straddle a window boundary, tile the run, and integrate
    to the exact per-step sum."""
    out = _early_late(tiny, tmp_path, 0.3, share=0.05)
    E = out.pop("budget")
    for name, (inj, exp) in out.items():
        active = inj[inj.active]
        assert len(active) == 32 and (active.step < 32).all() == (name == "early")
        assert (inj.clip_coef < 1).mean() > 0.5                       # clipping really acts
        assert inj.pne_injected.sum() == pytest.approx(E, rel=0.02)
        assert exp.interval.sum() == 80 and exp.step.iloc[-1] == 79
        starts = np.r_[0, exp.step.to_numpy()[:-1] + 1]
        for lo, hi in zip(starts, exp.step):                            # one schedule state per row
            assert inj[(inj.step >= lo) & (inj.step <= hi)].active.nunique() == 1
        s = summarize(exp)
        assert s["integrated_pne_injected"] == pytest.approx(inj.pne_injected.sum(), rel=1e-9)
        assert s["integrated_ne_injected"] == pytest.approx(inj.ne_injected.sum(), rel=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("probes, every, tol", [(32, 2, None), (8, 25, 0.05)], ids=["dense", "adaptive"])
def test_early_and_late_realise_their_budget_by_specs_definition_where_A_moves_fast(tiny, tmp_path, monkeypatch,
                                                                                    probes, every, tol):
    """Rows logged every 40 steps, 32-step windows at the start (A moves fast: v̂ fills from g², and the injected
    noise enters it) and at the end, clipping at 0.3. Each run's realised injected P-NE*, recomputed per step by
    method §6 with that step's A and the exact Gauss–Newton diagonal (`DoseReference`), meets the budget:
    - dense (32 Hutchinson probes, diag Ĥ re-measured every 2 steps): within 5 % (measured on seed 0: early
      −2.5 %, late −1.6 %; the books' own SE from the probes' error, 2.7 % and 2.6 %). Before issue 27's fix the loop
      divided by the last logged row's Curv: by this reference early realised 8.6× the budget and late 0.87×.
      Seed 0 is the case this was first measured on; over seeds 0-11 (2026-11-29) the reference reads 0.93-1.03 of
      the books early and 0.90-1.09 late: within 5 % in 21 of 24 windows (seed 1 early 0.928, seed 6 late 1.087,
      seed 10 late 0.900; delta-method SEs over the 32 steps 2-4 %), and the late window is unreachable under this
      clipping in 2 seeds (the books saturate at 0.79 and 0.80 of the budget; seed 11's reach 0.967).
    - the default's 8 probes every 25 steps: early realised 1.96× the budget (diag Ĥ from the window's first step
      held while the curvature grows; the books' SE 26 %). With `curvature_tol` 0.05 (refresh from every step at
      the window's opening, the interval adapting to the drift, at most 25) early realises 0.97× and late 0.75×
      with SEs of 6.7 % and 11.3 %: what remains is the probes' error, which the books now state (within 3 SE).
    The injection does not swamp the gradient on average: the loop caps the scale at
    SATURATION·max(|g|², G²/10)/Tr R', which bounds each step's expected clipping factor c² at ≥ 1/(1 + SATURATION)
    = 0.1 of what it would be without the injected noise, so a window's mean is ≥ 0.1 (measured over seeds 0-11:
    window means 0.27-0.99; single steps go lower, to 0.064, in the saturated late windows)."""
    made = with_dose_references(monkeypatch, 32)
    p = copy.deepcopy(tiny)
    p["exposure"].update(every=40, curvature_probes=probes, curvature_every=every, heldout=32, curvature_tol=tol)
    out = _early_late(p, tmp_path, 0.3)
    E = out.pop("budget")
    for ref, (name, (inj, exp)) in zip(made, out.items()):
        se = injected_dose_se(inj.curv_step.to_numpy(), inj.pne_injected_se.to_numpy())
        # the exposure rows carry it to outcomes.parquet (a measurement split at a row's last step: a cross term
        # lost, so never more than the per-step form)
        assert summarize(exp)["integrated_pne_injected_se"] == pytest.approx(se, rel=0.1)
        assert len(ref.pne) == 32
        assert inj.pne_injected.sum() == pytest.approx(E, rel=0.02)               # the run's own books
        bound = 0.05 if probes >= 32 else 3 * se / E                                # the method's definition
        assert abs(sum(ref.pne) / E - 1) <= bound, (name, sum(ref.pne) / E, se / E)
        assert np.mean(ref.c2) >= 1 / (1 + SATURATION), (name, np.round(ref.c2, 3).tolist())


@pytest.fixture(scope="module")
def tracking(tiny, tmp_path_factory) -> tuple[dict, float]:
    """300 steps at a constant lr without clipping (under clipping the post-clip P-NE saturates: a high target is
    unreachable), and the median batch-noise P-NE* of its noise-free run."""
    p = copy.deepcopy(tiny)
    p["train"]["budget"] = {"mode": "steps", "steps": 300}
    p["train"]["lr_schedule"] = {"kind": "constant"}
    p["train"]["grad_clip"] = None
    root = tmp_path_factory.mktemp("tracking")
    train_run(run_spec(p, "M4-B16-none-s0"), root / "none", progress=False)
    return p, float(read_parquet(root / "none/exposure.parquet").pne_postclip.median())


@pytest.mark.unit
@pytest.mark.parametrize("trajectory", [False, True])
def test_controller_tracks_a_target(tracking, tmp_path, trajectory):
    p, base = copy.deepcopy(tracking[0]), tracking[1]
    # a constant 10× the batch-noise P-NE*, or a step from 5× to 20× half-way through training
    target = [[0.0, 5 * base], [0.5, 5 * base], [0.5001, 20 * base], [1.0, 20 * base]] if trajectory else 10 * base
    p["noise"]["conditions"]["pid"]["target"] = target
    validate_params(p)
    train_run(run_spec(p, "M4-B16-pid-s0"), tmp_path / "pid", progress=False)
    e = read_parquet(tmp_path / "pid/exposure.parquet")
    want = np.array([target_at(target, s / 300) for s in e.step])
    err = np.log(e.pne_postclip / want)
    # stated tolerance: after warm-up (100 steps, and 50 after the step) the median log-error is within
    # ±0.25 (≈ ±28 %) and no point is off by more than 4×. Each row's P-NE* holds one step's batch-noise NE, so
    # the loop chases noise: measured log-errors after the step range −1.11 to 0.98 (medians 0.03, −0.01 and 0.15);
    # before issue 27's per-step curvature −1.08 to 0.82, already at the old bound of 3× (1.10)
    for lo, hi in ((100, 150), (200, 300)) if trajectory else ((150, 300),):
        late = err[(e.step >= lo) & (e.step < hi)]
        assert abs(np.median(late)) < 0.25 and np.abs(late).max() < math.log(4), (lo, late.tolist())


@pytest.mark.unit
def test_resume_with_injection_and_calibrated_exposure_gives_identical_numbers(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    p["exposure"]["kappa"] = "calibrated"
    specs = [run_spec(p, "M4-B64-param_b16-s0"), run_spec(p, "M1-B64-param_b16-s1")]
    full_dir, part = tmp_path / "full", tmp_path / "part"
    full = train_ensemble(specs, [full_dir, tmp_path / "full1"], progress=False)[0]
    train_ensemble(specs, [part, tmp_path / "part1"], progress=False, stop_after=25)
    resumed = train_ensemble(specs, [part, tmp_path / "part1"], progress=False)[0]
    pd.testing.assert_frame_equal(full, resumed)
    for name in ("exposure", "injection"):
        pd.testing.assert_frame_equal(read_parquet(full_dir / f"{name}.parquet"),
                                      read_parquet(part / f"{name}.parquet"))
    # AdamW's EMA momentum diffuses batch noise with factor ≈ 1, not the heavy-ball 1/(1 − β1)² = 100: the
    # calibrated κ settles in [0.7, 1.3] (measured 1.00, 1.77, 1.24, 1.20, 1.19, 1.19, 1.19; the second rests on
    # two measurements) and never comes near 100
    k = read_parquet(full_dir / "exposure.parquet").kappa
    assert k.iloc[-3:].between(0.7, 1.3).all() and (k < 2.5).all(), k.tolist()


@pytest.mark.unit
def test_controller_starts_from_the_open_loop_estimate(tiny, tmp_path):
    """A target 30× the batch noise's P-NE*: the open-loop start (the scale that reaches the target through the
    measured curvature) is on target at its own measurement (step 0) and every measurement from the third on
    is within 3× (measured log-errors: 0.03, -1.51, 0.35, -0.23, -0.14, -0.38, -0.76; the dip at step 9 is the
    curvature moving while Adam's v fills). The old start at s = 1/B was ~100× off and needed ~20 measurements."""
    p = copy.deepcopy(tiny)
    p["train"]["grad_clip"] = None
    train_run(run_spec(p, "M4-B16-none-s0"), tmp_path / "none", progress=False)
    base = float(read_parquet(tmp_path / "none/exposure.parquet").pne_postclip.median())
    p["noise"]["conditions"]["pid"]["target"] = 30 * base
    train_run(run_spec(p, "M4-B16-pid-s0"), tmp_path / "pid", progress=False)
    e = read_parquet(tmp_path / "pid/exposure.parquet")
    err = np.log(e.pne_postclip.to_numpy() / (30 * base))
    assert abs(err[0]) < math.log(1.2), err
    assert np.abs(err[2:]).max() < math.log(3), err


@pytest.mark.unit
def test_param_noise_reaches_a_dose_the_clipping_bound_would_cap(tiny, tmp_path):
    """The param source's noise enters the weights after the update and never passes through gradient clipping, so
    its closed loop solves for s without the clipping factor and without the grad source's saturation bound
    (injection.SATURATION): at 30× the batch noise's integrated P-NE* under clipping at 0.3 it books its budget
    within 2 %. Before, its scale was solved as if clipping shrank its noise: each step overshot and the run booked
    1.33× its budget (and at 100× on the science model the bound capped it at 0.27×, experiments/tuning/tuning.md §10).
    The grad source at this dose saturates under clipping, as it should, and books less."""
    p = copy.deepcopy(tiny)
    p["train"]["budget"] = {"mode": "steps", "steps": 80}
    p["train"]["grad_clip"] = 0.3
    train_run(run_spec(p, "M4-B16-none-s0"), tmp_path / "none", progress=False)
    E = 30 * float((lambda e: (e.pne_postclip * e.interval).sum())(read_parquet(tmp_path / "none/exposure.parquet")))
    booked = {}
    for source in ("param", "grad"):
        p["noise"]["conditions"]["dose"] = {"source": source, "shape": "diagonal", "schedule": "constant",
                                            "budget": E}
        p["grid"]["noise"] = ["none", "dose"]
        q = validate_params(copy.deepcopy(p))
        train_run(run_spec(q, "M4-B16-dose-s0"), tmp_path / source, progress=False)
        booked[source] = float(read_parquet(tmp_path / source / "injection.parquet").pne_injected.sum()) / E
    assert booked["param"] == pytest.approx(1.0, rel=0.02), booked
    assert booked["grad"] < 0.9, booked


@pytest.mark.unit
def test_the_closed_loop_scale_of_R_runs_is_each_runs_own_and_the_known_answers():
    """closed_loop_scale over (R,) tensors equals it run by run on floats, bit for bit, in each branch, and each
    branch gives its closed form (unit = curv = Tr R' = 1, 10 steps left, G = 1): unclipped s = target · curv / unit;
    clipped (|g|² = 2) s = target · |g|² / (G² − target); unreachable (target ≥ G²/Tr R'): the saturation bound
    9 · max(|g|², G²/10) / Tr R'; budget spent or no curvature: 0; unclipped and huge: e^MAX_LOG_SCALE."""
    left = [0.5, 1.0, 1.0, 30.0, -0.1, 1.0, 1e21]
    clip = [math.inf, math.inf, 1.0, 1.0, 1.0, 1.0, math.inf]
    g2 = [2.0, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0]
    curv = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    want = [0.05, 0.1, 0.1 * 2 / 0.9, 18.0, 0.0, 0.0, math.exp(MAX_LOG_SCALE)]
    each = [float(closed_loop_scale(a, 10, c, 1.0, g, 1.0, None if math.isinf(k) else k))
            for a, k, g, c in zip(left, clip, g2, curv)]
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    batched = closed_loop_scale(t(left), t([10.0] * 7), t(curv), t([1.0] * 7), t(g2), t([1.0] * 7), t(clip))
    assert batched.tolist() == each
    np.testing.assert_allclose(each, want, rtol=1e-15)


@pytest.mark.unit
@pytest.mark.parametrize("rng", ["generator", "counter"])
def test_a_noise_seed_draws_other_noise_on_the_same_data_and_initialisation(tiny, rng, tmp_path):
    """Three runs of one seed in one ensemble (their noise sections differ in noise_seed only), param-source diagonal
    noise at a budget: without noise_seed (the stream of runs before the key), noise_seed 0 and noise_seed 1. They
    share the first checkpoint's training loss (same data and initialisation) and end apart (other noise); the first
    and the last, each trained again alone, end where they ended in the ensemble (to float32 round-off: bmm against
    F.linear), so a run's noise is its own (seed, noise_seed)'s."""
    p = copy.deepcopy(tiny)
    p["train"]["rng"] = rng
    base = {"source": "param", "shape": "diagonal", "schedule": "constant", "budget": 0.002}
    p["noise"]["conditions"].update(pn={**base}, pn0={**base, "noise_seed": 0}, pn1={**base, "noise_seed": 1})
    runs = ["M4-B16-pn-s0", "M4-B16-pn0-s0", "M4-B16-pn1-s0"]
    specs = [run_spec(p, r) for r in runs]
    assert "noise_seed" not in specs[0]["noise"] and specs[2]["noise"]["noise_seed"] == 1
    out = train_ensemble(specs, [tmp_path / r for r in runs], progress=False)
    assert len({float(o.train_loss.dropna().iloc[0]) for o in out}) == 1
    w = [torch.load(tmp_path / r / "resume.pt", weights_only=False)["params"] for r in runs]
    assert all(not torch.allclose(w[i]["embed.weight"], w[j]["embed.weight"], rtol=1e-3)
               for i, j in ((0, 1), (0, 2), (1, 2)))
    for r, spec in ((runs[0], specs[0]), (runs[2], specs[2])):
        alone = train_run(spec, tmp_path / "alone" / r, progress=False)
        pd.testing.assert_frame_equal(alone, out[runs.index(r)], check_exact=False, rtol=1e-4)
        a = torch.load(tmp_path / "alone" / r / "resume.pt", weights_only=False)["params"]
        torch.testing.assert_close(a, w[runs.index(r)], rtol=1e-4, atol=2 * p["train"]["optimizer"]["lr"] * 60)


# ---------------------------------------------------------------- noise on some layers (noise.layers, method §5)
@pytest.mark.unit
def test_a_restricted_covariance_is_M_R_M_and_its_draw_the_whole_draw_masked():
    """parameter_mask marks exactly the named parameters' coordinates (blocks.1 is not blocks.10's prefix); the
    restricted R' is M R' M as a dense matrix, and its draw from one generator state is the unrestricted draw from
    the same state with the coordinates outside M zeroed, bit for bit. A prefix that names no parameter is refused
    with the names there are."""
    names = [("embed.weight", 3), ("blocks.1.attn.W_Q", 4), ("blocks.10.mlp.b", 2), ("blocks.1.ln1.w", 1)]
    m = parameter_mask(names, ["blocks.1"])
    assert m.tolist() == [0] * 3 + [1] * 4 + [0] * 2 + [1]
    assert parameter_mask(names, ["blocks.1.attn", "embed"]).tolist() == [1] * 7 + [0] * 3
    with pytest.raises(ValueError, match=r"blocks\.2 names no parameter.*blocks\.1, blocks\.10, embed"):
        parameter_mask(names, ["blocks.2"])
    g = torch.Generator().manual_seed(0)
    P, r = 10, 3
    U = torch.linalg.qr(torch.randn(P, r, generator=g, dtype=torch.float64))[0]
    cov = CovModel(U, torch.tensor([3.0, 2.0, 0.5], dtype=torch.float64), torch.rand(P, generator=g,
                                                                                      dtype=torch.float64))
    rc = restricted(cov, m)
    M = torch.diag(m.double())
    torch.testing.assert_close(rc.dense(), M @ cov.dense() @ M, rtol=0, atol=1e-15)
    assert float(rc.diag().sum()) == pytest.approx(float((cov.diag() * m).sum()), rel=1e-15)
    a, b = (c.sample(torch.Generator().manual_seed(5)) for c in (cov, rc))
    assert torch.equal(b, a * m)


@pytest.mark.unit
@pytest.mark.parametrize("source", ["param", "grad"])
def test_noise_on_some_layers_is_on_those_parameters_alone_at_the_same_exposure(tiny, tmp_path, monkeypatch, source):
    """noise.layers = [blocks.1, unembed], diagonal noise over the whole run at a budget, no clipping, per-run path
    (test_engine: the batched path gives the same numbers): every step's injected draw is exactly zero outside those
    parameters and not zero on them; the run books its budget as the unrestricted run books it (within 2 %), so a
    restriction moves where the noise is, not how much exposure it carries."""
    monkeypatch.setattr(ens, "INJECT_BATCHED", False)
    p = copy.deepcopy(tiny)
    p["train"]["grad_clip"] = None
    base = {"source": source, "shape": "diagonal", "schedule": "constant", "budget": 0.002}
    p["noise"]["conditions"].update(whole=base, some={**base, "layers": ["blocks.1", "unembed"]})
    p["grid"]["noise"] = ["whole", "some"]
    p = validate_params(p)
    drawn, restrict, on_grads = [], NoiseInjector.restrict, NoiseInjector.on_grads

    def keep(self, model):
        restrict(self, model)
        self.keep_draw = True

    def record(self, ctx):
        on_grads(self, ctx)
        if self.drawn is not None and self.layers:
            drawn.append(self.drawn.clone())

    monkeypatch.setattr(NoiseInjector, "restrict", keep)
    monkeypatch.setattr(NoiseInjector, "on_grads", record)
    booked = {}
    for cond in ("whole", "some"):
        train_run(run_spec(p, f"M4-B16-{cond}-s0"), tmp_path / cond, progress=False)
        booked[cond] = float(read_parquet(tmp_path / cond / "injection.parquet").pne_injected.sum())
    model = build_model(ModelConfig(D=p["data"]["D"], K=p["data"]["K"], **p["model"]), 0)
    m = parameter_mask([(n, q.numel()) for n, q in model.named_parameters()], ["blocks.1", "unembed"]).bool()
    assert len(drawn) == p["train"]["budget"]["steps"] and 0 < int(m.sum()) < m.numel()
    assert all(bool((d[~m] == 0).all()) and bool((d[m] != 0).any()) for d in drawn)
    assert booked["some"] == pytest.approx(0.002, rel=0.02) and booked["whole"] == pytest.approx(0.002, rel=0.02)


@pytest.mark.unit
def test_a_layer_the_model_does_not_have_is_refused_before_training(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    p["noise"]["conditions"]["some"] = {"source": "param", "shape": "diagonal", "schedule": "constant",
                                        "budget": 0.002, "layers": ["blocks.2"]}   # the model has 2 layers: 0, 1
    p["grid"]["noise"] = ["some"]
    with pytest.raises(ValueError, match=r"blocks\.2 names no parameter of the model.*blocks\.0, blocks\.1"):
        train_run(run_spec(validate_params(p), "M4-B16-some-s0"), tmp_path / "r", progress=False)
    assert not (tmp_path / "r" / "resume.pt").exists()
