"""Typed params sections (iclnoise.core.sections): params.yaml is the single source of truth.

A missing or unknown key is an error naming the section and the key; every section of params.yaml and of
every configs/*.yaml (merged on top, as snakemake does) builds; a dataclass default exists only where the
key declares a `default:` (the generated schema's, same value) or may be absent or null (None); and no module
reads a params key with an inline literal default (`.get("lanczos_iters", 20)`).
"""
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from iclnoise.config import ParamsError, load_params, read_yaml, typed, validate_params
from iclnoise.config.schema import schema
from iclnoise.config.validate import all_sections
from iclnoise.core import sections
from iclnoise.core.keys import meta
from iclnoise.core.probe_sections import ED, Geometry, LLCConfig, Mech, Refined, Stages, Stats
from iclnoise.core.runspec import RunSpec
from iclnoise.core.sections import Controller, Exposure, LRSchedule, NoiseCondition, schema_default
from iclnoise.probes.llc import LLCConfig as LLCConfigFromLLC

pytestmark = pytest.mark.unit

PARAMS = read_yaml("params.yaml")
CONFIGS = sorted(Path("configs").glob("*.yaml"))
PKG = Path(sections.__file__).parent

# section class -> its dict in params.yaml
SECTIONS = {
    Geometry: PARAMS["geometry"], Mech: PARAMS["mech"], Exposure: PARAMS["exposure"], Stats: PARAMS["stats"],
    ED: PARAMS["ed"], LLCConfig: PARAMS["llc"]["sampler"], Stages: PARAMS["llc"]["stages"],
    LRSchedule: PARAMS["train"]["lr_schedule"], NoiseCondition: PARAMS["noise"]["conditions"]["pid"],
    Controller: PARAMS["noise"]["conditions"]["pid"]["controller"], Refined: PARAMS["llc"]["refined"],
}


def _node(path: str) -> dict:
    """The generated schema of section `path` ("llc.sampler"; "*" steps into additionalProperties)."""
    node = schema()
    for part in path.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return node


def _required(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if meta(f)["required"]]


def test_llcconfig_is_the_typed_section_importable_from_llc():
    assert LLCConfigFromLLC is LLCConfig


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_missing_key_raises_naming_section_and_key(cls):
    d = SECTIONS[cls]
    assert cls.from_dict(d)  # the full section builds
    required = _required(cls)
    assert required
    for key in required:
        with pytest.raises(ValueError, match="^" + re.escape(f"{cls.SECTION}.{key} is missing")):
            cls.from_dict({k: v for k, v in d.items() if k != key})


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_an_unknown_key_raises_naming_it(cls):
    with pytest.raises(ValueError, match=r"unknown key\(s\) lanczos_iterz; allowed: "):
        cls.from_dict({**SECTIONS[cls], "lanczos_iterz": 20})
    with pytest.raises(ValueError, match="expected a mapping"):
        cls.from_dict(None)


def test_nbeta_may_be_null_but_not_absent_and_null_means_n_over_log_n():
    d = dict(PARAMS["llc"]["sampler"], nbeta=None, n=1000)
    assert LLCConfig.from_dict(d).resolved_nbeta() == pytest.approx(1000 / 6.907755, rel=1e-6)
    with pytest.raises(ValueError, match="llc.sampler.nbeta is missing"):
        LLCConfig.from_dict({k: v for k, v in d.items() if k != "nbeta"})


def test_values_pass_through_unchanged_and_schema_defaults_fill_only_absent_keys():
    g = Geometry.from_dict(PARAMS["geometry"])
    assert (g.lanczos_iters, g.n_heldout, g.probes) == (PARAMS["geometry"]["lanczos_iters"],
                                                        PARAMS["geometry"]["n_heldout"], PARAMS["geometry"]["probes"])
    s = dict(PARAMS["llc"]["sampler"])
    s.pop("rmsprop_alpha")
    c = LLCConfig.from_dict({**s, "micro_batches": 3})
    assert c.batch == PARAMS["llc"]["sampler"]["batch"] and c.micro_batches == 3
    assert c.rmsprop_alpha == schema()["properties"]["llc"]["properties"]["sampler"]["properties"]["rmsprop_alpha"][
        "default"]
    assert LRSchedule.from_dict({"kind": "triangle", "warmup_frac": 0.5}).min_lr_frac == 0.0


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Geometry.from_dict(PARAMS["geometry"]).probes = 3


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_defaults_come_from_the_schema_or_are_none(cls):
    """No field default duplicates a params value: a default is the schema's own `default:`, or None for a key
    the schema lets be absent; every field is a key of the schema section; a key the schema requires has no
    default unless it may be null (then from_dict still requires it)."""
    path = cls.SCHEMA or cls.SECTION
    props = _node(path)["properties"]
    required = set(_node(path).get("required", ()))
    for f in dataclasses.fields(cls):
        assert f.name in props, (cls.__name__, f.name)
        if f.default is dataclasses.MISSING:
            continue
        if f.default is None:
            assert f.name not in required or "null" in str(props[f.name]), (cls.__name__, f.name)
        else:
            assert f.name not in required and f.default == schema_default(path, f.name), (cls.__name__, f.name)


def test_every_key_the_code_reads_is_required_or_defaulted_by_the_schema():
    """A field without a Python default is a key the schema requires (or that only the cross-field rules
    require for the settings that use it: noise shape/schedule/rank/controller)."""
    for cls in SECTIONS:
        node = _node(cls.SCHEMA or cls.SECTION)
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING:
                assert f.name in node.get("required", ()), (cls.__name__, f.name)


@pytest.mark.parametrize("extra", [None, *CONFIGS], ids=lambda p: str(p or "params.yaml"))
def test_every_section_of_params_and_every_config_builds(extra):
    params = load_params("params.yaml", [extra] if extra else [])
    built = all_sections(params)
    assert {"train.lr_schedule", "stats", "exposure"} <= set(built)
    assert {k for k in built if k.startswith("noise.conditions.")} == {
        f"noise.conditions.{n}" for n in params["noise"]["conditions"]}
    for name in ("geometry", "mech", "ed", "llc"):
        assert (name in built or f"{name}.sampler" in built) == params[name]["enabled"], name
    refined = params["llc"]["enabled"] and params["llc"]["refined"]["enabled"]
    assert ("llc.refined" in built) == refined
    for name, sec in built.items():
        d = params
        for part in name.split("."):
            d = d[part]
        for f in dataclasses.fields(sec):
            if f.name in d and f.name != "controller":
                assert getattr(sec, f.name) == d[f.name], (name, f.name)


def test_validation_rejects_what_the_typed_sections_cannot_build():
    p = read_yaml("params.yaml")
    p["noise"]["conditions"]["grad_b16"].pop("rank")
    with pytest.raises(ParamsError, match="grad_b16.rank is required for shape lowrank"):
        validate_params(p)
    p = read_yaml("params.yaml")
    p["noise"]["conditions"]["pid"].pop("controller")
    with pytest.raises(ParamsError, match="pid.controller is required for schedule controlled"):
        validate_params(p)
    p = read_yaml("params.yaml")
    p["noise"]["conditions"]["pid"]["controller"] = {"kp": 0.5}
    with pytest.raises(ParamsError, match="ki is required"):
        validate_params(p)


def test_noise_condition_absent_keys_are_none_and_the_window_fraction_is_derived():
    none = NoiseCondition.from_dict({"source": "none"})
    assert (none.shape, none.rank, none.schedule, none.budget, none.controller) == (None,) * 5
    early = NoiseCondition.from_dict(PARAMS["noise"]["conditions"]["early"])
    assert early.window_fraction == PARAMS["noise"]["conditions"]["early"]["fraction"]
    assert NoiseCondition.from_dict(PARAMS["noise"]["conditions"]["grad_b16"]).window_fraction == 1.0
    pid = NoiseCondition.from_dict(PARAMS["noise"]["conditions"]["pid"])
    assert isinstance(pid.controller, Controller) and pid.controller.kp == PARAMS["noise"]["conditions"]["pid"][
        "controller"]["kp"]


def test_ed_names_the_retired_sigma_key():
    with pytest.raises(ParamsError, match="ed.sigma .* replaced by ed.bandwidth"):
        ED.from_dict({**PARAMS["ed"], "sigma": 1.0})
    assert typed(PARAMS, "ed") == ED.from_dict(PARAMS["ed"])


def _schema_keys(node) -> set[str]:
    out = set()
    if isinstance(node, dict):
        out |= set(node.get("properties", {}))
        for v in node.values():
            out |= _schema_keys(v)
    elif isinstance(node, list):
        for v in node:
            out |= _schema_keys(v)
    return out


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_literal(node.left) and _is_literal(node.right)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_literal(k) and _is_literal(v) for k, v in zip(node.keys, node.values))
    return False


def inline_defaults(source: str) -> list[tuple[int, str]]:
    """(line, key) of every `<x>.get("<params key>", <literal>)`: a params key read with a default of its own.
    Reads of other data (`opt.state.get(p)`, `e.get("kept", True)`, `shared.get("curv", math.nan)`) do not
    match: their key is not a params key or their fallback is not a literal."""
    keys = _schema_keys(schema())
    hits = []
    for n in ast.walk(ast.parse(source)):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("get", "setdefault", "pop") and len(n.args) == 2
                and isinstance(n.args[0], ast.Constant) and n.args[0].value in keys and _is_literal(n.args[1])):
            hits.append((n.lineno, n.args[0].value))
    return hits


def test_the_checker_finds_inline_defaults_and_ignores_other_data():
    src = ('a = cfg.get("lanczos_iters", 20)\nb = n.get("rank", 8)\nc = s.get("warmup_frac", 0.0)\n'
           'd = cfg.get("kappa")\ne = opt.state.get(p, {})\nf = ev.get("kept", True)\ng = sh.get("kappa", k)\n'
           'h = c.get("batch_sizes", [B])\ni = cfg.get("alpha", -0.05)\nj = t.get("ensemble_runs", 1 << 30)\n')
    assert inline_defaults(src) == [(1, "lanczos_iters"), (2, "rank"), (3, "warmup_frac"), (9, "alpha"),
                                    (10, "ensemble_runs")]


KNOWN: set = set()   # (module, key) pairs allowed to keep an inline default: none


def test_no_module_reads_a_params_key_with_an_inline_default():
    found = [(str(p.relative_to(PKG)), line, key) for p in sorted(PKG.rglob("*.py"))
             for line, key in inline_defaults(p.read_text(encoding="utf-8"))]
    assert [f for f in found if (f[0], f[2]) not in KNOWN] == []


def test_build_hooks_reads_the_typed_sections_and_names_a_missing_key():
    import torch

    from iclnoise.config.grid import run_spec
    from iclnoise.run.member import build_hooks

    p = validate_params(read_yaml("params.yaml"))
    spec = run_spec(p, "M4-B64-late-s0")
    logger, inj = build_hooks(RunSpec.of(spec), torch.device("cpu"))
    T, late = spec["train"]["steps"], p["noise"]["conditions"]["late"]
    assert (logger.name, inj.name, inj.shape, inj.budget) == ("exposure", "injection", "diagonal", late["budget"])
    assert (inj.start, inj.stop) == (T - round(late["fraction"] * T), T)
    assert logger.n_heldout == p["exposure"]["heldout"]
    assert build_hooks(RunSpec.of(run_spec(p, "M4-B64-grad_b16-s0")), torch.device("cpu"))[1].rank == 4
    del spec["exposure"]["heldout"]
    with pytest.raises(ValueError, match="exposure.heldout is missing"):
        RunSpec.of(spec)


def test_run_spec_decides_hooks_window_checkpoints_and_outputs():
    """A run's derived facts, each read from RunSpec (the workflow's train outputs, the trainer's hooks, the
    injector's window): batch noise with exposure logged; the same with exposure off; a late injected arm."""
    import dataclasses

    from iclnoise.config.grid import run_spec, typed_spec

    p = validate_params(read_yaml("params.yaml"))
    plain, late = typed_spec(p, "M4-B64-none-s0"), typed_spec(p, "M4-B64-late-s0")
    base = ["metrics.parquet", "token_losses.parquet", "root_preds.parquet", "checkpoints.json"]
    assert (plain.hooks, plain.window, plain.outputs) == (("exposure",), None, base + ["exposure.parquet"])
    off = {**p, "exposure": {**p["exposure"], "enabled": False}}
    assert typed_spec(off, "M4-B64-none-s0").hooks == () and typed_spec(off, "M4-B64-none-s0").outputs == base
    T, f = late.train.steps, p["noise"]["conditions"]["late"]["fraction"]
    assert late.hooks == ("exposure", "injection") and late.window == (T - round(f * T), T)
    assert late.outputs == base + ["exposure.parquet", "injection.parquet"]
    assert typed_spec(off, "M4-B64-late-s0").hooks == late.hooks   # injection logs exposure whatever `enabled` says
    early = dataclasses.replace(late.noise, schedule="early")
    assert early.window(T) == (0, round(f * T)) and dataclasses.replace(late.noise, schedule="constant").window(T) \
        == (0, T)
    ckpts = plain.train.checkpoints_planned
    assert ckpts[0] == 0 and ckpts[-1] == plain.train.last_step == plain.train.steps
    stopped = run_spec({**p, "train": {**p["train"], "budget": {**p["train"]["budget"], "stop_at": 100}}},
                       "M4-B64-none-s0")
    assert RunSpec.of(stopped).train.checkpoints_planned == [s for s in ckpts if s < 100] + [100]


def test_the_learning_rate_schedule_is_built_once_in_the_typed_section():
    """Train.lr(step) = optimizer.lr × the schedule's factor (warmup then cosine to min_lr_frac); lr_sum is its sum
    over the steps trained, which aggregate's η/B proxy reads."""
    import math

    from iclnoise.config.grid import typed_spec

    p = validate_params(read_yaml("params.yaml"))
    t = typed_spec(p, "M4-B64-none-s0").train
    s, lr, T = t.lr_schedule, t.optimizer.lr, t.steps
    warm = max(1, round(s.warmup_frac * T))
    assert s.kind == "warmup_cosine" and t.lr(0) == pytest.approx(lr / warm) and t.lr(warm - 1) == pytest.approx(lr)
    mid = warm + (T - warm) // 2
    cos = s.min_lr_frac + (1 - s.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * (mid - warm) / (T - warm)))
    assert t.lr(mid) == pytest.approx(lr * cos) and t.lr(T) == pytest.approx(lr * s.min_lr_frac)
    assert t.lr_sum() == pytest.approx(sum(t.lr(i) for i in range(T)), rel=1e-12)


def test_run_keys_are_one_description():
    """RunKeys is a spec's `keys`, a table's leading columns (KEY_FIELDS) and the run id, both ways; RunSpec.of
    refuses a spec whose run_id its keys do not name."""
    from iclnoise.config.grid import run_spec
    from iclnoise.core.runspec import KEY_FIELDS, RunKeys, parse_run_id

    k = parse_run_id("Minf-B16-none-sgd_momentum-s2")
    assert k == RunKeys(-1, 16, "none", 2, "sgd_momentum") and k.run_id == "Minf-B16-none-sgd_momentum-s2"
    assert list(k.to_dict()) == [f.name for f in KEY_FIELDS] and k.to_dict()["M"] == -1
    spec = run_spec(validate_params(read_yaml("params.yaml")), "M4-B64-none-s0")
    assert RunSpec.of(spec).key_dict == spec["keys"]
    with pytest.raises(ValueError, match="keys.run_id is 'M8-B64-none-s0'.*name run 'M4-B64-none-s0'"):
        RunSpec.of({**spec, "keys": {**spec["keys"], "run_id": "M8-B64-none-s0"}})


def test_jobs_are_the_workflows_and_the_cost_models():
    """grid.jobs: one training job per ensemble, one probe job per probed run with its sections, an ED family's two
    jobs, the one-off jobs; cost_estimate's count is theirs (and Snakemake's: test_config's dry runs)."""
    from iclnoise.config.cost import cost_estimate
    from iclnoise.config.grid import ensemble_groups, jobs

    p = validate_params(read_yaml("params.yaml"))
    j = jobs(p)
    assert j["train"] == ensemble_groups(p) and all(k.endswith("-s0") for k in j["probe"])
    assert set(j["probe"]["M16-B64-none-s0"]) == {"llc", "geometry", "mech", "refined"}
    assert "refined" not in j["probe"]["M4-B64-none-s0"] and "refined_figures" in j["single"]
    n = len(j["train"]) + len(j["probe"]) + 2 * len(j["ed"]) + len(j["single"])
    assert cost_estimate(p)["jobs"] == n
