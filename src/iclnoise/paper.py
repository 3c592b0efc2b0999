"""Reference sets and the paper (issue 28): `iclnoise export` keeps what the paper needs from a finished results
directory, `iclnoise paper` draws every figure and the report again from a reference set, training nothing.

A reference set (reference/<name>/) is a results directory without checkpoints, resume states and the large
per-token tables: per run run.json and the per-checkpoint tables the figures and the aggregate read
(metrics, exposure, injection, llc, stages, geometry, mech), the aggregate tables, the essential-dynamics
tables, summary.parquet, and provenance.json (the commit and package versions the tables were written with, read
from their Parquet metadata; the resolved parameters, each run's spec hash, the jobs' measured wall time, each
file's sha256). `iclnoise paper` copies a set to an output directory,
reruns the aggregate from the per-run tables (its tables must equal the committed ones: the check is printed
and a difference fails) and the figure and report commands there.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import pandas as pd

from .io import read_json, read_metadata, read_parquet, write_json

log = logging.getLogger(__name__)

RUN_TABLES = ("run.json", "metrics.parquet", "exposure.parquet", "injection.parquet", "llc.parquet",
              "stages.parquet", "geometry.parquet", "mech.parquet")
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
    from .runs import spec_hash

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


def paper(reference: Path, out: Path) -> list[Path]:
    """Every figure and the report of a reference set, drawn again in `out`; returns the PNGs. The rerun
    aggregate's tables must equal the reference's (SystemExit naming the table otherwise)."""
    from .cli import run_command

    prov = read_json(reference / "provenance.json")
    params = prov["params"]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("figures", "report.md"))
    runs = sorted(p for p in (out / "runs").iterdir() if (p / "metrics.parquet").exists())
    level = logging.getLevelName(logging.getLogger("iclnoise").getEffectiveLevel())
    run_command(level, ["figures", "--out-dir", str(out), *[str(r / "metrics.parquet") for r in runs]])
    agg = out / "aggregate"
    run_command(level, ["aggregate", *map(str, runs), "--out", str(agg), "--figures", str(out / "figures"),
                        "--cfg", json.dumps(params["stats"])])
    for name in AGGREGATE_TABLES:
        ours, theirs = read_parquet(agg / name), read_parquet(reference / "aggregate" / name)
        try:
            pd.testing.assert_frame_equal(ours, theirs)
        except AssertionError as e:
            raise SystemExit(f"{agg / name} differs from {reference / 'aggregate' / name}: {e}") from None
        log.info("%s: equal to the reference's (%d rows)", name, len(ours))
    llc = [r / "llc.parquet" for r in runs if (r / "llc.parquet").exists()]
    if llc:
        run_command(level, ["llc-figures", "--summary", str(out / "summary.parquet"), "--llc", *map(str, llc),
                            "--stages", *[str(p.with_name("stages.parquet")) for p in llc
                                          if p.with_name("stages.parquet").exists()],
                            "--out-dir", str(out / "figures")])
    ed_cfg = {k: v for k, v in params["ed"].items() if k not in ("enabled", "families", "seeds")}
    for fam in sorted(p for p in (out / "ed").glob("*") if (p / "sampling.parquet").exists()):
        fam_runs = read_parquet(fam / "sampling.parquet").run_id.tolist()
        run_command(level, ["ed-figures", *[str(out / "runs" / r) for r in fam_runs], "--family", fam.name,
                            "--ed", str(fam), "--figures", str(out / "figures"), "--cfg", json.dumps(ed_cfg)])
    run_command(level, ["report", "--results", str(out), "--params", json.dumps(params),
                        "--out", str(out / "report.md")])
    return sorted((out / "figures").glob("*.png"))


def cli_export(argv: list[str]) -> None:
    from .config import load_params

    ap = argparse.ArgumentParser(prog="iclnoise export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--configfile", nargs="*", default=[], help="the config files the workflow ran with")
    ap.add_argument("--workdir", default=".", help="the directory the workflow ran in (its benchmarks/)")
    ap.add_argument("--out", required=True, help="e.g. reference/science")
    a = ap.parse_args(argv)
    prov = export(Path(a.results), Path(a.out), load_params(a.params, a.configfile), Path(a.workdir))
    size = sum(p.stat().st_size for p in Path(a.out).rglob("*") if p.is_file())
    print(f"{a.out}: {len(prov['spec_hash'])} runs, {len(prov['sha256'])} files, {size / 2**20:.1f} MiB, "
          f"commit {prov['commit']}, jobs' wall time {prov['wall_time']['total_s']:.0f} s")


def cli_paper(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise paper", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("references", nargs="+", help="reference sets, e.g. reference/science reference/noise")
    ap.add_argument("--out", default="paper", help="figures and reports go to OUT/<set name>/")
    a = ap.parse_args(argv)
    for ref in map(Path, a.references):
        t0 = time.perf_counter()
        pngs = paper(ref, Path(a.out) / ref.name)
        print(f"{ref.name}: {len(pngs)} figures and report.md in {Path(a.out) / ref.name} "
              f"({time.perf_counter() - t0:.0f} s)")
