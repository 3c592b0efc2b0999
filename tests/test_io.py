"""Outputs: group-readable under the umask, byte-identical reruns, provenance metadata, corrupt files named."""
import os
import stat

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from iclnoise.core.io import (
    CorruptFileError,
    atomic_path,
    content_hash,
    read_json,
    read_metadata,
    read_parquet,
    write_json,
    write_parquet,
    write_text,
)
from iclnoise.core.runspec import KEY_FIELDS

SCHEMA = pa.schema([*KEY_FIELDS, pa.field("step", pa.int64()), pa.field("loss", pa.float64())])


def frame(n: int = 50) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"run_id": "M4-B16-none-s0", "M": 4, "seed": 0, "batch": 16, "noise": "none",
                         "step": np.arange(n), "loss": rng.normal(size=n)})


@pytest.fixture
def umask():
    """Set a umask for one test and restore the process's own afterwards."""
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.unit
@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_outputs_follow_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    write_parquet(frame(), tmp_path / "a.parquet", SCHEMA)
    write_json({"a": 1}, tmp_path / "a.json")
    write_text("x", tmp_path / "a.txt")
    final, tmp = atomic_path(tmp_path / "b.bin")  # the path callers (checkpoints, figures) write themselves
    with open(tmp, "wb") as f:
        f.write(b"x")
    os.replace(tmp, final)
    for name in ("a.parquet", "a.json", "a.txt", "b.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.unit
def test_same_frame_gives_identical_bytes_and_provenance(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    h = content_hash({"keys": {"run_id": "M4-B16-none-s0"}, "train": {"lr": 0.002}})
    write_parquet(frame(), a, SCHEMA, spec_hash=h)
    write_parquet(frame(), b, SCHEMA, spec_hash=h)
    assert a.read_bytes() == b.read_bytes()
    meta = read_metadata(a)
    assert meta["iclnoise.spec_hash"] == h and len(h) == 64
    assert '"pyarrow"' in meta["iclnoise.versions"] and '"python"' in meta["iclnoise.versions"]
    assert meta["iclnoise.commit"] == "unknown" or len(meta["iclnoise.commit"].split("+")[0]) == 40
    write_parquet(frame(), b, SCHEMA, spec_hash=content_hash({"train": {"lr": 0.003}}))
    assert a.read_bytes() != b.read_bytes()  # the hash is really in the file
    assert content_hash({"x": 1, "y": [1, 2]}) == content_hash({"y": [1, 2], "x": 1})


@pytest.mark.unit
def test_pandas_and_duckdb_read_it(tmp_path):
    p = tmp_path / "m.parquet"
    write_parquet(frame(), p, SCHEMA, spec_hash="abc")
    pd.testing.assert_frame_equal(pd.read_parquet(p), frame())
    pd.testing.assert_frame_equal(read_parquet(p, SCHEMA), frame())
    con = duckdb.connect()
    n, total = con.execute(f"select count(*), sum(loss) from read_parquet('{p}')").fetchone()
    assert n == 50 and total == pytest.approx(frame().loss.sum())
    kv = dict(con.execute(f"select key::varchar, value::varchar from parquet_kv_metadata('{p}')").fetchall())
    assert kv["iclnoise.spec_hash"] == "abc"


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_named_with_what_to_do(tmp_path, damage):
    p = tmp_path / "metrics.parquet"
    write_parquet(frame(), p, SCHEMA)
    data = p.read_bytes()
    p.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"x" * len(data), "empty": b""}[damage])
    with pytest.raises(CorruptFileError) as e:
        read_parquet(p)
    assert str(p) in str(e.value) and "truncated or corrupt" in str(e.value) and f"rm {p})" in str(e.value)


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["truncate", "empty", "not utf-8"])
def test_corrupt_json_is_named_with_the_smallest_thing_to_delete(tmp_path, damage):
    """A truncated or corrupt JSON file (issue 30) raises CorruptFileError naming it: delete the file itself, or for a
    run's run.json (which no rule declares) the file with the run's metrics.parquet; never a directory."""
    run = tmp_path / "results/runs/M4-B16-none-s0"
    for name in ("checkpoints.json", "run.json"):
        p = run / name
        write_json({"spec_hash": "0123456789abcdef", "keys": {"M": 4}}, p)
        data = p.read_bytes()
        p.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "not utf-8": b'{"a": "\xff\xfe"}'}[damage])
        with pytest.raises(CorruptFileError) as e:
            read_json(p)
        msg = str(e.value)
        assert msg.startswith(f"{p}: unreadable JSON file, truncated or corrupt") and "rerun snakemake" in msg, msg
        want = f"rm {p} {run / 'metrics.parquet'})" if name == "run.json" else f"rm {p})"
        assert want in msg, msg
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")


@pytest.mark.unit
def test_schema_mismatch_is_named(tmp_path):
    p = tmp_path / "metrics.parquet"
    write_parquet(frame(), p, SCHEMA)
    expected = pa.schema([*KEY_FIELDS, pa.field("step", pa.int64()), pa.field("loss", pa.float32()),
                          pa.field("r", pa.float64())])
    with pytest.raises(CorruptFileError) as e:
        read_parquet(p, expected)
    msg = str(e.value)
    assert str(p) in msg and "missing column r" in msg and "column loss is double, expected float" in msg, msg
    with pytest.raises(FileNotFoundError):
        read_parquet(tmp_path / "absent.parquet")


@pytest.mark.unit
def test_failed_write_keeps_the_old_file(tmp_path):
    p = tmp_path / "m.parquet"
    write_parquet(frame(), p, SCHEMA)
    before = p.read_bytes()
    with pytest.raises(ValueError, match="columns do not match"):
        write_parquet(frame().drop(columns="loss"), p, SCHEMA)
    with pytest.raises((pa.ArrowException, TypeError, ValueError)):
        write_parquet(frame().assign(loss="not a number"), p, SCHEMA)
    assert p.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.unit
def test_verify_names_every_unreadable_table_and_fails(tmp_path, capsys):
    """`iclnoise verify` (the last step of the DVC stage) reads every Parquet and JSON file under a directory."""
    import hashlib

    import pyarrow as pa

    from iclnoise.commands.runs import verify
    from iclnoise.core.io import write_json, write_parquet

    schema = pa.schema([pa.field("step", pa.int64())])
    write_parquet(pd.DataFrame({"step": [0, 1]}), tmp_path / "runs/a/metrics.parquet", schema)
    write_json({"0": hashlib.sha256(b"a checkpoint").hexdigest()}, tmp_path / "runs/a/checkpoints.json")
    (tmp_path / "runs/a/checkpoints").mkdir()
    (tmp_path / "runs/a/checkpoints/step_0000000.pt").write_bytes(b"a checkpoint")
    verify([str(tmp_path)])
    assert "2 tables read, 0 unreadable" in capsys.readouterr().out
    good = (tmp_path / "runs/a/metrics.parquet").read_bytes()
    (tmp_path / "runs/b").mkdir()
    (tmp_path / "runs/b/metrics.parquet").write_bytes(good[: len(good) // 2])
    (tmp_path / "runs/b/checkpoints.json").write_text('{"0": "ab')
    with pytest.raises(SystemExit) as e:
        verify([str(tmp_path)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "4 tables read, 2 unreadable" in out
    assert f"{tmp_path}/runs/b/metrics.parquet: unreadable Parquet file" in out
    assert f"{tmp_path}/runs/b/checkpoints.json: unreadable JSON file" in out


@pytest.mark.integration
def test_a_command_records_the_commit_it_started_at(tmp_path):
    """The commit in a command's Parquet metadata is the code's at the command's start: a commit made while it runs
    (a long training job beside ongoing work) is not recorded as its code. The package is copied into a scratch git
    repository, a command runs, a second commit lands, then the process writes its Parquet."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import iclnoise

    repo = tmp_path / "repo"
    shutil.copytree(Path(iclnoise.__file__).parent, repo / "src" / "iclnoise",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]

    def commit(msg):
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", msg], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    first = commit("first")
    script = f"""
import subprocess
from iclnoise import cli
from iclnoise.core import io
try:
    cli.main(["check", "--help"])
except SystemExit:
    pass
open({str(repo / "src" / "notes.txt")!r}, "w").write("a change committed while the command runs")
subprocess.run({[*git, "add", "-A"]!r}, check=True)
subprocess.run({[*git, "commit", "-qm", "second"]!r}, check=True)
print(io.provenance()["iclnoise.commit"])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(repo / "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == first


@pytest.mark.unit
def test_verify_fails_on_a_changed_checkpoint_and_on_a_missing_directory(tmp_path, capsys):
    """Issue 68 (10): `iclnoise verify` exited 0 on a checkpoint whose bytes differ from its manifest's sha256 and on
    a path that does not exist. Now the first exits 1 naming the checkpoint and what to do, the second 2 naming
    the path; a checkpoint with its listed bytes passes."""
    import hashlib

    from iclnoise.commands.runs import verify
    from iclnoise.core.io import write_json

    run = tmp_path / "runs" / "a"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "step_0000000.pt"
    ckpt.write_bytes(b"a checkpoint")
    write_json({"0": hashlib.sha256(b"a checkpoint").hexdigest()}, run / "checkpoints.json")
    verify([str(tmp_path)])
    ckpt.write_bytes(b"another checkpoint")
    with pytest.raises(SystemExit) as e:
        verify([str(tmp_path)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and f"{ckpt}: its bytes differ" in out and f"delete the run directory {run}" in out
    with pytest.raises(SystemExit) as e:
        verify([str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "nowhere: no such directory" in capsys.readouterr().err


@pytest.mark.unit
def test_a_full_disk_and_a_linked_lock_name_their_file(tmp_path, monkeypatch):
    """Issue 68 (13): a full disk and a `.train.lock` that is a symbolic link gave tracebacks naming no file. Now
    the write error names the file it could not write (the old bytes kept, no temporary file left), and the lock
    error names the link and what to do."""
    import errno
    from pathlib import Path

    import pyarrow as pa

    from iclnoise.core import io as iclio
    from iclnoise.core.io import write_json, write_parquet
    from iclnoise.run.runs import LOCK, RunDirError, lock_run_dir

    path = tmp_path / "t.json"
    write_json({"a": 1}, path)
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError) as e:
        write_json({"a": 2}, path)
    assert str(path) in str(e.value) and "No space left on device" in str(e.value) and e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    monkeypatch.setattr(iclio.pq, "write_table", full)
    table = tmp_path / "t.parquet"
    with pytest.raises(OSError, match=f"{table}: not written"):
        write_parquet(pd.DataFrame({"step": [0]}), table, pa.schema([pa.field("step", pa.int64())]))
    assert path.read_bytes() == before and not table.exists() and not list(tmp_path.glob(".*.tmp"))
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "elsewhere").write_text("somebody's file")
    (run / LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match="symbolic link") as e:
        lock_run_dir(run)
    assert f"rm {run / LOCK}" in str(e.value) and (tmp_path / "elsewhere").read_text() == "somebody's file"


@pytest.mark.unit
def test_a_hand_edited_run_json_is_refused_by_the_aggregate_and_verify(tmp_path, capsys):
    """Issue 68 (6): editing one run.json's M, with the run_id and directory name to match, counted the run at
    another M, and `iclnoise verify` and the aggregate said nothing. Now both name the file: its content no longer
    hashes to the spec_hash the trainer wrote (or its run_id is not its directory's name)."""
    import json
    import shutil
    from pathlib import Path

    from iclnoise.analysis.aggregate import run_outcomes
    from iclnoise.commands.runs import verify
    from iclnoise.core.io import CorruptFileError

    science = Path(__file__).resolve().parents[1] / "reference" / "science" / "runs" / "M16-B64-none-s0"
    run = tmp_path / "runs" / "M4-B64-none-s0"
    shutil.copytree(science, run)
    spec = json.loads((run / "run.json").read_text())
    spec["keys"].update(M=4, run_id="M4-B64-none-s0")
    (run / "run.json").write_text(json.dumps(spec))
    with pytest.raises(CorruptFileError, match="does not hash to the spec_hash"):
        run_outcomes(run, 0.05)
    with pytest.raises(SystemExit) as e:
        verify([str(tmp_path)])
    assert e.value.code == 1 and f"{run / 'run.json'}: its content does not hash" in capsys.readouterr().out
    renamed = tmp_path / "runs" / "M1-B64-none-s0"
    shutil.copytree(science, renamed)
    with pytest.raises(CorruptFileError, match="is not its directory's name"):
        run_outcomes(renamed, 0.05)
    assert run_outcomes(science, 0.05)["M"] == 16
