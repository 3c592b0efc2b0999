"""`iclnoise train | check | schema | verify`: train an ensemble, check a params file, write params.schema.yaml, read a
results directory back."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def train(argv: list[str]) -> None:
    import torch

    from ..config.grid import member_specs
    from ..run.train import train_ensemble
    from . import at_file

    ap = argparse.ArgumentParser(prog="iclnoise train",
                                 description="Train runs as one ensemble (resumes from their resume states).")
    ap.add_argument("--spec", required=True, help="a run spec as JSON (iclnoise.config.grid.run_spec), or @file.json; "
                    "with --runs, the spec shared by the ensemble (its keys are replaced per run)")
    ap.add_argument("--runs", default=None, help="comma-separated run ids of the ensemble (default: the spec's run)")
    ap.add_argument("--results", default="results", help="run directories are <results>/runs/<run>")
    ap.add_argument("--run-dir", default=None, help="the run directory of a single run (no --runs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    a = ap.parse_args(argv)
    spec = json.loads(at_file(a.spec))
    torch.set_num_threads(a.threads)
    if a.runs:
        specs = member_specs(spec, a.runs.split(","))
        dirs = [Path(a.results) / "runs" / s["keys"]["run_id"] for s in specs]
    else:
        specs, dirs = [spec], [Path(a.run_dir or Path(a.results) / "runs" / spec["keys"]["run_id"])]
    t0 = time.time()
    out = train_ensemble(specs, dirs, a.progress)
    steps = sum(int(m.step.iloc[-1]) for m in out)
    for s, m in zip(specs, out):
        last = m.iloc[-1]
        print(f"{s['keys']['run_id']}: {int(last.step)} steps; ood_loss {last.ood_loss:.4f} (dMMSE "
              f"{last.ood_loss_dmmse:.4f}, ridge {last.ood_loss_ridge:.4f}); r {last.r:.3f}"
              f"{'; DIVERGED' if last.diverged else ''}")
    print(f"{len(specs)} runs, {steps} run-steps in {time.time() - t0:.1f}s")


def check(argv: list[str]) -> None:
    from ..config import ParamsError, load_params, source_names
    from ..config.cost import COST_CONFIRM_CORE_HOURS, PARAMS_RECORD, cost_estimate, format_cost, rerun_note
    from ..config.grid import expand_grid, typed_spec

    ap = argparse.ArgumentParser(prog="iclnoise check",
                                 description="Validate a params file, list its runs and print the cost estimate.")
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--configfile", nargs="*", default=[], help="override files merged on top, as snakemake does")
    ap.add_argument("--results", default="results", help=f"compare with the params of <results>/{PARAMS_RECORD} "
                    "and print which jobs the change reruns")
    a = ap.parse_args(argv)
    try:
        params = load_params(a.params, a.configfile)
    except ParamsError as e:
        raise SystemExit(str(e))
    runs = expand_grid(params)
    print(f"{source_names([a.params, *a.configfile])}: valid; {len(runs)} runs")
    for k in runs:
        t = typed_spec(params, k.run_id).train
        n, stop = t.steps, t.last_step
        print(f"  {k.run_id}  ({n} steps{f', stopping at {stop}' if stop < n else ''})")
    est = cost_estimate(params)
    print(f"cost estimate: {format_cost(est)}")
    note = rerun_note(params, a.results)
    if note:
        print(note)
    if est["core_hours"] > COST_CONFIRM_CORE_HOURS:
        print(f"above the {COST_CONFIRM_CORE_HOURS:g} core-hour threshold: snakemake refuses it without "
              f"--config confirm_cost=true")


def schema(argv: list[str]) -> None:
    """Write src/iclnoise/params.schema.yaml from the typed sections' key declarations (iclnoise.config.schema);
    with --check, write nothing and exit 1 where the file differs from what they generate."""
    from ..config.schema import PATH, render
    from ..core.io import write_text

    ap = argparse.ArgumentParser(prog="iclnoise schema", description=schema.__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not the generated one")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not PATH.is_file() or PATH.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{PATH} is not the schema the typed sections generate: run `make schema` (iclnoise "
                             f"schema) and commit it")
        print(f"{PATH}: up to date")
        return
    write_text(text, PATH)
    print(f"wrote {PATH}")


def verify(argv: list[str]) -> None:
    """Read every Parquet and JSON file under a results directory, and check that every checkpoint a run's
    checkpoints.json lists is on disk with the bytes it lists (sha256); name each unreadable, missing or changed
    file and what to do (exit 1; a directory that does not exist: exit 2). scripts/dvc-snakemake.sh runs it last,
    so `dvc repro` never records a corrupt table."""
    from ..core.io import CorruptFileError, read_json, read_parquet
    from ..run.runs import MANIFEST, changed_checkpoints, checked_spec, missing_checkpoints

    ap = argparse.ArgumentParser(prog="iclnoise verify", description=verify.__doc__)
    ap.add_argument("dir", nargs="?", default="results")
    a = ap.parse_args(argv)
    if not Path(a.dir).is_dir():
        ap.error(f"{a.dir}: no such directory; name a results directory (default: results)")
    bad, n = [], 0
    for f in sorted(Path(a.dir).rglob("*")):
        if f.suffix not in (".parquet", ".json") or f.name.startswith("."):
            continue
        n += 1
        try:
            read_parquet(f) if f.suffix == ".parquet" else read_json(f)
        except CorruptFileError as e:
            bad.append(str(e))
            continue
        if f.name == "run.json" and f.parent.parent.name == "runs":
            try:
                checked_spec(f.parent)
            except CorruptFileError as e:
                bad.append(str(e))
        if f.name == MANIFEST:
            bad += [f"{c}: listed in {f}, missing; rerun snakemake: the run's training job trains it again (and its "
                    f"probes after it)" for c in missing_checkpoints(f.parent)]
            bad += [f"{c}: its bytes differ from the sha256 {f} lists (corrupt or replaced); delete the run directory "
                    f"{f.parent} and rerun snakemake to train it again" for c in changed_checkpoints(f.parent)]
    for line in bad:
        print(line)
    print(f"{a.dir}: {n} tables read, {len(bad)} unreadable, missing or changed")
    if bad:
        raise SystemExit(1)
