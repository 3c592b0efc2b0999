"""A relative dose (noise.conditions.*.relative_dose): a budget written as a multiple of the batch noise's own
integrated P-NE* at the run's batch (noise.batch_exposure), resolved in the run spec (issue 64 item 4)."""
import copy
import json
from pathlib import Path

import pytest

from iclnoise.config import ParamsError, load_params, validate_params
from iclnoise.config.grid import expand_grid, run_spec, spec_hash

pytestmark = pytest.mark.unit


def dose_params(**condition):
    p = load_params("params.yaml", ["configs/science.yaml", "configs/dose.yaml"])
    p = copy.deepcopy(p)
    p["noise"]["conditions"]["trial"] = {"source": "param", "shape": "diagonal", "schedule": "constant",
                                         "batch_sizes": [64], "M": [16], **condition}
    p["grid"]["noise"] = [*p["grid"]["noise"], "trial"]
    return p


def test_a_relative_dose_is_the_budget_it_multiplies_out_to():
    """0.3 × 0.055 resolves to the budget 0.0165 exactly (12 significant digits), so the spec and its hash equal
    those of the hand-written budget; relative_dose itself is not in the spec."""
    rel, hand = dose_params(relative_dose=0.3), dose_params(budget=0.0165)
    a, b = run_spec(validate_params(rel), "M16-B64-trial-s0"), run_spec(validate_params(hand), "M16-B64-trial-s0")
    assert a["noise"]["budget"] == 0.0165 and "relative_dose" not in a["noise"]
    assert a == b and spec_hash(a) == spec_hash(b)
    assert 0.1 * 0.055 != 0.0055 and run_spec(validate_params(dose_params(relative_dose=0.1)),   # float round-off
                                              "M16-B64-trial-s0")["noise"]["budget"] == 0.0055


@pytest.mark.parametrize("ref, configs, n", [
    ("science", ["configs/science.yaml"], 54),
    ("noise", ["configs/science.yaml", "configs/noise.yaml"], 90),
    ("align", ["configs/science.yaml", "configs/align.yaml"], 75),
    ("dose", ["configs/science.yaml", "configs/dose.yaml"], 234),
])
def test_the_committed_configs_reproduce_the_reference_runs_specs(ref, configs, n):
    """Every run of every reference set has the spec hash its committed configs give it now: configs/dose.yaml and
    align.yaml write their doses as relative doses (hand-multiplied budgets when they trained), and
    configs/science.yaml pins the curvature its experiments trained with (params.yaml's default changed)."""
    p = load_params("params.yaml", configs)
    ids = {k.run_id for k in expand_grid(p)}
    runs = sorted(Path(f"reference/{ref}/runs").iterdir())
    assert len(runs) == n
    for d in runs:
        stored = json.loads((d / "run.json").read_text())
        assert d.name in ids and spec_hash(run_spec(p, d.name)) == stored["spec_hash"], d.name


@pytest.mark.parametrize("condition, batch_exposure, message", [
    ({"relative_dose": 1.0}, None, "relative_dose needs noise.batch_exposure at every batch size the condition "
                                   "runs at; missing: 64"),
    ({"relative_dose": 1.0}, {"16": 0.8}, "missing: 64"),
    ({"relative_dose": 1.0, "budget": 0.05}, {"64": 0.055}, "needs exactly one of emulate_batch, budget, "
                                                            "relative_dose (got budget, relative_dose)"),
    ({"relative_dose": 1.0, "schedule": "controlled", "controller": {"kp": 0.1, "ki": 0.01}}, {"64": 0.055},
     "schedule controlled needs exactly one of target (got relative_dose)"),
    ({"relative_dose": -1.0}, {"64": 0.055}, "relative_dose = -1.0 is not allowed; it must be > 0"),
    ({"relative_dose": 1.0}, {"64": 0.0}, "noise.batch_exposure.64 = 0.0 is not allowed; it must be > 0"),
])
def test_bad_relative_doses_name_the_key(condition, batch_exposure, message):
    p = dose_params(**condition)
    p["noise"].pop("batch_exposure", None)
    if batch_exposure is not None:
        p["noise"]["batch_exposure"] = batch_exposure
    with pytest.raises(ParamsError, match=None) as e:
        validate_params(p)
    assert message in str(e.value), str(e.value)
