"""Geometry probes against the exact Hessian and closed forms (method §9)."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet, write_json
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.probe_sections import Geometry
from iclnoise.core.runspec import RunSpec
from iclnoise.core.tasks import BatchSampler, task_pool
from iclnoise.probes.geometry import (
    GEOMETRY_SCHEMA,
    FlatLoss,
    hutchinson_samples,
    hutchinson_trace,
    lanczos,
    lanczos_top,
    mean_se,
    precond_trace,
    preconditioned,
    sam_sharpness,
    t_halfwidth,
)
from iclnoise.run.probing import geometry_for_run
from iclnoise.run.runs import checkpoint_path, checkpoint_precond, sampler, save_torch

pytestmark = pytest.mark.numerics

CFG = ModelConfig(D=2, K=3, d_model=4, n_layers=1, n_heads=2, d_mlp=4)


def train_tiny(steps=50):
    torch.manual_seed(0)
    m = build_model(CFG, 0)
    s = BatchSampler(task_pool(0, 4, 2), 3, 2, 0.125, 0)
    opt = torch.optim.AdamW(m.parameters(), 1e-2)
    for i in range(steps):
        b = s.batch(i, 32)
        opt.zero_grad()
        mse_loss(m, b.xs, b.ys).backward()
        opt.step()
    return m, opt, s


def checkpoint_state(m, opt) -> dict:
    """An analysis checkpoint in the runs.py format (flat exp_avg_sq in parameter order)."""
    params = list(m.parameters())
    v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])
    group = opt.param_groups[0]
    return {"model": m.state_dict(), "model_config": CFG.to_dict(), "spec_hash": "test",
            "adam": {"exp_avg_sq": v, "step": int(opt.state[params[0]]["step"]), "beta2": group["betas"][1],
                     "eps": group["eps"]}}


@pytest.fixture(scope="module")
def tiny():
    m, opt, s = train_tiny(30)
    state = checkpoint_state(m, opt)
    b = s.batch(999, 64)
    m64 = build_model(CFG, 0).double()
    m64.load_state_dict({k: v.double() for k, v in state["model"].items()})
    f = FlatLoss(m64, mse_loss, b.xs.double(), b.ys.double())
    H = torch.func.vmap(f.hvp)(torch.eye(f.w0.numel(), dtype=torch.float64))   # exact, column by column
    return m, f, H, state, b


@pytest.mark.unit
def test_hvp_matches_exact_hessian(tiny):
    m, f, H, _, _ = tiny
    v = torch.randn(f.w0.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(f.hvp(v), H @ v, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(H, H.T, rtol=1e-8, atol=1e-10)
    e = torch.zeros_like(v)
    e[3] = 1.0
    fd = (f.grad(f.w0 + 1e-6 * e) - f.grad(f.w0 - 1e-6 * e)) / 2e-6           # central differences of ∇L
    torch.testing.assert_close(H[:, 3], fd, rtol=1e-5, atol=1e-7)
    h = f.hvp_at_w0()                 # reverse-over-reverse on one retained graph, reused for every product
    for s in (1, 2):
        v = torch.randn(f.w0.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        torch.testing.assert_close(h(v), H @ v, rtol=1e-8, atol=1e-10)


@pytest.mark.unit
def test_hutchinson_and_lanczos_extremes_against_exact_hessian(tiny):
    """On the model's exact Hessian (as a matrix, so the test is fast): Hutchinson within 4 se of
    the trace; Lanczos' largest and smallest Ritz values equal eigvalsh's extremes."""
    m, f, H, _, _ = tiny
    hvp = lambda v: H @ v  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    est, se = hutchinson_trace(hvp, f.w0.numel(), 200, gen, dtype=torch.float64)
    assert abs(est - float(torch.trace(H))) < 4 * se
    ev = torch.linalg.eigvalsh(H)
    assert ev[0] < 0 < ev[-1]                          # a saddle direction exists: the min matters
    res = lanczos(hvp, f.w0.numel(), f.w0.numel(), gen, tol=1e-8, dtype=torch.float64)
    assert res["max"]["converged"] and res["min"]["converged"]
    assert res["max"]["eigenvalue"] == pytest.approx(float(ev[-1]), rel=1e-6)
    assert res["min"]["eigenvalue"] == pytest.approx(float(ev[0]), rel=1e-6, abs=1e-9)


@pytest.mark.unit
def test_quadratic_with_known_spectrum_is_exact():
    lams = torch.tensor([5.0, 3.0, 1.0, 0.5, -0.1], dtype=torch.float64)
    hvp = lambda v: lams * v  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    est, se = hutchinson_trace(hvp, 5, 4, gen, dtype=torch.float64)   # Rademacher on a diagonal H: zᵀDz = tr D
    assert est == pytest.approx(float(lams.sum())) and se == pytest.approx(0.0, abs=1e-12)
    res = lanczos(hvp, 5, 10, gen, tol=1e-10, dtype=torch.float64)
    assert res["max"]["eigenvalue"] == pytest.approx(5.0, rel=1e-10) and res["max"]["iterations"] <= 5
    assert res["min"]["eigenvalue"] == pytest.approx(-0.1, rel=1e-10)
    assert lanczos_top(hvp, 5, 10, gen, tol=1e-10, dtype=torch.float64)["eigenvalue"] == pytest.approx(5.0)
    a = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0], dtype=torch.float64)
    est_p, _ = hutchinson_trace(preconditioned(hvp, a), 5, 3, gen, dtype=torch.float64)
    assert est_p == pytest.approx(float((a * lams * a).sum()))


@pytest.mark.validation
def test_t_interval_covers_at_nominal_rate():
    """8 probes: ±2 se covers ~91 %, the t half-width (t_{0.975,7} = 2.36) 95 %; measured over 4000
    simulated Gaussian samples: t coverage within 0.94-0.96."""
    assert t_halfwidth(1.0, 8) == pytest.approx(stats.t.ppf(0.975, 7))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 8))
    m, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(8)
    cover_t = np.mean(np.abs(m) <= t_halfwidth(1.0, 8) * se)
    cover_2se = np.mean(np.abs(m) <= 2 * se)
    assert 0.94 <= cover_t <= 0.96 and cover_2se < 0.93


@pytest.mark.unit
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
    assert mean_se([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1 / math.sqrt(3)))


@pytest.mark.unit
def test_checkpoint_precond_zeroes_dead_coordinates(tiny):
    m, _, _, state, _ = tiny
    a = checkpoint_precond(state)
    ad = state["adam"]
    v = ad["exp_avg_sq"]
    root = (v / (1 - ad["beta2"] ** ad["step"])).sqrt()
    dead = root <= torch.finfo(root.dtype).eps * root.max()   # v is 0 or round-off of the largest (adam.precondition)
    names = [n for n, p in m.named_parameters() for _ in range(p.numel())]
    # never updated: the last position's embedding (the y_K token feeds no prediction) and attention b_K
    # (softmax is invariant to it; its v is round-off of ~1e-20, not 0)
    assert dead.any() and all(names[i].endswith(("pos_embed", "b_K")) for i in torch.nonzero(dead).ravel().tolist())
    assert any(names[i].endswith("b_K") for i in torch.nonzero(dead).ravel().tolist())
    assert (a[dead] == 0).all()
    torch.testing.assert_close(a[~dead], 1 / (root[~dead] + ad["eps"]))


@pytest.mark.unit
def test_precond_trace_float32_error_below_se(tiny):
    """Tr(A H A) against the float64 exact value Σ a_i² H_ii; float32 per-probe error ≪ the reported se.
    Measured (16 probes, 30 Adam steps): |float32 − float64| of the estimate = 1.5e4 against se 4.3e6
    (3.4e-3 se) with a = 0 on never-updated coordinates. On the default model (d_model 32, 300 Adam
    steps) float32 was off by 4.4e6 against 2.0e6 ± 3.1e6 (b_K: v is round-off, not 0, so a ≈ 1/δ),
    which is why geometry computes A·H·A in float64 (precond_trace); zeroing a where √v̂ ≤ ε32 · max √v̂
    (the 96 coordinates: both b_K and the last pos_embed row) brings float32 to 1.5 off."""
    m, f, H, state, b = tiny
    a64 = checkpoint_precond(state).double()
    exact = float((a64 ** 2 * torch.diagonal(H)).sum())
    f32 = FlatLoss(m, mse_loss, b.xs, b.ys)
    n = 16
    v32 = np.array(hutchinson_samples(preconditioned(f32.hvp, a64.float()), f.w0.numel(), n,
                                      torch.Generator().manual_seed(5)))
    v64 = np.array(hutchinson_samples(preconditioned(f.hvp, a64), f.w0.numel(), n,
                                      torch.Generator().manual_seed(5), dtype=torch.float64))
    se = v32.std(ddof=1) / math.sqrt(n)
    # float32 vs float64 by design: per probe ≲ dim·ε32·max|term| ≈ 188·1.2e-7·6e4 ≈ 1.4 ≪ 0.05 se ≈ 300
    # (measured over 3 CPU settings: ≤ 1.1e-6 se)
    assert abs(v32.mean() - v64.mean()) < 0.05 * se
    assert abs(v64.mean() - exact) < t_halfwidth(se, n) * 1.5
    # b_K: float32 round-off gives v ~ 1e-24 (not 0); adam.precondition gives a = 0 where sqrt(v̂) is below
    # float32 resolution of the largest, so these coordinates cannot multiply round-off by 1/δ
    names = [n for n, p in m.named_parameters() for _ in range(p.numel())]
    bk = torch.tensor([n.endswith("b_K") for n in names])
    assert (a64[bk] == 0).all()


@pytest.mark.unit
def test_geometry_for_run_on_a_checkpoint_fixture(tmp_path):
    m, opt, _ = train_tiny(20)
    run = tmp_path / "run"
    keys = {"run_id": "M4-B32-none-s0", "M": 4, "seed": 0, "batch": 32, "noise": "none"}
    spec = {**run_spec(load_params("params.yaml"), "M4-B32-none-s0"), "keys": keys,   # a full spec, our data
            "data": {"D": 2, "K": 3, "noise_var": 0.125, "pool_seed": 0}}
    write_json(spec, run / "run.json")
    fresh = build_model(CFG, 0)
    man = {0: save_torch({"model": fresh.state_dict(), "model_config": CFG.to_dict(), "adam": None,
                          "spec_hash": "x"}, checkpoint_path(run, 0)),
           20: save_torch(checkpoint_state(m, opt), checkpoint_path(run, 20))}
    write_json({str(k): v for k, v in man.items()}, run / "checkpoints.json")
    cfg = Geometry(probes=4, lanczos_iters=10, lanczos_tol=1e-3, sam_rho=0.05, sam_batches=3, n_heldout=16, seed=0)
    df = geometry_for_run(run, cfg)
    assert list(df.step) == [0, 20] and list(df.columns) == GEOMETRY_SCHEMA.names
    assert np.isnan(df.precond_trace[0]) and np.isfinite(df.precond_trace[1]) and df.n_dead[1] > 0
    # A·H·A is computed in float64: the same probes on a float64 copy give the same number
    state = checkpoint_state(m, opt)
    held = sampler(RunSpec.of(spec), "geometry").batch(0, 16)
    gen = torch.Generator().manual_seed(cfg.seed + 20)
    hutchinson_trace(lambda v: v, sum(p.numel() for p in m.parameters()), 4, gen)      # the draws before it
    lanczos(lambda v: v, sum(p.numel() for p in m.parameters()), 10, gen)
    assert df.precond_trace[1] == pytest.approx(precond_trace(m, checkpoint_precond(state), held, 4, gen)[0], rel=1e-12)
    assert (df.min_eigenvalue <= df.top_eigenvalue).all() and (df.sam_batches == 3).all()
    np.testing.assert_allclose(df.hessian_trace_ci95, stats.t.ppf(0.975, 3) * df.hessian_trace_se)
    first = (run / "geometry.parquet").read_bytes()
    geometry_for_run(run, cfg)
    assert (run / "geometry.parquet").read_bytes() == first          # no wall-clock column: byte-identical
    assert read_parquet(run / "geometry.parquet").sam_sharpness_se.notna().all()
