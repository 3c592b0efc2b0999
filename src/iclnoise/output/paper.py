"""Reference sets and the paper (issue 28): `iclnoise export` (iclnoise.output.export) keeps what the paper needs
from a finished results directory, `iclnoise paper` draws every figure and the report again from a reference set,
training nothing.

A reference set (reference/<name>/) is a results directory without checkpoints, resume states and the large
per-token tables: per run run.json and the per-checkpoint tables the figures and the aggregate read
(metrics, exposure, llc, stages, geometry, mech, rllc, susceptibility; for a noise-shaped run its alignment at each
NAP refresh, alignment.parquet, from injection.parquet), the aggregate tables, the essential-dynamics
tables, summary.parquet, and provenance.json (the commit and package versions the tables were written with, read
from their Parquet metadata; the resolved parameters, each run's spec hash, the jobs' measured wall time, each
file's sha256, and its own content hash, self_sha256). `iclnoise paper` first checks the set against
provenance.json (every file's sha256, none missing, none added; provenance.json's own hash) and refuses a set that
changed, naming the file and how to restore it from git. It then copies the set to an output directory,
reruns the aggregate from the per-run tables (its tables must equal the committed ones: the check is logged
and a difference fails) and draws every figure and the report there, with the functions the workflow's
figure and report commands call.

Output directories: export and paper refuse an output that is, contains or lies inside one of their inputs, and
an existing output that is not theirs (no provenance.json / report.md in it). They write a whole new directory
beside the output (hidden, unique: `.<name>.<random>.tmp`) and rename it into place (io.replace_dir), so a killed
command leaves the old output and a temporary directory (named in the log by the next export or paper), never a
half-written output, and two commands writing the same output do not collide.

A CNR check (method §13: a CRN effects table with an estimator's predictions, experiments/reproductions/
crn_check.py) is attached to a set with `iclnoise paper --attach-crn TABLE` (attach_crn): it lies at
reference/<name>/crn/crn.csv, provenance.json's `crn` says where it came from, and `iclnoise paper` draws it
(figure 13) and puts its r rows in the report.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from ..core.io import (
    CorruptFileError,
    atomic_dir,
    content_hash,
    read_json,
    read_metadata,
    read_parquet,
    replace_dir,
    write_bytes,
    write_json,
    write_text,
)

log = logging.getLogger(__name__)

ALIGNMENT = "alignment.parquet"   # derived at export from injection.parquet (noise-shaped runs: _export_alignment)
AGGREGATE_TABLES = ("outcomes.parquet", "thresholds.parquet", "tests.parquet")
SEAL = "self_sha256"   # provenance.json's own content hash
WRITTEN = ".written.json"   # the files `paper` wrote into OUT/<set>: it replaces only a directory of its own


def apart(out: Path, inputs: Iterable[Path]) -> None:
    """SystemExit unless the output directory `out` is apart from every input (file or directory): not one of
    them, not inside one, not holding one (replacing `out` deletes what it holds)."""
    o = out.resolve()
    for i in inputs:
        r = Path(i).resolve()
        how = "is" if o == r else "lies inside" if r in o.parents else "contains" if o in r.parents else None
        if how:
            raise SystemExit(f"output {out} {how} the input {i}: writing it would delete that input; choose an "
                             f"output directory apart from the inputs")


def _listed(out: Path, marker: str) -> set[str]:
    """The files (relative paths) the command that wrote `out` says it wrote: provenance.json's sha256 for a set,
    WRITTEN for paper's output; the marker itself included."""
    try:
        got = read_json(out / marker)
        names = set(got["sha256"]) if marker == "provenance.json" else set(got)
    except (CorruptFileError, KeyError, TypeError) as e:
        raise SystemExit(f"{out / marker}: unreadable ({e}), so what {out} holds cannot be told apart from what this "
                         f"command wrote; replacing it could delete files of yours: choose another output "
                         f"directory") from None
    return names | {marker}


def _writable(out: Path, marker: str) -> tuple[Path, Path]:
    """atomic_dir(out), after checking that an existing `out` is ours to replace: empty, or holding `marker` and
    no file but those the marker lists (_listed: what an earlier run of this command wrote there); naming in the
    log the temporary directories a killed export or paper left beside it. SystemExit otherwise, naming files."""
    if out.exists() and not (out.is_dir() and ((out / marker).exists() or not any(out.iterdir()))):
        raise SystemExit(f"{out} exists and holds no {marker}, so no earlier output of this command (or one of an "
                         f"older version, which did not list its files): replacing it would delete it; choose "
                         f"another output directory, or delete it yourself")
    if out.is_dir() and (out / marker).exists():
        listed = _listed(out, marker)
        foreign = sorted(n for p in out.rglob("*") if p.is_file() and (n := str(p.relative_to(out))) not in listed)
        if foreign:
            raise SystemExit(f"{out} holds {len(foreign)} file(s) this command did not write ({', '.join(foreign[:3])}"
                             f"{', ...' if len(foreign) > 3 else ''}): replacing it would delete them; move them out "
                             f"or choose another output directory")
    stale = [out.with_name(out.name + ".tmp"), out.with_name(out.name + ".aggregate.tmp")]
    for p in [*sorted(out.parent.glob(f".{out.name}.*")), *stale]:
        if p.suffix in (".tmp", ".old") and p.exists():
            log.warning("%s: ignored, a temporary directory left by a killed export or paper (or one still running); "
                        "delete it when none runs: rm -r %s", p, p)
    try:
        return atomic_dir(out)
    except OSError as e:
        raise SystemExit(f"cannot write {out}: {e.strerror or e}; choose a writable output directory (--out DIR; "
                         f"make paper PAPER_OUT=DIR)") from None


def _hashes(reference: Path) -> dict[str, str]:
    return {str(p.relative_to(reference)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(reference.rglob("*")) if p.is_file() and p != reference / "provenance.json"}


def seal(reference: Path, prov: dict) -> dict:
    """Write `reference`/provenance.json: `prov` with the sha256 of every other file of the set, and its own
    content hash (self_sha256: io.content_hash of the rest). The one place that computes them (export, a rerun
    aggregate, a new report); returns what it wrote."""
    prov = {k: v for k, v in prov.items() if k != SEAL}
    prov["sha256"] = _hashes(reference)
    prov[SEAL] = content_hash(prov)
    write_json(prov, reference / "provenance.json")
    return prov


CRN_TABLE = "crn/crn.csv"   # a CNR check attached to the set (attach_crn)
CRN_STEM = "fig13_crn"
CRN_COLUMNS = ("counterfactual", "seed", "metric", "n_realisations", "crn_mean", "crn_se", "predicted",
               "predicted_lo", "predicted_hi")


def attach_crn(reference: Path, table: Path, note: str) -> dict:
    """Attach a CNR check to a reference set (module docstring): `table` (a CSV with CRN_COLUMNS) copied to
    CRN_TABLE, provenance.json's `crn` set to where it came from (`note`, the table's path, the commit now) and the
    set sealed again; the set must match its provenance.json first. Returns the provenance written."""
    from datetime import datetime, timezone

    prov = verify(reference)
    try:
        df = pd.read_csv(table)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise SystemExit(f"{table}: not a readable CSV ({e}); experiments/reproductions/crn_check.py writes one")
    missing = [c for c in CRN_COLUMNS if c not in df]
    if missing:
        raise SystemExit(f"{table}: no column(s) {', '.join(missing)}: not a CNR check with an estimator's "
                         f"predictions (experiments/reproductions/crn_check.py --table writes one)")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (reference / CRN_TABLE).parent.mkdir(exist_ok=True)
    write_bytes(Path(table).read_bytes(), reference / CRN_TABLE)
    prov["crn"] = {"from": str(table), "note": note, "attached_at_commit": commit or "unknown",
                   "attached": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return seal(reference, prov)


def rehash(reference: Path) -> None:
    """provenance.json's sha256 of every other file of the set, and its own, computed again."""
    seal(reference, read_json(reference / "provenance.json"))


def verify(reference: Path) -> dict:
    """The provenance.json of a reference set, after checking it against its self_sha256 and every file of the set
    against its sha256 (none missing, none added). SystemExit otherwise, naming the file and how to restore it."""
    pj = reference / "provenance.json"

    def restore(p: Path) -> str:
        return (f"restore it from git: git checkout -- {p} (a deliberate change is a new export: iclnoise export "
                f"--out {reference})")

    if not pj.is_file():
        raise SystemExit(f"{reference}: not a reference set, {pj} is missing (iclnoise export writes it); "
                         f"a committed set: git checkout -- {reference}")
    try:
        prov = read_json(pj)
    except CorruptFileError:
        raise SystemExit(f"{pj}: unreadable JSON, truncated or corrupt; {restore(pj)}") from None
    if isinstance(prov, dict) and SEAL not in prov:
        raise SystemExit(f"{pj}: has no {SEAL} (written by an iclnoise export before issue 48), so its own edits "
                         f"cannot be told; export the set again: iclnoise export --out {reference}")
    if not isinstance(prov, dict) or prov.get(SEAL) != content_hash({k: v for k, v in prov.items() if k != SEAL}):
        raise SystemExit(f"{pj}: changed after the set was written (its content does not match its {SEAL}); "
                         f"{restore(pj)}")
    listed, found = prov["sha256"], _hashes(reference)
    problems = [(n, "is missing (provenance.json lists it)") for n in sorted(set(listed) - set(found))]
    problems += [(n, "differs from its sha256 in provenance.json (changed after the set was written)")
                 for n in sorted(set(listed) & set(found)) if listed[n] != found[n]]
    problems = [(reference / n, f"{what}; {restore(reference / n)}") for n, what in problems]
    problems += [(reference / n, f"is not part of the set (provenance.json does not list it); move it out of "
                  f"{reference}") for n in sorted(set(found) - set(listed))]
    if problems:
        (path, what), more = problems[0], len(problems) - 1
        raise SystemExit(f"{path} {what}" + (f" ({more} more file(s) of the set differ: git status {reference})"
                                              if more else ""))
    log.info("%s: %d files match provenance.json's sha256", reference, len(found))
    return prov


def update_aggregate(reference: Path, stats_from: dict | None = None) -> list[str]:
    """Rerun a reference set's aggregate from its per-run tables with this code and write it into the set (after a
    change of the aggregate's columns or gates: the runs are not retrained). The set must match its provenance.json
    first. `stats_from`: params whose stats section to aggregate with (e.g. params.yaml after a new stats key; it
    trains nothing), recorded in provenance.json's params; None: the set's own. provenance.json then records the
    commit that aggregated them and the new sha256 of every file. Returns the tables that changed."""
    import dataclasses

    from ..analysis.aggregate import aggregate
    from ..config import typed

    prov = verify(reference)
    if stats_from is not None:
        prov["params"] = {**prov["params"], "stats": dataclasses.asdict(typed(stats_from, "stats"))}
    _, tmp = atomic_dir(reference.with_name(reference.name + ".aggregate"))
    try:
        aggregate(sorted(p for p in (reference / "runs").iterdir() if (p / "metrics.parquet").exists()), tmp,
                  typed(prov["params"], "stats"))
        changed = []
        for f in sorted(tmp.iterdir()):
            old = reference / "aggregate" / f.name
            if not old.exists() or old.read_bytes() != f.read_bytes():
                changed.append(f.name)
                write_bytes(f.read_bytes(), old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prov["aggregate_commit"] = read_metadata(reference / "aggregate" / "tests.parquet").get("iclnoise.commit")
    seal(reference, prov)
    return changed


def git_changes(reference: Path) -> list[str] | None:
    """The set's files that are not as git holds them at HEAD (changed, added, removed: `git status` lines), or
    None where the set lies in no git checkout. provenance.json can be sealed again after an edit, so the set's own
    check cannot tell; git can."""
    try:
        inside = subprocess.run(["git", "-C", str(reference), "rev-parse", "--is-inside-work-tree"],
                                capture_output=True, text=True, timeout=60)
        if inside.returncode or inside.stdout.strip() != "true":
            return None
        st = subprocess.run(["git", "-C", str(reference), "status", "--porcelain", "--untracked-files=all", "--", "."],
                            capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line[3:] for line in st.stdout.splitlines()] if st.returncode == 0 else None


def origin(reference: Path, prov: dict, changed: list[str] | None = None) -> str:
    """The report's line on where a reference set's numbers come from: the commits its runs trained at, the one
    that aggregated them, the check of its files, and (`changed`, git_changes) whether git holds it as it is."""
    def short(c: str) -> str:
        return c[:7] + ("+dirty" if c.endswith("+dirty") else "")

    trained = ", ".join(f"{short(c)} ({n} runs)" for c, n in sorted(prov["runs_per_commit"].items(),
                                                                   key=lambda cn: (-cn[1], cn[0])))
    planned = prov.get("planned_runs")
    growing = (f" A set in progress: {len(prov['spec_hash'])} of the {len(planned)} runs its parameters plan, added "
               f"by {len(prov['exports'])} export(s) (iclnoise export --add); the verdicts are those of these runs."
               if planned and len(prov["spec_hash"]) < len(planned) else "")
    return (f"Reference set `{reference.name}`: trained at git {trained}; aggregated at git "
            f"{short(prov.get('aggregate_commit') or 'unknown')}; exported {prov.get('exported', '?')}; "
            f"its {len(prov['sha256'])} files match provenance.json's sha256. Parameters (below): the provenance's."
            + growing
            + (f" It is not as git holds it at HEAD ({len(changed)} file(s) changed, added or removed: "
               f"{', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): these numbers are of the changed set."
               if changed else ""))


def paper(reference: Path, out: Path) -> list[Path]:
    """Every figure and the report of a reference set, drawn again in `out` (replaced); returns the PNGs. The
    set must match its provenance.json, and the rerun aggregate's tables the set's (SystemExit naming the file
    otherwise)."""
    prov = verify(reference)
    changed = git_changes(reference)
    if changed:
        log.warning("%s: not as git holds it at HEAD (%d file(s): %s); the figures and report are of the changed set "
                    "(git status %s; git checkout -- %s restores it)", reference, len(changed),
                    ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else ""), reference, reference)
    final, tmp = _writable(out, WRITTEN)
    try:
        pngs = [final / "figures" / p.name for p in _render(reference, tmp, prov, changed)]
        write_json(sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()), tmp / WRITTEN)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pngs


def _render(reference: Path, out: Path, prov: dict, changed: list[str] | None = None) -> list[Path]:
    from ..analysis.aggregate import aggregate
    from ..config import typed
    from .figures.aggregate import aggregate_figures
    from .figures.ed import ed_figures
    from .figures.llc import llc_figures
    from .figures.refined import refined_figures
    from .figures.training import training_figures
    from .report import build

    params = prov["params"]
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("figures", "report.md"), dirs_exist_ok=True)
    runs = sorted(p for p in (out / "runs").iterdir() if (p / "metrics.parquet").exists())
    agg, figs = out / "aggregate", out / "figures"
    training_figures([r / "metrics.parquet" for r in runs], out)
    aggregate(runs, agg, typed(params, "stats"))
    extra = sorted(p for g in ("dose*.parquet", "batch_levels.parquet") for p in (reference / "aggregate").glob(g))
    for name in AGGREGATE_TABLES + tuple(p.name for p in extra):
        ours, theirs = read_parquet(agg / name), read_parquet(reference / "aggregate" / name)
        try:
            pd.testing.assert_frame_equal(ours, theirs)
        except AssertionError as e:
            raise SystemExit(f"{reference / 'aggregate' / name}: the aggregate rerun from the set's per-run tables "
                             f"differs from it ({e}); rerun it with this code: iclnoise paper --update-aggregate "
                             f"{reference}") from None
        log.info("%s: equal to the reference's (%d rows)", name, len(ours))
    aggregate_figures(agg, [r / "exposure.parquet" for r in runs if (r / "exposure.parquet").exists()], figs,
                      [r / ALIGNMENT for r in runs if (r / ALIGNMENT).exists()])
    llc = [r / "llc.parquet" for r in runs if (r / "llc.parquet").exists()]
    if llc:
        llc_figures(out / "summary.parquet", llc, [p.with_name("stages.parquet") for p in llc
                                                    if p.with_name("stages.parquet").exists()], figs)
    rllc = [r / "rllc.parquet" for r in runs if (r / "rllc.parquet").exists()]
    if rllc:
        refined_figures(rllc, [p.with_name("susceptibility.parquet") for p in rllc], figs)
    if (out / CRN_TABLE).exists():   # an attached CNR check (attach_crn)
        from .figures.cnr import fig_crn
        fig_crn(pd.read_csv(out / CRN_TABLE), figs / CRN_STEM)
    for fam in sorted(p for p in (out / "ed").glob("*") if (p / "sampling.parquet").exists()):
        fam_runs = read_parquet(fam / "sampling.parquet").run_id.tolist()
        ed_figures([out / "runs" / r for r in fam_runs], fam.name, fam, figs, typed(params, "ed"))
    write_text(build(out, params, Path.cwd(), origin(reference, prov, changed)), out / "report.md")
    return sorted(figs.glob("*.png"))
