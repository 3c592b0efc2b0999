"""The grid of runs: run ids, their keys, each run's resolved spec and its hash, ensembles (runs trained in one
job) and essential-dynamics families, from a validated params dict (iclnoise.config.load_params).
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from ..core.runspec import M_INF, RunKeys, RunSpec, m_label, parse_m, parse_run_id
from ..core.sections import OPTIMIZERS, RNGS, ParamsError
from .memory import ensemble_memory, gpu_limit


def refined_covers(params: dict, keys: RunKeys) -> bool:
    """Whether llc.refined runs in a run's probe job: llc and llc.refined enabled, the run's seed among llc.seeds
    (absent: every seed) and its M among llc.refined.M (null: every M)."""
    llc = params.get("llc") or {}
    ref = llc.get("refined") or {}
    if not (llc.get("enabled") and ref.get("enabled")):
        return False
    seeds, ms = llc.get("seeds"), ref.get("M")
    return (seeds is None or keys.seed in seeds) and (ms is None or keys.M in {parse_m(M) for M in ms})


PROBE_TABLES = {   # the per-run tables each probe section writes (its probe job's outputs; mech also a heads figure)
    "llc": ("llc.parquet", "llc_traces.parquet", "stages.parquet"),
    "refined": ("rllc.parquet", "susceptibility.parquet"),
    "geometry": ("geometry.parquet",),
    "mech": ("mech.parquet",),
}


def probe_sections(params: dict, keys: RunKeys) -> list[str]:
    """The probe sections a run's probe job runs: llc, geometry, mech (each where it is enabled and `<section>.seeds`,
    absent = every seed, holds the run's seed) and refined (refined_covers)."""
    secs = [s for s in ("llc", "geometry", "mech") if (params.get(s) or {}).get("enabled")
            and (params[s].get("seeds") is None or keys.seed in params[s]["seeds"])]
    return secs + ["refined"] if refined_covers(params, keys) else secs


SELECTION_KEYS = ("seeds", "families", "refined.M")   # which jobs exist, not what a job computes (in a section)


def without(sec: Any, keys: list[str] | tuple[str, ...]) -> Any:
    """`sec` less `keys`, dotted keys reaching into its subsections."""
    if not isinstance(sec, dict):
        return sec
    return {k: without(v, [x.split(".", 1)[1] for x in keys if x.startswith(k + ".")])
            for k, v in sec.items() if k not in keys}


def job_cfg(params: dict, *names: str) -> dict:
    """What a command's --cfg holds: the params sections it reads, less the keys that only select jobs. As a rule's
    param it reruns the rule when what it computes changes, and only then."""
    return {n: without(params[n], SELECTION_KEYS) for n in names}


def optimizers(params: dict) -> list[str]:
    """grid.optimizer; absent: AdamW alone."""
    return params["grid"].get("optimizer") or [OPTIMIZERS[0]]


def expand_grid(params: dict) -> list[RunKeys]:
    """Every (M, batch, noise, optimizer, seed) of the grid, in a stable order (without grid.optimizer: the order
    of grids before it); a noise condition with its own `batch_sizes` or `M` runs only at those."""
    g, conds = params["grid"], params["noise"]["conditions"]
    return [RunKeys(parse_m(M), B, n, s, o) for M in g["M"] for B in g["batch_sizes"] for n in g["noise"]
            for o in optimizers(params) for s in g["seeds"] if B in conds[n].get("batch_sizes", [B])
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
            fams.setdefault(f"bym-{k.noise}{k.label}-B{k.batch}-s{k.seed}", []).append(k.run_id)
        if "by_noise" in ed["families"] and len(params["grid"]["noise"]) > 1:
            fams.setdefault(f"bynoise-M{m_label(k.M)}-B{k.batch}{k.label}-s{k.seed}", []).append(k.run_id)
    return {f: r for f, r in fams.items() if (len(r) == 1) == single}


def steps_for(params: dict, batch: int, noise: str = "none") -> int:
    """A run's schedule length (its budget in steps). A noise condition with `steps_as_batch: B_t` takes the
    steps batch B_t takes on the sequence budget (so at batch B it sees B/B_t times the sequences)."""
    b = params["train"]["budget"]
    per = params["noise"]["conditions"].get(noise, {}).get("steps_as_batch") or batch
    return b["steps"] if b["mode"] == "steps" else max(1, b["sequences"] // per)


ENGINE = ("cuda_graphs", "tf32")   # train's switches of how the step runs on CUDA
SIZING = ("ensemble_runs", "gpu_memory_gib", "share_conditions")   # train's keys of how runs are grouped into ensembles


def run_spec(params: dict, run_id: str) -> dict[str, Any]:
    """Everything one run needs, resolved (steps, micro-batch, noise condition, optimizer); JSON-serialisable.
    An sgd_momentum run's train.optimizer is train.sgd_momentum with `kind: sgd_momentum`; an AdamW run's spec is
    what it was before grid.optimizer existed (train.sgd_momentum is not part of it)."""
    keys = parse_run_id(run_id)
    train = {k: v for k, v in copy.deepcopy(params["train"]).items()   # how runs are grouped ≠ what they are; the
             if k not in (*SIZING, "sgd_momentum") and (k not in ENGINE or v)   # engine switches only when on,
             and (k != "rng" or v != RNGS[0])}   # the random stream only when not the one of runs before the key
    if keys.optimizer != OPTIMIZERS[0]:
        train["optimizer"] = {"kind": keys.optimizer, **copy.deepcopy(params["train"][keys.optimizer])}
    train["steps"] = steps_for(params, keys.batch, keys.noise)
    train["micro_batch"] = min(train["micro_batch"], keys.batch)
    spec = {
        "keys": keys.to_dict(),
        "data": copy.deepcopy(params["data"]),
        "model": copy.deepcopy(params["model"]),
        "train": train,
        "eval": copy.deepcopy(params["eval"]),
        "noise": _noise_spec(params, keys.noise, keys.batch),
        "exposure": copy.deepcopy(params.get("exposure")),
    }
    return spec


def _noise_spec(params: dict, name: str, batch: int) -> dict[str, Any]:
    """A run's noise condition: without batch_sizes and M (which runs exist is the grid's business, not the run's),
    a relative_dose resolved into the budget it stands for at the run's batch, relative_dose ×
    noise.batch_exposure[batch], to 12 significant digits (so 0.3 × 0.055 is the 0.0165 a hand-written budget
    gives, and the run's spec and hash are the same either way)."""
    c = {k: v for k, v in copy.deepcopy(params["noise"]["conditions"][name]).items() if k not in ("batch_sizes", "M")}
    if "relative_dose" in c:
        c["budget"] = budget_at(params, c.pop("relative_dose"), batch)
    return c


def budget_at(params: dict, relative_dose: float, batch: int) -> float:
    """The budget a relative dose stands for at `batch`: relative_dose × noise.batch_exposure[batch], to 12
    significant digits."""
    return float(f"{relative_dose * params['noise']['batch_exposure'][str(batch)]:.12g}")


def typed_spec(params: dict, run_id: str) -> RunSpec:
    """run_spec, typed: where a run's derived facts (hooks, injection window, checkpoints, outputs) are read."""
    return RunSpec.of(run_spec(params, run_id))


def spec_hash(spec: dict) -> str:
    """A run's identity: sha256 of its canonical JSON spec (16 hex digits), without `train.budget.stop_at`:
    where a run stops changes none of its steps, so a run stopped early resumes under a later stop."""
    t = spec["train"]
    same = {**spec, "train": {**t, "budget": {k: v for k, v in t["budget"].items() if k != "stop_at"}}}
    return hashlib.sha256(json.dumps(same, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# `train.ensemble_runs: auto` on the CPU: the default's 18, its two training jobs (36 runs) one per core on 2 cores
# (209-229 run-steps per job-second; 4 ensembles of 9 ran 201, README "Throughput on the default DAG").
CPU_ENSEMBLE_RUNS = 18


def ensemble_groups(params: dict) -> dict[str, list[str]]:
    """Ensembles: runs trained together in one process (iclnoise.run.train). Runs of one (batch, noise condition)
    share model shape, step count and training configuration; each such set is split into consecutive chunks (in
    grid order) of at most `train.ensemble_runs` runs, or with `auto` of as many runs as fit the GPU's memory
    (iclnoise.config.cost.fit_runs), CPU_ENSEMBLE_RUNS on the CPU. Group id `B{batch}-{noise}` (+ `-{optimizer}` for
    an optimizer other than AdamW, + `-c{k}` when chunked). With `train.share_conditions` the noise conditions of one
    batch size, optimizer and step count share ensembles: group id `B{batch}-steps{steps}` (+ the same suffixes)."""
    share = params["train"].get("share_conditions", False)
    by_key: dict[str, list[str]] = {}
    for k in expand_grid(params):
        cond = f"steps{steps_for(params, k.batch, k.noise)}" if share else k.noise
        by_key.setdefault(f"B{k.batch}-{cond}{k.label}", []).append(k.run_id)
    groups = {}
    for key, runs in by_key.items():
        chunks = _chunks(params, runs)
        for i, c in enumerate(chunks):
            groups[key if len(chunks) == 1 else f"{key}-c{i}"] = c
    return groups


def _chunks(params: dict, runs: list[str]) -> list[list[str]]:
    """One ensemble key's runs split as `train.ensemble_runs` says (ensemble_groups)."""
    cap = params["train"]["ensemble_runs"]
    if cap == "auto":
        limit = gpu_limit(params)
        if limit is not None:
            return fit_runs(params, runs, limit)
        cap = CPU_ENSEMBLE_RUNS
    return [runs[i:i + cap] for i in range(0, len(runs), cap)]


def fit_runs(params: dict, runs: list[str], limit: float) -> list[list[str]]:
    """`runs` (one ensemble key, grid order) split into consecutive chunks, each as long as its planned memory
    (iclnoise.config.memory.ensemble_memory) stays within `limit` bytes; a pool grows with M, so chunks may differ."""
    def need(ks: list[RunKeys]) -> int:
        return ensemble_memory(params, ks[0].batch, [k.M for k in ks])["total"]

    keys = [parse_run_id(r) for r in runs]
    chunks: list[list[RunKeys]] = []
    for k in keys:
        if chunks and need(chunks[-1] + [k]) <= limit:
            chunks[-1].append(k)
        elif need([k]) <= limit:
            chunks.append([k])
        else:
            raise ParamsError(f"train.ensemble_runs = 'auto': run {k.run_id} alone plans {need([k]) / 2**20:.1f} "
                              f"MiB, more than the {limit / 2**20:.1f} MiB a job may fill on this GPU; lower "
                              f"grid.M, eval.n_sequences or train.micro_batch")
    return [[k.run_id for k in c] for c in chunks]


def shared_spec(params: dict, runs: list[str]) -> dict:
    """The spec an ensemble's runs share: a run spec without its keys (iclnoise.run.train rebuilds them per run)."""
    spec = run_spec(params, runs[0])
    spec.pop("keys")
    return spec


def member_specs(shared: dict, runs: list[str]) -> list[dict]:
    """Each run's full spec from the shared spec; equal to `run_spec(params, run)` for every run of a group."""
    return [{"keys": parse_run_id(r).to_dict(), **copy.deepcopy(shared)} for r in runs]


def jobs(params: dict) -> dict[str, Any]:
    """The workflow's jobs (workflow/rules), by kind; the Snakefile makes its rules from this and iclnoise.config.cost
    counts it. `train`: ensemble → its runs (ensemble_groups); `probe`: run id → its probe sections
    (probe_sections; a run with none has no probe job); `ed`: family → its runs (ed_families), an analysis and a
    figures job each; `single`: the one-off jobs (llc_figures where llc is enabled, refined_figures where
    llc.refined covers a run)."""
    probe = {k.run_id: secs for k in expand_grid(params) if (secs := probe_sections(params, k))}
    single = ["training_figures", *["llc_figures"] * bool((params.get("llc") or {}).get("enabled")),
              *["refined_figures"] * any("refined" in s for s in probe.values()),
              "aggregate", "aggregate_figures", "report", "all"]
    return {"train": ensemble_groups(params), "probe": probe, "ed": ed_families(params), "single": single}


def has_batch_axis(params: dict) -> bool:
    """Whether the grid of `params` holds an arm of ≥ 3 batch sizes of plain runs at finite M (what
    iclnoise.analysis.verdicts.h1_batch.batch_arms finds in its outcomes): at equal data (source none, no
    steps_as_batch), or at batch B_t's steps (steps_as_batch B_t, with B_t's equal-data runs). The workflow declares
    the batch-axis table and figure only then."""
    conds, arms = params["noise"]["conditions"], {}
    for k in expand_grid(params):
        c = conds[k.noise]
        if c.get("source") == "none" and k.M != M_INF:
            arms.setdefault(int(c.get("steps_as_batch") or 0), set()).add(k.batch)
    data = arms.get(0, set())
    return len(data) >= 3 or any(len(bs | ({bt} & data)) >= 3 for bt, bs in arms.items() if bt)


def has_dose_series(params: dict) -> bool:
    """Whether the grid of `params` holds a dose series (what iclnoise.analysis.dose.dose_runs finds in its outcomes):
    some injected source, shape and schedule (constant, early or late) at a batch size with ≥ 2 distinct positive
    budgets (relative doses resolved), no emulated batch. The workflow declares the dose tables and figure only then."""
    g, conds = params["grid"], params["noise"]["conditions"]
    budgets: dict[tuple, set] = {}
    for name in g["noise"]:
        c = conds[name]
        if (c.get("source") in ("grad", "param") and c.get("schedule") in ("constant", "early", "late")
                and not c.get("emulate_batch")
                and not c.get("steps_as_batch") and (c.get("budget") or c.get("relative_dose") or 0) > 0):
            for b in c.get("batch_sizes") or g["batch_sizes"]:
                if b in g["batch_sizes"]:
                    level = c["budget"] if "budget" in c else budget_at(params, c["relative_dose"], b)
                    budgets.setdefault((c["source"], c.get("shape"), c["schedule"], b), set()).add(float(level))
    return any(len(v) >= 2 for v in budgets.values())
