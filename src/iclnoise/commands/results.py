"""`iclnoise figures | llc-figures | refined-figures | ed-figures | cnr-figure | aggregate | aggregate-figures |
report | export | paper`: what the workflow makes from the runs' tables (the work is in iclnoise.output.figures,
iclnoise.analysis.aggregate, iclnoise.output.report and iclnoise.output.paper). Only the figure commands draw."""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from . import add_cfg, doc, sections

log = logging.getLogger(__name__)


def figures(argv: list[str]) -> None:
    from ..output.figures.training import training_figures

    ap = argparse.ArgumentParser(prog="iclnoise figures", description=doc("output.figures.training"))
    ap.add_argument("metrics", nargs="+", help="per-run metrics.parquet files")
    ap.add_argument("--out-dir", default="results")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    s = training_figures(a.metrics, out)
    print(f"figure: {out / 'figures' / 'fig01_ood_loss.png'}; summary: {out / 'summary.md'} ({len(s)} runs)")


def cnr_figure(argv: list[str]) -> None:
    import pandas as pd

    from ..output.figures.cnr import fig_crn

    ap = argparse.ArgumentParser(prog="iclnoise cnr-figure", description=doc("output.figures.cnr"))
    ap.add_argument("table", help="a CSV of CNR's ground truth by common random numbers (columns counterfactual, "
                    "seed, metric, n_realisations, crn_mean, crn_se; an estimator's predicted, predicted_lo, "
                    "predicted_hi drawn beside them where present), e.g. reference/reproductions/crn_pathwise.csv")
    ap.add_argument("--out", default="results/figures/cnr_check")
    a = ap.parse_args(argv)
    df = pd.read_csv(a.table)
    missing = {"counterfactual", "seed", "metric", "n_realisations", "crn_mean", "crn_se"} - set(df.columns)
    if missing:
        raise SystemExit(f"{a.table}: not a CRN table (no column(s) {', '.join(sorted(missing))}); "
                         f"experiments/reproductions/crn_check.py writes one")
    print(f"wrote {', '.join(map(str, fig_crn(df, a.out)))}")


def llc_figures(argv: list[str]) -> None:
    from ..output.figures.llc import llc_figures as draw

    ap = argparse.ArgumentParser(prog="iclnoise llc-figures",
                                 description="Figures 3 (loss and LLC against M) and 4 (LLC over training).")
    ap.add_argument("--summary", required=True)
    ap.add_argument("--llc", nargs="+", required=True)
    ap.add_argument("--stages", nargs="*", default=[])
    ap.add_argument("--out-dir", default="results/figures")
    a = ap.parse_args(argv)
    print(f"wrote {', '.join(map(str, draw(a.summary, a.llc, a.stages, Path(a.out_dir))))}")


def refined_figures(argv: list[str]) -> None:
    from ..output.figures.refined import refined_figures as draw

    ap = argparse.ArgumentParser(prog="iclnoise refined-figures", description=doc("output.figures.refined"))
    ap.add_argument("--rllc", nargs="+", required=True, help="the probed runs' rllc.parquet files")
    ap.add_argument("--susceptibility", nargs="+", required=True, help="their susceptibility.parquet files")
    ap.add_argument("--out-dir", default="results/figures")
    a = ap.parse_args(argv)
    print(f"wrote {', '.join(map(str, draw(a.rllc, a.susceptibility, Path(a.out_dir))))}")


def ed_figures(argv: list[str]) -> None:
    from ..config import typed
    from ..output.figures.ed import ed_figures as draw

    ap = argparse.ArgumentParser(prog="iclnoise ed-figures", description=doc("output.figures.ed"))
    ap.add_argument("run_dirs", nargs="+", help="the family's run directories (their metrics.parquet: t_crit)")
    ap.add_argument("--family", required=True)
    ap.add_argument("--ed", required=True, help="the directory `iclnoise ed --out` wrote")
    ap.add_argument("--figures", required=True, help="figure directory")
    add_cfg(ap, "ed")
    a = ap.parse_args(argv)
    draw(a.run_dirs, a.family, Path(a.ed), Path(a.figures), typed(sections(a.cfg, "ed"), "ed"))


def aggregate(argv: list[str]) -> None:
    from ..analysis.aggregate import aggregate as run
    from ..config import typed

    ap = argparse.ArgumentParser(prog="iclnoise aggregate", description=doc("analysis.aggregate"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--out", default="results/aggregate")
    add_cfg(ap, "stats")
    a = ap.parse_args(argv)
    tests = run([Path(d) for d in a.run_dirs], Path(a.out), typed(sections(a.cfg, "stats"), "stats"))
    print(tests[["hypothesis", "test", "outcome", "estimate", "p_holm", "verdict"]].to_string(index=False))


def aggregate_figures(argv: list[str]) -> None:
    from ..output.figures.aggregate import aggregate_figures as draw

    ap = argparse.ArgumentParser(prog="iclnoise aggregate-figures", description=doc("output.figures.aggregate"))
    ap.add_argument("--aggregate", default="results/aggregate", help="the directory `iclnoise aggregate --out` wrote")
    ap.add_argument("--exposure", nargs="*", default=[], help="the runs' exposure.parquet files")
    ap.add_argument("--alignment", nargs="*", default=[],
                    help="the noise-shaped (nap*) runs' injection.parquet or alignment.parquet files (H5's figure)")
    ap.add_argument("--out-dir", default="results/figures")
    a = ap.parse_args(argv)
    print(f"wrote {', '.join(map(str, draw(Path(a.aggregate), a.exposure, Path(a.out_dir), a.alignment)))}")


def report(argv: list[str]) -> None:
    from ..core.io import write_text
    from ..output.report import build

    ap = argparse.ArgumentParser(prog="iclnoise report", description=doc("output.report"))
    ap.add_argument("--results", default="results")
    add_cfg(ap)
    ap.add_argument("--out", default="results/report.md")
    a = ap.parse_args(argv)
    write_text(build(Path(a.results), sections(a.cfg), Path.cwd()), a.out)
    print(f"wrote {a.out}")


def export(argv: list[str]) -> None:
    from ..config import load_params
    from ..output.export import export as run

    ap = argparse.ArgumentParser(prog="iclnoise export", description=doc("output.export"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--configfile", nargs="*", default=[], help="the config files the workflow ran with")
    ap.add_argument("--workdir", default=".", help="the directory the workflow ran in (its benchmarks/)")
    ap.add_argument("--out", required=True, help="e.g. reference/science")
    ap.add_argument("--add", action="store_true",
                    help="grow the set OUT: keep its runs and add the finished runs of RESULTS (a grid trained over "
                         "several sessions); the aggregate and report are computed again from the grown set")
    a = ap.parse_args(argv)
    prov = run(Path(a.results), Path(a.out), load_params(a.params, a.configfile), Path(a.workdir),
               [Path(a.params), *map(Path, a.configfile)], add=a.add)
    size = sum(p.stat().st_size for p in Path(a.out).rglob("*") if p.is_file())
    print(f"{a.out}: {len(prov['spec_hash'])} runs, {len(prov['sha256'])} files, {size / 2**20:.1f} MiB, "
          f"commit {prov['commit']}, jobs' wall time {prov['wall_time']['total_s']:.0f} s")


def paper(argv: list[str]) -> None:
    from ..core.io import write_bytes
    from ..output.paper import apart, attach_crn, rehash, update_aggregate, verify
    from ..output.paper import paper as run

    ap = argparse.ArgumentParser(prog="iclnoise paper", description=doc("output.paper"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("references", nargs="+", help="reference sets, e.g. reference/science reference/noise")
    ap.add_argument("--out", default="paper", help="figures and reports go to OUT/<set name>/ (make paper: "
                    "PAPER_OUT=DIR); it must be apart from the sets")
    ap.add_argument("--update-aggregate", action="store_true",
                    help="first rerun each set's aggregate with this code and write it into the set (after a change "
                         "of the aggregate; the runs are not retrained)")
    ap.add_argument("--stats-from", metavar="PARAMS",
                    help="with --update-aggregate: aggregate with this params file's stats section (e.g. params.yaml "
                         "after a new stats key), recorded in the set's provenance.json; default: the set's own")
    ap.add_argument("--attach-crn", metavar="TABLE",
                    help="first attach this CNR check to the set (one set): a CSV of CRN means with an estimator's "
                         "predictions (experiments/reproductions/crn_check.py --table), kept as <set>/crn/crn.csv "
                         "with its origin in provenance.json; figure 13 and the report's CNR section draw it")
    ap.add_argument("--note", default="", help="with --attach-crn: how the table was made (the command, the machine)")
    a = ap.parse_args(argv)
    if a.attach_crn and len(a.references) != 1:
        raise SystemExit("--attach-crn: give one reference set, the one the check's run belongs to")
    refs = []
    for ref in map(Path, a.references):
        if ref.name.endswith(".tmp") or ref.name.startswith("."):
            log.warning("%s: skipped, a temporary directory left by a killed export (or one still running), no "
                        "reference set; delete it when none runs: rm -r %s", ref, ref)
        else:
            refs.append(ref)
    if len({r.name for r in refs}) < len(refs):
        raise SystemExit(f"two reference sets share a name ({', '.join(map(str, refs))}): both would be drawn into "
                         f"{a.out}/<name>; pass one of them")
    for ref in refs:   # every set checked before the first is drawn
        apart(Path(a.out) / ref.name, refs)
        verify(ref)
    for ref in refs:
        if a.attach_crn:
            attach_crn(ref, Path(a.attach_crn), a.note)
            print(f"{ref.name}: CNR check {a.attach_crn} attached as {ref / 'crn' / 'crn.csv'}")
        if a.update_aggregate:
            from ..config import load_params
            params = load_params(a.stats_from) if a.stats_from else None
            print(f"{ref.name}: aggregate rerun; changed: {', '.join(update_aggregate(ref, params)) or 'nothing'}")
        t0 = time.perf_counter()
        pngs = run(ref, Path(a.out) / ref.name)
        if a.update_aggregate or a.attach_crn:   # the set's report follows its aggregate and its CNR check
            write_bytes((Path(a.out) / ref.name / "report.md").read_bytes(), ref / "report.md")
            rehash(ref)
        print(f"{ref.name}: {len(pngs)} figures and report.md in {Path(a.out) / ref.name} "
              f"({time.perf_counter() - t0:.0f} s)")
