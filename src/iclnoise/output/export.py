"""Reference sets written: a results directory's finished runs exported into a set with its provenance (export),
or a set grown by the runs of a later session (add_runs). Checked and drawn again by iclnoise.output.paper."""
from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ..core.io import read_json, read_metadata, read_parquet, replace_dir, write_parquet, write_text
from .paper import ALIGNMENT, _writable, apart, seal, verify

log = logging.getLogger(__name__)
SET_NAME = re.compile(r"[A-Za-z0-9._-]+")   # a set's directory name: what make paper can pass on


# injection.parquet (a row per injecting step: 26 MB for reference/noise's 40 000-step arms) stays out: nothing the
# paper draws reads it, and exposure.parquet carries its exact interval sums
RUN_TABLES = ("run.json", "metrics.parquet", "exposure.parquet", "llc.parquet", "stages.parquet", "geometry.parquet",
              "mech.parquet", "rllc.parquet", "susceptibility.parquet")


def _job_seconds(benchmarks: Path) -> dict:
    """Wall seconds per Snakemake job from its benchmark file (the `s` column), and their sum."""
    jobs = {}
    for f in sorted(benchmarks.rglob("*.tsv")):
        with open(f) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            jobs[str(f.relative_to(benchmarks).with_suffix(""))] = round(float(rows[-1]["s"]), 1)
    return {"jobs": jobs, "total_s": round(sum(jobs.values()), 1)}


def export(results: Path, out: Path, params: dict, workdir: Path, sources: Iterable[Path] = (),
           add: bool = False) -> dict:
    """Copy the paper's tables of `results` into `out` (replaced) and write provenance.json. `sources`: the params
    files, inputs like `results` and the benchmarks (`out` must be apart from all of them). `add`: keep the runs
    already in the set `out` (if any) and add the finished runs of `results` to them (add_runs)."""
    if not SET_NAME.fullmatch(out.name):
        raise SystemExit(f"{out}: a set's name ({out.name!r}) may hold only letters, digits, '.', '_' and '-' (make "
                         f"paper reads the sets' names from reference/*/, split at spaces); choose another --out")
    apart(out, [results, workdir / "benchmarks", *sources])
    with _exclusive(out):
        if add:
            return add_runs(results, out, params, workdir)
        if not (results / "aggregate" / "tests.parquet").exists():
            raise SystemExit(f"{results}/aggregate/tests.parquet is missing: run the workflow to the end first "
                             f"(snakemake --cores 2 ...), then export")
        runs = _grid_runs(results, params)
        final, tmp = _writable(out, "provenance.json")
        try:
            prov = _export(results, runs, tmp, params, workdir)
            replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return prov


@contextlib.contextmanager
def _exclusive(out: Path):
    """One export into the sets of a directory at a time: an flock on the directory that holds the set `out`
    (no file left behind), waited for: two `export --add` from two results directories each add their runs, in
    turn, to the set the other left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another export is writing a set in %s; waiting for it", out, out.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _grid_runs(results: Path, params: dict) -> list[Path]:
    """The run directories of `results` that are runs of `params`' grid, each checked (check_run); the others are
    left out, each named in the log (a grid changed since they trained: the workflow's aggregate has none of them)."""
    from ..config.grid import expand_grid

    planned = {k.run_id for k in expand_grid(params)}
    runs = sorted(p for p in (results / "runs").iterdir() if (p / "run.json").exists())
    for run in runs:
        if run.name not in planned:
            log.warning("%s: left out, not a run of these parameters' grid", run)
    runs = [r for r in runs if r.name in planned]
    for run in runs:
        check_run(run, params)
    return runs


def _export(results: Path, runs: list[Path], tmp: Path, params: dict, workdir: Path) -> dict:
    from ..config.grid import spec_hash

    specs = {}
    for run in runs:
        _copy_run(run, tmp / "runs" / run.name)
        specs[run.name] = spec_hash(read_json(run / "run.json"))
    shutil.copytree(results / "aggregate", tmp / "aggregate")
    if (results / "ed").exists():
        shutil.copytree(results / "ed", tmp / "ed")
    for name in ("summary.parquet", "summary.md", "report.md"):
        if (results / name).exists():
            shutil.copy2(results / name, tmp / name)
    trained = [read_metadata(p) for p in sorted((tmp / "runs").glob("*/metrics.parquet"))]
    commits = pd.Series([m.get("iclnoise.commit") for m in trained]).value_counts()   # runs trained at each commit
    agg = read_metadata(tmp / "aggregate" / "tests.parquet")                          # the one that aggregated them
    made = trained[0]
    return seal(tmp, {"commit": commits.index[0], "runs_per_commit": {str(k): int(v) for k, v in commits.items()},
                      "aggregate_commit": agg.get("iclnoise.commit"),
                      "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "params": params, "spec_hash": specs,
                      "versions": json.loads(made.get("iclnoise.versions", "{}")),
                      "wall_time": _job_seconds(workdir / "benchmarks")})


def _leaf_diff(a, b, path: str = "") -> list[str]:
    """The leaf keys where mappings `a` (what a run recorded) and `b` (what the parameters give) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _leaf_diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [f"{path} {a!r} (these parameters: {b!r})"]


def check_run(run: Path, params: dict) -> None:
    """SystemExit naming the file and what differs unless the run `run` is what `params` make of it: its run.json
    the spec they give its run id (as train checks), its LLC table computed with their llc.sampler. An export
    records `params` as the set's: a run of other parameters would be stated under the wrong ones."""
    from ..config import typed
    from ..config.grid import run_spec, spec_hash

    spec = read_json(run / "run.json")
    want = run_spec(params, run.name)
    if spec.get("spec_hash") != spec_hash(want):
        diff = _leaf_diff({k: v for k, v in spec.items() if k != "spec_hash"}, want)
        what = ("; ".join(diff[:3]) + ("; ..." if len(diff) > 3 else "")) if diff else \
            "its run.json's spec_hash is not its content's"
        raise SystemExit(f"{run}: trained with another spec than these parameters give it ({what}): pass the "
                         f"parameters it was trained with (--params, --configfile as the workflow ran), or train it "
                         f"again")
    llc = read_parquet(run / "llc.parquet") if (run / "llc.parquet").exists() and "llc" in params else None
    if llc is not None and len(llc):
        cfg = typed(params, "llc.sampler")
        row = llc.iloc[0]
        want_llc = {"epsilon": cfg.epsilon, "gamma": cfg.gamma, "nbeta": cfg.resolved_nbeta(), "chains": cfg.chains,
                    "burn_in": cfg.burn_in, "draws": cfg.draws, "batch_size": cfg.batch, "n": cfg.n,
                    "method": cfg.method}
        diff = [f"{k} {row[k]!r} (llc.sampler: {v!r})" for k, v in want_llc.items() if k in row.index
                and not (row[k] == v or isinstance(v, float) and math.isclose(float(row[k]), v, rel_tol=1e-9))]
        if diff:
            raise SystemExit(f"{run / 'llc.parquet'}: computed with other LLC settings than these parameters' "
                             f"({'; '.join(diff[:3])}): pass the parameters it was computed with, or rerun the run's "
                             f"probes (snakemake) under these")


def set_tables(params: dict, run_id: str) -> tuple[list[str], list[str]]:
    """The tables a set takes from the run `run_id` of `params`' grid: its training tables (metrics.parquet first)
    and the probe tables its probe sections make (iclnoise.config.grid.probe_sections, PROBE_TABLES; not
    llc_traces). KeyError or ValueError for a run not of the grid."""
    from ..config.grid import PROBE_TABLES, parse_run_id, probe_sections, typed_spec

    spec = typed_spec(params, run_id)
    trained = list(dict.fromkeys(["metrics.parquet", *(f for f in spec.outputs if f in RUN_TABLES)]))
    probes = [f for s in probe_sections(params, parse_run_id(run_id)) for f in PROBE_TABLES[s] if f in RUN_TABLES]
    return trained, probes


def finished_runs(results: Path, params: dict) -> list[Path]:
    """The runs of `results` that a set can take before the whole grid has run: in the grid of `params`, their
    training tables written and, after them, every probe table a set keeps that their probe sections make
    (set_tables). A run whose job is still training, or whose training was rerun after its probes, is left out;
    so is a run of another design that shares the results directory (its condition may be defined here too)."""
    from ..config.grid import expand_grid

    planned = {k.run_id for k in expand_grid(params)}
    done = []
    for run in sorted(p for p in (results / "runs").iterdir() if (p / "run.json").exists()):
        try:
            if run.name not in planned:
                raise KeyError(run.name)
            trained, probes = set_tables(params, run.name)
        except (KeyError, ValueError):
            log.warning("%s: left out, not a run of these parameters' grid", run)
            continue
        missing = [f for f in dict.fromkeys([*trained, *probes]) if not (run / f).exists()]
        trained_at = (run / "metrics.parquet").stat().st_mtime if not missing else None
        older = [f for f in probes if trained_at is not None and (run / f).stat().st_mtime < trained_at]
        if missing:
            log.warning("%s: left out, not finished (no %s yet)", run, ", ".join(missing))
        elif older:
            log.warning("%s: left out, its training tables are newer than its probes' (%s): retrained after them, "
                        "or a clock that moved; rerun its probes (snakemake) or touch them if they are current",
                        run, ", ".join(older))
        else:
            done.append(run)
    return done


def add_runs(results: Path, out: Path, params: dict, workdir: Path) -> dict:
    """Grow the reference set `out` by the finished runs of `results` (finished_runs), for a grid that takes more
    than one session to train: each session exports what it finished, and the set keeps what earlier sessions
    added. Every run of the grown set must be a run of `params`' grid with the spec `params` give it (so the set's
    runs are one experiment; other parameters: export afresh, without --add); a run in both is taken from
    `results`. The aggregate, the end-of-training summary and report.md are computed again from the grown set's
    per-run tables (as `iclnoise paper` does); provenance.json records the planned grid (`planned_runs`), each
    export (`exports`: when, how many runs it added and replaced) and the jobs' wall time of every export."""
    from ..analysis.aggregate import aggregate
    from ..config import typed
    from .figures.training import training_figures
    from .report import build

    old = verify(out) if out.exists() else {"spec_hash": {}, "exports": []}
    planned, new, kept = _growth(results, out, params)
    added = [r for r in new if r.name not in old["spec_hash"]]
    final, tmp = _writable(out, "provenance.json")
    draw = tmp.with_name(tmp.name + ".draw")
    try:
        for run in kept:
            shutil.copytree(run, tmp / "runs" / run.name)
        for run in new:
            _copy_run(run, tmp / "runs" / run.name)
        runs = sorted((tmp / "runs").iterdir())
        aggregate(runs, tmp / "aggregate", typed(params, "stats"))
        training_figures([r / "metrics.parquet" for r in runs], draw)
        for name in ("summary.parquet", "summary.md"):
            shutil.copy2(draw / name, tmp / name)
        write_text(build(tmp, params, Path(__file__).parent), tmp / "report.md")   # this code's checkout, not workdir's
        prov = seal(tmp, _grown_provenance(tmp, runs, old, params, planned, len(added), len(new) - len(added),
                                           workdir))
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(draw, ignore_errors=True)
    log.info("%s: %d runs (%d added, %d replaced, %d kept) of the %d planned", out, len(prov["spec_hash"]), len(added),
             len(new) - len(added), len(kept), len(planned))
    return prov


def _growth(results: Path, out: Path, params: dict) -> tuple[list[str], list[Path], list[Path]]:
    """add_runs' checks: the planned run ids of `params`' grid, the finished runs of `results` and the runs of `out`
    it keeps; SystemExit naming the run where a run is not of the grid or was trained with another spec."""
    from ..config.grid import expand_grid

    if (out / "ed").exists():
        raise SystemExit(f"{out}: holds essential-dynamics tables, which are computed over a family of runs and "
                         f"cannot be grown; export the set afresh (without --add)")
    planned = sorted(k.run_id for k in expand_grid(params))
    if not (results / "runs").is_dir():
        raise SystemExit(f"{results}/runs: no such directory; --results names the workflow's results directory")
    new = finished_runs(results, params)
    if not new:
        raise SystemExit(f"{results}: no finished run of these parameters' grid (trained and probed); nothing to add")
    for run in new:   # a corrupt table is named where it lies, not as its copy in the temporary set
        for name in RUN_TABLES:
            if name.endswith(".parquet") and (run / name).exists():
                read_parquet(run / name)
    kept = [p for p in sorted((out / "runs").glob("*")) if p.name not in {r.name for r in new}]
    for run in [*kept, *new]:
        if run.name not in planned:
            raise SystemExit(f"{run}: not a run of these parameters' grid; export the set afresh (without --add) "
                             f"with the parameters it was trained with")
        check_run(run, params)   # its spec (as train checks) and its LLC settings
    return planned, new, kept


def _grown_provenance(tmp: Path, runs: list[Path], old: dict, params: dict, planned: list[str], added: int,
                      replaced: int, workdir: Path) -> dict:
    """The grown set's provenance (before sealing): the earlier exports and this one, the jobs' wall time of
    every export (a job of this grid's ensembles or runs: a workdir shared with another design holds its jobs
    too), the planned grid."""
    from ..config.grid import ensemble_groups, spec_hash

    trained = [read_metadata(r / "metrics.parquet") for r in runs]
    commits = pd.Series([m.get("iclnoise.commit") for m in trained]).value_counts()
    mine = set(ensemble_groups(params)) | {r.name for r in runs}
    jobs = {k: s for k, s in _job_seconds(workdir / "benchmarks")["jobs"].items() if Path(k).name in mine}
    for job, s in old.get("wall_time", {}).get("jobs", {}).items():
        # the same measurement again (an earlier export of this workdir) counts once; a job of that name in
        # another session (resumed there, or another grouping) adds its time
        jobs[job] = s if jobs.get(job) in (None, s) else round(jobs[job] + s, 1)
    exported = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    exports = (old["exports"] if "exports" in old   # a set first written by a plain export: that export first
               else [{"exported": old["exported"], "added": len(old["spec_hash"])}])
    return {"commit": commits.index[0], "runs_per_commit": {str(k): int(v) for k, v in commits.items()},
            "aggregate_commit": read_metadata(tmp / "aggregate" / "tests.parquet").get("iclnoise.commit"),
            "exported": exported, "exports": [*exports, {"exported": exported, "added": added, "replaced": replaced}],
            "planned_runs": planned, "params": params,
            "spec_hash": {r.name: spec_hash(read_json(r / "run.json")) for r in runs},
            "versions": json.loads(trained[0].get("iclnoise.versions", "{}")),
            "wall_time": {"jobs": jobs, "total_s": round(sum(jobs.values()), 1)}}



def _copy_run(run: Path, dest: Path) -> None:
    """The tables of `run` that a set keeps (RUN_TABLES, and its alignment from injection.parquet) into `dest`."""
    dest.mkdir(parents=True)
    for name in RUN_TABLES:
        if (run / name).exists():
            shutil.copy2(run / name, dest / name)
    _export_alignment(run, dest)

def _export_alignment(run: Path, out: Path) -> None:
    """A noise-shaped run's logged alignment (figure 6 by noise shape, H5) as alignment.parquet: injection.parquet's
    rows where it changes (figures.align.alignment_rows), none where the run logs no alignment."""
    from .figures.align import ALIGNMENT_SCHEMA, alignment_rows

    if (run / "injection.parquet").exists():
        rows = alignment_rows(read_parquet(run / "injection.parquet"))
        if len(rows):
            write_parquet(rows, out / ALIGNMENT, ALIGNMENT_SCHEMA)
