"""Counterfactual noise replay of a run directory (iclnoise.replay): the replay is the run, the linearised step is
AdamW's, paired draws make the prediction linear in the covariance change, bad counterfactuals are refused."""
import json
import math

import pytest
import torch

from iclnoise.cli import main
from iclnoise.ensemble import Ensemble, Member
from iclnoise.figures.cnr import fig_cnr
from iclnoise.grid import run_spec, spec_hash
from iclnoise.injection import NoiseInjector
from iclnoise.io import read_parquet
from iclnoise.replay import CNR_SCHEMA, METRICS, Replayer, counterfactual, step_preconditioner
from iclnoise.sections import RunSpec
from iclnoise.train import train_run

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
    main(["cnr", str(run), "--counterfactual", *names, "--cfg", cfg, "--probes", "3", "--jac-batch", "4"])
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
        main(["cnr", str(run), "--counterfactual", "none", "nope", "--cfg", cfg])
    assert len(read_parquet(run / "cnr.parquet", CNR_SCHEMA)) == len(df)


class _StepCheck(Replayer):
    """Compares the linearised step at the recorded state with the step AdamW really took (full batch)."""

    errors: list

    def on_update(self, ctx):
        now = self.now
        now["clip"], now["a_step"] = ctx.clip_coef, step_preconditioner(ctx.adam)
        x = torch.cat([now["theta"], now["m"]])
        got = self._phi(now)(x)[:self.P]
        real = torch.cat([p.detach().reshape(-1) for p in ctx.model.parameters()])
        live = now["a_step"] > 0   # a = 0 on round-off coordinates (iclnoise.adam): no curvature, no linear term
        got, real, now = got[live], real[live], {**now, "theta": now["theta"][live]}
        step = (real - now["theta"]).norm()
        # float32 rounding of θ + step: ≈ eps/2 · ‖θ‖ next to ‖step‖ (θ ≫ one step), the rest is the gradient's
        self.errors.append(float((got - real).norm() / step) / (4 * 2.0 ** -24 * float(real.norm() / step) + 1e-5))
        super().on_update(ctx)


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
    # the same step as AdamW's (the injected parameter noise comes after it), up to float32 rounding (error / bound),
    # from step 1: at step 0 AdamW's step is g/(|g| + ε), whose derivative ε/(|g| + ε)² (up to 1/(4ε)) magnifies the
    # gradient's own float32 reduction order on coordinates where |g| ~ ε; that order is the kernels' (1.10x the
    # bound under ATEN_CPU_CAPABILITY=default), which θ's rounding does not bound (test_engine exempts step 0 alike)
    assert len(check.errors) == spec.train.steps
    assert max(check.errors[1:]) < 1, check.errors


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
    assert counterfactual("self*0.5", conds, spec).factor == 0.5 and counterfactual("none", conds, spec).noise is None
    assert not math.isnan(counterfactual("grad_b16*4", conds, spec).factor)
