"""Per-run probe drivers (run level): read a run directory, call the formulas, write the run's Parquet.

llc_for_run (iclnoise.probes.llc), stages_for_run (iclnoise.probes.stages), geometry_for_run (iclnoise.probes.geometry),
mech_for_run (iclnoise.probes.mech) and essential_dynamics of a family of runs (iclnoise.probes.ed). Checkpoints are
read through iclnoise.run.runs (verified against their manifest), data from the run's named streams.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from ..core.io import read_json, read_parquet, write_json, write_parquet
from ..core.probe_sections import ED, Geometry, Mech, Stages
from ..core.runspec import RunSpec
from ..core.schedules import select_steps, steps_at
from ..probes.ed import (
    EVENTS_SCHEMA,
    FORMS_SCHEMA,
    MAX_GAP,
    PCS_SCHEMA,
    SAMPLING_SCHEMA,
    bootstrap_curves,
    detect_events,
    forms,
    joint_pca,
    log_time,
    max_inner_gap,
    predictor_vectors,
)
from ..probes.geometry import GEOMETRY_SCHEMA, geometry_at
from ..probes.llc import (
    CALIBRATION_SCHEMA,
    LLC_SCHEMA,
    TRACE_SCHEMA,
    LLCConfig,
    LLCResult,
    calibration_sweep,
    choose_setting,
    estimate_llcs,
    flag_shared_levels,
    sampler_columns,
    undefined_centers,
)
from ..probes.mech import MECH_SCHEMA, mech_at
from ..probes.refined import RLLC_SCHEMA, SUSCEPTIBILITY_SCHEMA, position_loss, refined_llcs, tables
from ..probes.stages import STAGES_SCHEMA, stages
from . import runs

log = logging.getLogger(__name__)


# sequences in one batched SGLD pass (chains × checkpoints × mini-batch): the checkpoints of a run are
# sampled together up to this, which keeps memory bounded on the paper model's 8 × 1024-sequence chains.
# A GPU's step is launch-bound at 8192 (README, Benchmarks), so it takes 8 such checkpoints at once
# (≈ 30 GB of activations for the Hoogland model).
LAUNCH_SEQUENCES = {"cpu": 8192, "cuda": 65536}


def sampling_data(spec: RunSpec, n: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences from the run's own q_M on the named `llc` stream (training never uses it)."""
    b = runs.sampler(spec, "llc", device).batch(0, n)
    return b.xs, b.ys


def _on_terminal() -> bool:
    return sys.stderr.isatty()


def llc_for_run(run_dir: str | Path, cfg: LLCConfig, every: int = 1, progress: bool | None = None,
                at: dict | None = None, device: str = "cpu") -> pd.DataFrame:
    """Estimate the LLC at the selected checkpoints of a run; write llc.parquet and llc_traces.parquet.

    Checkpoints: every `every`-th (and the last), or with `at` = {"linear": a, "log": b} or {"steps": [...]}
    those nearest to a published schedule (`steps_at`). `device`: where the chains run (the sampling set and the
    checkpoints are moved there; chain noise comes from that device's generators).

    Progress bars only on a terminal (progress=None); wall-clock times go to the log, never to the
    parquet, so reruns are byte-identical. A killed job resumes: each batched pass is added to
    llc.partial.parquet (and its traces), kept only while the sampler settings and the checkpoints' sha256
    are those it was written with (llc.partial.json); the final tables replace them.
    """
    from ..core.model import mse_loss

    run_dir = Path(run_dir)
    show = _on_terminal() if progress is None else progress
    spec = RunSpec.of(runs.read_spec(run_dir))
    xs, ys = sampling_data(spec, cfg.n, device)
    chosen = llc_steps(run_dir, every, at)
    part = {k: run_dir / f"llc{k}.partial.parquet" for k in ("", "_traces")}
    marker = run_dir / "llc.partial.json"
    rows, traces = _llc_partial(run_dir, cfg, chosen, part, marker)
    todo = [s for s in chosen if s not in {r["step"] for r in rows}]
    launch = LAUNCH_SEQUENCES.get(torch.device(device).type, LAUNCH_SEQUENCES["cpu"])
    per = max(1, launch // (cfg.chains * min(cfg.batch, cfg.n)))  # checkpoints per batched pass
    for i in tqdm(range(0, len(todo), per), desc=f"LLC {spec.keys.run_id}", disable=not show,
                  mininterval=5):
        steps = todo[i:i + per]
        models = [runs.load_model(run_dir, step, device) for step in steps]
        centers = [{k: v.detach() for k, v in model.named_parameters()} for model in models]
        t0 = time.perf_counter()
        results = estimate_llcs(models[0], mse_loss, xs, ys, cfg, centers)
        log.info("steps %s: %d chains each, one batched pass, %.1f s", steps, cfg.chains, time.perf_counter() - t0)
        for step, r in zip(steps, results):
            row, trace = _llc_rows(spec, step, r, cfg)
            rows.append(row)
            traces += trace
        write_parquet(pd.DataFrame(traces), part["_traces"], TRACE_SCHEMA)
        write_parquet(pd.DataFrame(rows), part[""], LLC_SCHEMA)
    flag_shared_levels(rows)
    df = pd.DataFrame(rows).sort_values("step", kind="stable").reset_index(drop=True)
    write_parquet(pd.DataFrame(traces).sort_values(["step", "chain", "sgld_step"], kind="stable"),
                  run_dir / "llc_traces.parquet", TRACE_SCHEMA)
    write_parquet(df, run_dir / "llc.parquet", LLC_SCHEMA)
    for f in [*part.values(), marker]:
        f.unlink(missing_ok=True)
    return df


def _llc_partial(run_dir: Path, cfg: LLCConfig, chosen: list[int], part: dict[str, Path],
                 marker: Path) -> tuple[list[dict], list[dict]]:
    """The rows and trace rows a killed job left in the `part` tables, where `marker` says they were written with
    these sampler settings and these checkpoints' sha256 (else none); the marker then records the current ones."""
    key = {"sampler": dataclasses.asdict(cfg),
           "sha256": {str(s): h for s, h in runs.manifest(run_dir).items() if s in chosen}}
    rows, traces = [], []
    if marker.exists() and all(f.exists() for f in part.values()) and read_json(marker) == key:
        rows = read_parquet(part[""]).to_dict("records")
        traces = read_parquet(part["_traces"]).to_dict("records")
        log.info("resuming: %d of %d checkpoints already estimated", len(rows), len(chosen))
    write_json(key, marker)
    return rows, traces


def _llc_rows(spec: RunSpec, step: int, r: LLCResult, cfg: LLCConfig) -> tuple[dict, list[dict]]:
    """The LLC_SCHEMA row of one checkpoint's estimate, and its TRACE_SCHEMA rows (cfg.trace_points evenly spaced
    SGLD steps of every chain)."""
    log.info("step %d: λ̂ = %.3f ± %.3f, MALA acceptance %.3f, stability ratio %.3f (λ_max %.3g), E[L] %.4f vs "
             "trivial %.4f", step, r.llc_mean, r.llc_std, r.mala_accept, r.stability_ratio, r.lambda_max,
             r.mean_loss, r.trivial_loss)
    row = {**spec.key_dict, "step": step, "llc_mean": r.llc_mean, "llc_std": r.llc_std,
           "llc_se": r.llc_std / math.sqrt(cfg.chains), "llc_per_chain": r.llc_per_chain.tolist(),
           "init_loss": r.init_loss, "mala_accept": r.mala_accept, **sampler_columns(r),
           **r.flags, "method": cfg.method,
           "epsilon": cfg.epsilon, "gamma": cfg.gamma, "nbeta": r.nbeta,
           "chains": cfg.chains, "burn_in": cfg.burn_in, "draws": cfg.draws, "batch_size": cfg.batch,
           "n": cfg.n}
    keep = np.unique(np.linspace(0, r.traces.shape[1] - 1, min(cfg.trace_points, r.traces.shape[1])).astype(int))
    trace = [{"run_id": spec.keys.run_id, "step": step, "chain": c, "sgld_step": int(t),
              "loss": float(r.traces[c, t])} for c in range(cfg.chains) for t in keep]
    return row, trace


def geometry_for_run(run_dir: str | Path, cfg: Geometry, every: int = 1) -> pd.DataFrame:
    """Geometry probes at every `every`-th analysis checkpoint (and the last) on held-out q_M batches
    of the named stream "geometry" (never trained on). No wall-clock column: reruns are byte-identical."""
    from .runs import (
        checkpoint_precond,
        load_checkpoint,
        model_from_checkpoint,
        read_spec,
        sampler,
        saved_steps,
    )

    run_dir = Path(run_dir)
    spec = RunSpec.of(read_spec(run_dir))
    held = sampler(spec, "geometry")
    batches = [held.batch(i, cfg.n_heldout) for i in range(cfg.sam_batches)]
    rows = []
    for step in select_steps(saved_steps(run_dir), every):
        state = load_checkpoint(run_dir, step)
        model = model_from_checkpoint(state)
        rows.append({**spec.key_dict, "step": step,
                     **geometry_at(model, checkpoint_precond(state), batches, cfg, cfg.seed + step)})
    df = pd.DataFrame(rows, columns=GEOMETRY_SCHEMA.names)
    write_parquet(df, run_dir / "geometry.parquet", GEOMETRY_SCHEMA)
    return df


def mech_for_run(run_dir: str | Path, cfg: Mech, every: int = 1) -> pd.DataFrame:
    """Mechanistic probes at every `every`-th analysis checkpoint (and the last) of a run."""
    from ..core.tasks import eval_set
    from .runs import load_model, read_spec, sampler, saved_steps

    run_dir = Path(run_dir)
    spec = RunSpec.of(read_spec(run_dir))
    d, e = spec.data, spec.eval
    ood = eval_set("ood", spec.keys.M, e.n_sequences, d.K, d.D, d.noise_var, d.pool_seed, e.eval_seed,
                   d.task_prior)
    probe_batch = sampler(spec, "mech").batch(0, cfg.n_probe)
    rows = []
    for step in select_steps(saved_steps(run_dir), every):
        model = load_model(run_dir, step).eval()
        rows += [{**spec.key_dict, "step": step, **r} for r in mech_at(model, ood, probe_batch, d, e, cfg)]
    df = pd.DataFrame(rows, columns=MECH_SCHEMA.names)
    write_parquet(df, run_dir / "mech.parquet", MECH_SCHEMA)
    return df


def stages_for_run(run_dir: str | Path, cfg: Stages) -> pd.DataFrame:
    run_dir = Path(run_dir)
    llc = read_parquet(run_dir / "llc.parquet").sort_values("step")
    keys = llc.iloc[0][["run_id", "M", "seed", "batch", "noise"]].to_dict()
    llc = llc[~(llc.diverged | llc.negative)]
    metrics = read_parquet(run_dir / "metrics.parquet").set_index("step")
    df = stages(keys, llc.step.to_numpy(), llc.llc_mean.to_numpy(), metrics.loc[llc.step, "id_loss"].to_numpy(),
                cfg.sigma, cfg.plateau_tol)
    write_parquet(df, run_dir / "stages.parquet", STAGES_SCHEMA)
    return df


def essential_dynamics(run_dirs: list[Path], family: str, cfg: ED) -> dict[str, pd.DataFrame]:
    """Joint PCA of a family of runs, projected predictors, and per run its events and forms."""
    specs = [RunSpec.of(read_json(d / "run.json")) for d in run_dirs]
    preds = [read_parquet(d / "root_preds.parquet").sort_values("step") for d in run_dirs]
    Xs = [np.stack(p.preds.to_numpy()).astype(np.float64) for p in preds]
    scores, comps, mean, evr = joint_pca(np.concatenate(Xs), cfg.n_pcs)
    rows, o = [], 0
    for spec, p in zip(specs, preds):
        for r, step in enumerate(p.step):
            rows += [{"family": family, "kind": "run", **spec.key_dict, "step": int(step), "pc": k + 1,
                      "value": float(scores[o + r, k])} for k in range(scores.shape[1])]
        o += len(p)
    for name, vec in predictor_vectors(specs[0].data, specs[0].eval, sorted({s.keys.M for s in specs})).items():
        M = -1 if name == "ridge" else int(name.split("_")[1])
        rows += [{"family": family, "kind": name.split("_")[0], "run_id": name, "M": M, "seed": -1, "batch": -1,
                  "noise": "", "step": -1, "pc": k + 1, "value": float(v)}
                 for k, v in enumerate((vec - mean) @ comps.T)]
    pcs = pd.DataFrame(rows, columns=PCS_SCHEMA.names)
    var = pd.DataFrame({"family": family, "pc": np.arange(1, len(evr) + 1), "explained_variance_ratio": evr})
    ev_rows, form_rows, samp_rows = [], [], []
    for r, (spec, d, p, X) in enumerate(zip(specs, run_dirs, preds, Xs)):
        rid, steps = spec.keys.run_id, p.step.to_numpy()
        tau = log_time(steps)
        curves = bootstrap_curves(X, mean, comps, spec.eval.n_root, cfg.n_boot, cfg.seed + r)
        events = detect_events(tau, curves, cfg)
        ev_rows += [{"family": family, "run_id": rid, **e, "step": float(np.expm1(e["log_step"]))} for e in events]
        stage_steps = (read_parquet(d / "stages.parquet").query("kind != 'end'").step.to_numpy()
                       if (d / "stages.parquet").exists() else np.array([], dtype=int))
        found = forms(events, min(cfg.n_form_pcs, curves.shape[-1]), cfg.tolerance)
        gap = max_inner_gap(tau, cfg.margin)
        samp_rows.append({"family": family, **spec.key_dict, "n_checkpoints": len(steps), "max_gap_log": gap,
                          "bandwidth": cfg.bandwidth, "undersampled": gap > MAX_GAP * cfg.bandwidth,
                          "n_forms": len(found)})
        for f, t0 in enumerate(found):
            near = int(stage_steps[np.abs(log_time(stage_steps) - t0).argmin()]) if len(stage_steps) else -1
            form_rows.append({"family": family, **spec.key_dict, "form": f, "log_step": t0, "step": float(np.expm1(t0)),
                              "nearest_checkpoint": int(steps[np.abs(tau - t0).argmin()]), "nearest_stage_step": near,
                              "distance_to_stage_log": abs(float(log_time(near)) - t0) if near >= 0 else float("nan")})
    return {"pcs": pcs, "variance": var, "events": pd.DataFrame(ev_rows, columns=EVENTS_SCHEMA.names),
            "forms": pd.DataFrame(form_rows, columns=FORMS_SCHEMA.names),
            "sampling": pd.DataFrame(samp_rows, columns=SAMPLING_SCHEMA.names)}


def llc_steps(run_dir: str | Path, every: int, at: dict | None = None) -> list[int]:
    """The checkpoints llc_for_run estimates: every `every`-th and the last, or those nearest to `at`."""
    avail = runs.saved_steps(run_dir)
    return steps_at(avail, **at) if at else select_steps(avail, every)


def refined_for_run(run_dir: str | Path, cfg: LLCConfig, steps: Sequence[int], positions: Sequence[int] | None = None,
                    n_obs: int = 256, device: str = "cpu") -> tuple[pd.DataFrame, pd.DataFrame]:
    """Refined λ̂ and χ (perturbation "new_tasks": q = the run's q_M, q' = q_∞, fresh tasks) of every component at
    the run's checkpoints `steps`, one batched pass per checkpoint; writes rllc.parquet and susceptibility.parquet.

    Sampling set: the run's `llc` stream (iclnoise.run.probing.sampling_data); the n_obs-sequence observable sets are
    the next batch of the same stream, from q_M and from q_∞. `positions`: the loss restricted to those y_k."""
    from ..core.model import mse_loss
    from ..core.tasks import BatchSampler

    run_dir = Path(run_dir)
    spec = RunSpec.of(runs.read_spec(run_dir))
    d = spec.data
    xs, ys = sampling_data(spec, cfg.n, device)
    q = runs.sampler(spec, "llc", device).batch(1, n_obs)
    fresh = BatchSampler(None, d.K, d.D, d.noise_var, spec.keys.seed, device, stream=runs.STREAMS["llc"],
                         prior=d.task_prior)
    q2 = fresh.batch(1, n_obs)      # for an M = ∞ run the same sequences as q: χ = 0
    loss_fn = mse_loss if positions is None else position_loss(positions)
    data = "all" if positions is None else "k" + ",".join(str(p) for p in positions)
    rllc, sus = [], []
    for step in steps:
        model = runs.load_model(run_dir, step, device)
        r = refined_llcs(model, loss_fn, xs, ys, cfg, perturbations={"new_tasks": ((q.xs, q.ys), (q2.xs, q2.ys))})
        a, b = tables(spec.key_dict, step, data, r, cfg)
        rllc, sus = rllc + a, sus + b
    flag_shared_levels(rllc, by=("component",))
    rllc, sus = pd.DataFrame(rllc, columns=RLLC_SCHEMA.names), pd.DataFrame(sus, columns=SUSCEPTIBILITY_SCHEMA.names)
    write_parquet(rllc, run_dir / "rllc.parquet", RLLC_SCHEMA, spec.raw.get("spec_hash"))
    write_parquet(sus, run_dir / "susceptibility.parquet", SUSCEPTIBILITY_SCHEMA, spec.raw.get("spec_hash"))
    return rllc, sus


def calibrate_for_run(run_dir: str | Path, base: LLCConfig, steps: Sequence[int], epsilons: list[float],
                      gammas: list[float], nbetas: list[float | None] = (None,), device: str = "cpu"
                      ) -> tuple[pd.DataFrame, dict | None]:
    """The ε × γ (× nβ) sweep of `iclnoise.probes.llc.calibration_sweep` at the run's checkpoints `steps` (sampling set
    as llc_for_run's), and its choice (`choose_setting`; None: no setting is clean and levelled off in ε). Writes
    llc_calibration.parquet (the sweep, one row per setting and checkpoint) and llc_calibration.json (the choice, the
    checkpoints, the base settings and the checkpoints left out as not near a minimum, `undefined_centers`)."""
    from ..core.model import mse_loss

    run_dir = Path(run_dir)
    spec = RunSpec.of(runs.read_spec(run_dir))
    xs, ys = sampling_data(spec, base.n, device)
    models = [runs.load_model(run_dir, s, device) for s in steps]
    centers = [{k: v.detach() for k, v in m.named_parameters()} for m in models]
    rows = calibration_sweep(models[0], mse_loss, xs, ys, base, centers, epsilons, gammas, list(nbetas), list(steps))
    choice, undefined = choose_setting(rows), undefined_centers(rows)
    df = pd.DataFrame([{"run_id": spec.keys.run_id, "step": r.pop("center"), **r} for r in rows])
    write_parquet(df, run_dir / "llc_calibration.parquet", CALIBRATION_SCHEMA)
    write_json({"choice": choice, "steps": [int(s) for s in steps], "base": dataclasses.asdict(base),
                "undefined_steps": [int(s) for s in undefined]}, run_dir / "llc_calibration.json")
    return df, choice
