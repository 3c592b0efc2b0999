"""Essential dynamics (SPEC §8): joint trajectory PCA of behavioural vectors and forms.

Behavioural vector of a checkpoint: the model's K predictions on each of the B root-task
sequences, flattened (B·K); stored by training in root_preds.parquet. For a family of runs the
vectors of every checkpoint of every run are stacked, centred and reduced by a truncated SVD;
dMMSE_M and ridge on the same sequences are projected into the subspace without entering the fit.

Curve geometry: each run's PC trajectory is smoothed with a Gaussian filter of width `sigma`
checkpoints (checkpoints are log-spaced, so the index is close to log-time and the filter acts
evenly across the developmental timeline); for each pair of leading PCs the plane curve γ(τ)
gets its signed curvature κ, osculating circles and evolute. A vertex is a local extremum of κ
(a cusp of the evolute) whose prominence exceeds `vertex_prominence` × the range of
arcsinh(κ / median|κ|), on a part of the curve that moves; a cusp
singularity is a local minimum of the speed |γ'| below `cusp_speed` × the median speed at which
the tangent turns by more than 90°. A form is a time at which every pair of the leading
`n_form_pcs` PCs has a vertex or cusp within ± `tolerance` checkpoints.
"""
from __future__ import annotations

import argparse
import json
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from scipy.ndimage import gaussian_filter1d
from scipy.signal import find_peaks

from .io import KEY_FIELDS, read_json, read_parquet, write_parquet
from .predictors import dmmse, ridge
from .tasks import M_INF, eval_set, task_pool

PCS_SCHEMA = pa.schema([pa.field("family", pa.string()), pa.field("kind", pa.string())] + KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("pc", pa.int64()), pa.field("value", pa.float64())])
VAR_SCHEMA = pa.schema([pa.field("family", pa.string()), pa.field("pc", pa.int64()),
                        pa.field("explained_variance_ratio", pa.float64())])
EVENTS_SCHEMA = pa.schema([pa.field("family", pa.string()), pa.field("run_id", pa.string()),
                           pa.field("pc_i", pa.int64()), pa.field("pc_j", pa.int64()), pa.field("kind", pa.string()),
                           pa.field("index", pa.int64()), pa.field("step", pa.int64())])
FORMS_SCHEMA = pa.schema([pa.field("family", pa.string())] + KEY_FIELDS + [
    pa.field("form", pa.int64()), pa.field("step", pa.int64()), pa.field("index", pa.int64()),
    pa.field("nearest_stage_step", pa.int64()), pa.field("distance_to_stage", pa.int64())])


def joint_pca(X: np.ndarray, n_pcs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Centred truncated SVD of the rows of X: (scores, components (n_pcs, d), mean, explained ratio)."""
    mean = X.mean(0)
    Xc = torch.from_numpy(X - mean)
    k = min(n_pcs, *Xc.shape)
    if min(Xc.shape) <= 4 * k + 10:
        U, S, Vt = torch.linalg.svd(Xc, full_matrices=False)
        U, S, V = U[:, :k], S[:k], Vt[:k].T
    else:
        torch.manual_seed(seed)
        U, S, V = torch.svd_lowrank(Xc, q=k + 10, niter=6)
        U, S, V = U[:, :k], S[:k], V[:, :k]
    total = float((Xc ** 2).sum())
    sign = torch.sign(V[V.abs().argmax(0), torch.arange(k)])  # deterministic orientation
    V, U = V * sign, U * sign
    return (U * S).numpy(), V.T.numpy(), mean, (S ** 2).numpy() / total


def plane_geometry(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Derivatives in the index parameter, signed curvature κ, speed, and the evolute (centres)."""
    dx, dy = np.gradient(x), np.gradient(y)
    ddx, ddy = np.gradient(dx), np.gradient(dy)
    speed = np.hypot(dx, dy)
    kappa = (dx * ddy - dy * ddx) / np.maximum(speed, 1e-12) ** 3
    nx, ny = -dy / np.maximum(speed, 1e-12), dx / np.maximum(speed, 1e-12)
    with np.errstate(divide="ignore"):
        rad = np.where(np.abs(kappa) > 1e-12, 1.0 / kappa, np.inf)
    return {"dx": dx, "dy": dy, "speed": speed, "kappa": kappa, "ex": x + rad * nx, "ey": y + rad * ny}


def vertices(kappa: np.ndarray, speed: np.ndarray | None = None, prominence: float = 0.1,
             moving: float = 0.1) -> np.ndarray:
    """Indices of interior local extrema of κ with prominence ≥ `prominence` × range(κ), where the
    curve moves (speed ≥ `moving` × max speed): on a stalled curve κ is noise divided by ~0."""
    ok = speed >= moving * speed.max() if speed is not None else np.ones(len(kappa), bool)
    # arcsinh(κ / median|κ|) keeps every extremum of κ but compresses the range, so broad curvature
    # minima are not drowned by sharp maxima when prominence is measured
    k = np.arcsinh(kappa / max(np.median(np.abs(kappa[ok])) if ok.any() else 1.0, 1e-12))
    p = prominence * max(np.ptp(k[ok]) if ok.any() else 0.0, 1e-12)
    sep = max(1, len(k) // 25)  # one extremum per neighbourhood: noise splits broad peaks
    hi, _ = find_peaks(k, prominence=p, distance=sep)
    lo, _ = find_peaks(-k, prominence=p, distance=sep)
    idx = np.sort(np.concatenate([hi, lo]))
    return idx[ok[idx]]


def cusps(dx: np.ndarray, dy: np.ndarray, speed_frac: float = 0.3, window: int = 2) -> np.ndarray:
    """Speed minima below `speed_frac` × median speed where the tangent turns by more than 90°
    between `window` checkpoints before and after (the curve stops and goes back)."""
    speed = np.hypot(dx, dy)
    mins, _ = find_peaks(-speed)
    out = []
    for i in mins:
        if speed[i] > speed_frac * np.median(speed) or i < window or i + window >= len(speed):
            continue
        a = np.array([dx[i - window], dy[i - window]])
        b = np.array([dx[i + window], dy[i + window]])
        if a @ b < 0:
            out.append(i)
    return np.array(out, dtype=int)


def detect_events(curve: np.ndarray, sigma: float, n_pcs: int, prominence: float, cusp_speed: float) -> list[dict]:
    """Vertices and cusps of γ_ij for every pair i < j of the leading `n_pcs` PCs of one trajectory."""
    sm = gaussian_filter1d(curve, sigma, axis=0, mode="nearest") if sigma > 0 else curve
    events = []
    for i, j in combinations(range(min(n_pcs, curve.shape[1])), 2):
        g = plane_geometry(sm[:, i], sm[:, j])
        for idx in vertices(g["kappa"], g["speed"], prominence):
            events.append({"pc_i": i + 1, "pc_j": j + 1, "kind": "vertex", "index": int(idx)})
        for idx in cusps(g["dx"], g["dy"], cusp_speed):
            events.append({"pc_i": i + 1, "pc_j": j + 1, "kind": "cusp", "index": int(idx)})
    return events


def forms(events: list[dict], n_pcs: int, length: int, tolerance: int) -> list[int]:
    """Indices t0 where every pair i < j of the leading PCs has an event within ± tolerance.

    Runs of consecutive qualifying indices are merged into their middle index."""
    pairs = list(combinations(range(1, n_pcs + 1), 2))
    by_pair = {p: np.array([e["index"] for e in events if (e["pc_i"], e["pc_j"]) == p]) for p in pairs}
    ok = [t for t in range(length)
          if all(len(by_pair[p]) and np.abs(by_pair[p] - t).min() <= tolerance for p in pairs)]
    out, run = [], []
    for t in ok:
        if run and t != run[-1] + 1:
            out.append(run[len(run) // 2])
            run = []
        run.append(t)
    if run:
        out.append(run[len(run) // 2])
    return out


def predictor_vectors(spec: dict, Ms: list[int]) -> dict[str, np.ndarray]:
    """Flattened dMMSE_M (each finite M) and ridge predictions on the root-task sequences."""
    d, e = spec["data"], spec["eval"]
    b = eval_set("root", 1, e["n_root"], d["K"], d["D"], d["noise_var"], d["pool_seed"], e["eval_seed"])
    out = {"ridge": ridge(b.xs, b.ys, d["noise_var"]).numpy().ravel()}
    for M in Ms:
        if M != M_INF:
            out[f"dmmse_{M}"] = dmmse(b.xs, b.ys, task_pool(d["pool_seed"], M, d["D"]), d["noise_var"]).numpy().ravel()
    return out


def essential_dynamics(run_dirs: list[Path], family: str, cfg: dict) -> dict[str, pd.DataFrame]:
    n_pcs, sigma, tol = cfg.get("n_pcs", 3), cfg.get("sigma", 1.0), cfg.get("tolerance", 2)
    n_form = cfg.get("n_form_pcs", 3)
    specs = [read_json(d / "run.json") for d in run_dirs]
    preds = [read_parquet(d / "root_preds.parquet").sort_values("step") for d in run_dirs]
    X = np.concatenate([np.stack(p.preds.to_numpy()).astype(np.float64) for p in preds])
    scores, comps, mean, evr = joint_pca(X, n_pcs, cfg.get("seed", 0))
    rows, o = [], 0
    for spec, p in zip(specs, preds):
        for r, step in enumerate(p.step):
            for k in range(scores.shape[1]):
                rows.append({"family": family, "kind": "run", **spec["keys"], "step": int(step), "pc": k + 1,
                             "value": float(scores[o + r, k])})
        o += len(p)
    for name, vec in predictor_vectors(specs[0], sorted({s["keys"]["M"] for s in specs})).items():
        proj = (vec - mean) @ comps.T
        M = -1 if name == "ridge" else int(name.split("_")[1])
        for k, v in enumerate(proj):
            rows.append({"family": family, "kind": name.split("_")[0], "run_id": name, "M": M, "seed": -1,
                         "batch": -1, "noise": "", "step": -1, "pc": k + 1, "value": float(v)})
    pcs = pd.DataFrame(rows, columns=PCS_SCHEMA.names)
    var = pd.DataFrame({"family": family, "pc": np.arange(1, len(evr) + 1), "explained_variance_ratio": evr})
    ev_rows, form_rows = [], []
    for spec, d, p in zip(specs, run_dirs, preds):
        rid, steps = spec["keys"]["run_id"], p.step.to_numpy()
        curve = pcs[(pcs.run_id == rid) & (pcs.kind == "run")].pivot(index="step", columns="pc", values="value").to_numpy()
        events = detect_events(curve, sigma, n_form, cfg.get("vertex_prominence", 0.1), cfg.get("cusp_speed", 0.3))
        ev_rows += [{"family": family, "run_id": rid, **e, "step": int(steps[e["index"]])} for e in events]
        stage_steps = (read_parquet(d / "stages.parquet").query("kind != 'end'").step.to_numpy()
                       if (d / "stages.parquet").exists() else np.array([]))
        for f, idx in enumerate(forms(events, min(n_form, curve.shape[1]), len(steps), tol)):
            near = int(stage_steps[np.abs(stage_steps - steps[idx]).argmin()]) if len(stage_steps) else -1
            form_rows.append({"family": family, **spec["keys"], "form": f, "step": int(steps[idx]), "index": idx,
                              "nearest_stage_step": near, "distance_to_stage": abs(near - int(steps[idx])) if near >= 0 else -1})
    return {"pcs": pcs, "variance": var, "events": pd.DataFrame(ev_rows, columns=EVENTS_SCHEMA.names),
            "forms": pd.DataFrame(form_rows, columns=FORMS_SCHEMA.names)}


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise ed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--family", required=True)
    ap.add_argument("--out", required=True, help="output directory, e.g. results/ed/<family>")
    ap.add_argument("--cfg", default="{}", help="JSON of the params.yaml ed section")
    ap.add_argument("--figures", default=None, help="figure directory (figures 2 and 5)")
    a = ap.parse_args(argv)
    cfg = json.loads(a.cfg)
    res = essential_dynamics([Path(d) for d in a.run_dirs], a.family, cfg)
    out = Path(a.out)
    write_parquet(res["variance"], out / "variance.parquet", VAR_SCHEMA)
    write_parquet(res["events"], out / "events.parquet", EVENTS_SCHEMA)
    write_parquet(res["forms"], out / "forms.parquet", FORMS_SCHEMA)
    write_parquet(res["pcs"], out / "pcs.parquet", PCS_SCHEMA)
    if a.figures:
        from .figures.ed import fig_essential_subspace, fig_forms
        metrics = pd.concat([read_parquet(Path(d) / "metrics.parquet") for d in a.run_dirs])
        fig_essential_subspace(res["pcs"], res["variance"], metrics, Path(a.figures) / f"fig02_essential_subspace_{a.family}")
        fig_forms(res["pcs"], res["forms"], res["events"], cfg, Path(a.figures) / f"fig05_ed_forms_{a.family}")
    ev = res["variance"].explained_variance_ratio
    print(f"{a.family}: {len(a.run_dirs)} runs; explained variance {', '.join(f'{v:.1%}' for v in ev)}; "
          f"{len(res['forms'])} forms")
