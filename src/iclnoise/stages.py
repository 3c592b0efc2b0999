"""Developmental stages from the LLC curve (Hoogland et al.; SPEC §7).

The LLC is smoothed with a Gaussian filter over the checkpoint index (checkpoints are dense
early and log-spaced, so the index is close to log-time) and differentiated in log(step + 1).
Milestones are its critical points: sign changes of the slope (peaks, troughs) and plateaus
where |slope| has a local minimum below `plateau_tol` × max |slope|. Stages are the intervals
between consecutive milestones (and the ends); a stage is type A if the LLC rises across it,
type B if it falls.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from scipy.ndimage import gaussian_filter1d

from .io import KEY_FIELDS, read_parquet, write_parquet

STAGES_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("stage", pa.int64()), pa.field("type", pa.string()),
    pa.field("start_step", pa.int64()), pa.field("end_step", pa.int64()),
    pa.field("step", pa.int64()),            # the milestone closing the stage (= end_step)
    pa.field("kind", pa.string()),           # milestone kind: peak, trough, plateau, end
    pa.field("llc_start", pa.float64()), pa.field("llc_end", pa.float64()), pa.field("delta_llc", pa.float64()),
    pa.field("delta_loss", pa.float64()),    # change of in-distribution loss / D across the stage
])


def milestones(steps: np.ndarray, llc: np.ndarray, sigma: float = 1.0,
               plateau_tol: float = 0.1) -> list[tuple[int, str]]:
    """Indices and kinds of the critical points of the smoothed LLC curve (interior points only)."""
    y = gaussian_filter1d(np.asarray(llc, float), sigma, mode="nearest") if sigma > 0 else np.asarray(llc, float)
    t = np.log1p(np.asarray(steps, float))
    if len(y) < 3:
        return []
    d = np.gradient(y, t)
    scale = np.abs(d).max() or 1.0
    found: dict[int, str] = {}
    for i in range(1, len(d) - 1):
        if d[i - 1] > 0 >= d[i] or (d[i - 1] >= 0 > d[i]):
            found[i] = "peak"
        elif d[i - 1] < 0 <= d[i] or (d[i - 1] <= 0 < d[i]):
            found[i] = "trough"
        elif abs(d[i]) < plateau_tol * scale and abs(d[i]) <= abs(d[i - 1]) and abs(d[i]) <= abs(d[i + 1]):
            found[i] = "plateau"
    out, last = [], -10
    for i in sorted(found):       # merge milestones on adjacent checkpoints into one
        if i - last > 1:
            out.append((i, found[i]))
        last = i
    return out


def stages(keys: dict, steps, llc, loss, sigma: float = 1.0, plateau_tol: float = 0.1) -> pd.DataFrame:
    steps, llc, loss = np.asarray(steps), np.asarray(llc, float), np.asarray(loss, float)
    ms = milestones(steps, llc, sigma, plateau_tol)
    bounds = [(0, "start")] + ms + [(len(steps) - 1, "end")]
    rows = []
    for s, ((i0, _), (i1, kind)) in enumerate(zip(bounds, bounds[1:])):
        if i1 <= i0:
            continue
        dl = llc[i1] - llc[i0]
        rows.append({**keys, "stage": s, "type": "A" if dl >= 0 else "B", "start_step": int(steps[i0]),
                     "end_step": int(steps[i1]), "step": int(steps[i1]), "kind": kind,
                     "llc_start": float(llc[i0]), "llc_end": float(llc[i1]), "delta_llc": float(dl),
                     "delta_loss": float(loss[i1] - loss[i0])})
    return pd.DataFrame(rows, columns=STAGES_SCHEMA.names)


def stages_for_run(run_dir: str | Path, sigma: float = 1.0, plateau_tol: float = 0.1) -> pd.DataFrame:
    run_dir = Path(run_dir)
    llc = read_parquet(run_dir / "llc.parquet").sort_values("step")
    metrics = read_parquet(run_dir / "metrics.parquet").set_index("step")
    keys = llc.iloc[0][["run_id", "M", "seed", "batch", "noise"]].to_dict()
    df = stages(keys, llc.step.to_numpy(), llc.llc_mean.to_numpy(), metrics.loc[llc.step, "id_loss"].to_numpy(),
                sigma, plateau_tol)
    write_parquet(df, run_dir / "stages.parquet", STAGES_SCHEMA)
    return df


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise stages", description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--plateau-tol", type=float, default=0.1)
    a = ap.parse_args(argv)
    df = stages_for_run(a.run_dir, a.sigma, a.plateau_tol)
    print(df[["stage", "type", "start_step", "end_step", "kind", "delta_llc", "delta_loss"]].to_string(index=False))
