"""params.yaml: load, validate (schema + cross-field rules), expand the grid, run ids, run specs.

`validate_params` is the one gate: every invalid value is rejected with a message naming the key
and what is allowed, before any job starts (the Snakefile calls it at parse time).
"""
from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .tasks import M_INF, m_label, parse_m


class ParamsError(ValueError):
    """An invalid parameter; the message names the key and the allowed values."""


def schema() -> dict:
    return yaml.safe_load(resources.files("iclnoise").joinpath("params.schema.yaml").read_text())


def load_params(path: str | Path = "params.yaml") -> dict:
    with open(path) as f:
        return validate_params(yaml.safe_load(f))


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


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
        return f"{key}: {err.message}"
    if err.validator == "anyOf" and err.absolute_path and "M" in list(err.absolute_path):
        return f"{key} = {err.instance!r} is not allowed; M must be an integer >= 1 or 'inf'"
    if err.validator in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        op = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[err.validator]
        return f"{key} = {err.instance!r} is not allowed; it must be {op} {err.validator_value}"
    if err.validator == "pattern":
        return f"{key} = {err.instance!r} is not allowed; it must match {err.validator_value} (lowercase letters, digits, _)"
    desc = s.get("description", "")
    return f"{key}: {err.message}" + (f" ({desc})" if desc else "")


def validate_params(params: dict) -> dict:
    """Check `params` against the schema and the cross-field rules; return it unchanged."""
    if not isinstance(params, dict):
        raise ParamsError("params.yaml must be a mapping of sections (grid, data, model, train, eval, noise, ...)")
    validator = jsonschema.Draft7Validator(schema())
    errors = sorted(validator.iter_errors(params), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
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
            raise ParamsError(f"grid.batch_sizes: batch {B} is not divisible by train.micro_batch = {t['micro_batch']}; "
                              f"allowed: batch sizes that are multiples of the micro-batch (or smaller than it)")
        if budget["mode"] == "sequences" and budget["sequences"] < B:
            raise ParamsError(f"train.budget.sequences = {budget['sequences']} is smaller than batch {B}; "
                              f"allowed: at least one full batch")
    if m["d_model"] % m["n_heads"]:
        raise ParamsError(f"model.d_model = {m['d_model']} is not divisible by model.n_heads = {m['n_heads']}")
    k1, k2 = p["eval"]["icl_tokens"]
    if not (1 <= k1 < k2 <= d["K"]):
        raise ParamsError(f"eval.icl_tokens = {[k1, k2]} is not allowed; need 1 <= k_early < k_late <= data.K = {d['K']}")
    conditions = p["noise"]["conditions"]
    unknown = [n for n in p["grid"]["noise"] if n not in conditions]
    if unknown:
        raise ParamsError(f"grid.noise: {unknown} not defined; allowed: the names under noise.conditions "
                          f"({', '.join(sorted(conditions))})")
    Ms = [parse_m(x) for x in p["grid"]["M"]]
    if len(set(Ms)) != len(Ms):
        raise ParamsError(f"grid.M has duplicates: {p['grid']['M']}")
    _noise_checks(p)


# which level key each schedule takes (SPEC §5; iclnoise.noise)
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
        if c["source"] == "none":
            extra = sorted(set(c) - {"source", "batch_sizes"})
            if extra:
                raise ParamsError(f"{key}: source none takes no other keys, got {', '.join(extra)}")
            continue
        if not exp:
            raise ParamsError(f"{key}: injected noise needs the exposure section (it measures the covariance)")
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
        if c["schedule"] == "controlled" and not exp.get("enabled"):
            raise ParamsError(f"{key}: schedule controlled needs exposure.enabled: true (it measures P-NE*)")
        if c["shape"] == "lowrank" and not exp.get("per_example") and c.get("rank", 8) >= exp["groups"] \
                and name in used:
            raise ParamsError(f"{key}.rank = {c.get('rank', 8)} is not allowed; with exposure.groups = "
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
    `batch_sizes` runs only at those."""
    g, conds = params["grid"], params["noise"]["conditions"]
    return [RunKeys(parse_m(M), B, n, s) for M in g["M"] for B in g["batch_sizes"] for n in g["noise"]
            for s in g["seeds"] if B in conds[n].get("batch_sizes", [B])]


def grid_ms(params: dict) -> list[int]:
    return [parse_m(M) for M in params["grid"]["M"]]


def ed_families(params: dict) -> dict[str, list[str]]:
    """Essential-dynamics families: name → run ids. by_m: all M at one (noise, batch, seed);
    by_noise: all noise conditions at one (M, batch, seed) (only when there are ≥ 2 conditions)."""
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
    return {f: r for f, r in fams.items() if len(r) >= 2}


def steps_for(params: dict, batch: int) -> int:
    b = params["train"]["budget"]
    return b["steps"] if b["mode"] == "steps" else max(1, b["sequences"] // batch)


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
                  if k != "batch_sizes"},  # which runs exist is the grid's business, not the run's
        "exposure": copy.deepcopy(params.get("exposure")),
    }
    return spec


def ensemble_groups(params: dict) -> dict[str, list[str]]:
    """Ensembles: runs trained together in one process (iclnoise.train). Runs of one (batch, noise condition)
    share model shape, step count and training configuration; each such set is split into chunks of at
    most `train.ensemble_runs` runs (in grid order). Group id `B{batch}-{noise}` (+ `-c{k}` when chunked)."""
    cap = params["train"].get("ensemble_runs", 1 << 30)
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

    ap = argparse.ArgumentParser(prog="iclnoise check", description="Validate a params file and list its runs.")
    ap.add_argument("params", nargs="?", default="params.yaml")
    a = ap.parse_args(argv)
    try:
        params = load_params(a.params)
    except ParamsError as e:
        raise SystemExit(f"{a.params}: {e}")
    runs = expand_grid(params)
    print(f"{a.params}: valid; {len(runs)} runs")
    for k in runs:
        print(f"  {k.run_id}  ({steps_for(params, k.batch)} steps)")
