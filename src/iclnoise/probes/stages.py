"""Developmental stages from the LLC curve (Hoogland et al.; method §7).

The LLC is a function of training time, so it is smoothed and differentiated in log-time,
t = log10(step + 1), whatever the checkpoint spacing: a Gaussian kernel (Nadaraya–Watson) of
width `sigma` decades, as a local-linear fit (value and slope dŷ/dt at every checkpoint; no
first-order bias from uneven checkpoint density, see `local_linear_log_time`). Milestones are its critical points:
interior runs of checkpoints where |slope| < `plateau_tol` × max |slope| (a plateau, or a peak /
trough when the slope changes sign across the run), and sign changes between steep neighbours. Stages are the
intervals between consecutive milestones (and the ends); a stage is type A if the LLC rises across
it, type B if it falls. Estimates flagged diverged or negative are left out of the curve.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from ..core.runspec import KEY_FIELDS

STAGES_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("stage", pa.int64()), pa.field("type", pa.string()),
    pa.field("start_step", pa.int64()), pa.field("end_step", pa.int64()),
    pa.field("step", pa.int64()),            # the milestone closing the stage (= end_step)
    pa.field("kind", pa.string()),           # milestone kind: peak, trough, plateau, end
    pa.field("llc_start", pa.float64()), pa.field("llc_end", pa.float64()), pa.field("delta_llc", pa.float64()),
    pa.field("delta_loss", pa.float64()),    # change of in-distribution loss / D across the stage
])


def local_linear_log_time(steps: np.ndarray, y: np.ndarray, sigma: float,
                          chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Smoothed value and slope dŷ/dt of y over t = log10(step + 1): at each t_i the weighted least-squares
    line y ≈ a + b (t − t_i) with Gaussian weights exp(−(t − t_i)²/(2σ²)) gives ŷ(t_i) = a, slope b.

    A local line rather than a local mean (Nadaraya–Watson): its value carries no first-order bias from
    uneven checkpoint density (dense linear checkpoints late, log-spaced early).
    """
    t = np.log10(np.asarray(steps, float) + 1)
    y = np.asarray(y, float)
    if sigma <= 0 or len(y) < 3:
        return y, np.gradient(y, t) if len(y) > 1 else np.zeros_like(y)
    a, b = np.empty_like(y), np.empty_like(y)
    for s in range(0, len(t), chunk):
        dt = t[None, :] - t[s:s + chunk, None]
        w = np.exp(-0.5 * (dt / sigma) ** 2)
        s0, s1, s2 = w.sum(1), (w * dt).sum(1), (w * dt ** 2).sum(1)
        r0, r1 = w @ y, (w * dt) @ y
        det = s0 * s2 - s1 ** 2
        ok = det > 1e-12 * np.maximum(s0 * s2, 1e-300)
        a[s:s + chunk] = np.where(ok, (s2 * r0 - s1 * r1) / np.where(ok, det, 1), r0 / s0)
        b[s:s + chunk] = np.where(ok, (s0 * r1 - s1 * r0) / np.where(ok, det, 1), 0.0)
    return a, b


def smooth_log_time(steps: np.ndarray, y: np.ndarray, sigma: float) -> np.ndarray:
    """The smoothed curve of `local_linear_log_time`."""
    return local_linear_log_time(steps, y, sigma)[0]


def milestones(steps: np.ndarray, llc: np.ndarray, sigma: float,
               plateau_tol: float) -> list[tuple[int, str]]:
    """Indices and kinds of the critical points of the smoothed LLC curve (interior points only).

    A checkpoint is flat where |dŷ/dt| < plateau_tol × max |dŷ/dt|. Each run of flat checkpoints that
    touches neither end is one milestone, at its flattest checkpoint: a peak if the slope goes from + to −
    across the run, a trough if from − to +, else a plateau. A sign change between two steep neighbours
    (a sharp extremum between sparse checkpoints) is a milestone at the flatter of the two.
    """
    if len(llc) < 3:
        return []
    _, d = local_linear_log_time(steps, llc, sigma)
    flat = np.abs(d) < plateau_tol * (np.abs(d).max() or 1.0)
    out: list[tuple[int, str]] = []
    i, n = 0, len(d)
    while i < n:
        if flat[i]:
            j = i
            while j + 1 < n and flat[j + 1]:
                j += 1
            if i > 0 and j < n - 1:
                k = i + int(np.argmin(np.abs(d[i:j + 1])))
                before, after = d[i - 1], d[j + 1]
                out.append((k, "peak" if before > 0 > after else "trough" if before < 0 < after else "plateau"))
            i = j + 1
            continue
        if i + 1 < n and not flat[i + 1] and d[i] * d[i + 1] < 0:
            k = i if abs(d[i]) <= abs(d[i + 1]) else i + 1
            if 0 < k < n - 1:
                out.append((k, "peak" if d[i] > 0 else "trough"))
        i += 1
    return out


def stages(keys: dict, steps, llc, loss, sigma: float, plateau_tol: float) -> pd.DataFrame:
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
