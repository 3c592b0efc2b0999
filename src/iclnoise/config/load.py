"""params.yaml: read strictly (bounded YAML, unique string keys), merge the overrides as Snakemake's --configfile
does, validate (iclnoise.config.validate), read the workflow's --config switches, and hand out typed sections: `typed`
and `every_at` are the one way a command or iclnoise.output.paper reads a params mapping (the resolved params, or a
command's --cfg {section name: section}).

Grid, run ids and run specs live in iclnoise.config.grid; the cost and memory model in iclnoise.config.cost.
"""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import yaml

from ..core.probe_sections import ED, Geometry, LLCConfig, Mech, Refined, Stages, Stats
from ..core.sections import ParamsError, Section
from .validate import dotted_key, validate_params

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
                          f"(at {dotted_key(path[:3])}...); allowed: params.yaml's sections, a few levels deep")
    size = 1
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            line = k.start_mark.line + 1
            if not isinstance(k, yaml.ScalarNode) or k.tag != _STR:
                raise ParamsError(f"{name}, line {line}: key {k.value if isinstance(k, yaml.ScalarNode) else '?'!r}"
                                  f" under {dotted_key(path)} is not a string (YAML reads it as "
                                  f"{k.tag.rsplit(':', 1)[-1]});"
                                  f" allowed: string keys (quote it, e.g. \"{k.value}\":)"
                                  if isinstance(k, yaml.ScalarNode) else
                                  f"{name}, line {line}: a key under {dotted_key(path)} is a list or mapping; allowed: "
                                  f"string keys")
            key = k.value
            if key in first:
                raise ParamsError(f"{name}, line {line}: key {dotted_key(path + [key])} is given twice (first at line "
                                  f"{first[key]}); allowed: each key once (YAML would silently keep the last)")
            first[key] = line
            size += _check_nodes(v, path + [key], name, sizes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            size += _check_nodes(item, path + [i], name, sizes)
    if size > MAX_YAML_NODES:
        raise ParamsError(f"{name}: {dotted_key(path)} expands to more than {MAX_YAML_NODES:,} values (aliases "
                          f"included); allowed: a params file of the size of params.yaml")
    sizes[id(node)] = size
    return size


def read_bounded(path: str | Path, cap: int = MAX_YAML_BYTES) -> bytes:
    """The bytes of a params source (a file, a device, a pipe): at most `cap + 1` are read, and a source longer
    than `cap` is a ParamsError naming it (stat's size is 0 for /dev/zero and pipes, so it is not trusted); one
    that cannot be opened is a ParamsError too."""
    try:
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as e:
        raise ParamsError(f"{path}: cannot be read ({e.strerror or e}); allowed: a readable params file") from None
    if len(raw) > cap:
        raise ParamsError(f"{path}: more than {cap:,} bytes; allowed: a params file up to {cap:,} bytes")
    return raw


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file strictly: a duplicate or non-string key, a syntax error, bytes that are not UTF-8, a
    file over MAX_YAML_BYTES, nesting or alias expansion beyond the bounds above are a ParamsError naming the
    file (and the line and column where there is one)."""
    raw = read_bounded(path)
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
        raise ParamsError(f"{source_names([path, *overrides])}: {e}") from None


def parse_overrides(overrides: Any) -> Any:
    """Snakemake's `--config key=value` overrides with each string value read as a YAML scalar (safe loader), as
    it would be in a params file: Snakemake parses `stats={alpha: 0.05}` with YAML's BaseLoader, which gives the
    string '0.05'. A string that is no YAML scalar (a mapping's text, an unsafe tag) stays as written, and the
    schema then names its key."""
    if isinstance(overrides, dict):
        return {k: parse_overrides(v) for k, v in overrides.items()}
    if isinstance(overrides, list):
        return [parse_overrides(v) for v in overrides]
    if not isinstance(overrides, str):
        return overrides
    try:
        value = yaml.safe_load(overrides)
    except yaml.YAMLError:
        return overrides
    return overrides if isinstance(value, (dict, list)) else value


def source_names(files: list[str | Path], overrides: dict | None = None) -> str:
    """The params sources an error message starts with: each file once (Snakemake lists the workflow's configfile
    among --configfile's), then `--config` and the keys it set."""
    seen, names = set(), []
    for f in files:
        key = Path(f).resolve()
        if key not in seen:
            seen.add(key)
            names.append(str(f))
    if overrides:
        names.append(f"--config {', '.join(map(str, overrides))}")
    return " + ".join(names)


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


def run_options(config: dict, device: str = "cpu") -> tuple[int, dict]:
    """The `--config` keys that say how training jobs run (the profiles set them): train_threads, a whole number
    1-256, train_resources, a mapping of Snakemake resource names to whole numbers ≥ 0 or words (slurm_partition),
    and train_gpu_resources, the same, added to train_resources only where `device` (train.device) is cuda.
    Anything else is a ParamsError naming the key and an allowed value."""
    t = config.get("train_threads", 1)
    if isinstance(t, bool) or not (isinstance(t, int) or str(t).strip().isdigit()) or not 1 <= int(t) <= 256:
        raise ParamsError(f"--config train_threads={t!r}: allowed: a whole number 1-256 (threads per training job),"
                          f" e.g. train_threads=4")
    res = _resources(config, "train_resources")
    gpu = _resources(config, "train_gpu_resources")
    return int(t), {**res, **gpu} if device == "cuda" else res


def _resources(config: dict, key: str) -> dict:
    """The `--config` mapping `key` of Snakemake resources, checked (run_options)."""
    res = config.get(key) or {}
    if not isinstance(res, dict):
        raise ParamsError(f"--config {key}={res!r}: allowed: a mapping of resources, e.g. "
                          f"\"{key}={{mem_mb: 16000, runtime: 720, slurm_partition: gpu}}\"")
    out = {}
    for k, v in res.items():
        if not isinstance(k, str) or not RESOURCE_KEY.match(k):
            raise ParamsError(f"--config {key}: key {k!r} is not a resource name; allowed: lower-case "
                              f"names such as mem_mb, runtime, cpus_per_task, slurm_partition")
        try:
            num = float(v) if not isinstance(v, bool) and v is not None else None
        except (TypeError, ValueError):
            num = None  # a word, e.g. slurm_partition=gpu
        if isinstance(v, bool) or v is None or not str(v).strip() or (num is not None and (
                not math.isfinite(num) or num < 0 or num != int(num))):
            raise ParamsError(f"--config {key}.{k}={v}: allowed: a whole number >= 0 or a word")
        out[k] = int(num) if num is not None else str(v)
    return out


TYPED = {c.SECTION: c for c in (Stats, ED, Geometry, Mech, LLCConfig, Stages, Refined)}
CHECKPOINT_PROBES = ("llc", "geometry", "mech")   # the sections that say which checkpoints their probe reads


def _get(params: dict, path: str) -> Any:
    """The value at dotted `path` of a params mapping; a ParamsError naming the path where it is absent."""
    d, parts = params, path.split(".")
    for i, part in enumerate(parts):
        if not isinstance(d, dict) or part not in d:
            keys = ", ".join(map(str, d)) if isinstance(d, dict) else "none"
            raise ParamsError(f"{path} is missing (keys of {'.'.join(parts[:i]) or 'the params'}: {keys})")
        d = d[part]
    return d


def typed(params: dict, path: str) -> Section:
    """The typed section `path` of a params mapping: one of TYPED's keys ("stats", "ed", "llc.sampler", ...). A
    ParamsError names another path, an absent section, and (from_dict) a missing or an unknown key."""
    if path not in TYPED:
        raise ParamsError(f"no typed section {path!r}; allowed: {', '.join(TYPED)}")
    return TYPED[path].from_dict(_get(params, path))


def noise_conditions(params: dict) -> dict[str, dict]:
    """The noise conditions of a params mapping (`noise.conditions`) by name; a ParamsError where it is absent or
    not a mapping."""
    conds = _get(params, "noise.conditions")
    if not isinstance(conds, dict):
        raise ParamsError("noise.conditions must map condition names to conditions (as in params.yaml)")
    return conds


def every_at(params: dict, name: str) -> tuple[int, dict | None]:
    """Which checkpoints the probe of section `name` (CHECKPOINT_PROBES) reads: (`every`, llc's `at` or None); the
    probes take every `every`-th checkpoint and the last, or those nearest to `at` (iclnoise.run.probing.llc_steps)."""
    if name not in CHECKPOINT_PROBES:
        raise ParamsError(f"{name} names no checkpoints; allowed: {', '.join(CHECKPOINT_PROBES)}")
    return _get(params, f"{name}.every"), _get(params, name).get("at")
