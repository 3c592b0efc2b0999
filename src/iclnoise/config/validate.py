"""params.yaml's one gate: the schema generated from the typed sections (iclnoise.config.schema; JSON Schema 2020-12,
integers must be ints) and the cross-field rules. Every invalid value is rejected with a message naming the key and
what is allowed, before any job starts (the Snakefile calls it at parse time, through iclnoise.config.load_params).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from typing import Any

import jsonschema

from ..core.keys import M_MAX, NAME, meta
from ..core.probe_sections import ED, Geometry, LLCConfig, Mech, Refined, Stages, Stats
from ..core.runspec import parse_m
from ..core.sections import Exposure, LRSchedule, NoiseCondition, ParamsError, Section, TaskPrior, Train, enabled
from .cost import check_memory
from .grid import expand_grid, grid_ms, run_spec
from .schema import schema


def dotted_key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "a mapping", "null": "null"}


def _is_integer(checker, instance) -> bool:
    """JSON Schema counts 4.0 as an integer; a params file must write 4."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    return _Validator(schema())


def _switchable(s: dict) -> bool:
    return "enabled" in (s.get("properties") or {})


def _option(o: dict) -> str:
    """One simple anyOf option in words: 'auto', an integer >= 1."""
    if "const" in o:
        return repr(o["const"])
    return _TYPE_WORDS[o["type"]] + (f" >= {o['minimum']}" if "minimum" in o else "")


def _describe(err: jsonschema.ValidationError) -> str:
    key = dotted_key(err.absolute_path)
    s = err.schema if isinstance(err.schema, dict) else {}
    if err.validator == "enum":
        return f"{key} = {err.instance!r} is not allowed; allowed values: {', '.join(map(str, s['enum']))}"
    if err.validator == "additionalProperties":
        allowed = ", ".join(sorted(s.get("properties", {})))
        extra = sorted(set(err.instance) - set(s.get("properties", {})))
        return f"{key}: unknown key(s) {', '.join(extra)}; allowed keys: {allowed}"
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        name = ".".join(str(p) for p in [*err.absolute_path, missing[0]]) if missing else key
        sub = (s.get("properties") or {}).get(missing[0], {}) if missing else {}
        if not err.absolute_path:  # a whole section
            off = f"; to switch it off write `{name}: {{enabled: false}}`" if _switchable(sub) else ""
            return (f"{name}: section missing; allowed: every section is required (a missing one would silently "
                    f"drop its part of the pipeline){off}")
        off = f" (or `{key}.enabled: false` to switch the section off)" if _switchable(s) else ""
        return f"{name} is required; allowed: the keys {', '.join(err.validator_value)}{off}"
    if err.validator == "anyOf" and err.absolute_path and "M" in list(err.absolute_path):
        return f"{key} = {err.instance!r} is not allowed; M must be an integer 1 <= M <= {M_MAX} (2^20) or 'inf'"
    if err.validator == "anyOf" and all(set(o) <= {"type", "minimum", "const"} for o in err.validator_value):
        return f"{key} = {err.instance!r} is not allowed; allowed: {' or '.join(map(_option, err.validator_value))}"
    if err.validator == "type":
        types = [err.validator_value] if isinstance(err.validator_value, str) else list(err.validator_value)
        want = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
        hint = (f" (write {int(err.instance)}, not {err.instance!r})"
                if "integer" in types and isinstance(err.instance, float) and err.instance.is_integer() else "")
        if "number" in types and isinstance(err.instance, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+",
                                                                              err.instance):
            hint = f" (YAML reads {err.instance} as a string: write it with a dot, e.g. 1.0e-8)"
        return f"{key} = {err.instance!r} is not allowed; it must be {want}{hint}"
    if err.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[err.validator]
        return f"{key} = {err.instance!r} is not allowed; it must be {op} {err.validator_value}"
    if err.validator == "pattern":
        hint = " (1-32 lowercase letters, digits, _)" if err.validator_value == NAME else ""
        return f"{key} = {err.instance!r} is not allowed; it must match {err.validator_value}{hint}"
    desc = s.get("description", "")
    return f"{key}: {err.message}" + (f" (allowed: {desc})" if desc else "")


def _non_finite(node: Any, path: list) -> list[tuple[list, float]]:
    """(path, value) of every NaN or ±inf number in a parsed params tree."""
    if isinstance(node, float):
        return [] if math.isfinite(node) else [(path, node)]
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _non_finite(v, path + [k])]
    if isinstance(node, (list, tuple)):
        return [x for i, v in enumerate(node) for x in _non_finite(v, path + [i])]
    return []


def _switched_off(err: jsonschema.ValidationError) -> bool:
    """A `required` error inside a section that says `enabled: false`: its other keys may be left out."""
    return (err.validator == "required" and isinstance(err.instance, dict) and err.instance.get("enabled") is False
            and bool(err.absolute_path) and _switchable(err.schema))


def validate_params(params: dict) -> dict:
    """Check `params` against the schema (JSON Schema 2020-12; integers must be ints) and the cross-field
    rules (finite numbers, seeds, sizes, noise conditions); return it unchanged."""
    if not isinstance(params, dict):
        raise ParamsError("params.yaml must be a mapping of sections (grid, data, model, train, eval, noise, ...)")
    errors = [e for e in _validator().iter_errors(params) if not _switched_off(e)]
    listed = {tuple(e.absolute_path) for e in errors if e.validator == "enum"}   # names the allowed values already
    errors = [e for e in errors if not (e.validator == "type" and tuple(e.absolute_path) in listed)]
    errors.sort(key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    # NaN passes the schema's bounds: a non-finite number is named here, unless no number belongs there at all
    # (`--config data=nan`: the schema says data must be a mapping)
    no_number = {tuple(e.absolute_path) for e in errors if e.validator == "type" and not {"number", "integer"}
                 & ({e.validator_value} if isinstance(e.validator_value, str) else set(e.validator_value))}
    bad = [(p, v) for p, v in _non_finite(params, []) if tuple(p) not in no_number]
    lines = [f"{dotted_key(p)} = {v!r} is not allowed; allowed: a finite number"
             + (" (M = ∞ is written inf, a string)" if p[:2] == ["grid", "M"] else "") for p, v in bad]
    lines += [_describe(e) for e in errors if list(e.absolute_path) not in [p for p, _ in bad]]
    if lines:
        raise ParamsError("invalid params:\n  - " + "\n  - ".join(lines[:10]))
    _cross_checks(params)
    return params


def validate_condition(c: dict, spec: dict, name: str = "counterfactual") -> dict:
    """One noise condition for the run of `spec` (a run spec: a counterfactual's, iclnoise.run.crn): the schema's
    noise.conditions.* and the cross-field rules, as params.yaml's would be at the run's M, batch, exposure and
    training budget; return it unchanged."""
    noise = {"conditions": {name: c}}
    errors = sorted(_Validator(schema()["properties"]["noise"]).iter_errors(noise), key=lambda e: list(e.path))
    if errors:
        raise ParamsError("invalid noise condition:\n  - " + "\n  - ".join(_describe(e) for e in errors[:10]))
    k = spec["keys"]
    _noise_checks({"grid": {"noise": [name], "M": [k["M"]], "batch_sizes": [k["batch"]]}, "noise": noise,
                   "exposure": spec.get("exposure") or {}, "train": spec["train"]})
    return c


def _prior_checks(d: dict) -> None:
    """data.task_prior: its spectrum fits data.D."""
    if d.get("task_prior") is not None:
        from ..core.tasks import prior_spectrum  # here, not above: the Snakefile validates params without torch

        prior_spectrum(TaskPrior.from_dict(d["task_prior"]), d["D"])


def _cross_checks(p: dict) -> None:
    t, m, d = p["train"], p["model"], p["data"]
    budget = t["budget"]
    if budget["mode"] not in budget:
        raise ParamsError(f"train.budget.mode = {budget['mode']!r} needs train.budget.{budget['mode']} to be set")
    for B in p["grid"]["batch_sizes"]:
        mb = min(t["micro_batch"], B)
        if B % mb:
            raise ParamsError(f"grid.batch_sizes: batch {B} is not divisible by train.micro_batch = "
                              f"{t['micro_batch']}; "
                              f"allowed: batch sizes that are multiples of the micro-batch (or smaller than it)")
        if budget["mode"] == "sequences" and budget["sequences"] < B:
            raise ParamsError(f"train.budget.sequences = {budget['sequences']} is smaller than batch {B}; "
                              f"allowed: at least one full batch")
    if m["d_model"] % m["n_heads"]:
        raise ParamsError(f"model.d_model = {m['d_model']} is not divisible by model.n_heads = {m['n_heads']}")
    k1, k2 = p["eval"]["icl_tokens"]
    if not (1 <= k1 < k2 <= d["K"]):
        raise ParamsError(f"eval.icl_tokens = {[k1, k2]} is not allowed; "
                          f"need 1 <= k_early < k_late <= data.K = {d['K']}")
    pos = ((p.get("llc") or {}).get("refined") or {}).get("positions") or []
    if any(k >= d["K"] for k in pos):
        raise ParamsError(f"llc.refined.positions = {pos} is not allowed; allowed: 0-based positions < data.K = "
                          f"{d['K']}")
    ref = (p.get("llc") or {}).get("refined") or {}
    if ref.get("enabled") and {parse_m(M) for M in ref.get("M") or []} - {parse_m(M) for M in p["grid"]["M"]}:
        warnings.warn(f"llc.refined.M = {ref['M']} names task-pool sizes grid.M = {p['grid']['M']} does not train: "
                      f"the refined LLC covers only the probed runs of the others", stacklevel=2)
    conditions = p["noise"]["conditions"]
    unknown = [n for n in p["grid"]["noise"] if n not in conditions]
    if unknown:
        raise ParamsError(f"grid.noise: {unknown} not defined; allowed: the names under noise.conditions "
                          f"({', '.join(sorted(conditions))})")
    _prior_checks(d)
    _seed_checks(p)
    _noise_checks(p)
    _optimizer_checks(p)
    _ed_checks(p)   # after the noise and optimizer checks: it resolves every run's spec
    check_memory(p)
    try:  # the typed sections (iclnoise.core.sections) build from what the schema let through
        all_sections(p)
    except ValueError as e:
        raise ParamsError(str(e)) from None


def all_sections(params: dict) -> dict[str, Section]:
    """Every typed section of a validated params dict (switched-off sections left out): proves that the
    dataclasses and the schema agree, e.g. for `iclnoise check`."""
    out: dict[str, Section] = {"train.lr_schedule": LRSchedule.from_dict(params["train"]["lr_schedule"]),
                               "stats": Stats.from_dict(params["stats"])}
    for name, cond in params["noise"]["conditions"].items():
        out[f"noise.conditions.{name}"] = NoiseCondition.from_dict(cond)
    if "groups" in params["exposure"]:  # the full section (enabled or not: injection measures with it)
        out["exposure"] = Exposure.from_dict(params["exposure"])
    if enabled(params["llc"]):
        out["llc.sampler"] = LLCConfig.from_dict(params["llc"]["sampler"])
        out["llc.stages"] = Stages.from_dict(params["llc"]["stages"])
        if enabled(params["llc"].get("refined")):
            out["llc.refined"] = Refined.from_dict(params["llc"]["refined"])
    for name, cls in (("geometry", Geometry), ("mech", Mech), ("ed", ED)):
        if enabled(params[name]):
            out[name] = cls.from_dict(params[name])
    return out


PROBE_SECTIONS = ("llc", "geometry", "mech", "ed")


def _seed_checks(p: dict) -> None:
    grid = p["grid"]["seeds"]
    for name in PROBE_SECTIONS:
        sec = p.get(name) or {}
        missing = [s for s in sec.get("seeds") or [] if s not in grid]
        if sec.get("enabled") and missing:
            raise ParamsError(f"{name}.seeds = {sec['seeds']}: seed(s) {missing} not in grid.seeds = {grid}; allowed: "
                              f"a subset of grid.seeds (those runs do not exist and would be skipped silently)")


MAX_CHECKPOINTS = 2000  # per run: each is a file, a row, and for the probes an estimate


def _ed_checks(p: dict) -> None:
    """Checkpoint counts the probes can use, and the ED section's own consistency. (A grid where some or all
    families would hold one run is allowed: the workflow names those families in its log.)"""
    c = p["train"]["checkpoints"]
    n = [len(Train.from_dict(run_spec(p, k.run_id)["train"]).checkpoints_planned) for k in expand_grid(p)]
    if max(n) > MAX_CHECKPOINTS:
        raise ParamsError(f"train.checkpoints = {c}: {max(n)} checkpoints per run; allowed: at most "
                          f"{MAX_CHECKPOINTS} (lower linear or log)")
    ed = p.get("ed") or {}
    if not ed.get("enabled"):
        return
    if ed["n_form_pcs"] > ed["n_pcs"]:
        raise ParamsError(f"ed.n_form_pcs = {ed['n_form_pcs']} > ed.n_pcs = {ed['n_pcs']}: forms are read in the "
                          f"leading PCs the PCA keeps; allowed: n_form_pcs <= n_pcs")
    if min(n) < ed["n_pcs"] + 2:
        raise ParamsError(f"train.checkpoints = {c} gives {min(n)} checkpoints per run; essential dynamics needs at "
                          f"least ed.n_pcs + 2 = {ed['n_pcs'] + 2} (raise linear or log, or ed.enabled: false)")


_EXPOSURE_KEYS = [f.name for f in dataclasses.fields(Exposure) if meta(f)["required"] and f.name != "enabled"]
# which level key each schedule takes (method §5; iclnoise.noise)
_LEVELS = {"constant": ("emulate_batch", "budget", "relative_dose"), "early": ("budget", "relative_dose"),
           "late": ("budget", "relative_dose"), "controlled": ("target",)}


def _noise_checks(p: dict) -> None:
    exp = p.get("exposure") or {}
    used = {n: p["noise"]["conditions"][n] for n in p["grid"]["noise"]}
    if exp.get("enabled") and not exp.get("per_example"):
        for B in p["grid"]["batch_sizes"]:
            if B % exp["groups"]:
                raise ParamsError(f"exposure.groups = {exp['groups']} does not divide batch {B}; allowed: a divisor "
                                  f"of every grid.batch_sizes value (or exposure.per_example: true)")
    for name, c in p["noise"]["conditions"].items():
        key = f"noise.conditions.{name}"
        if name in used and "batch_sizes" in c and not set(c["batch_sizes"]) & set(p["grid"]["batch_sizes"]):
            raise ParamsError(f"{key}.batch_sizes = {c['batch_sizes']} shares no value with grid.batch_sizes = "
                              f"{p['grid']['batch_sizes']}; the condition would have no runs")
        if name in used and "M" in c and not set(map(parse_m, c["M"])) & set(grid_ms(p)):
            raise ParamsError(f"{key}.M = {c['M']} shares no value with grid.M = {p['grid']['M']}; "
                              f"the condition would have no runs")
        if "steps_as_batch" in c and p["train"]["budget"]["mode"] != "sequences":
            raise ParamsError(f"{key}.steps_as_batch needs train.budget.mode: sequences (with a budget in steps "
                              f"every run already trains the same steps)")
        if c["source"] == "none":
            extra = sorted(set(c) - {"source", "batch_sizes", "M", "steps_as_batch"})
            if extra:
                raise ParamsError(f"{key}: source none takes no other keys than steps_as_batch (batch noise at "
                                  f"another batch's steps), got {', '.join(extra)}")
            continue
        if name in used and "groups" not in exp:
            raise ParamsError(f"{key}: injected noise needs the full exposure section (it measures the covariance); "
                              f"allowed: exposure with its keys ({', '.join(_EXPOSURE_KEYS)}), enabled true or false")
        for k in ("shape", "schedule"):
            if k not in c:
                raise ParamsError(f"{key}.{k} is required for source {c['source']}")
        allowed = _LEVELS[c["schedule"]]
        given = [k for k in ("emulate_batch", "budget", "relative_dose", "target") if k in c]
        if len(given) != 1 or given[0] not in allowed:
            raise ParamsError(f"{key}: schedule {c['schedule']} needs exactly one of {', '.join(allowed)}"
                              f" (got {', '.join(given) or 'none'})")
        if c["schedule"] in ("early", "late") and "fraction" not in c:
            raise ParamsError(f"{key}.fraction is required for schedule {c['schedule']} (0 < f ≤ 1)")
        if c["schedule"] == "controlled" and name in used and not exp.get("enabled"):
            raise ParamsError(f"{key}: schedule controlled needs exposure.enabled: true (it measures P-NE*)")
        if c["shape"] == "lowrank" and "rank" not in c:
            raise ParamsError(f"{key}.rank is required for shape lowrank (the rank of the low-rank part)")
        _nap_checks(p, key, c)
        if c["schedule"] == "controlled" and "controller" not in c:
            raise ParamsError(f"{key}.controller is required for schedule controlled; allowed: {{kp: …, ki: …}} "
                              f"(PI gains on log P-NE*)")
        if c["shape"] == "lowrank" and name in used and not exp.get("per_example") and c["rank"] >= exp["groups"]:
            raise ParamsError(f"{key}.rank = {c['rank']} is not allowed; with exposure.groups = "
                              f"{exp['groups']} the covariance has rank ≤ {exp['groups'] - 1}")
        runs_at = [B for B in p["grid"]["batch_sizes"] if B in c.get("batch_sizes", [B])]
        have = p["noise"].get("batch_exposure") or {}
        if "relative_dose" in c and name in used and [B for B in runs_at if str(B) not in have]:
            raise ParamsError(f"{key}.relative_dose needs noise.batch_exposure at every batch size the condition runs "
                              f"at; missing: {', '.join(str(B) for B in runs_at if str(B) not in have)} (the batch "
                              f"noise's integrated P-NE* there, measured on runs without injection, e.g. "
                              f"\"64\": 0.055)")
        if "emulate_batch" in c and name in used and runs_at and c["emulate_batch"] >= min(runs_at):
            warnings.warn(f"{key}.emulate_batch = {c['emulate_batch']} is not below every batch size; the "
                          f"negative residual is clipped to zero and logged (injection.parquet clipped_trace)")
    _one_window_per_series(used, p["grid"]["batch_sizes"])


def _one_window_per_series(used: dict, batch_sizes: list[int]) -> None:
    """A dose series is one source, shape and schedule (iclnoise.analysis.dose.SERIES; method §11, Dose–response):
    its windowed conditions at ≥ 2 doses must switch the noise at one fraction, or arms with different windows
    would be read as one series (and two at the same dose as one level)."""
    series: dict[tuple, list[str]] = {}
    for name, c in used.items():
        if c.get("schedule") in ("early", "late") and c.get("source") not in (None, "none"):
            for B in (B for B in batch_sizes if B in c.get("batch_sizes", [B])):
                series.setdefault((c["source"], c.get("shape"), c["schedule"], B), []).append(name)
    for (src, shape, schedule, B), names in series.items():
        doses = {(k, used[n][k]) for n in names for k in ("budget", "relative_dose") if k in used[n]}
        windows = sorted({used[n]["fraction"] for n in names})
        if len(doses) >= 2 and len(windows) >= 2:
            raise ParamsError(f"noise.conditions {', '.join(names)} form one dose series ({src}, {shape}, {schedule}, "
                              f"batch {B}) but switch the noise at fractions {', '.join(map(str, windows))}; a "
                              f"series has one window: give them one fraction, or run the arms in separate grids")


_NAP_KEYS = ("rank", "nap_tasks", "nap_per_task", "nap_memory")


def _nap_checks(p: dict, key: str, c: dict) -> None:
    """A NAP shape (iclnoise.noise.nap) has its keys, a level the closed loop sets, rank < nap_tasks (Σ_b of J tasks has
    rank ≤ J − 1) and runs where the batch can hold two tasks (M = 1 has no between-task covariance)."""
    nap = c["shape"].startswith("nap")
    given = [k for k in _NAP_KEYS[1:] if k in c]
    if not nap:
        if given:
            raise ParamsError(f"{key}: {', '.join(given)} apply to the nap shapes only (shape is {c['shape']})")
        return
    missing = [k for k in _NAP_KEYS if k not in c]
    if missing:
        raise ParamsError(f"{key}: shape {c['shape']} needs {', '.join(missing)} (iclnoise.noise.nap)")
    if "emulate_batch" in c:
        raise ParamsError(f"{key}: shape {c['shape']} takes a budget or a target, not emulate_batch (its covariance is "
                          f"the task family's, not the batch noise's)")
    if c["rank"] >= c["nap_tasks"]:
        raise ParamsError(f"{key}.rank = {c['rank']} must be < nap_tasks = {c['nap_tasks']} (the between-task "
                          f"covariance of J tasks has rank ≤ J − 1)")
    if 1 in map(parse_m, c.get("M", p["grid"]["M"])):
        raise ParamsError(f"{key}: shape {c['shape']} cannot run at M = 1 (one task: no between-task covariance); "
                          f"give the condition an M list without 1")


def _optimizer_checks(p: dict) -> None:
    """grid.optimizer's settings exist, and κ is each optimizer's own (iclnoise.noise.exposure.kappa)."""
    opts = p["grid"].get("optimizer") or ["adamw"]
    if "sgd_momentum" not in opts:
        return
    if "sgd_momentum" not in p["train"]:
        raise ParamsError("grid.optimizer has sgd_momentum but train.sgd_momentum is missing; allowed: "
                          "train.sgd_momentum: {lr: …, momentum: …, weight_decay: …}")
    k = (p.get("exposure") or {}).get("kappa")
    if k == "calibrated":
        raise ParamsError("exposure.kappa: calibrated measures AdamW's update variance; with grid.optimizer "
                          "sgd_momentum use null (κ = 1/(1 − β)² for heavy ball, method §6)")
    if k is not None and len(opts) > 1:
        raise ParamsError(f"exposure.kappa = {k} would give every optimizer of grid.optimizer = {opts} the same κ; "
                          f"allowed: null (each optimizer's own: 1 for adamw, 1/(1 − β)² for sgd_momentum)")
