"""Essential dynamics: PCA, curve geometry on curves with known vertices and cusps, forms, CLI."""
import json

import numpy as np
import pandas as pd
import pytest

from iclnoise.ed import cli, cusps, detect_events, forms, joint_pca, plane_geometry, predictor_vectors, vertices
from iclnoise.evaluate import METRICS_SCHEMA, root_preds_schema
from iclnoise.io import read_parquet, write_json, write_parquet
from scipy.ndimage import gaussian_filter1d


def ellipse(n=240, a=3.0, b=1.0, noise=0.0, seed=0):
    th = np.linspace(-np.pi / 4, 2 * np.pi + np.pi / 4, n, endpoint=False)
    rng = np.random.default_rng(seed)
    return th, a * np.cos(th) + noise * rng.standard_normal(n), b * np.sin(th) + noise * rng.standard_normal(n)


def test_curvature_of_a_circle_and_ellipse_vertices_exactly():
    th = np.linspace(0, 2 * np.pi, 400)
    g = plane_geometry(2 * np.cos(th), 2 * np.sin(th))
    np.testing.assert_allclose(g["kappa"][5:-5], 0.5, rtol=1e-3)
    np.testing.assert_allclose(np.hypot(g["ex"], g["ey"])[5:-5], 0, atol=1e-2)   # evolute of a circle: its centre
    th, x, y = ellipse()
    g = plane_geometry(x, y)
    found = th[vertices(g["kappa"], g["speed"])]
    np.testing.assert_allclose(np.sort(found), [0, np.pi / 2, np.pi, 3 * np.pi / 2, 2 * np.pi], atol=0.03)


def test_noisy_ellipse_vertices_with_bounded_false_positives():
    """Noise 0.5 % of the major axis on 240 points, Gaussian smoothing σ = 8 points: every vertex is
    found within ±0.2 rad in all 20 draws, with at most 0.1 false positives per curve on average
    (measured: 0 misses, 0 false positives, max error 0.13 rad; σ = 3 gives ~5 false positives per curve)."""
    truth = np.array([0, np.pi / 2, np.pi, 3 * np.pi / 2, 2 * np.pi])
    false_pos = 0
    for seed in range(20):
        th, x, y = ellipse(noise=0.015, seed=seed)
        g = plane_geometry(gaussian_filter1d(x, 8, mode="nearest"), gaussian_filter1d(y, 8, mode="nearest"))
        found = th[vertices(g["kappa"], g["speed"], prominence=0.1)]
        dist = np.abs(found[:, None] - truth[None, :]).min(1)
        assert all(np.abs(found - t).min() < 0.2 for t in truth), (seed, found)
        false_pos += int((dist >= 0.2).sum())
    assert false_pos / 20 <= 0.1


def test_semicubical_parabola_cusp():
    t = np.linspace(-1, 1, 101)
    g = plane_geometry(t ** 2, t ** 3)
    c = cusps(g["dx"], g["dy"])
    assert list(c) == [50]
    # a smooth curve through the same region has none
    g2 = plane_geometry(t, t ** 3)
    assert len(cusps(g2["dx"], g2["dy"])) == 0


def test_forms_on_a_planted_simultaneous_event():
    u = np.linspace(-1, 1, 81)                      # the curve stops and turns back at index 40 in all PCs
    curve = np.stack([u ** 2, u ** 3, 0.5 * u ** 2 + u ** 3], 1)
    events = detect_events(curve, sigma=0, n_pcs=3, prominence=0.1, cusp_speed=0.3)
    assert {(e["pc_i"], e["pc_j"]) for e in events if e["kind"] == "cusp" and abs(e["index"] - 40) <= 1} == {(1, 2), (1, 3), (2, 3)}
    assert forms(events, 3, len(u), tolerance=2) == [40]
    # an event in only two of three pairs is not a form
    partial = [e for e in events if (e["pc_i"], e["pc_j"]) != (2, 3)]
    assert forms(partial, 3, len(u), tolerance=2) == []


def test_randomised_pca_matches_dense_svd():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 5)) @ rng.standard_normal((5, 400)) * np.array([10, 5, 3, 2, 1])[:5].sum() \
        + 0.01 * rng.standard_normal((200, 400))
    scores, comps, mean, evr = joint_pca(X, 3)
    Xc = X - X.mean(0)
    U, S, Vt = np.linalg.svd(Xc, full_matrices=False)
    np.testing.assert_allclose(evr, S[:3] ** 2 / (S ** 2).sum(), rtol=1e-4)
    # same subspace: projector difference ~ 0
    np.testing.assert_allclose(comps.T @ comps, Vt[:3].T @ Vt[:3], atol=1e-4)
    np.testing.assert_allclose(np.abs(scores), np.abs(U[:, :3] * S[:3]), rtol=1e-3, atol=1e-3)


def fake_run(root, M, seed=0, steps=(0, 1, 3, 10, 30, 100, 300, 1000), K=4, D=2, n_root=16):
    rid = f"M{M}-B8-none-s{seed}"
    d = root / rid
    keys = {"run_id": rid, "M": M, "seed": seed, "batch": 8, "noise": "none"}
    spec = {"keys": keys, "data": {"D": D, "K": K, "noise_var": 0.125, "pool_seed": 0},
            "eval": {"n_root": n_root, "eval_seed": 1}}
    write_json(spec, d / "run.json")
    rng = np.random.default_rng(M)
    target = rng.standard_normal(n_root * K)
    preds = [np.tanh(np.log1p(s) / 3) * target + 0.01 * rng.standard_normal(n_root * K) for s in steps]
    write_parquet(pd.DataFrame({"run_id": rid, "step": list(steps), "preds": [p.astype(np.float32) for p in preds]}),
                  d / "root_preds.parquet", root_preds_schema(n_root * K))
    m = [{**keys, "step": s, "sequences": s * 8, "lr": 1e-3, "train_loss": 1.0, "id_loss": 1.0, "ood_loss": 1.0 / (1 + i),
          "id_loss_dmmse": 0.1, "id_loss_ridge": 0.2, "ood_loss_dmmse": 0.5, "ood_loss_ridge": 0.3, "delta_dmmse": 0.1,
          "delta_ridge": 0.1, "r": 0.5, "icl_score": 0.0, "diverged": False} for i, s in enumerate(steps)]
    write_parquet(pd.DataFrame(m), d / "metrics.parquet", METRICS_SCHEMA)
    return d


def test_cli_end_to_end_and_predictor_projection(tmp_path):
    dirs = [fake_run(tmp_path / "runs", M) for M in (1, 4, 16)]
    cli([str(d) for d in dirs] + ["--family", "fam", "--out", str(tmp_path / "ed"), "--figures", str(tmp_path / "fig"),
                                  "--cfg", json.dumps({"n_pcs": 3, "sigma": 1.0})])
    pcs = read_parquet(tmp_path / "ed/pcs.parquet")
    assert set(pcs.kind) == {"run", "dmmse", "ridge"} and set(pcs[pcs.kind == "dmmse"].M) == {1, 4, 16}
    assert len(pcs[pcs.kind == "run"]) == 3 * 8 * 3
    X = np.concatenate([np.stack(read_parquet(d / "root_preds.parquet").preds.to_numpy()) for d in dirs]).astype(float)
    _, comps, mean, _ = joint_pca(X, 3)
    ridge_vec = predictor_vectors(json.loads((dirs[0] / "run.json").read_text()), [1])["ridge"]
    np.testing.assert_allclose(pcs[pcs.kind == "ridge"].sort_values("pc").value, (ridge_vec - mean) @ comps.T, rtol=1e-6)
    for stem in ("fig02_essential_subspace_fam", "fig05_ed_forms_fam"):
        assert (tmp_path / "fig" / f"{stem}.png").stat().st_size > 10_000
    assert (tmp_path / "ed/forms.parquet").exists()
