"""AdamW's step as a differentiable map (iclnoise.run.linearised), what the pathwise estimator carries its tangents
through: its value at the recorded state is the step AdamW took, and its JVP is AdamW's Jacobian in (θ, m, v)."""
import dataclasses

import pytest
import torch
from torch.func import functional_call, grad

from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.adam import adam_a
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.noise.injection import NoiseInjector
from iclnoise.run.ensemble import Ensemble
from iclnoise.run.linearised import adamw_map, flat_params
from iclnoise.run.member import Member
from iclnoise.run.pathwise import Pathwise
from iclnoise.run.runs import sampler

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

RUN = "M4-B64-param_b16-s0"


@pytest.fixture(scope="module")
def small(tiny):
    p = {**tiny, "train": {**tiny["train"], "budget": {"mode": "steps", "steps": 16}}}
    p["model"] = {**p["model"], "n_layers": 1}
    return p


class _StepCheck(Pathwise):
    """Compares the linearised step's value at the recorded state with the step AdamW really took (full batch)."""

    errors: list

    def on_update(self, ctx):
        super().on_update(ctx)
        now = self.pending
        if ctx.adam.exp_avg is None:   # step 0: AdamW's state tensors appear with it (the views come at step 1)
            return
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
        got = self._phi(now)(torch.cat([now["theta"], now["m"], now["v"]]), None).chunk(3)
        real = flat(ctx.model.parameters()), flat(ctx.adam.exp_avg), flat(ctx.adam.exp_avg_sq)
        live = now["live"]   # a = 0 on round-off coordinates (iclnoise.core.adam): no curvature, no linear term
        step = (real[0] - now["theta"])[live].norm()
        # float32 rounding of θ + step: ≈ eps/2 · ‖θ‖ next to ‖step‖ (θ ≫ one step), the rest is the gradient's
        self.errors.append(float((got[0] - real[0])[live].norm() / step)
                           / (4 * 2.0 ** -24 * float(real[0][live].norm() / step) + 1e-5))
        for a, b in zip(got[1:], real[1:]):   # m' and v': a few roundings of each element
            self.errors.append(float((a - b).abs().max() / (4 * 2.0 ** -24 * b.abs().max())))


def test_the_linearised_step_is_adamws_step(small, tmp_path):
    spec = RunSpec.of(run_spec(small, RUN))
    m = Member(spec, tmp_path, spec_hash(spec.raw), torch.device("cpu"))
    m.setup()
    (tmp_path / "checkpoints").mkdir()
    inj = next(h for h in m.hooks if isinstance(h, NoiseInjector))
    check = _StepCheck(spec, m.model, inj, jac_batch=spec.keys.batch)
    check.errors = []
    m.hooks.append(check)
    Ensemble([m], 0, "check").run(False)
    # the map at the recorded state is the step AdamW took, (θ', m', v') (the injected parameter noise comes after
    # it), up to float32 rounding (error / bound), from step 1, where AdamW's state is there to read
    assert len(check.errors) == 3 * (spec.train.steps - 1)
    assert max(check.errors) < 1, check.errors


def _adamw(model, state, xs, ys, clip, lr, wd, betas, eps):
    """torch's AdamW step from state (θ, m, v) after n steps on the batch's gradient × clip: the new (θ, m, v)."""
    params = list(model.parameters())
    theta, m, v, n = state
    sizes = [p.numel() for p in params]
    with torch.no_grad():
        for p, t in zip(params, theta.split(sizes)):
            p.copy_(t.view_as(p))
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for p, mm, vv in zip(params, m.split(sizes), v.split(sizes)):
        opt.state[p] = {"step": torch.tensor(float(n), dtype=torch.float64), "exp_avg": mm.view_as(p).clone(),
                        "exp_avg_sq": vv.view_as(p).clone()}
    opt.zero_grad()
    (mse_loss(model, xs, ys) * clip).backward()
    opt.step()
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    return torch.cat([flat(params), *(flat(opt.state[p][k] for p in params) for k in ("exp_avg", "exp_avg_sq"))])


def test_the_tangent_map_is_adamws_jacobian(small):
    """adamw_map's JVP in (θ, m, v) against central differences of torch's AdamW step (float64), at the state after
    four real steps; the map of before (A frozen, v out of the state) misses it by far more than the tolerance."""
    spec = RunSpec.of(run_spec(small, RUN))
    model = build_model(ModelConfig(D=spec.data.D, K=spec.data.K, **dataclasses.asdict(spec.model)), 0).double()
    batch = sampler(spec, "train").batch(0, 16)
    xs, ys = batch.xs.double(), batch.ys.double()
    o, clip, lr = spec.train.optimizer, 0.7, 3e-3
    hyper, n = (lr, o.weight_decay, tuple(o.betas), o.eps), 4
    P = sum(p.numel() for p in model.parameters())
    x = torch.cat([flat_params(model)[1], torch.zeros(2 * P, dtype=torch.float64)])
    for k in range(n):
        x = _adamw(model, (*x.chunk(3), k), xs, ys, clip, *hyper)
    unflat = flat_params(model)[0]
    g = grad(lambda th: mse_loss(lambda a, b: functional_call(model, unflat(th), (a, b)), xs, ys))
    real = _adamw(model, (*x.chunk(3), n), xs, ys, clip, *hyper)
    live = adam_a(real.chunk(3)[2], n + 1, o.betas[1], o.eps) > 0
    phi = adamw_map(g, *hyper, n, clip, live)
    keep = torch.cat([live, torch.ones(2 * P, dtype=torch.bool)])   # a = 0 on round-off coordinates by design
    sizes = [int(live.sum()), P, P]
    for a, b in zip(phi(x, None)[keep].split(sizes), real[keep].split(sizes)):   # the gradient's reduction order
        assert (a - b).norm() < 1e-12 * b.norm()
    assert live.float().mean() > 0.9
    gen = torch.Generator().manual_seed(0)
    theta, m, v = x.chunk(3)
    d = torch.cat([torch.randn(P, generator=gen, dtype=torch.float64) * theta.abs().mean(),
                   torch.randn(P, generator=gen, dtype=torch.float64) * m.abs().mean(),
                   torch.rand(P, generator=gen, dtype=torch.float64) * v])
    got = torch.func.jvp(lambda y: phi(y, None), (x,), (d,))[1]
    h = 1e-6   # central differences in float64: truncation ~h² f''' and rounding ~1e-16/h, both < 1e-9 relative
    # (measured 1e-10 on each part; the frozen map misses by 1.2e-2)
    fd = (_adamw(model, (*(x + h * d).chunk(3), n), xs, ys, clip, *hyper)
          - _adamw(model, (*(x - h * d).chunk(3), n), xs, ys, clip, *hyper)) / (2 * h)
    for a, b in zip(got[keep].split(sizes), fd[keep].split(sizes)):
        assert (a - b).norm() < 1e-7 * b.norm(), float((a - b).norm() / b.norm())
    # the map of before: A frozen at the step's v', v out of the state
    b1, a = o.betas[0], live / ((real.chunk(3)[2] / (1 - o.betas[1] ** (n + 1))).sqrt() + o.eps)
    frozen = lambda y: y[:P] * (1 - lr * o.weight_decay) - lr * a * (  # noqa: E731
        b1 * y[P:2 * P] + (1 - b1) * clip * g(y[:P])) / (1 - b1 ** (n + 1))
    old = torch.func.jvp(frozen, (x,), (d,))[1]
    assert (old - fd[:P])[live].norm() > 1e-3 * fd[:P][live].norm()
