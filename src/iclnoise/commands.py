"""The probe commands `iclnoise llc | llc-calibrate | stages | geometry | mech | ed` (argument parsing and
printing; the work is in iclnoise.probes and the formula modules). Training, figures, aggregate and report
keep their commands beside their code (iclnoise.train, iclnoise.figures, iclnoise.aggregate, iclnoise.report).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch

from . import runs
from .ed import EVENTS_SCHEMA, FORMS_SCHEMA, MAX_GAP, PCS_SCHEMA, SAMPLING_SCHEMA, VAR_SCHEMA, ed_config
from .io import write_parquet
from .llc import LLCConfig, estimate_llc
from .mech import run_summary
from .probes import essential_dynamics, geometry_for_run, llc_for_run, mech_for_run, sampling_data, stages_for_run
from .sections import Geometry, Mech, Stages


def _doc(module: str) -> str:
    """The docstring of a formula module, as the command's description."""
    import importlib
    return importlib.import_module(f"iclnoise.{module}").__doc__ or ""


def llc(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise llc", description="LLC per checkpoint of one run.")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--sampler", required=True, help="JSON of the params.yaml llc.sampler section")
    ap.add_argument("--every", type=int, default=1, help="every k-th checkpoint (the last always; default: all)")
    ap.add_argument("--at", default="null", help='JSON {"linear": a, "log": b} (params.yaml llc.at); '
                    "overrides --every")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or auto (cuda where visible)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    df = llc_for_run(a.run_dir, LLCConfig.from_dict(json.loads(a.sampler)), a.every, at=json.loads(a.at),
                     device=device)
    print(df[["step", "llc_mean", "llc_std", "mala_accept", "not_levelled", "negative", "diverged"]]
          .to_string(index=False))


def llc_calibrate(argv: list[str]) -> None:
    """Sweep ε × γ on one checkpoint; plot the traces so a user can pick settings."""
    import matplotlib.pyplot as plt

    from .figures import style
    from .model import mse_loss

    ap = argparse.ArgumentParser(prog="iclnoise llc-calibrate", description=llc_calibrate.__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the last)")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3])
    ap.add_argument("--gammas", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    ap.add_argument("--cfg", required=True, help="JSON of the params.yaml llc.sampler section (epsilon and gamma "
                    "are swept)")
    ap.add_argument("--out", default=None, help="output stem (default: <run-dir>/llc_calibration)")
    a = ap.parse_args(argv)
    run_dir = Path(a.run_dir)
    spec = runs.read_spec(run_dir)
    step = a.step if a.step is not None else max(runs.checkpoint_steps(run_dir))
    base = LLCConfig.from_dict(json.loads(a.cfg))
    xs, ys = sampling_data(spec, base.n)
    model = runs.load_model(run_dir, step)
    style.setup()
    fig, axes = plt.subplots(len(a.gammas), len(a.epsilons), figsize=(3 * len(a.epsilons), 2.4 * len(a.gammas)),
                             squeeze=False, sharex=True)
    rows = []
    for i, g in enumerate(a.gammas):
        for j, e in enumerate(a.epsilons):
            cfg = LLCConfig(**{**asdict(base), "epsilon": e, "gamma": g})
            r = estimate_llc(model, mse_loss, xs, ys, cfg)
            ax = axes[i, j]
            for tr in r.traces:
                ax.plot(r.nbeta * (tr - r.init_loss), lw=0.7)
            ax.axvline(cfg.burn_in, color="grey", ls=":")
            ax.axhline(0, color="black", lw=0.5)
            bad = [k for k, v in r.flags.items() if v]
            flags = f" [{', '.join(bad)}]" if bad else ""
            ax.set_title(f"ε={e:g} γ={g:g}\nλ̂={r.llc_mean:.2f}±{r.llc_std:.2f}" + flags,
                         fontsize=8, color="firebrick" if bad else "black")
            rows.append({"epsilon": e, "gamma": g, "llc_mean": r.llc_mean, "llc_std": r.llc_std, **r.flags})
    for ax in axes[-1]:
        ax.set_xlabel("SGLD step")
    for ax in axes[:, 0]:
        ax.set_ylabel("nβ·(L − L(w*))")
    fig.suptitle(f"LLC calibration, {spec['keys']['run_id']} step {step}: pick the largest ε whose traces level "
                 f"off without divergence, and the smallest γ that keeps chains local", fontsize=9)
    fig.tight_layout()
    out = Path(a.out) if a.out else run_dir / "llc_calibration"
    table = pd.DataFrame(rows)
    style.save_figure(fig, out, table)
    print(table.to_string(index=False))
    print(f"wrote {out}.png")


def geometry(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise geometry", description=_doc("geometry"))
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--cfg", required=True,
                    help="JSON of the params.yaml geometry section: probes, lanczos_iters, lanczos_tol, sam_rho, "
                    "sam_batches, n_heldout, seed")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    df = geometry_for_run(a.run_dir, Geometry.from_dict(json.loads(a.cfg)), a.every)
    print(df[["step", "hessian_trace", "hessian_trace_ci95", "top_eigenvalue", "min_eigenvalue", "sam_sharpness",
              "sam_sharpness_se", "precond_trace", "precond_trace_ci95"]].to_string(index=False))


def mech(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise mech", description=_doc("mech"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--cfg", required=True, help="JSON of the params.yaml mech section: n_probe, ln_threshold, seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--figure", default=None, help="write the per-run head figure here (stem)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    df = mech_for_run(a.run_dir, Mech.from_dict(json.loads(a.cfg)), a.every)
    if a.figure:
        from .figures.probes import fig_heads
        fig_heads(df, a.figure)
    print(json.dumps(run_summary(df), indent=1))
    print(f"{df.step.nunique()} checkpoints in {time.time() - t0:.1f}s")


def stages(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise stages", description=_doc("stages"))
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--sigma", type=float, required=True, help="llc.stages.sigma: smoothing width in decades of "
                    "training steps")
    ap.add_argument("--plateau-tol", type=float, required=True, help="llc.stages.plateau_tol")
    a = ap.parse_args(argv)
    df = stages_for_run(a.run_dir, Stages(sigma=a.sigma, plateau_tol=a.plateau_tol))
    print(df[["stage", "type", "start_step", "end_step", "kind", "delta_llc", "delta_loss"]].to_string(index=False))


def ed(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise ed", description=_doc("ed"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--family", required=True)
    ap.add_argument("--out", required=True, help="output directory, e.g. results/ed/<family>")
    ap.add_argument("--cfg", required=True, help="JSON of the params.yaml ed section")
    a = ap.parse_args(argv)
    res = essential_dynamics([Path(d) for d in a.run_dirs], a.family, ed_config(json.loads(a.cfg)))
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


def verify(argv: list[str]) -> None:
    """Read every Parquet and JSON file under a results directory; name each unreadable one and what to do
    (exit 1). scripts/dvc-snakemake.sh runs it last, so `dvc repro` never records a corrupt table."""
    from .io import CorruptFileError, read_json, read_parquet

    ap = argparse.ArgumentParser(prog="iclnoise verify", description=verify.__doc__)
    ap.add_argument("dir", nargs="?", default="results")
    a = ap.parse_args(argv)
    bad, n = [], 0
    for f in sorted(Path(a.dir).rglob("*")):
        if f.suffix not in (".parquet", ".json") or f.name.startswith("."):
            continue
        n += 1
        try:
            read_parquet(f) if f.suffix == ".parquet" else read_json(f)
        except CorruptFileError as e:
            bad.append(str(e))
    for line in bad:
        print(line)
    print(f"{a.dir}: {n} tables read, {len(bad)} unreadable")
    if bad:
        raise SystemExit(1)
