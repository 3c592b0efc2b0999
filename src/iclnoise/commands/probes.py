"""`iclnoise llc | llc-calibrate | refined | stages | geometry | mech | ed | cnr | cnr-pathwise`: the probes of a
run's checkpoints, the essential dynamics of a family of runs, and a run's response to counterfactual noise, retrained
with common random numbers or estimated pathwise (the work is in iclnoise.run.probing, iclnoise.run.crn,
iclnoise.run.pathwise and the formula modules).

Each reads its params section from `--cfg` (llc, refined, stages and llc-calibrate the llc section; geometry, mech
and ed their own), and the probes of checkpoints take `every` (and llc `at`) from it.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import pyarrow as pa
import torch

from ..analysis.stats import paired_effects
from ..config import ParamsError, every_at, noise_conditions, typed
from ..core.io import CorruptFileError, read_json, write_parquet
from ..core.schedules import refined_steps
from ..probes.ed import EVENTS_SCHEMA, FORMS_SCHEMA, MAX_GAP, PCS_SCHEMA, SAMPLING_SCHEMA, VAR_SCHEMA
from ..probes.mech import run_summary
from ..run.crn import REALISATIONS_SCHEMA, REFERENCE, crn
from ..run.probing import (
    calibrate_for_run,
    essential_dynamics,
    geometry_for_run,
    llc_for_run,
    llc_steps,
    mech_for_run,
    refined_for_run,
    stages_for_run,
)
from ..run.runs import checked_spec
from . import add_cfg, doc, sections


def _sampling_args(ap: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, dict, str]:
    """The arguments llc and refined share (--run-dir, --cfg with the llc section, --threads, --device): the parsed
    arguments, the --cfg mapping and the device, with the threads and the log set."""
    ap.add_argument("--run-dir", required=True)
    add_cfg(ap, "llc")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or auto (cuda where visible)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    return a, sections(a.cfg, "llc"), device


def llc(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise llc", description="LLC per checkpoint of one run: every llc.every-th "
                                 "checkpoint and the last, or those nearest to llc.at.")
    a, cfg, device = _sampling_args(ap, argv)
    every, at = every_at(cfg, "llc")
    df = llc_for_run(a.run_dir, typed(cfg, "llc.sampler"), every, at=at, device=device)
    print(df[["step", "llc_mean", "llc_std", "mala_accept", "stability_ratio", "not_levelled", "negative", "diverged",
              "unstable", "escaped"]].to_string(index=False))


def refined(argv: list[str]) -> None:
    """Refined LLC of every component (each head, MLP, embed, unembed, all) and its susceptibility to new tasks at
    llc.refined.checkpoints of the LLC's checkpoints; writes rllc.parquet and susceptibility.parquet. The sampler:
    llc.sampler with llc.refined's chains, burn_in and draws."""
    ap = argparse.ArgumentParser(prog="iclnoise refined", description=refined.__doc__)
    a, cfg, device = _sampling_args(ap, argv)
    ref = typed(cfg, "llc.refined")
    sampler = ref.sampler(typed(cfg, "llc.sampler"))
    steps = refined_steps(llc_steps(a.run_dir, *every_at(cfg, "llc")), ref.checkpoints)
    t0 = time.process_time()
    rllc, sus = refined_for_run(a.run_dir, sampler, steps, ref.positions, ref.n_obs, device)
    heads = rllc[rllc["head"] >= 0].pivot(index="step", columns="component", values="llc_mean")
    print(heads.to_string(float_format=lambda v: f"{v:.2f}"))
    print(f"{len(steps)} checkpoints, {rllc.component.nunique()} components, {len(sus)} susceptibilities in "
          f"{time.process_time() - t0:.1f} CPU s")


def llc_calibrate(argv: list[str]) -> None:
    """Choose (ε, γ, nβ) inside SGLD's stable, non-escaped region (method §7): sweep ε × γ (× nβ) at the first, middle
    and last of the LLC's checkpoints past step 0 (the other settings: llc.sampler) and keep the largest ε whose
    estimate is unflagged and has levelled off in ε, at the smallest such γ. Writes <run-dir>/llc_calibration.parquet
    (the sweep), llc_calibration.json (the choice) and the figure."""
    from ..output.figures.llc import fig_llc_calibration

    ap = argparse.ArgumentParser(prog="iclnoise llc-calibrate", description=llc_calibrate.__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, nargs="+", default=None,
                    help="checkpoint steps (default: first, middle and last of the LLC's past step 0)")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4, 1e-3, 3e-3])
    ap.add_argument("--gammas", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    ap.add_argument("--nbetas", type=float, nargs="+", default=None, help="default: llc.sampler's nbeta")
    add_cfg(ap, "llc")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="figure stem (default: <run-dir>/llc_calibration)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    cfg = sections(a.cfg, "llc")
    base = typed(cfg, "llc.sampler")
    steps = a.steps or refined_steps(llc_steps(a.run_dir, *every_at(cfg, "llc")), 3)
    t0 = time.process_time()
    table, choice = calibrate_for_run(a.run_dir, base, steps, a.epsilons, a.gammas, a.nbetas or [base.nbeta], a.device)
    out = Path(a.out) if a.out else Path(a.run_dir) / "llc_calibration"
    fig_llc_calibration(table, out)
    cols = ["step", "nbeta", "gamma", "epsilon", "llc_mean", "llc_se", "stability_ratio", "mean_sampling_loss",
            "trivial_loss", "not_levelled", "unstable", "escaped", "plateau", "chosen"]
    print(table[cols].to_string(index=False))
    if undefined := read_json(Path(a.run_dir) / "llc_calibration.json")["undefined_steps"]:
        print(f"left out: steps {undefined}, negative at every stable setting (w* not near a minimum)")
    print(f"choice: {choice}" if choice else "no setting is unflagged and levelled off in ε: widen the sweep")
    print(f"{len(table)} estimates in {time.process_time() - t0:.1f} CPU s; wrote {out}.png")


def stages(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise stages", description=doc("probes.stages"))
    ap.add_argument("--run-dir", required=True)
    add_cfg(ap, "llc")
    a = ap.parse_args(argv)
    df = stages_for_run(a.run_dir, typed(sections(a.cfg, "llc"), "llc.stages"))
    print(df[["stage", "type", "start_step", "end_step", "kind", "delta_llc", "delta_loss"]].to_string(index=False))


def geometry(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise geometry", description=doc("probes.geometry"))
    ap.add_argument("--run-dir", required=True)
    add_cfg(ap, "geometry")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    cfg = sections(a.cfg, "geometry")
    torch.set_num_threads(a.threads)
    df = geometry_for_run(a.run_dir, typed(cfg, "geometry"), every_at(cfg, "geometry")[0])
    print(df[["step", "hessian_trace", "hessian_trace_ci95", "top_eigenvalue", "min_eigenvalue", "sam_sharpness",
              "sam_sharpness_se", "precond_trace", "precond_trace_ci95"]].to_string(index=False))


def mech(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise mech", description=doc("probes.mech"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    add_cfg(ap, "mech")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--figure", default=None, help="write the per-run head figure here (stem)")
    a = ap.parse_args(argv)
    cfg = sections(a.cfg, "mech")
    torch.set_num_threads(a.threads)
    t0 = time.time()
    df = mech_for_run(a.run_dir, typed(cfg, "mech"), every_at(cfg, "mech")[0])
    if a.figure:
        from ..output.figures.probes import fig_heads
        fig_heads(df, a.figure)
    print(json.dumps(run_summary(df), indent=1))
    print(f"{df.step.nunique()} checkpoints in {time.time() - t0:.1f}s")


def ed(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise ed", description=doc("probes.ed"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--family", required=True)
    ap.add_argument("--out", required=True, help="output directory, e.g. results/ed/<family>")
    add_cfg(ap, "ed")
    a = ap.parse_args(argv)
    res = essential_dynamics([Path(d) for d in a.run_dirs], a.family, typed(sections(a.cfg, "ed"), "ed"))
    out = Path(a.out)
    write_parquet(res["variance"], out / "variance.parquet", VAR_SCHEMA)
    write_parquet(res["events"], out / "events.parquet", EVENTS_SCHEMA)
    write_parquet(res["forms"], out / "forms.parquet", FORMS_SCHEMA)
    write_parquet(res["pcs"], out / "pcs.parquet", PCS_SCHEMA)
    write_parquet(res["sampling"], out / "sampling.parquet", SAMPLING_SCHEMA)
    ev = res["variance"].explained_variance_ratio
    print(f"{a.family}: {len(a.run_dirs)} runs; explained variance {', '.join(f'{v:.1%}' for v in ev)}; "
          f"{int(res['events'].kept.sum())} of {len(res['events'])} events significant; {len(res['forms'])} forms")
    for _, r in res["sampling"][res["sampling"].undersampled].iterrows():
        print(f"inconclusive: {r.run_id} is undersampled (checkpoints up to {r.max_gap_log:.2f} apart in log-step, "
              f"more than {MAX_GAP} × bandwidth {r.bandwidth}); its forms (or their absence) are not reliable")


CRN_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("seed", pa.int64()), pa.field("counterfactual", pa.string()),
    pa.field("metric", pa.string()), pa.field("t0", pa.int64()), pa.field("n_realisations", pa.int64()),
    pa.field("crn_mean", pa.float64()),        # ΔE f against the run's own noise, paired by realisation
    pa.field("crn_se", pa.float64()),          # its standard error over the realisations
    pa.field("mean", pa.float64()), pa.field("reference_mean", pa.float64()),   # E f under c and under self
    pa.field("seconds", pa.float64()),
])


def cnr(argv: list[str]) -> None:
    """CNR by common random numbers (method §13; iclnoise.run.crn): the run forked at t0 into (its own noise and
    each counterfactual) × N realisations of the noise stream (noise_seed 0..N-1), trained to the end in one
    ensemble; ΔE f ± SE per counterfactual and metric, paired by realisation. Counterfactuals: NAME[*k][+field=value]
    with NAME none, self or a noise condition of --cfg. Writes <run>/crn.parquet and <run>/crn_realisations.parquet."""
    ap = argparse.ArgumentParser(prog="iclnoise cnr", description=cnr.__doc__)
    ap.add_argument("run", help="the run directory (results/runs/<run>: its run.json; the run need not be trained)")
    ap.add_argument("--counterfactual", nargs="+", required=True, metavar="NAME")
    ap.add_argument("--realisations", type=int, default=8, help="noise streams per counterfactual (N)")
    ap.add_argument("--t0", type=int, default=None, help="the step to fork at (default: the start of the run's "
                    "injection window)")
    add_cfg(ap, "noise")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="default <run>/crn.parquet (and crn_realisations.parquet beside it)")
    ap.add_argument("--work", default=None, help="the members' run directories, so a killed call resumes (default "
                    "<run>/crn_work; removed once the tables are written)")
    ap.add_argument("--fork", default=None, help="a file for the run's state at t0: kept here when the members are "
                    "planted, or, where it exists, forked from (iclnoise cnr-pathwise --fork replays from it)")
    a = ap.parse_args(argv)
    try:
        conditions = noise_conditions(sections(a.cfg, "noise"))
        raw = checked_spec(a.run)
    except (ParamsError, CorruptFileError, FileNotFoundError) as e:
        raise SystemExit(f"iclnoise cnr: {e}") from None
    torch.set_num_threads(a.threads)
    work = Path(a.work) if a.work else Path(a.run) / "crn_work"
    if Path(a.run).resolve().is_relative_to(work.resolve()):
        raise SystemExit(f"iclnoise cnr: --work {work} holds the run directory; it is removed at the end: give "
                         f"another directory")
    if work.is_dir() and any(not (p.is_dir() and p.name.isdigit()) for p in work.iterdir()):
        raise SystemExit(f"iclnoise cnr: --work {work} holds files that are not members' run directories; it is "
                         f"removed at the end: give a new or empty directory")
    t = time.time()
    try:
        values = crn(raw, a.counterfactual, conditions, a.realisations, a.t0, a.device, work, a.fork)
    except ValueError as e:
        raise SystemExit(f"iclnoise cnr: {e}") from None
    seconds = time.time() - t
    keep = values.groupby(["counterfactual", "metric"], sort=False)[["run_id", "seed", "t0"]].first().reset_index()
    effects = paired_effects(values, REFERENCE).merge(keep, on=["counterfactual", "metric"]).assign(seconds=seconds)
    out = Path(a.out) if a.out else Path(a.run) / "crn.parquet"
    write_parquet(values, out.with_name(out.stem + "_realisations.parquet"), REALISATIONS_SCHEMA)
    write_parquet(effects, out, CRN_SCHEMA)
    shutil.rmtree(work, ignore_errors=True)
    show = effects[effects.metric.isin(["r", "ood_loss", "ood_delta_ridge"]) & (effects.counterfactual != REFERENCE)]
    print(show[["counterfactual", "metric", "n_realisations", "crn_mean", "crn_se", "mean"]].to_string(index=False))
    n = values[["counterfactual", "realisation"]].drop_duplicates().shape[0]
    print(f"{n} members from t0 = {int(values.t0.iloc[0])}: {seconds:.1f} s")


def cnr_pathwise(argv: list[str]) -> None:
    """CNR's first-order pathwise estimator (method §13; iclnoise.run.pathwise): the change of a run's final metrics
    had its own noise level been k times as large, ΔE f ≈ ḡ ln k, from N replays of [t0, T) along the realisations
    iclnoise cnr pairs, no counterfactual retrained. Writes <run>/cnr_pathwise.parquet."""
    from ..run.pathwise import PATHWISE_SCHEMA, pathwise

    ap = argparse.ArgumentParser(prog="iclnoise cnr-pathwise", description=cnr_pathwise.__doc__)
    ap.add_argument("run", help="the run directory (results/runs/<run>: its run.json; the run need not be trained)")
    ap.add_argument("--k", type=float, nargs="+", default=[0.5, 0.75, 1.5, 2.0],
                    help="levels × k to predict (first order: keep |ln k| / 2 ≤ 0.5, method §13)")
    ap.add_argument("--realisations", type=int, default=8, help="replays (noise_seed 0..N-1)")
    ap.add_argument("--t0", type=int, default=None, help="the step to replay from (default: the start of the "
                    "run's injection window)")
    ap.add_argument("--fork", default=None, help="the run's state at t0 as iclnoise cnr --fork keeps it (default: "
                    "train the first t0 steps here)")
    ap.add_argument("--jac-batch", type=int, default=64, help="sequences of each step's batch in its Jacobian")
    ap.add_argument("--layers", nargs="+", default=None, help="per layer group instead of the whole noise: each "
                    "group dotted parameter-name prefixes joined by commas (blocks.0 blocks.1 or "
                    "blocks.0.attn,blocks.1.attn), disjoint; the parameters none names form `rest`. The groups' g add "
                    "up to the whole noise's; each costs one more tangent of the replay")
    ap.add_argument("--windows", type=int, default=1, help="per window: [t0, T) cut into this many equal windows, "
                    "the level over each window's steps alone (with --layers, per group and window); they add up too")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="default <run>/cnr_pathwise.parquet")
    a = ap.parse_args(argv)
    try:
        raw = checked_spec(a.run)
    except (CorruptFileError, FileNotFoundError) as e:
        raise SystemExit(f"iclnoise cnr-pathwise: {e}") from None
    torch.set_num_threads(a.threads)
    try:
        df = pathwise(raw, a.k, a.realisations, a.t0, a.fork, a.jac_batch, a.device, a.layers, a.windows)
    except (ValueError, CorruptFileError, FileNotFoundError) as e:
        raise SystemExit(f"iclnoise cnr-pathwise: {e}") from None
    write_parquet(df, a.out or Path(a.run) / "cnr_pathwise.parquet", PATHWISE_SCHEMA)
    show = df[df.metric.isin(["r", "ood_loss", "ood_delta_ridge"])]
    print(show[["layers", "window_start", "window_stop", "metric", "k", "g", "g_se", "predicted",
                "predicted_se"]].to_string(index=False))
    print(f"{a.realisations} replays from t0 = {int(df.t0.iloc[0])}: {df.seconds.iloc[0]:.1f} s")
