"""Invalid parameters are rejected with a message that names the key and what is allowed."""
import copy

import pytest
import yaml

from iclnoise.config import ParamsError, expand_grid, parse_run_id, run_spec, validate_params


@pytest.fixture(scope="module")
def params():
    with open("params.yaml") as f:
        return validate_params(yaml.safe_load(f))


def bad(params, path, value):
    p = copy.deepcopy(params)
    node = p
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    return str(e.value)


@pytest.mark.parametrize("path,value,expect", [
    (("train", "lr_schedule", "kind"), "cyclic", ["train.lr_schedule.kind", "constant", "warmup_cosine", "triangle"]),
    (("grid", "M"), [0, 4], ["grid.M.0", "inf"]),
    (("grid", "M"), [4, "many"], ["grid.M.1", "inf"]),
    (("grid", "noise"), ["loud"], ["grid.noise", "noise.conditions", "none"]),
    (("grid", "batch_sizes"), [96], ["grid.batch_sizes", "micro_batch"]),
    (("train", "optimizer", "lr"), -1.0, ["train.optimizer.lr", "> 0"]),
    (("train", "device"), "tpu", ["train.device", "auto", "cpu", "cuda"]),
    (("eval", "icl_tokens"), [8, 2], ["eval.icl_tokens", "k_early < k_late"]),
    (("model", "n_heads"), 3, ["model.d_model", "model.n_heads"]),
    (("data", "typo_key"), 1, ["data", "typo_key", "allowed keys"]),
])
def test_rejections_name_the_key_and_the_allowed_values(params, path, value, expect):
    msg = bad(params, path, value)
    for fragment in expect:
        assert fragment in msg, msg


def test_budget_modes(params):
    p = copy.deepcopy(params)
    p["train"]["budget"] = {"mode": "sequences", "sequences": 64 * 100}
    validate_params(p)
    assert run_spec(p, "M4-B16-none-s0")["train"]["steps"] == 400
    assert run_spec(p, "M4-B64-none-s0")["train"]["steps"] == 100
    p["train"]["budget"] = {"mode": "sequences"}
    with pytest.raises(ParamsError, match="train.budget.sequences"):
        validate_params(p)


def test_grid_and_run_ids(params):
    runs = expand_grid(params)
    g = params["grid"]
    conds = params["noise"]["conditions"]
    pairs = [(B, n) for B in g["batch_sizes"] for n in g["noise"] if B in conds[n].get("batch_sizes", [B])]
    assert len(runs) == len(g["M"]) * len(g["seeds"]) * len(pairs)
    assert {(k.batch, k.noise) for k in runs} == set(pairs) and (16, "grad_b16") not in pairs  # restricted to B=64
    for k in runs:
        assert parse_run_id(k.run_id) == k
    assert parse_run_id("Minf-B32-none-s1").M == -1
    spec = run_spec(params, "M16-B16-none-s1")
    assert spec["keys"] == {"run_id": "M16-B16-none-s1", "M": 16, "seed": 1, "batch": 16, "noise": "none"}
    assert spec["train"]["micro_batch"] == 16


@pytest.mark.parametrize("edit, key, allowed", [
    (lambda p: p["noise"]["conditions"]["early"].pop("budget"), "noise.conditions.early", "budget"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(shape="spiky"), "noise.conditions.grad_b16.shape", "lowrank"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(source="both"), "noise.conditions.grad_b16.source", "param"),
    (lambda p: p["noise"]["conditions"]["late"].update(schedule="middle"), "noise.conditions.late.schedule", "controlled"),
    (lambda p: p["exposure"].update(groups=6), "exposure.groups", "divisor"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(rank=8), "noise.conditions.grad_b16.rank", "rank ≤ 7"),
    (lambda p: p["noise"]["conditions"]["none"].update(shape="diagonal"), "noise.conditions.none", "no other keys"),
])
def test_noise_and_exposure_errors_name_the_key(params, edit, key, allowed):
    p = copy.deepcopy(params)
    edit(p)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    assert key in str(e.value) and allowed in str(e.value), str(e.value)
