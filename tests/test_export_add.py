"""`iclnoise export --add` (issue 43): a grid that takes several sessions to train grows its reference set session by
session, and the grown set is what one export of all its runs would be: the same aggregate, every file sealed,
what each export added recorded; a run of another spec, or one not yet probed, is not taken.

The runs are reference/science's (their per-run tables stand in for a session's finished results directory), with
the parameters its provenance records."""
import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from iclnoise.analysis.aggregate import aggregate
from iclnoise.commands.results import export as export_cmd
from iclnoise.config import typed
from iclnoise.core.io import read_parquet
from iclnoise.output.export import export, finished_runs
from iclnoise.output.paper import AGGREGATE_TABLES, origin, verify
from iclnoise.output.report import code_version

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCIENCE = ROOT / "reference" / "science"
FIRST = [f"M{m}-B64-none-s0" for m in (1, 16, "inf")]
SECOND = [f"M{m}-B64-none-s{s}" for m in (1, 16, "inf") for s in (1, 2)]


@pytest.fixture(scope="module")
def params() -> dict:
    return json.loads((SCIENCE / "provenance.json").read_text())["params"]


def session(tmp: Path, runs: list[str]) -> Path:
    """A results directory holding `runs` as a session leaves them finished (reference/science's tables): no probe
    table older than the training tables. The checkout's own times cannot say that: a fresh clone writes a run's files
    in name order (metrics.parquet after llc.parquet and mech.parquet), and where the clock ticks between them the
    probes read as older. So every copied table gets one time."""
    for r in runs:
        shutil.copytree(SCIENCE / "runs" / r, tmp / "runs" / r)
        for f in (tmp / "runs" / r).rglob("*"):
            os.utime(f, (1_700_000_000, 1_700_000_000))
    return tmp


def test_a_set_grown_over_two_sessions_equals_one_export_of_all_its_runs(tmp_path, params):
    out = tmp_path / "reference" / "dose"
    bench = tmp_path / "benchmarks" / "train"   # the first session's job, exported twice, counts once
    bench.mkdir(parents=True)
    (bench / "B64-none.tsv").write_text("s\th:m:s\n100.0\t0:01:40\n")
    export(session(tmp_path / "s1", FIRST), out, params, tmp_path, add=True)
    first = export(tmp_path / "s1", out, params, tmp_path, add=True)
    assert sorted(first["spec_hash"]) == sorted(FIRST)
    assert [(e["added"], e["replaced"]) for e in first["exports"]] == [(3, 0), (0, 3)]
    assert first["wall_time"] == {"jobs": {"train/B64-none": 100.0}, "total_s": 100.0}
    (bench / "B64-none.tsv").write_text("s\th:m:s\n50.0\t0:00:50\n")   # the second session's job of that name
    prov = export(session(tmp_path / "s2", SECOND), out, params, tmp_path, add=True)
    assert prov["wall_time"]["total_s"] == 150.0
    assert verify(out) == prov
    assert sorted(prov["spec_hash"]) == sorted(FIRST + SECOND) and [e["added"] for e in prov["exports"]] == [3, 0, 6]
    assert len(prov["planned_runs"]) == 54 and set(prov["spec_hash"]) < set(prov["planned_runs"])
    assert "A set in progress: 9 of the 54 runs its parameters plan, added by 3 export(s)" in origin(out, prov)
    for r in FIRST + SECOND:   # each run's tables as trained, its spec the one its hash names
        committed = SCIENCE / "runs" / r / "metrics.parquet"
        assert (out / "runs" / r / "metrics.parquet").read_bytes() == committed.read_bytes()
        assert prov["spec_hash"][r] == json.loads((SCIENCE / "provenance.json").read_text())["spec_hash"][r]
    once = tmp_path / "once"   # the aggregate of all nine runs at once
    aggregate([SCIENCE / "runs" / r for r in sorted(FIRST + SECOND)], once, typed(params, "stats"))
    for name in AGGREGATE_TABLES:
        pd.testing.assert_frame_equal(read_parquet(out / "aggregate" / name), read_parquet(once / name))
    assert len(read_parquet(out / "summary.parquet")) == 9 and (out / "report.md").read_text().startswith("# Does")
    # the report names the code that computed it (this checkout), not the workdir's (here no checkout at all)
    assert f"from {code_version(ROOT / 'src' / 'iclnoise')}." in (out / "report.md").read_text().splitlines()[2]


def test_the_command_grows_the_set_and_takes_only_finished_runs_of_its_spec(tmp_path, params):
    results = session(tmp_path / "s1", FIRST + ["M16-B64-none-s1"])
    out = tmp_path / "set"   # the committed files give the science runs their specs (tests/test_optimizer.py)
    argv = ["--results", results, "--params", ROOT / "params.yaml", "--configfile", ROOT / "configs" / "science.yaml",
            "--workdir", tmp_path, "--out", out, "--add"]
    # probed before it trained again: its probes are older than its metrics, so it is not finished
    old = (results / "runs" / "M16-B64-none-s0" / "llc.parquet").stat().st_mtime
    os.utime(results / "runs" / "M16-B64-none-s0" / "metrics.parquet", (old + 60, old + 60))
    # still training: its probe job has not run (seed 1 is not probed in this grid: only metrics are needed)
    (results / "runs" / "M1-B64-none-s0" / "mech.parquet").unlink()
    assert [r.name for r in finished_runs(results, params)] == ["M16-B64-none-s1", "Minf-B64-none-s0"]
    with pytest.raises(SystemExit) as e:   # a mistyped results directory: one line saying what --results names
        export_cmd([str(a) for a in [*argv[:1], tmp_path / "nothere", *argv[2:]]])
    assert "nothere/runs: no such directory" in str(e.value.code) and not out.exists()
    export_cmd([str(a) for a in argv])
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["M16-B64-none-s1", "Minf-B64-none-s0"]
    spec = json.loads((results / "runs" / "M16-B64-none-s1" / "run.json").read_text())
    spec["spec_hash"] = "0123456789abcdef"   # trained with another spec than the parameters give it
    (results / "runs" / "M16-B64-none-s1" / "run.json").write_text(json.dumps(spec))
    with pytest.raises(SystemExit) as e:
        export_cmd([str(a) for a in argv])
    assert "M16-B64-none-s1: trained with another spec" in str(e.value.code)
    assert sorted(verify(out)["spec_hash"]) == ["M16-B64-none-s1", "Minf-B64-none-s0"]   # the set is unchanged


def test_runs_left_out_are_named_and_a_corrupt_table_by_its_own_path(tmp_path, params, caplog):
    """Issue 68 (9, 11): `export --add` left out, unnamed, a run whose metrics file was newer than its probes (a
    clock that moved), and named a corrupt table by its hidden temporary copy, advising to delete a file that no
    longer exists. Now each run left out is named with why, and a corrupt table is named where it lies."""
    from iclnoise.core.io import CorruptFileError

    results = session(tmp_path / "s1", FIRST)
    skewed = results / "runs" / FIRST[1]
    t = (skewed / "metrics.parquet").stat().st_mtime
    for f in skewed.glob("*.parquet"):
        if f.name != "metrics.parquet":
            os.utime(f, (t - 60, t - 60))
    (results / "runs" / FIRST[2] / "llc.parquet").unlink()
    with caplog.at_level("WARNING", logger="iclnoise.output.export"):
        assert [r.name for r in finished_runs(results, params)] == [FIRST[0]]
    assert f"{skewed}: left out, its training tables are newer than its probes'" in caplog.text
    assert f"{results / 'runs' / FIRST[2]}: left out, not finished (no llc.parquet yet)" in caplog.text
    bad = results / "runs" / FIRST[0] / "exposure.parquet"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(CorruptFileError) as e:
        export(results, tmp_path / "set", params, tmp_path, add=True)
    assert str(e.value).startswith(str(bad)) and ".tmp" not in str(e.value)


def test_a_results_directory_shared_with_another_design_adds_only_this_grids_runs(tmp_path, params, caplog):
    """The batch axis (configs/exposure_batch.yaml) trains in the results directory of the exposure design, whose
    conditions its parameters still define: `export --add` stopped at the first such run ("not a run of these
    parameters' grid; export the set afresh") although finished_runs had taken it, and would have counted the
    other design's jobs in its wall time. Here a grid of batch 64 alone beside batch 16's runs and job: they are left
    out, each named, and the set takes the grid's runs and its job's time."""
    import copy

    mine = copy.deepcopy(params)
    mine["grid"]["batch_sizes"] = [64]
    other = [f"M{m}-B16-none-s0" for m in (1, 16)]
    results = session(tmp_path / "s1", FIRST + other)
    with caplog.at_level("WARNING", logger="iclnoise.output.export"):
        assert [r.name for r in finished_runs(results, mine)] == sorted(FIRST)
    assert f"{results / 'runs' / other[0]}: left out, not a run of these parameters' grid" in caplog.text
    bench = tmp_path / "benchmarks" / "train"
    bench.mkdir(parents=True)
    (bench / "B64-none.tsv").write_text("s\th:m:s\n100.0\t0:01:40\n")
    (bench / "B16-none.tsv").write_text("s\th:m:s\n70.0\t0:01:10\n")
    prov = export(results, tmp_path / "set", mine, tmp_path, add=True)
    assert sorted(p.name for p in (tmp_path / "set" / "runs").iterdir()) == sorted(FIRST)
    assert prov["wall_time"] == {"jobs": {"train/B64-none": 100.0}, "total_s": 100.0}


def test_two_exports_into_one_set_at_once_both_add_their_runs(tmp_path, params, monkeypatch):
    """Issue 68 (2): two `export --add` at once into one set, from two results directories, both exited 0 and said
    what they added, and the set kept one side's runs. Now exports into a set take turns (a lock on its directory): the
    set holds both sessions' runs. Each export, once inside, waits up to 3 s for the other to be inside too, so
    without the lock the two overlap for certain."""
    import threading

    import iclnoise.output.export as ex

    inside, both = [], threading.Event()
    real = ex.verify

    def meeting(out):
        inside.append(1)
        if len(inside) == 2:
            both.set()
        both.wait(3)
        return real(out)

    out = tmp_path / "set"
    export(session(tmp_path / "s0", FIRST[:1]), out, params, tmp_path, add=True)   # the set exists: both verify it
    monkeypatch.setattr(ex, "verify", meeting)
    errors = []

    def run(results):
        try:
            export(results, out, params, tmp_path, add=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(session(tmp_path / name, runs),))
               for name, runs in (("s1", FIRST[1:]), ("s2", SECOND))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(real(out)["spec_hash"]) == sorted(FIRST + SECOND)


def test_export_checks_every_run_against_the_parameters_it_records(tmp_path, params, caplog):
    """Issue 68 (3, 4, 5): a plain export recorded the parameters it was given without checking the runs against
    them (forgetting --configfile stated lr 0.03 for runs trained at 0.003), copied run directories no longer in
    the grid, and `export --add` sealed kept runs' LLC tables under LLC settings they were not computed with. Now
    a run of another spec, or an LLC table of other settings, is refused naming the file and what differs, and a
    run outside the grid is left out, named."""
    import copy

    results = session(tmp_path / "s1", FIRST)
    from iclnoise.analysis.aggregate import aggregate as agg

    agg(sorted((results / "runs").iterdir()), results / "aggregate", typed(params, "stats"))
    other = copy.deepcopy(params)
    other["train"]["optimizer"]["lr"] *= 10
    with pytest.raises(SystemExit) as e:
        export(results, tmp_path / "a", other, tmp_path)
    assert "trained with another spec than these parameters give it (train.optimizer.lr" in str(e.value.code)
    assert not (tmp_path / "a").exists()
    stale = results / "runs" / "M3-B64-none-s0"   # a run of an earlier grid
    shutil.copytree(results / "runs" / FIRST[0], stale)
    with caplog.at_level("WARNING", logger="iclnoise.output.export"):
        prov = export(results, tmp_path / "b", params, tmp_path)
    assert f"{stale}: left out, not a run of these parameters' grid" in caplog.text
    assert sorted(prov["spec_hash"]) == sorted(FIRST) and not (tmp_path / "b" / "runs" / stale.name).exists()
    llc = copy.deepcopy(params)
    llc["llc"]["sampler"]["draws"] += 1
    with pytest.raises(SystemExit) as e:
        export(session(tmp_path / "s2", SECOND), tmp_path / "b", llc, tmp_path, add=True)
    msg = str(e.value.code)
    assert "llc.parquet: computed with other LLC settings than these parameters' (draws" in msg, msg
