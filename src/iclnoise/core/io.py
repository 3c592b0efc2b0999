"""Parquet tables with explicit schemas, written atomically and group-readable; small JSON helpers.

Every Parquet file carries provenance in its key-value metadata (`iclnoise.*`: package versions, the
git commit of the package source, a spec hash when the writer passes one) and no wall-clock time, so
writing the same frame twice gives the same bytes. `read_parquet` and `read_json` name a truncated or
corrupt file and the smallest thing to delete (`repair_advice`); `read_parquet` checks the columns against
an expected schema when given one.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)


class CorruptFileError(OSError):
    """A file the pipeline reads is unreadable or has the wrong columns; the message names it and what to do."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new output file: 0o666 minus the process umask (what open() would give), so a group-
    readable umask (e.g. 0o022, 0o002) gives group-readable results. mkstemp alone gives 0o600."""
    return 0o666 & ~_umask()


def atomic_path(path: str | os.PathLike) -> tuple[Path, Path]:
    """(final, temporary) paths in the same directory, so os.replace is atomic. The temporary file exists,
    with the umask's mode (file_mode), and keeps it when the caller overwrites it and renames it."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        os.fchmod(fd, file_mode())
    finally:
        os.close(fd)
    return final, Path(tmp)



@contextlib.contextmanager
def _naming(final: Path):
    """An OSError while writing `final`'s temporary file (a full disk, a quota) re-raised naming `final`: the
    temporary file is removed and `final` keeps its old bytes."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, f"{final}: not written ({e.strerror or e}); its old content, if any, is unchanged: "
                               f"free space and rerun") from None

def atomic_dir(path: str | os.PathLike) -> tuple[Path, Path]:
    """(final, temporary) directories for writing a whole directory: the temporary one is new, hidden and unique
    (`.<name>.<random>.tmp` beside `final`, so concurrent writers never share one and a glob `*` skips it), with
    the umask's mode; `replace_dir` puts it in place. OSError when the parent is not writable."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())   # what mkdir would give; mkdtemp gives 0o700
    return final, tmp


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished directory `tmp` (from atomic_dir) at `final` by renames: an old `final` is first renamed
    aside, then deleted. A reader sees the old directory or the new one (or, between the two renames, none), never
    a mix; when two processes replace `final` at once, the last rename wins and neither fails."""
    for _ in range(100):
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
        try:
            try:
                os.rename(final, old)
            except FileNotFoundError:
                pass
            try:
                os.rename(tmp, final)
                return
            except OSError as e:   # another process put its directory there in between: move that one aside
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    raise OSError(f"{final}: could not replace it after 100 tries (other processes keep replacing it)")


def content_hash(obj: Any) -> str:
    """sha256 of `obj` as canonical JSON (sorted keys, no spaces): the spec/params hash in Parquet metadata."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_commit() -> str | None:
    """HEAD of the git checkout holding this package's source ('+dirty' with uncommitted changes to that source:
    results written into the same checkout do not count), or None (installed from a wheel, no git). Read once per
    process: the CLI reads it at the start, so a commit made while a command runs is not recorded as its code."""
    src = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("no git commit for the Parquet provenance: %s", e)
        return None
    return head + ("+dirty" if dirty else "")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    names = ("iclnoise", "torch", "numpy", "pandas", "pyarrow", "transformer-lens")
    return json.dumps({"python": platform.python_version(), **{n: _version(n) for n in names}}, sort_keys=True)


def provenance(spec_hash: str | None = None) -> dict[str, str]:
    """Key-value metadata written into every Parquet file: no timestamps, so reruns are byte-identical."""
    meta = {"iclnoise.versions": _versions(), "iclnoise.commit": code_commit() or "unknown"}
    if spec_hash is not None:
        meta["iclnoise.spec_hash"] = spec_hash
    return meta


def write_parquet(df: pd.DataFrame, path: str | os.PathLike, schema: pa.Schema, spec_hash: str | None = None) -> None:
    """Write `df` with exactly `schema` (columns in schema order; extra columns are an error), with
    provenance metadata (`spec_hash`: e.g. content_hash(run spec) of the run the table belongs to)."""
    extra = set(df.columns) - set(schema.names)
    missing = set(schema.names) - set(df.columns)
    if extra or missing:
        raise ValueError(f"{path}: columns do not match schema (extra={sorted(extra)}, missing={sorted(missing)})")
    table = (pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False) if len(df)
             else schema.empty_table())   # an empty frame's columns carry no type (a list column reads as float64)
    meta = {**(table.schema.metadata or {}), **{k.encode(): v.encode() for k, v in provenance(spec_hash).items()}}
    table = table.replace_schema_metadata(meta)
    final, tmp = atomic_path(path)
    try:
        with _naming(final):
            pq.write_table(table, tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `iclnoise.*` key-value metadata of a Parquet file."""
    meta = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"iclnoise.")}


def _schema_problems(found: pa.Schema, expected: pa.Schema) -> list[str]:
    problems = [f"missing column {f.name} ({f.type})" for f in expected if found.get_field_index(f.name) < 0]
    problems += [f"column {f.name} is {found.field(f.name).type}, expected {f.type}" for f in expected
                 if found.get_field_index(f.name) >= 0 and not found.field(f.name).type.equals(f.type)]
    problems += [f"unexpected column {n}" for n in found.names if n not in expected.names]
    return problems


def repair_advice(path: str | os.PathLike) -> str:
    """What to delete so that plain `snakemake` writes `path` again, and nothing more: the file itself (rule
    `all` asks for every output), except a run's run.json, which the run's training job writes without
    declaring it: delete it with the run's metrics.parquet, and the job reruns from the run's resume state."""
    path = Path(path)
    if path.name == "run.json":
        metrics = path.parent / "metrics.parquet"
        return (f"delete it and the run's metrics.parquet (rm {path} {metrics}) and rerun snakemake: the run's "
                f"training job writes both again, resuming from the run's resume state")
    return f"delete it (rm {path}) and rerun snakemake: the job that writes it runs again"


def read_parquet(path: str | os.PathLike, schema: pa.Schema | None = None) -> pd.DataFrame:
    """Read a Parquet table. A truncated or corrupt file, or (given `schema`) one whose columns differ,
    raises CorruptFileError naming the file and what to do; a missing file raises FileNotFoundError."""
    what_to_do = repair_advice(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise CorruptFileError(f"{path}: unreadable Parquet file, truncated or corrupt ({e}); {what_to_do}") from e
    if schema is not None:
        problems = _schema_problems(table.schema, schema)
        if problems:
            raise CorruptFileError(f"{path}: columns differ from the expected schema ({'; '.join(problems)}); it was "
                                   f"written by another version of iclnoise or damaged; {what_to_do}")
    return table.to_pandas()


def write_bytes(data: bytes, path: str | os.PathLike) -> None:
    """Write `data` to `path` atomically (a temporary file in the same directory, then a rename)."""
    final, tmp = atomic_path(path)
    try:
        with _naming(final):
            tmp.write_bytes(data)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(obj: Any, path: str | os.PathLike) -> None:
    write_bytes((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), path)


def write_text(text: str, path: str | os.PathLike) -> None:
    write_bytes(text.encode(), path)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file. A truncated or corrupt one raises CorruptFileError naming it and what to do; a missing
    one raises FileNotFoundError."""
    try:
        return json.loads(Path(path).read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CorruptFileError(f"{path}: unreadable JSON file, truncated or corrupt ({e}); "
                               f"{repair_advice(path)}") from None
