"""params.yaml: load, validate (schema + cross-field rules), expand the grid, run ids, run specs.

`validate_params` is the one gate: every invalid value is rejected with a message naming the key
and what is allowed, before any job starts (the Snakefile calls it at parse time).
"""
from __future__ import annotations

import copy
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .sections import all_sections, schema
from .tasks import M_INF, m_label, parse_m


class ParamsError(ValueError):
    """An invalid parameter; the message names the key and the allowed values."""




MAX_YAML_BYTES = 1 << 20      # a params file is a few KB; bounds parsing time and memory
MAX_YAML_DEPTH = 32           # params.yaml nests 5 levels
MAX_YAML_NODES = 100_000      # values after expanding aliases (a few dozen aliases can otherwise expand to 10^9)
_STR = "tag:yaml.org,2002:str"


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last), a key that
    is not a string (`1:`, YAML 1.1's `on:` = true), nesting deeper than MAX_YAML_DEPTH and aliases expanding to
    more than MAX_YAML_NODES values."""

    def construct_document(self, node):
        _check_nodes(node, [], self.name, {})
        return super().construct_document(node)


def _check_nodes(node: yaml.Node, path: list, name: str, sizes: dict) -> int:
    """Check a node and its children; returns its size with aliases expanded (memoised per node, so an alias
    is counted, not walked, again)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if len(path) > MAX_YAML_DEPTH:
        raise ParamsError(f"{name}, line {node.start_mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels "
                          f"(at {_key(path[:3])}...); allowed: params.yaml's sections, a few levels deep")
    size = 1
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            line = k.start_mark.line + 1
            if not isinstance(k, yaml.ScalarNode) or k.tag != _STR:
                raise ParamsError(f"{name}, line {line}: key {k.value if isinstance(k, yaml.ScalarNode) else '?'!r}"
                                  f" under {_key(path)} is not a string (YAML reads it as {k.tag.rsplit(':', 1)[-1]});"
                                  f" allowed: string keys (quote it, e.g. \"{k.value}\":)"
                                  if isinstance(k, yaml.ScalarNode) else
                                  f"{name}, line {line}: a key under {_key(path)} is a list or mapping; allowed: "
                                  f"string keys")
            key = k.value
            if key in first:
                raise ParamsError(f"{name}, line {line}: key {_key(path + [key])} is given twice (first at line "
                                  f"{first[key]}); allowed: each key once (YAML would silently keep the last)")
            first[key] = line
            size += _check_nodes(v, path + [key], name, sizes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_nodes(item, path + [i], name, sizes)
    if size > MAX_YAML_NODES:
        raise ParamsError(f"{name}: {_key(path)} expands to more than {MAX_YAML_NODES:,} values (aliases "
                          f"included); allowed: a params file of the size of params.yaml")
    sizes[id(node)] = size
    return size


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file strictly: a duplicate or non-string key, a syntax error, bytes that are not UTF-8, a
    file over MAX_YAML_BYTES, nesting or alias expansion beyond the bounds above are a ParamsError naming the
    file (and the line and column where there is one)."""
    size = Path(path).stat().st_size
    if size > MAX_YAML_BYTES:
        raise ParamsError(f"{path}: {size:,} bytes; allowed: a params file up to {MAX_YAML_BYTES:,} bytes")
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ParamsError(f"{path}, line {line}: byte {raw[e.start]:#04x} is not UTF-8; allowed: a UTF-8 text "
                          f"file (save it as UTF-8)") from None
    try:
        loader = UniqueKeyLoader(text)
        loader.name = str(path)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "position unknown"
        what = "; ".join(x for x in (e.context, e.problem) if x)
        raise ParamsError(f"{path}, {where}: YAML syntax error: {what}. Allowed: YAML mappings indented with "
                          f"spaces (no tabs); quote strings that contain ': ' or ' #'") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    except RecursionError:
        raise ParamsError(f"{path}: nested too deeply to parse; allowed: nesting up to {MAX_YAML_DEPTH} "
                          f"levels") from None


def check_yaml_files(paths: list[str | Path]) -> None:
    """Parse each config file strictly (duplicate keys, syntax errors); for the Snakefile, which lets
    Snakemake load the files itself."""
    for p in paths:
        read_yaml(p)


def merge_params(base: dict, override: dict) -> dict:
    """`override` merged into a copy of `base` key by key, mappings recursively (as Snakemake merges
    --configfile into the workflow's configfile); lists and values are replaced whole."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = merge_params(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_params(path: str | Path = "params.yaml", overrides: list[str | Path] = ()) -> dict:
    """Read `path` and each override file strictly (read_yaml), merge them (merge_params) and validate
    the result (validate_params); errors start with the file names."""
    params = read_yaml(path)
    for o in overrides:
        extra = read_yaml(o)
        if not isinstance(extra, dict) or not isinstance(params, dict):
            raise ParamsError(f"{o}: a params file must be a mapping of sections")
        params = merge_params(params, extra)
    try:
        return validate_params(params)
    except ParamsError as e:
        raise ParamsError(f"{' + '.join(map(str, [path, *overrides]))}: {e}") from None


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


M_MAX = 2**20  # largest finite task-pool size (the schema's grid.M maximum)
MAX_JOB_MEMORY = 32 * 2**30  # bytes one job may plan to allocate (memory_estimate)
_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "a mapping", "null": "null"}


def _is_integer(checker, instance) -> bool:
    """JSON Schema counts 4.0 as an integer; a params file must write 4."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_integer))


def _switchable(s: dict) -> bool:
    return "enabled" in (s.get("properties") or {})


def _describe(err: jsonschema.ValidationError) -> str:
    key = _key(err.absolute_path)
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
        return (f"{key} = {err.instance!r} is not allowed; it must match {err.validator_value} "
                f"(1-32 lowercase letters, digits, _)")
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
    bad = _non_finite(params, [])
    if bad:
        lines = "\n  - ".join(
            f"{_key(p)} = {v!r} is not allowed; allowed: a finite number"
            + (" (M = ∞ is written inf, a string)" if p[:2] == ["grid", "M"] else "") for p, v in bad)
        raise ParamsError(f"invalid params:\n  - {lines}")
    errors = [e for e in _Validator(schema()).iter_errors(params) if not _switched_off(e)]
    errors.sort(key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        lines = "\n  - ".join(_describe(e) for e in errors[:10])
        raise ParamsError(f"invalid params:\n  - {lines}")
    _cross_checks(params)
    return params


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
    conditions = p["noise"]["conditions"]
    unknown = [n for n in p["grid"]["noise"] if n not in conditions]
    if unknown:
        raise ParamsError(f"grid.noise: {unknown} not defined; allowed: the names under noise.conditions "
                          f"({', '.join(sorted(conditions))})")
    Ms = [parse_m(x) for x in p["grid"]["M"]]
    if len(set(Ms)) != len(Ms):
        raise ParamsError(f"grid.M has duplicates: {p['grid']['M']}")
    _seed_checks(p)
    _ed_checks(p)
    _noise_checks(p)
    _memory_check(p)
    try:  # the typed sections (iclnoise.sections) build from what the schema let through
        all_sections(p)
    except ValueError as e:
        raise ParamsError(str(e)) from None


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
    from .schedules import checkpoints_until

    c = p["train"]["checkpoints"]
    n = [len(checkpoints_until(steps_for(p, B), c["linear"], c["log"], trained_steps(p, B)))
         for B in p["grid"]["batch_sizes"]]
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


def memory_estimate(params: dict) -> dict[str, int]:
    """Bytes one training job plans to allocate at the largest M of the grid (a floor, not a measurement):

    pool   = M·(16D + 196): the training pool M·D·4 plus the evaluator's peak, max(M·D·12 (float64 draw and
             float32 copy), M·D·4 + M·(2D+1)·4 + 3·16·M·4 (dMMSE: pool, its two copies, three buffers))
    eval   = (2·n_sequences + n_root)·K·(D+1)·4·2 (sets, predictions) + n_sequences·2K·(4d + d_mlp + 2K·h)·4·2
    train  = micro_batch·2K·L·(10d + 2·d_mlp + 3·2K·h)·4 (activations kept for backward)
    params = 16·P, P = L·(4d² + 2d·d_mlp) (weights, gradients, two Adam moments)
    """
    d, m, e, t = params["data"], params["model"], params["eval"], params["train"]
    finite = [x for x in grid_ms(params) if x != M_INF]
    M, D, K, T = max(finite, default=0), d["D"], d["K"], 2 * d["K"]
    dm, dmlp, L, h = m["d_model"], m["d_mlp"], m["n_layers"], m["n_heads"]
    est = {
        "pool": M * (16 * D + 196),
        "eval": (2 * e["n_sequences"] + e["n_root"]) * K * (D + 1) * 8
        + e["n_sequences"] * T * (4 * dm + dmlp + T * h) * 8,
        "train": min(t["micro_batch"], max(params["grid"]["batch_sizes"])) * T * L
        * (10 * dm + 2 * dmlp + 3 * T * h) * 4,
        "params": 16 * L * (4 * dm * dm + 2 * dm * dmlp),
    }
    est["total"] = sum(est.values())
    return est


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""


def probe_memory_estimate(params: dict) -> dict[str, dict[str, int]]:
    """Bytes the other job kinds plan to allocate (floors, as memory_estimate), per job and part. With
    a = 2K·L·(10d + 2·d_mlp + 3·2K·h)·4, one sequence's activations kept for a backward pass:

    exposure (inside a training job)  curvature = 3·heldout·a (Hessian-vector products: double backward)
    llc       set = n·K·(D+1)·4 (the sampling set), chains = min(8192, chains·min(batch, n))·a·2 (one batched
              SGLD pass, per-chain weights and gradients included in the factor 2)
    geometry  heldout = 3·n_heldout·a·sam_batches (held-out batches, Hessian-vector products)
    mech      probe = n_probe·a"""
    d, m = params["data"], params["model"]
    D, K, T = d["D"], d["K"], 2 * d["K"]
    a = T * m["n_layers"] * (10 * m["d_model"] + 2 * m["d_mlp"] + 3 * T * m["n_heads"]) * 4
    out: dict[str, dict[str, int]] = {}
    exp = params.get("exposure") or {}
    if exp.get("enabled"):
        out["exposure"] = {"curvature": 3 * exp["heldout"] * a}
    llc = params.get("llc") or {}
    if llc.get("enabled"):
        s = llc["sampler"]
        out["llc"] = {"set": s["n"] * K * (D + 1) * 4,
                      "chains": min(8192, s["chains"] * min(s["batch"], s["n"])) * a * 2}
    geo = params.get("geometry") or {}
    if geo.get("enabled"):
        out["geometry"] = {"heldout": 3 * geo["n_heldout"] * a * geo["sam_batches"]}
    mech = params.get("mech") or {}
    if mech.get("enabled"):
        out["mech"] = {"probe": mech["n_probe"] * a}
    return out


PROBE_KEYS = {"exposure": "exposure.heldout", "llc": "llc.sampler.n, chains and batch",
              "geometry": "geometry.n_heldout × sam_batches", "mech": "mech.n_probe"}


def _memory_check(p: dict) -> None:
    est = memory_estimate(p)
    if est["total"] > MAX_JOB_MEMORY:
        parts = ", ".join(f"{k} {_bytes(v)}" for k, v in est.items() if k != "total")
        raise ParamsError(f"estimated memory of one job {_bytes(est['total'])} ({parts}) is not allowed; allowed: "
                          f"<= {_bytes(MAX_JOB_MEMORY)}; the pool grows with grid.M × data.D, evaluation with "
                          f"eval.n_sequences × data.K × model.d_mlp, training with train.micro_batch")
    for job, parts in probe_memory_estimate(p).items():
        total = sum(parts.values()) + (est["total"] if job == "exposure" else 0)
        if total > MAX_JOB_MEMORY:
            detail = ", ".join(f"{k} {_bytes(v)}" for k, v in parts.items())
            what = "job" if job != "exposure" else "step of a training job"
            raise ParamsError(f"estimated memory of one {job} {what} {_bytes(total)} ({detail}) is not allowed; "
                              f"allowed: <= {_bytes(MAX_JOB_MEMORY)}; it grows with {PROBE_KEYS[job]}")


# CPU milliseconds per ensemble step = STEP_MS_BASE + runs · (STEP_MS_PER_RUN + STEP_MS_PER_MFLOP · step MFLOPs),
# × INJECTED_FACTOR[source]. Fitted to the CPU time of the default DAG's training jobs (fresh clone of afcdeca,
# benchmarks/train/*.tsv cpu_time; 3 layers, d_model 32, D = 3, K = 8, stacked-parameter step; evaluation at 25-26
# checkpoints and exposure every 400 steps amortised; 18 runs per job, the two jobs side by side on 2 cores):
# batch 16, 10000 steps: 546.7 s (54.7 ms per ensemble step, 42.5 MFLOP per run-step); batch 64, 2500 steps:
# 456.8 s (182.7 ms, 170 MFLOP). STEP_MS_PER_RUN kept from the earlier fit; the line is exact at both jobs and
# within 5 % of the 9-run jobs of 9baea51 (29.6 and 88.7 ms). INJECTED_FACTOR: the cost of a step that injects
# relative to a plain one (exposure logged in both); only the injection window's share of a run's steps pays it.
# grad: 1.22, the closed loop of the early and late arms (diagonal, curvature re-measured every 25 steps) on
# 12-run ensembles at batch 64 (bench/bench_noise.py --runs 12 --every 400; README); param: 1.19, measured on a
# single run (param_b16) before issue 27. Re-measure on new hardware.
STEP_MS_BASE = 3.03
STEP_MS_PER_RUN = 0.5
STEP_MS_PER_MFLOP = 0.0558
INJECTED_FACTOR = {"none": 1.0, "grad": 1.22, "param": 1.19}
COST_CONFIRM_CORE_HOURS = 2.0


def step_flops(params: dict, batch: int) -> float:
    """Training FLOPs of one update: 6 · batch · T · L · (4d² + 2d·d_mlp + 2T·d), T = 2K tokens
    (forward 2 FLOPs per multiply-add, backward twice the forward)."""
    m, T = params["model"], 2 * params["data"]["K"]
    d = m["d_model"]
    return 6.0 * batch * T * m["n_layers"] * (4 * d * d + 2 * d * m["d_mlp"] + 2 * T * d)


def step_ms(params: dict, batch: int, source: str = "none", runs: int = 1, injecting: float = 1.0) -> float:
    """Estimated CPU milliseconds of one step of an ensemble of `runs` runs (one core): the per-step overhead
    STEP_MS_BASE is paid once per ensemble, STEP_MS_PER_RUN + STEP_MS_PER_MFLOP · MFLOPs per run; a share
    `injecting` of the steps (an early or late window's fraction, else 1) costs INJECTED_FACTOR[source] times
    as much (noise source none, grad or param)."""
    per_run = STEP_MS_PER_RUN + STEP_MS_PER_MFLOP * step_flops(params, batch) / 1e6
    return (STEP_MS_BASE + runs * per_run) * (1 + (INJECTED_FACTOR[source] - 1) * injecting)


JOB_START_S = 2.5  # CPU seconds to start one `iclnoise` job (python + torch + package imports; measured 2.1–4.2 s)


def probed_checkpoints(params: dict, batch: int, section: str) -> int:
    """How many checkpoints of a run at `batch` a probe section (llc, geometry, mech) analyses."""
    from .probes import steps_at
    from .runs import select_steps
    from .schedules import checkpoints_until
    c = params["train"]["checkpoints"]
    steps = checkpoints_until(steps_for(params, batch), c["linear"], c["log"], trained_steps(params, batch))
    at = params[section].get("at") if section == "llc" else None
    return len(steps_at(steps, **at) if at else select_steps(steps, params[section]["every"]))


def probe_seconds(params: dict, batch: int, section: str) -> float:
    """Estimated CPU seconds of one probe section in a run's probe job (without the job's start-up), counted
    in training-step equivalents (step_ms) per checkpoint:
    llc: chains · (burn_in + draws) SGLD steps at sampler.batch; geometry: (2·probes + lanczos_iters + 2)
    Hessian-vector products at n_heldout, 2 steps each; mech: (n_layers · n_heads + 2) forward passes (⅓ step)
    at n_sequences and one at n_probe. Measured on one default run (M16-B64-none-s0, snakemake benchmark
    cpu_time): llc 25.3 s (estimate 35.7), geometry 5.0 s (5.5), mech 4.7 s (2.8)."""
    g, m = params[section], params["model"]
    if section == "llc":
        sm = g["sampler"]
        per = sm["chains"] * (sm["burn_in"] + sm["draws"]) * step_ms(params, sm["batch"])
    elif section == "geometry":
        per = (2 * g["probes"] + g["lanczos_iters"] + 2) * 2 * step_ms(params, g["n_heldout"])
    else:
        heads = m["n_layers"] * m["n_heads"]
        per = ((heads + 2) * step_ms(params, params["eval"]["n_sequences"]) + step_ms(params, g["n_probe"])) / 3
    return probed_checkpoints(params, batch, section) * per / 1000


def cost_estimate(params: dict) -> dict[str, Any]:
    """Jobs of the DAG, training steps summed over runs, and estimated core-hours: training (step_ms), the
    llc / geometry / mech probes (probe_seconds) and JOB_START_S for every other job."""
    runs = expand_grid(params)
    conds = params["noise"]["conditions"]
    probes = {}
    for name in ("llc", "geometry", "mech"):
        sec = params.get(name) or {}
        seeds = sec.get("seeds")
        probes[name] = [k for k in runs if seeds is None or k.seed in seeds] if sec.get("enabled") else []
    families = len(ed_families(params))
    groups = ensemble_groups(params)
    # one probe job per probed run (llc with its stages, geometry, mech in one process); llc figures, ed
    # families (analysis + figures), training figures, aggregate, report, all
    probed = {k for ks in probes.values() for k in ks}
    other = (1 if probes["llc"] else 0) + 2 * families + 4
    jobs = len(groups) + len(probed) + other
    run_steps = sum(trained_steps(params, k.batch) for k in runs)
    train_s = 0.0
    for members in groups.values():
        k = parse_run_id(members[0])
        cond = conds[k.noise]
        window = cond.get("fraction") if cond.get("schedule") in ("early", "late") else 1.0
        train_s += JOB_START_S + trained_steps(params, k.batch) * step_ms(params, k.batch, cond["source"], len(members),
                                                                       window) / 1000
    probe_s = (len(probed) * JOB_START_S
               + sum(probe_seconds(params, k.batch, name) for name, ks in probes.items() for k in ks))
    return {"runs": len(runs), "jobs": jobs, "run_steps": run_steps, "train_core_hours": train_s / 3600,
            "core_hours": (train_s + probe_s + other * JOB_START_S) / 3600,
            "peak_job_memory": memory_estimate(params)["total"], "threshold_core_hours": COST_CONFIRM_CORE_HOURS}


def format_cost(est: dict) -> str:
    """One line: jobs, steps, CPU core-hours (all jobs; training alone), planned memory per training job."""
    return (f"{est['runs']} runs, {est['jobs']} jobs, {est['run_steps']:,} training steps, "
            f"≈ {est['core_hours']:,.2f} CPU core-hours ({est['train_core_hours']:,.2f} of them training; rates "
            f"measured on the default model, a GPU is faster), ≈ {_bytes(est['peak_job_memory'])} allocated per "
            f"training job")


def switch(value: Any, key: str) -> bool:
    """A `--config` on/off switch: True/False, 1/0, or the words true/false (any case); anything else is refused,
    so that `confirm_cost=false` (a string to Snakemake) cannot read as a confirmation."""
    words = {"true": True, "false": False, "1": True, "0": False}
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in words:
        return words[str(value).strip().lower()]
    raise ParamsError(f"--config {key}={value!r}: use {key}=true or {key}=false")


RESOURCE_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


def run_options(config: dict) -> tuple[int, dict]:
    """The `--config` keys that say how training jobs run (the profiles set them): train_threads, a whole number
    1-256, and train_resources, a mapping of Snakemake resource names to whole numbers ≥ 0 or words
    (slurm_partition). Anything else is a ParamsError naming the key and an allowed value."""
    t = config.get("train_threads", 1)
    if isinstance(t, bool) or not (isinstance(t, int) or str(t).strip().isdigit()) or not 1 <= int(t) <= 256:
        raise ParamsError(f"--config train_threads={t!r}: allowed: a whole number 1-256 (threads per training job),"
                          f" e.g. train_threads=4")
    res = config.get("train_resources") or {}
    if not isinstance(res, dict):
        raise ParamsError(f"--config train_resources={res!r}: allowed: a mapping of resources, e.g. "
                          f"\"train_resources={{mem_mb: 16000, runtime: 720, slurm_partition: gpu}}\"")
    out = {}
    for k, v in res.items():
        if not isinstance(k, str) or not RESOURCE_KEY.match(k):
            raise ParamsError(f"--config train_resources: key {k!r} is not a resource name; allowed: lower-case "
                              f"names such as mem_mb, runtime, cpus_per_task, slurm_partition")
        try:
            num = float(v) if not isinstance(v, bool) and v is not None else None
        except (TypeError, ValueError):
            num = None  # a word, e.g. slurm_partition=gpu
        if isinstance(v, bool) or v is None or not str(v).strip() or (num is not None and (
                not math.isfinite(num) or num < 0 or num != int(num))):
            raise ParamsError(f"--config train_resources.{k}={v}: allowed: a whole number >= 0 or a word")
        out[k] = int(num) if num is not None else str(v)
    return int(t), out


def check_cost(params: dict, confirmed: bool = False) -> dict[str, Any]:
    """The cost estimate; raises ParamsError above COST_CONFIRM_CORE_HOURS unless `confirmed`."""
    est = cost_estimate(params)
    if est["core_hours"] > COST_CONFIRM_CORE_HOURS and not confirmed:
        raise ParamsError(f"this grid costs {format_cost(est)}: above the {COST_CONFIRM_CORE_HOURS:g} core-hour "
                          f"threshold. To start it anyway add `--config confirm_cost=true` to the snakemake command "
                          f"(or shrink grid.M, grid.seeds, grid.batch_sizes or train.budget)")
    return est


# which level key each schedule takes (SPEC §5; iclnoise.noise)
_EXPOSURE_KEYS = ("every", "groups", "per_example", "kappa", "curvature", "curvature_probes", "heldout", "floor",
                  "eig_rank")
_LEVELS = {"constant": ("emulate_batch", "budget"), "early": ("budget",), "late": ("budget",),
           "controlled": ("target",)}


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
        if c["source"] == "none":
            extra = sorted(set(c) - {"source", "batch_sizes", "M"})
            if extra:
                raise ParamsError(f"{key}: source none takes no other keys, got {', '.join(extra)}")
            continue
        if name in used and "groups" not in exp:
            raise ParamsError(f"{key}: injected noise needs the full exposure section (it measures the covariance); "
                              f"allowed: exposure with its keys ({', '.join(_EXPOSURE_KEYS)}), enabled true or false")
        for k in ("shape", "schedule"):
            if k not in c:
                raise ParamsError(f"{key}.{k} is required for source {c['source']}")
        allowed = _LEVELS[c["schedule"]]
        given = [k for k in ("emulate_batch", "budget", "target") if k in c]
        if len(given) != 1 or given[0] not in allowed:
            raise ParamsError(f"{key}: schedule {c['schedule']} needs exactly one of {', '.join(allowed)}"
                              f" (got {', '.join(given) or 'none'})")
        if c["schedule"] in ("early", "late") and "fraction" not in c:
            raise ParamsError(f"{key}.fraction is required for schedule {c['schedule']} (0 < f ≤ 1)")
        if c["schedule"] == "controlled" and name in used and not exp.get("enabled"):
            raise ParamsError(f"{key}: schedule controlled needs exposure.enabled: true (it measures P-NE*)")
        if c["shape"] == "lowrank" and "rank" not in c:
            raise ParamsError(f"{key}.rank is required for shape lowrank (the rank of the low-rank part)")
        if c["schedule"] == "controlled" and "controller" not in c:
            raise ParamsError(f"{key}.controller is required for schedule controlled; allowed: {{kp: …, ki: …}} "
                              f"(PI gains on log P-NE*)")
        if c["shape"] == "lowrank" and name in used and not exp.get("per_example") and c["rank"] >= exp["groups"]:
            raise ParamsError(f"{key}.rank = {c['rank']} is not allowed; with exposure.groups = "
                              f"{exp['groups']} the covariance has rank ≤ {exp['groups'] - 1}")
        runs_at = [B for B in p["grid"]["batch_sizes"] if B in c.get("batch_sizes", [B])]
        if "emulate_batch" in c and name in used and runs_at and c["emulate_batch"] >= min(runs_at):
            warnings.warn(f"{key}.emulate_batch = {c['emulate_batch']} is not below every batch size; the "
                          f"negative residual is clipped to zero and logged (injection.parquet clipped_trace)")


@dataclass(frozen=True, order=True)
class RunKeys:
    M: int
    batch: int
    noise: str
    seed: int

    @property
    def run_id(self) -> str:
        return f"M{m_label(self.M)}-B{self.batch}-{self.noise}-s{self.seed}"

    def to_dict(self) -> dict:
        return {"run_id": self.run_id, "M": self.M, "seed": self.seed, "batch": self.batch, "noise": self.noise}


_RUN_RE = re.compile(r"^M(?P<M>inf|\d+)-B(?P<batch>\d+)-(?P<noise>[a-z0-9_]+)-s(?P<seed>\d+)$")


def parse_run_id(run_id: str) -> RunKeys:
    m = _RUN_RE.match(run_id)
    if not m:
        raise ValueError(f"not a run id: {run_id!r} (expected e.g. M64-B128-none-s0)")
    return RunKeys(parse_m(m["M"]), int(m["batch"]), m["noise"], int(m["seed"]))


def expand_grid(params: dict) -> list[RunKeys]:
    """Every (M, batch, noise, seed) of the grid, in a stable order; a noise condition with its own
    `batch_sizes` or `M` runs only at those."""
    g, conds = params["grid"], params["noise"]["conditions"]
    return [RunKeys(parse_m(M), B, n, s) for M in g["M"] for B in g["batch_sizes"] for n in g["noise"]
            for s in g["seeds"] if B in conds[n].get("batch_sizes", [B])
            and parse_m(M) in map(parse_m, conds[n].get("M", [M]))]


def grid_ms(params: dict) -> list[int]:
    return [parse_m(M) for M in params["grid"]["M"]]


def ed_families(params: dict, single: bool = False) -> dict[str, list[str]]:
    """Essential-dynamics families: name → run ids. by_m: all M at one (noise, batch, seed);
    by_noise: all noise conditions at one (M, batch, seed) (only when there are ≥ 2 conditions). A family needs
    two runs; `single`: the would-be families of one run instead (a condition run at one M), which have none."""
    ed = params.get("ed") or {}
    if not ed.get("enabled"):
        return {}
    runs = [k for k in expand_grid(params) if k.seed in ed["seeds"]]
    fams: dict[str, list[str]] = {}
    for k in runs:
        if "by_m" in ed["families"]:
            fams.setdefault(f"bym-{k.noise}-B{k.batch}-s{k.seed}", []).append(k.run_id)
        if "by_noise" in ed["families"] and len(params["grid"]["noise"]) > 1:
            fams.setdefault(f"bynoise-M{m_label(k.M)}-B{k.batch}-s{k.seed}", []).append(k.run_id)
    return {f: r for f, r in fams.items() if (len(r) == 1) == single}


def steps_for(params: dict, batch: int) -> int:
    """A run's schedule length (its budget in steps)."""
    b = params["train"]["budget"]
    return b["steps"] if b["mode"] == "steps" else max(1, b["sequences"] // batch)


def trained_steps(params: dict, batch: int) -> int:
    """The steps a run trains: its schedule, or up to `train.budget.stop_at` where that comes first."""
    return min(steps_for(params, batch), params["train"]["budget"].get("stop_at") or steps_for(params, batch))


def run_spec(params: dict, run_id: str) -> dict[str, Any]:
    """Everything one run needs, resolved (steps, micro-batch, noise condition); JSON-serialisable."""
    keys = parse_run_id(run_id)
    train = {k: v for k, v in copy.deepcopy(params["train"]).items() if k != "ensemble_runs"}  # how runs are
    train["steps"] = steps_for(params, keys.batch)                                            # grouped ≠ what they are
    train["micro_batch"] = min(train["micro_batch"], keys.batch)
    spec = {
        "keys": keys.to_dict(),
        "data": copy.deepcopy(params["data"]),
        "model": copy.deepcopy(params["model"]),
        "train": train,
        "eval": copy.deepcopy(params["eval"]),
        "noise": {k: v for k, v in copy.deepcopy(params["noise"]["conditions"][keys.noise]).items()
                  if k not in ("batch_sizes", "M")},  # which runs exist is the grid's business, not the run's
        "exposure": copy.deepcopy(params.get("exposure")),
    }
    return spec


def ensemble_groups(params: dict) -> dict[str, list[str]]:
    """Ensembles: runs trained together in one process (iclnoise.train). Runs of one (batch, noise condition)
    share model shape, step count and training configuration; each such set is split into chunks of at
    most `train.ensemble_runs` runs (in grid order). Group id `B{batch}-{noise}` (+ `-c{k}` when chunked)."""
    cap = params["train"]["ensemble_runs"]
    by_key: dict[str, list[str]] = {}
    for k in expand_grid(params):
        by_key.setdefault(f"B{k.batch}-{k.noise}", []).append(k.run_id)
    groups = {}
    for key, runs in by_key.items():
        chunks = [runs[i:i + cap] for i in range(0, len(runs), cap)]
        for i, c in enumerate(chunks):
            groups[key if len(chunks) == 1 else f"{key}-c{i}"] = c
    return groups


def shared_spec(params: dict, runs: list[str]) -> dict:
    """The spec an ensemble's runs share: a run spec without its keys (iclnoise.train rebuilds them per run)."""
    spec = run_spec(params, runs[0])
    spec.pop("keys")
    return spec


def member_specs(shared: dict, runs: list[str]) -> list[dict]:
    """Each run's full spec from the shared spec; equal to `run_spec(params, run)` for every run of a group."""
    return [{"keys": parse_run_id(r).to_dict(), **copy.deepcopy(shared)} for r in runs]


def section(params: dict, name: str) -> dict:
    """A top-level section (e.g. 'llc') as a plain dict, for rules that pass it to a command."""
    return copy.deepcopy(params.get(name) or {})


__all__ = ["ParamsError", "RunKeys", "M_INF", "load_params", "validate_params", "expand_grid", "grid_ms", "ed_families",
           "ensemble_groups", "member_specs", "parse_run_id", "run_spec", "section", "shared_spec", "steps_for",
           "schema"]


def cli(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="iclnoise check",
                                 description="Validate a params file, list its runs and print the cost estimate.")
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--configfile", nargs="*", default=[], help="override files merged on top, as snakemake does")
    a = ap.parse_args(argv)
    try:
        params = load_params(a.params, a.configfile)
    except ParamsError as e:
        raise SystemExit(str(e))
    runs = expand_grid(params)
    print(f"{' + '.join([a.params, *a.configfile])}: valid; {len(runs)} runs")
    for k in runs:
        n, stop = steps_for(params, k.batch), trained_steps(params, k.batch)
        print(f"  {k.run_id}  ({n} steps{f', stopping at {stop}' if stop < n else ''})")
    est = cost_estimate(params)
    print(f"cost estimate: {format_cost(est)}")
    if est["core_hours"] > COST_CONFIRM_CORE_HOURS:
        print(f"above the {COST_CONFIRM_CORE_HOURS:g} core-hour threshold: snakemake refuses it without "
              f"--config confirm_cost=true")
