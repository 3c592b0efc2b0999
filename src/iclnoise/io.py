"""Parquet tables with explicit schemas, written atomically; small JSON helpers."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq


def atomic_path(path: str | os.PathLike) -> tuple[Path, Path]:
    """(final, temporary) paths in the same directory, so os.replace is atomic."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return final, Path(tmp)


def write_parquet(df: pd.DataFrame, path: str | os.PathLike, schema: pa.Schema) -> None:
    """Write `df` with exactly `schema` (columns in schema order; extra columns are an error)."""
    extra = set(df.columns) - set(schema.names)
    missing = set(schema.names) - set(df.columns)
    if extra or missing:
        raise ValueError(f"{path}: columns do not match schema (extra={sorted(extra)}, missing={sorted(missing)})")
    table = pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)
    final, tmp = atomic_path(path)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def read_parquet(path: str | os.PathLike) -> pd.DataFrame:
    return pq.read_table(path).to_pandas()


def write_json(obj: Any, path: str | os.PathLike) -> None:
    final, tmp = atomic_path(path)
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(text: str, path: str | os.PathLike) -> None:
    final, tmp = atomic_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


KEY_FIELDS = [
    pa.field("run_id", pa.string()),
    pa.field("M", pa.int64()),       # M_INF = -1 encodes M = ∞
    pa.field("seed", pa.int64()),
    pa.field("batch", pa.int64()),
    pa.field("noise", pa.string()),
]
