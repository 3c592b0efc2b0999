"""grid.optimizer (issue 45): AdamW's run ids and spec hashes unchanged, SGD with undampened heavy-ball momentum
trained in the same grid with its own κ."""
import copy
import json
from pathlib import Path

import pytest
import torch

from iclnoise.config import validate_params
from iclnoise.config.grid import ensemble_groups, expand_grid, parse_run_id, run_spec, spec_hash
from iclnoise.core.io import read_parquet
from iclnoise.core.sections import ParamsError
from iclnoise.noise.exposure import kappa
from iclnoise.run.train import train_ensemble

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SETS = sorted(p.name for p in (ROOT / "reference").iterdir() if (p / "provenance.json").exists())


@pytest.mark.parametrize("ref", SETS)
def test_committed_reference_runs_keep_their_ids_and_spec_hashes(ref):
    """Every committed run's id is in the grid of its provenance params and its spec hashes as run.json records."""
    d = ROOT / "reference" / ref
    params = json.loads((d / "provenance.json").read_text())["params"]
    ids = {k.run_id for k in expand_grid(params)}
    runs = sorted((d / "runs").iterdir())
    assert len(runs) >= 8
    for r in runs:
        rec = json.loads((r / "run.json").read_text())
        assert r.name in ids
        assert spec_hash(run_spec(params, r.name)) == rec["spec_hash"], r.name


def mixed(tiny):
    p = copy.deepcopy(tiny)
    p["grid"].update(M=[4], seeds=[0], batch_sizes=[16], noise=["none"], optimizer=["adamw", "sgd_momentum"])
    p["train"]["budget"] = {"mode": "steps", "steps": 30}
    p["train"]["sgd_momentum"] = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
    return validate_params(p)


def test_the_axis_adds_labelled_runs_and_leaves_adamws_alone(tiny):
    p = mixed(tiny)
    q = copy.deepcopy(p)
    del q["grid"]["optimizer"], q["train"]["sgd_momentum"]
    q = validate_params(q)
    ids = [k.run_id for k in expand_grid(p)]
    assert ids == ["M4-B16-none-s0", "M4-B16-none-sgd_momentum-s0"]
    assert parse_run_id(ids[1]).optimizer == "sgd_momentum" and parse_run_id(ids[0]).optimizer == "adamw"
    assert spec_hash(run_spec(p, ids[0])) == spec_hash(run_spec(q, ids[0]))   # the sgd section is not AdamW's spec
    sgd = run_spec(p, ids[1])
    assert sgd["train"]["optimizer"] == {"kind": "sgd_momentum", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
    assert sgd["keys"]["run_id"] == ids[1] and "sgd_momentum" not in sgd["train"]
    assert set(ensemble_groups(p)) == {"B16-none", "B16-none-sgd_momentum"}   # one optimizer per ensemble


@pytest.mark.numerics
def test_one_grid_trains_adamw_and_heavy_ball_with_their_own_kappa(tiny, tmp_path):
    """Both runs of the mixed grid train 30 steps and log exposure with κ = 1 (AdamW) and 1/(1 − 0.9)² = 100 (heavy
    ball), the SGD run's with A = I."""
    p = mixed(tiny)
    groups = ensemble_groups(p)
    k = {}
    for g, runs in groups.items():
        specs = [run_spec(p, r) for r in runs]
        train_ensemble(specs, [tmp_path / r for r in runs], progress=False)
        for r in runs:
            e = read_parquet(tmp_path / r / "exposure.parquet")
            k[parse_run_id(r).optimizer] = sorted(set(e.kappa))
            if parse_run_id(r).optimizer == "sgd_momentum":   # no preconditioner: Σ a² C_ii = Tr C
                torch.testing.assert_close(e.trace_aca.to_numpy(), e.trace_c.to_numpy(), rtol=1e-5, atol=0)
            m = read_parquet(tmp_path / r / "metrics.parquet")
            assert m.step.iloc[-1] == 30 and not m.diverged.any() and m.train_loss.iloc[1:].notna().all(), r
    assert k["adamw"] == [1.0] and k["sgd_momentum"] == [pytest.approx(100.0)]
    assert kappa(None, 0.9, "sgd_momentum") == pytest.approx(100.0) and kappa(None, 0.9) == 1.0
    assert kappa(2.0, 0.9, "sgd_momentum") == 2.0


@pytest.mark.numerics
def test_the_ensemble_steps_the_heavy_ball_recursion(tiny, tmp_path):
    """Two steps of an sgd_momentum run (constant lr, no clipping, weight decay 0.01) against the recursion by hand,
    v_1 = g_0 + λ w_0, v_2 = β v_1 + g_1 + λ w_1, w_t = w_{t−1} − η v_t, from the gradients of the run's own batches:
    the weights after step 2 agree to float32 round-off (AdamW's step would move them by ~η per coordinate)."""
    from iclnoise.core.model import ModelConfig, build_model, mse_loss
    from iclnoise.core.runspec import RunSpec
    from iclnoise.run.runs import checkpoint_path, sampler

    p = mixed(tiny)
    p["train"].update(budget={"mode": "steps", "steps": 2}, checkpoints={"linear": 1, "log": 0}, grad_clip=None,
                      lr_schedule={"kind": "constant"}, sgd_momentum={"lr": 0.05, "momentum": 0.9,
                                                                     "weight_decay": 0.01})
    p["exposure"]["enabled"] = p["ed"]["enabled"] = False
    spec = run_spec(validate_params(p), "M4-B16-none-sgd_momentum-s0")
    train_ensemble([spec], [tmp_path / "r"], progress=False)
    rs = RunSpec.of(spec)
    model = build_model(ModelConfig(D=rs.data.D, K=rs.data.K, **spec["model"]), 0)
    model.load_state_dict(torch.load(checkpoint_path(tmp_path / "r", 0))["model"])
    data, v = sampler(rs, "train"), None
    for step in range(2):
        b = data.batch(step, 16)
        model.zero_grad()
        mse_loss(model, b.xs, b.ys).backward()
        with torch.no_grad():
            g = [q.grad + 0.01 * q for q in model.parameters()]
            v = g if v is None else [0.9 * a + c for a, c in zip(v, g)]
            for q, a in zip(model.parameters(), v):
                q -= 0.05 * a
    ours = torch.load(checkpoint_path(tmp_path / "r", 2))["model"]
    for n, q in model.named_parameters():
        torch.testing.assert_close(ours[n], q.detach(), rtol=1e-4, atol=1e-6, msg=n)


def test_validation_names_the_optimizer_keys(tiny):
    p = mixed(tiny)
    q = copy.deepcopy(p)
    del q["train"]["sgd_momentum"]
    with pytest.raises(ParamsError, match="train.sgd_momentum is missing"):
        validate_params(q)
    q = copy.deepcopy(p)
    q["exposure"]["kappa"] = "calibrated"
    with pytest.raises(ParamsError, match="calibrated"):
        validate_params(q)
    q = copy.deepcopy(p)
    q["exposure"]["kappa"] = 1.0
    with pytest.raises(ParamsError, match="same κ"):
        validate_params(q)
    q = copy.deepcopy(p)
    q["grid"]["optimizer"] = ["nap"]
    with pytest.raises(ParamsError):
        validate_params(q)


def test_the_cost_model_counts_each_optimizers_runs_and_ensembles(tiny):
    """grid.optimizer doubles the runs, the training steps and the training jobs (one ensemble per optimizer) at the
    same per-step rate (bench/bench_noise.py: sgd_momentum 1.01x AdamW's step)."""
    from iclnoise.config.cost import cost_estimate

    p = mixed(tiny)
    q = copy.deepcopy(p)
    q["grid"]["optimizer"] = ["adamw"]
    two, one = cost_estimate(p), cost_estimate(q)
    assert two["runs"] == 2 * one["runs"] and two["run_steps"] == 2 * one["run_steps"]
    assert two["jobs"] - one["jobs"] >= 1
    assert two["train_core_hours"] == pytest.approx(2 * one["train_core_hours"], rel=1e-9)
