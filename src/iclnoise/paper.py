"""Reference sets and the paper (issue 28): `iclnoise export` keeps what the paper needs from a finished results
directory, `iclnoise paper` draws every figure and the report again from a reference set, training nothing.

A reference set (reference/<name>/) is a results directory without checkpoints, resume states and the large
per-token tables: per run run.json and the per-checkpoint tables the figures and the aggregate read
(metrics, exposure, llc, stages, geometry, mech, rllc, susceptibility), the aggregate tables, the essential-dynamics
tables, summary.parquet, and provenance.json (the commit and package versions the tables were written with, read
from their Parquet metadata; the resolved parameters, each run's spec hash, the jobs' measured wall time, each
file's sha256). `iclnoise paper` copies a set to an output directory,
reruns the aggregate from the per-run tables (its tables must equal the committed ones: the check is logged
and a difference fails) and draws every figure and the report there, with the functions the workflow's
figure and report commands call.
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import pandas as pd

from .io import read_json, read_metadata, read_parquet, write_json, write_text

log = logging.getLogger(__name__)

# injection.parquet (a row per injecting step: 26 MB for reference/noise's 40 000-step arms) stays out: nothing the
# paper draws reads it, and exposure.parquet carries its exact interval sums
RUN_TABLES = ("run.json", "metrics.parquet", "exposure.parquet", "llc.parquet", "stages.parquet", "geometry.parquet",
              "mech.parquet", "rllc.parquet", "susceptibility.parquet")
AGGREGATE_TABLES = ("outcomes.parquet", "thresholds.parquet", "tests.parquet")


def _job_seconds(benchmarks: Path) -> dict:
    """Wall seconds per Snakemake job from its benchmark file (the `s` column), and their sum."""
    jobs = {}
    for f in sorted(benchmarks.rglob("*.tsv")):
        with open(f) as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            jobs[str(f.relative_to(benchmarks).with_suffix(""))] = round(float(rows[-1]["s"]), 1)
    return {"jobs": jobs, "total_s": round(sum(jobs.values()), 1)}


def export(results: Path, out: Path, params: dict, workdir: Path) -> dict:
    """Copy the paper's tables of `results` into `out` (replaced) and write provenance.json."""
    from .grid import spec_hash

    if not (results / "aggregate" / "tests.parquet").exists():
        raise SystemExit(f"{results}/aggregate/tests.parquet is missing: run the workflow to the end first "
                         f"(snakemake --cores 2 ...), then export")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    specs = {}
    for run in sorted(p for p in (results / "runs").iterdir() if (p / "run.json").exists()):
        (tmp / "runs" / run.name).mkdir(parents=True)
        for name in RUN_TABLES:
            if (run / name).exists():
                shutil.copy2(run / name, tmp / "runs" / run.name / name)
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
    prov = {"commit": commits.index[0], "runs_per_commit": {str(k): int(v) for k, v in commits.items()},
            "aggregate_commit": agg.get("iclnoise.commit"),
            "exported": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "params": params, "spec_hash": specs, "versions": json.loads(made.get("iclnoise.versions", "{}")),
            "wall_time": _job_seconds(workdir / "benchmarks"),
            "sha256": {str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
                       for p in sorted(tmp.rglob("*")) if p.is_file()}}
    write_json(prov, tmp / "provenance.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return prov


def update_aggregate(reference: Path, stats_from: dict | None = None) -> list[str]:
    """Rerun a reference set's aggregate from its per-run tables with this code and write it into the set (after a
    change of the aggregate's columns or gates: the runs are not retrained). `stats_from`: params whose stats section
    to aggregate with (e.g. params.yaml after a new stats key; it trains nothing), recorded in provenance.json's
    params; None: the set's own. provenance.json records the commit that aggregated them and the new sha256 of every
    file. Returns the tables that changed."""
    import dataclasses

    from .aggregate import aggregate
    from .config import typed

    prov = read_json(reference / "provenance.json")
    if stats_from is not None:
        prov["params"] = {**prov["params"], "stats": dataclasses.asdict(typed(stats_from, "stats"))}
    tmp = reference.with_name(reference.name + ".aggregate.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    aggregate(sorted(p for p in (reference / "runs").iterdir() if (p / "metrics.parquet").exists()), tmp,
              typed(prov["params"], "stats"))
    changed = []
    for f in sorted(tmp.iterdir()):
        old = reference / "aggregate" / f.name
        if not old.exists() or old.read_bytes() != f.read_bytes():
            changed.append(f.name)
            shutil.copy2(f, old)
    shutil.rmtree(tmp)
    prov["aggregate_commit"] = read_metadata(reference / "aggregate" / "tests.parquet").get("iclnoise.commit")
    write_json(prov, reference / "provenance.json")
    rehash(reference)
    return changed


def rehash(reference: Path) -> None:
    """provenance.json's sha256 of every other file of the set, computed again."""
    prov = read_json(reference / "provenance.json")
    prov["sha256"] = {str(p.relative_to(reference)): hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in sorted(reference.rglob("*")) if p.is_file() and p.name != "provenance.json"}
    write_json(prov, reference / "provenance.json")


def paper(reference: Path, out: Path) -> list[Path]:
    """Every figure and the report of a reference set, drawn again in `out`; returns the PNGs. The rerun
    aggregate's tables must equal the reference's (SystemExit naming the table otherwise)."""
    from .aggregate import aggregate
    from .config import typed
    from .figures.aggregate import aggregate_figures
    from .figures.ed import ed_figures
    from .figures.llc import llc_figures
    from .figures.refined import refined_figures
    from .figures.training import training_figures
    from .report import build

    prov = read_json(reference / "provenance.json")
    params = prov["params"]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("figures", "report.md"))
    runs = sorted(p for p in (out / "runs").iterdir() if (p / "metrics.parquet").exists())
    agg, figs = out / "aggregate", out / "figures"
    training_figures([r / "metrics.parquet" for r in runs], out)
    aggregate(runs, agg, typed(params, "stats"))
    for name in AGGREGATE_TABLES:
        ours, theirs = read_parquet(agg / name), read_parquet(reference / "aggregate" / name)
        try:
            pd.testing.assert_frame_equal(ours, theirs)
        except AssertionError as e:
            raise SystemExit(f"{agg / name} differs from {reference / 'aggregate' / name}: {e}") from None
        log.info("%s: equal to the reference's (%d rows)", name, len(ours))
    aggregate_figures(agg, [r / "exposure.parquet" for r in runs if (r / "exposure.parquet").exists()], figs)
    llc = [r / "llc.parquet" for r in runs if (r / "llc.parquet").exists()]
    if llc:
        llc_figures(out / "summary.parquet", llc, [p.with_name("stages.parquet") for p in llc
                                                    if p.with_name("stages.parquet").exists()], figs)
    rllc = [r / "rllc.parquet" for r in runs if (r / "rllc.parquet").exists()]
    if rllc:
        refined_figures(rllc, [p.with_name("susceptibility.parquet") for p in rllc], figs)
    for fam in sorted(p for p in (out / "ed").glob("*") if (p / "sampling.parquet").exists()):
        fam_runs = read_parquet(fam / "sampling.parquet").run_id.tolist()
        ed_figures([out / "runs" / r for r in fam_runs], fam.name, fam, figs, typed(params, "ed"))
    write_text(build(out, params, Path.cwd()), out / "report.md")
    return sorted(figs.glob("*.png"))
