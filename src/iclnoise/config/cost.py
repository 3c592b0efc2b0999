"""What a grid costs before it runs: CPU core-hours per job kind (fitted step rates) and the memory one job plans
to allocate, with the checks that refuse a grid above a threshold (validation, `iclnoise check`, the Snakefile).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.runspec import RunSpec
from ..core.sections import ParamsError
from .grid import (
    ensemble_groups,
    expand_grid,
    job_cfg,
    jobs,
    parse_run_id,
    refined_covers,
    shared_spec,
    typed_spec,
)
from .memory import MAX_JOB_MEMORY, ensemble_memory


def memory_estimate(params: dict) -> dict[str, int]:
    """job_memory of the grid's most demanding training job (iclnoise.config.grid.ensemble_groups)."""
    keys = [[parse_run_id(r) for r in runs] for runs in ensemble_groups(params).values()]
    jobs = [ensemble_memory(params, ks[0].batch, [k.M for k in ks]) for ks in keys]
    return max(jobs, key=lambda e: e["total"])


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
    refined   set = (n + 2·n_obs)·K·(D+1)·4, chains = components·chains·min(batch, n)·a·2 (every component's
              chains in one pass; components = n_layers·(n_heads + 1) + 3)
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
    if any(refined_covers(params, k) for k in expand_grid(params)):
        r, s = llc["refined"], llc["sampler"]
        rows = (m["n_layers"] * (m["n_heads"] + 1) + 3) * (s["chains"] if r["chains"] is None else r["chains"])
        out["refined"] = {"set": (s["n"] + 2 * r["n_obs"]) * K * (D + 1) * 4,
                          "chains": rows * min(s["batch"], s["n"]) * a * 2}
    geo = params.get("geometry") or {}
    if geo.get("enabled"):
        out["geometry"] = {"heldout": 3 * geo["n_heldout"] * a * geo["sam_batches"]}
    mech = params.get("mech") or {}
    if mech.get("enabled"):
        out["mech"] = {"probe": mech["n_probe"] * a}
    return out


PROBE_KEYS = {"exposure": "exposure.heldout", "llc": "llc.sampler.n, chains and batch",
              "refined": "model.n_layers × n_heads, llc.refined.chains and llc.sampler.batch",
              "geometry": "geometry.n_heldout × sam_batches", "mech": "mech.n_probe"}


def check_memory(p: dict) -> None:
    """Refuse a grid whose training or probe jobs plan to allocate more than MAX_JOB_MEMORY."""
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
# relative to a plain one (exposure logged in both), less the closed loop's curvature probes, which cost
# CURVATURE_PROBE_COST plain steps each (injected_factor); only the injection window's share of a run's steps pays it.
# Issue 43 (bench/bench_noise.py --override <configs/science.yaml + exposure> --runs 9 --steps 200 --every 200
# --rounds 2, diagonal shape under the closed loop, batch 64, held-out 32, the two settings side by side on the 2
# cores, training paused), injecting step / exposure step: 8 probes every 25 steps grad 1.309, param 1.487; 16 every
# 10 (configs/dose.yaml) grad 1.565, param 1.677. The line through them: 0.20 (grad) and 0.15 (param) per probe per
# step, mean 0.17; with it the factors at 0 probes are 1.256 and 1.436, and the model is within 2.5 % of the four
# measurements. Earlier (default model, 8 probes every 25 steps): grad 1.22 on 12-run ensembles (bench_noise.py --runs
# 12 --every 400), param 1.19 on a single run before issue 27. Re-measure on new hardware.
# Issue 45 (bench/bench_noise.py --steps 400 --rounds 3, one run, batch 64, default model, 2 shared loaded cores):
# a NAP step costs 1.05-1.10x a plain injecting step at --every 100 (budget_nap 57.3 ms/step, budget_diagonal 54.3,
# budget_lowrank 52.0) and 1.27-1.38x at --every 25 (89.5 against 70.4 and 64.6), its refresh (16 × 4
# per-sequence gradients and two Gram eigendecompositions, ≈ 0.25 s here) amortised over exposure.every steps: at
# the default's and the science setting's 400 it is ≈ 2 %, so the NAP shapes take their source's INJECTED_FACTOR.
# SGD with heavy-ball momentum costs what AdamW does (46.5 against 46.0 ms/step with exposure logged), so
# grid.optimizer multiplies runs and ensembles (iclnoise.config.grid.ensemble_groups: one optimizer per ensemble).
STEP_MS_BASE = 3.03
STEP_MS_PER_RUN = 0.5
STEP_MS_PER_MFLOP = 0.0558
INJECTED_FACTOR = {"none": 1.0, "grad": 1.256, "param": 1.436}
CURVATURE_PROBE_COST = 0.17
COST_CONFIRM_CORE_HOURS = 2.0


def step_flops(params: dict, batch: int) -> float:
    """Training FLOPs of one update: 6 · batch · T · L · (4d² + 2d·d_mlp + 2T·d), T = 2K tokens
    (forward 2 FLOPs per multiply-add, backward twice the forward)."""
    m, T = params["model"], 2 * params["data"]["K"]
    d = m["d_model"]
    return 6.0 * batch * T * m["n_layers"] * (4 * d * d + 2 * d * m["d_mlp"] + 2 * T * d)


def injected_factor(params: dict, source: str) -> float:
    """Cost of a step that injects noise from `source` (none, grad or param) relative to a plain one:
    f = INJECTED_FACTOR[source] + CURVATURE_PROBE_COST · exposure.curvature_probes / exposure.curvature_every
    (the closed loop re-measures diag Ĥ every curvature_every steps from curvature_probes probes); 1 for none."""
    if source == "none":
        return 1.0
    e = params["exposure"]
    return INJECTED_FACTOR[source] + CURVATURE_PROBE_COST * e["curvature_probes"] / e["curvature_every"]


def step_ms(params: dict, batch: int, source: str = "none", runs: int = 1, injecting: float = 1.0) -> float:
    """Estimated CPU milliseconds of one step of an ensemble of `runs` runs (one core): the per-step overhead
    STEP_MS_BASE is paid once per ensemble, STEP_MS_PER_RUN + STEP_MS_PER_MFLOP · MFLOPs per run; a share
    `injecting` of the steps (an early or late window's fraction, else 1) costs injected_factor(params, source)
    times as much."""
    per_run = STEP_MS_PER_RUN + STEP_MS_PER_MFLOP * step_flops(params, batch) / 1e6
    return (STEP_MS_BASE + runs * per_run) * (1 + (injected_factor(params, source) - 1) * injecting)


JOB_START_S = 2.5  # CPU seconds to start one `iclnoise` job (python + torch + package imports; measured 2.1–4.2 s)


def probed_checkpoints(params: dict, spec: RunSpec, section: str) -> int:
    """How many checkpoints of a run a probe section (llc, geometry, mech) analyses."""
    from ..core.schedules import select_steps, steps_at
    steps = spec.train.checkpoints_planned
    at = params[section].get("at") if section == "llc" else None
    return len(steps_at(steps, **at) if at else select_steps(steps, params[section]["every"]))


def probe_seconds(params: dict, spec: RunSpec, section: str) -> float:
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
    return probed_checkpoints(params, spec, section) * per / 1000


# measured / modelled CPU seconds of the refined probe (refined_seconds) on the default run M16-B64-none-s0 (`iclnoise
# refined`, process time, 1 thread, under load): 24.7 s for the default llc.refined (model 41.7 s; the batched rows
# share the per-step overhead) and 102.2 s with burn_in 50, draws 100, n_obs 64 (model 151.8 s)
REFINED_FACTOR = 0.6


def refined_seconds(params: dict, spec: RunSpec) -> float:
    """Estimated CPU seconds of llc.refined in a run's probe job: at each of its checkpoints (refined_steps of the
    LLC's) one SGLD pass of components · chains rows (components = n_layers · (n_heads + 1) + 3), each row
    (burn_in + draws) steps at sampler.batch (step_ms) and at every draw two forward passes (⅓ step) over n_obs
    sequences; × REFINED_FACTOR (measured on one default run, see params.yaml)."""
    from ..core.schedules import refined_steps, select_steps, steps_at

    llc, m = params["llc"], params["model"]
    r, sm = llc["refined"], llc["sampler"]
    steps = spec.train.checkpoints_planned
    chosen = steps_at(steps, **llc["at"]) if llc.get("at") else select_steps(steps, llc["every"])
    n_ckpt = len(refined_steps(chosen, r["checkpoints"]))
    rows = (m["n_layers"] * (m["n_heads"] + 1) + 3) * (sm["chains"] if r["chains"] is None else r["chains"])
    burn_in = sm["burn_in"] if r["burn_in"] is None else r["burn_in"]
    draws = sm["draws"] if r["draws"] is None else r["draws"]
    per = rows * ((burn_in + draws) * step_ms(params, sm["batch"]) + draws * 2 * step_ms(params, r["n_obs"]) / 3)
    return REFINED_FACTOR * n_ckpt * per / 1000


def train_seconds(params: dict, runs: list[str]) -> float:
    """Estimated CPU seconds of one training job, the ensemble of `runs` (step_ms over the steps it trains, its
    injection window's share at the injected rate), with its start-up."""
    spec = typed_spec(params, runs[0])
    start, stop = spec.window or (0, 0)
    injecting = (stop - start) / spec.train.steps
    return JOB_START_S + spec.train.last_step * step_ms(params, spec.keys.batch, spec.noise.source, len(runs),
                                                        injecting) / 1000


def probe_job_seconds(params: dict, run_id: str, sections: list[str]) -> float:
    """Estimated CPU seconds of one run's probe job: its sections (probe_seconds, refined_seconds) and start-up."""
    spec = typed_spec(params, run_id)
    return JOB_START_S + sum(refined_seconds(params, spec) if s == "refined" else probe_seconds(params, spec, s)
                             for s in sections)


def cost_estimate(params: dict) -> dict[str, Any]:
    """Jobs of the DAG (iclnoise.config.grid.jobs), training steps summed over runs, and estimated core-hours: training
    (train_seconds), probe jobs (probe_job_seconds) and JOB_START_S for every other job."""
    runs, plan = expand_grid(params), jobs(params)
    other = 2 * len(plan["ed"]) + len(plan["single"])
    train_s = sum(train_seconds(params, members) for members in plan["train"].values())
    probe_s = sum(probe_job_seconds(params, r, secs) for r, secs in plan["probe"].items())
    return {"runs": len(runs), "jobs": len(plan["train"]) + len(plan["probe"]) + other,
            "run_steps": sum(typed_spec(params, k.run_id).train.last_step for k in runs),
            "train_core_hours": train_s / 3600, "core_hours": (train_s + probe_s + other * JOB_START_S) / 3600,
            "peak_job_memory": memory_estimate(params)["total"], "threshold_core_hours": COST_CONFIRM_CORE_HOURS}


def format_cost(est: dict) -> str:
    """One line: jobs, steps, CPU core-hours (all jobs; training alone), planned memory per training job."""
    return (f"{est['runs']} runs, {est['jobs']} jobs, {est['run_steps']:,} training steps, "
            f"≈ {est['core_hours']:,.2f} CPU core-hours ({est['train_core_hours']:,.2f} of them training; rates "
            f"measured on the default model, a GPU is faster), ≈ {_bytes(est['peak_job_memory'])} allocated per "
            f"training job")


def check_cost(params: dict, confirmed: bool = False) -> dict[str, Any]:
    """The cost estimate; raises ParamsError above COST_CONFIRM_CORE_HOURS unless `confirmed`."""
    est = cost_estimate(params)
    if est["core_hours"] > COST_CONFIRM_CORE_HOURS and not confirmed:
        raise ParamsError(f"this grid costs {format_cost(est)}: above the {COST_CONFIRM_CORE_HOURS:g} core-hour "
                          f"threshold. To start it anyway add `--config confirm_cost=true` to the snakemake command "
                          f"(or shrink grid.M, grid.seeds, grid.batch_sizes or train.budget)")
    return est


PARAMS_RECORD = "params.last.json"  # in the results directory: the params of the last successful snakemake run


def rerun_note(params: dict, results: str = "results") -> str | None:
    """format_rerun against the params the results were last made with (<results>/params.last.json, written by
    the Snakefile after a successful run), None where there is no record."""
    from ..core.io import CorruptFileError, read_json

    path = Path(results) / PARAMS_RECORD
    if not path.exists():
        return None
    try:
        return format_rerun(read_json(path), params)
    except (CorruptFileError, KeyError, TypeError, ValueError, AttributeError) as e:  # corrupt, or an older schema
        return f"{path}: cannot compare with it ({type(e).__name__}: {e}), so which jobs rerun is not estimated"


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two params trees (a whole section where one side lacks it)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix or "(all)"]
    return [k for key in sorted(set(old) | set(new), key=str)
            for k in changed_keys(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))]


def rerun_plan(old: dict, new: dict) -> dict[str, list[str]]:
    """The jobs of `new`'s DAG that a change from `old` (the params the results were made with) reruns, by job kind,
    from what each job's rule reads (workflow/rules): a training job its ensemble's shared spec; a probe job its
    run's training and probe sections' job_cfg; an ED family (and its figures) its runs' training and probe jobs and
    job_cfg ed; the training, LLC and refined figures their jobs' inputs; aggregate its inputs and stats; aggregate
    figures aggregate; the report any change. A job new to the grid counts as a rerun."""
    was, now = jobs(old), jobs(new)
    old_groups = {tuple(runs) for runs in was["train"].values()}
    train = [g for g, runs in now["train"].items()
             if tuple(runs) not in old_groups or shared_spec(old, runs) != shared_spec(new, runs)]
    retrained = {r for g in train for r in now["train"][g]}
    probe = []
    for r, secs in now["probe"].items():
        cfg = sorted({"refined": "llc"}.get(x, x) for x in secs)
        if r in retrained or was["probe"].get(r) != secs or job_cfg(old, *cfg) != job_cfg(new, *cfg):
            probe.append(r)
    reprobed = set(probe) if new["llc"]["enabled"] else set()
    ed = [f for f, runs in now["ed"].items()
          if was["ed"].get(f) != runs or job_cfg(old, "ed") != job_cfg(new, "ed")
          or any(r in retrained or r in reprobed for r in runs)]
    other = ["training_figures"] * bool(train) + ["llc_figures", "refined_figures"] * bool(probe)
    if train or probe or job_cfg(old, "stats") != job_cfg(new, "stats"):
        other += ["aggregate", "aggregate_figures"]
    other += ["report"] * bool(train or probe or ed or other or changed_keys(old, new))
    return {"train": train, "probe": probe, "ed": ed, "other": other}


def format_rerun(old: dict, new: dict) -> str:
    """Which keys changed since `old` and which jobs that reruns, with their estimated CPU core-hours."""
    keys = changed_keys(old, new)
    if not keys:
        return "no parameter changed since the results were made: nothing reruns for a parameter"
    plan, now = rerun_plan(old, new), jobs(new)
    train_s = sum(train_seconds(new, now["train"][g]) for g in plan["train"])
    probe_s = sum(probe_job_seconds(new, r, now["probe"][r]) for r in plan["probe"])
    other_s = (2 * len(plan["ed"]) + len(plan["other"])) * JOB_START_S
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    what = (f"{len(plan['train'])} training job(s){': ' + ', '.join(plan['train']) if plan['train'] else ''}; "
            f"{len(plan['probe'])} probe job(s) (every probe of a run reruns together: llc, refined LLC, geometry, "
            f"mech); {len(plan['ed'])} ED famil{'y' if len(plan['ed']) == 1 else 'ies'} (analysis and figures); "
            f"{', '.join(plan['other']) or 'no other job'}")
    return (f"changed since the results were made: {shown}; this reruns {what}: ≈ "
            f"{(train_s + probe_s + other_s) / 3600:,.2f} CPU core-hours")
