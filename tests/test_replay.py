"""Counterfactual noise replay of a run directory (iclnoise.run.replay): the replay is the run, the linearised step is
AdamW's, paired draws make the prediction linear in the covariance change, bad counterfactuals are refused."""
import dataclasses
import json
import math
import shutil

import pytest
import torch
from torch.func import functional_call, grad

from iclnoise.cli import main
from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.adam import adam_a
from iclnoise.core.io import read_parquet
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.noise.injection import NoiseInjector
from iclnoise.output.figures.cnr import fig_cnr
from iclnoise.run.ensemble import Ensemble
from iclnoise.run.member import Member
from iclnoise.run.replay import CNR_SCHEMA, METRICS, Replayer, _functional, adamw_map, counterfactual, replay_run
from iclnoise.run.runs import sampler
from iclnoise.run.train import train_ensemble, train_run

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

RUN = "M4-B64-param_b16-s0"


@pytest.fixture(scope="module")
def small(tiny):
    p = {**tiny, "train": {**tiny["train"], "budget": {"mode": "steps", "steps": 16}}}
    p["model"] = {**p["model"], "n_layers": 1}
    return p


@pytest.fixture(scope="module")
def run(small, tmp_path_factory):
    rd = tmp_path_factory.mktemp("cnr") / RUN
    train_run(run_spec(small, RUN), rd, progress=False)
    return rd


def test_replay_is_the_run_and_paired_predictions_are_linear_in_the_covariance(small, run, tmp_path):
    names = ["none", "self*2", "self*3", "grad_iso_b16"]
    cfg = json.dumps({"noise": small["noise"]})
    main(["cnr-replay", str(run), "--counterfactual", *names, "--cfg", cfg, "--probes", "3", "--jac-batch", "4"])
    df = read_parquet(run / "cnr.parquet", CNR_SCHEMA).set_index(["counterfactual", "metric"])
    assert len(df) == len(names) * len(METRICS)
    for name in names:   # the replayed trajectory ends where the run ended
        ood = df.loc[(name, "ood_loss")]
        assert ood.replayed == pytest.approx(ood.observed, rel=1e-6)
    d = df["delta"].unstack("metric")
    # u = √k v, second-order terms are quadratic in the draws: Δ(k) = (k − 1) · mean second(v), in float32
    assert torch.allclose(torch.tensor(d.loc["self*3"].values), 2 * torch.tensor(d.loc["self*2"].values), rtol=1e-3)
    assert torch.allclose(torch.tensor(d.loc["none"].values), -torch.tensor(d.loc["self*2"].values), rtol=1e-3)
    assert (d.loc["self*2"].abs() > 0).all()
    assert not torch.allclose(torch.tensor(d.loc["grad_iso_b16"].values), torch.tensor(d.loc["none"].values))
    assert (df.lo <= df.predicted).all() and (df.predicted <= df.hi).all()
    # the figure of predicted against realised changes draws from such a table (realised: here a stand-in)
    table = df.reset_index().assign(lo_delta=lambda t: t.lo - t.observed, hi_delta=lambda t: t.hi - t.observed,
                                    realised=lambda t: t.delta)
    assert {p.suffix for p in fig_cnr(table, tmp_path / "cnr")} == {".png", ".pdf", ".parquet"}
    # a bad name stops the command before any replay, naming it; the table written before stays
    with pytest.raises(SystemExit, match="'nope' is not a noise condition"):
        main(["cnr-replay", str(run), "--counterfactual", "none", "nope", "--cfg", cfg])
    assert len(read_parquet(run / "cnr.parquet", CNR_SCHEMA)) == len(df)


class _StepCheck(Replayer):
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
    check = _StepCheck(spec, m.model, [], inj, probes=2, jac_batch=spec.keys.batch, seed=0)
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
    x = torch.cat([_functional(model)[1], torch.zeros(2 * P, dtype=torch.float64)])
    for k in range(n):
        x = _adamw(model, (*x.chunk(3), k), xs, ys, clip, *hyper)
    unflat = _functional(model)[0]
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


def test_bad_counterfactuals_are_refused(small):
    spec = RunSpec.of(run_spec(small, RUN))
    conds = small["noise"]["conditions"]
    with pytest.raises(ValueError, match="not a noise condition"):
        counterfactual("nope", conds, spec)
    with pytest.raises(ValueError, match="closed loop"):
        counterfactual("early", conds, spec)
    with pytest.raises(ValueError, match="NAME or NAME"):
        counterfactual("self**2", conds, spec)
    with pytest.raises(ValueError, match="injects no noise"):
        counterfactual("self*2", conds, RunSpec.of(run_spec(small, "M4-B64-none-s0")))
    some = {**conds["grad_b16"], "layers": ["blocks.0"]}   # noise on some layers: this replay does not restrict it
    with pytest.raises(ValueError, match="some layers"):
        counterfactual("some", {**conds, "some": some}, spec)
    assert counterfactual("self*0.5", conds, spec).factor == 0.5 and counterfactual("none", conds, spec).noise is None
    assert not math.isnan(counterfactual("grad_b16*4", conds, spec).factor)


def test_a_windowed_replay_starts_from_the_runs_resume_state(small, tmp_path):
    """Replaying from a resume state at t0 is the run from t0 (the replay ends where the run ended) and changes the
    noise over [t0, T] only: a state at T leaves nothing to change; another run's state is refused, named."""
    rd, spec = tmp_path / RUN, run_spec(small, RUN)
    train_ensemble([spec], [rd], progress=False, stop_after=4)   # a checkpoint step (0 1 4 11 16): resume.pt at 4
    shutil.copyfile(rd / "resume.pt", tmp_path / "t0.pt")
    train_ensemble([spec], [rd], progress=False)
    conds = small["noise"]["conditions"]
    df = replay_run(rd, ["none", "self*2"], conds, 2, 4, state=tmp_path / "t0.pt")
    df = df.set_index(["counterfactual", "metric"])
    ood = df.loc[("none", "ood_loss")]
    assert ood.replayed == pytest.approx(ood.observed, rel=1e-6)
    whole = tmp_path / "whole"   # the same run uninterrupted, here: the `run` fixture may have trained under another
    train_ensemble([spec], [whole], progress=False)   # thread count (`iclnoise cnr` sets it): float32 sums an ulp apart
    assert ood.observed == read_parquet(whole / "metrics.parquet").iloc[-1].ood_loss   # resumed training is the run
    d = df["delta"].unstack("metric")
    assert (d.loc["none"].abs() > 0).all()
    assert torch.allclose(torch.tensor(d.loc["none"].values), -torch.tensor(d.loc["self*2"].values), rtol=1e-3)
    assert (replay_run(rd, ["none"], conds, 2, 4, state=rd / "resume.pt").delta == 0).all()   # t0 = T
    other = tmp_path / "other"
    train_ensemble([run_spec(small, "M4-B64-none-s0")], [other], progress=False, stop_after=1)
    with pytest.raises(ValueError, match="not a resume state of"):
        replay_run(rd, ["none"], conds, 2, 4, state=other / "resume.pt")
