"""Mechanistic probes: hooks really ablate, attention masses add up, probes read planted signals,
undefined values are NaN with a reason, ablation drops carry paired standard errors."""
import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.optimize import brentq

from iclnoise.config import load_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import write_json
from iclnoise.core.model import ModelConfig, build_model
from iclnoise.core.predictors import icl_score, ridge, token_losses
from iclnoise.core.probe_sections import Mech
from iclnoise.core.tasks import BatchSampler, eval_set, task_pool
from iclnoise.probes.mech import (
    LAMBDAS,
    MECH_SCHEMA,
    _ridge_fit,
    _ridge_predict,
    ablate_head_hook,
    attention_masses,
    head_ablation,
    layernorm_collapse,
    probes,
    ridge_estimates,
    ridge_probe_r2,
    run_summary,
    uniform_attention_masses,
)
from iclnoise.run.probing import mech_for_run
from iclnoise.run.runs import checkpoint_path, save_torch

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

CFG = ModelConfig(D=3, K=5, d_model=16, n_layers=2, n_heads=2, d_mlp=16)


def model_and_batch(M=8):
    m = build_model(CFG, 0).eval()
    for p in m.parameters():  # a non-trivial random model (init is close to uniform attention)
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    return m, BatchSampler(task_pool(0, M, 3), 5, 3, 0.125, 0).batch(0, 64)


def test_ablation_hook_changes_output_and_noop_hook_does_not():
    m, b = model_and_batch()
    base = m(b.xs, b.ys)
    noop = m.run_with_hooks(b.xs, b.ys, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z)])
    assert torch.equal(base, noop)
    abl = m.run_with_hooks(b.xs, b.ys, fwd_hooks=[("blocks.0.attn.hook_z", ablate_head_hook(1))])
    assert (abl - base).abs().max() > 1e-3
    assert torch.equal(m(b.xs, b.ys), base)          # hooks are removed after run_with_hooks
    m2, _ = model_and_batch()                          # = zeroing the head's rows of W_O (weight surgery)
    with torch.no_grad():
        m2.blocks[0].attn.W_O[1] = 0
    torch.testing.assert_close(m2(b.xs, b.ys), abl)


def test_ablation_sign_and_paired_se_match_a_direct_computation():
    """In float64 on both sides: the drop is a difference of nearly equal losses (0.02 of losses ≈ 1), and the probe
    sums in another order than the direct computation, so in float32 the two differ by a few ε32 of the losses,
    1e-5 of the drop on one CPU and 2.4e-5 on another (issue 33). In float64 that cancellation costs ~1e-15 of the
    losses, ~1e-13 of the drop: rel 1e-9 leaves five orders of margin and still fails for any other formula."""
    m, b = model_and_batch()
    m, b = m.double(), replace(b, xs=b.xs.double(), ys=b.ys.double())
    res = head_ablation(m, b.xs, b.ys, (1, 5))
    assert set(res) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    abl = m.run_with_hooks(b.xs, b.ys, fwd_hooks=[("blocks.0.attn.hook_z", ablate_head_hook(1))])
    base = m(b.xs, b.ys)
    drop = icl_score(token_losses(base, b.ys, 3), 1, 5) - icl_score(token_losses(abl, b.ys, 3), 1, 5)
    v, se = res[(0, 1)]["ablation_icl_drop"]
    assert v == pytest.approx(drop, rel=1e-9)                   # method §10: drop = base − ablated
    per = (((base - b.ys) ** 2)[:, 0] - ((base - b.ys) ** 2)[:, 4] - ((abl - b.ys) ** 2)[:, 0]
           + ((abl - b.ys) ** 2)[:, 4]) / 3
    assert se == pytest.approx(float(per.std() / math.sqrt(64)), rel=1e-9)
    inc, _ = res[(0, 1)]["ablation_ood_loss_increase"]
    assert inc == pytest.approx(float(token_losses(abl, b.ys, 3).mean() - token_losses(base, b.ys, 3).mean()), rel=1e-9)


def test_attention_masses_add_up_and_a_uniform_head_reads_chance():
    m, b = model_and_batch()
    for vals in attention_masses(m, b.xs, b.ys).values():
        assert abs(sum(vals.values()) - 1) < 1e-5 and min(vals.values()) >= 0
    with torch.no_grad():                              # W_Q = 0: all scores equal, attention uniform
        for blk in m.blocks:
            blk.attn.W_Q.zero_()
            blk.attn.b_Q.zero_()
    chance = uniform_attention_masses(5)
    for vals in attention_masses(m, b.xs, b.ys).values():
        for k, v in chance.items():
            assert vals[k] == pytest.approx(v, abs=1e-6)
    assert uniform_attention_masses(8)["attn_to_y"] == pytest.approx(0.4270, abs=1e-4)   # the 0.427


def planted(n, d, r2, seed, D=4):
    """Residual stream x = t A + σ ε (t ~ N(0, I_D), A random D × d) with σ solved so the population R²
    of the best linear read-out of t, 1 − tr((I + AAᵀ/σ²)⁻¹)/D, equals r2 (closed form)."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((D, d)) / np.sqrt(d)
    G = A @ A.T
    sigma = brentq(lambda s: 1 - np.trace(np.linalg.inv(np.eye(D) + G / s ** 2)) / D - r2, 1e-3, 1e3)
    t = rng.standard_normal((n, D))
    return torch.tensor(t @ A + sigma * rng.standard_normal((n, d))), torch.tensor(t)


def test_probe_reads_a_planted_r2_of_one_half_at_the_paper_width():
    """d_model 256, planted R² 0.5. Measured: 4096 sequences (the default n_probe) read 0.459; 2048:
    0.426; 1024: 0.393 (the old 50/50 probe with a fixed penalty read 0.046, noise −0.94).
    Noise reads ≈ 0 (0.0006 at 1024), a strong signal (R² 0.99, d 32, 512 sequences) 0.989."""
    x, t = planted(4096, 256, 0.5, 0)
    assert abs(ridge_probe_r2(x, t)[0] - 0.5) < 0.1
    x, _ = planted(1024, 256, 0.5, 1)
    assert abs(ridge_probe_r2(x, torch.randn(1024, 4, generator=torch.Generator().manual_seed(0)).double())[0]) < 0.03
    x, t = planted(512, 32, 0.99, 2)
    assert ridge_probe_r2(x, t)[0] > 0.97


def test_ridge_path_predictions_equal_a_direct_solve_for_every_penalty():
    """The eigen-path predictions (every λ at once) against ridge solved directly per λ: standardise X with the
    training mean and sd, W = (ZᵀZ + λ n I)⁻¹ Zᵀ(Y − Ȳ), prediction Ȳ + Z_new W."""
    g = np.random.default_rng(0)
    X, Y, Xn = g.normal(size=(200, 12)) * 3 + 1, g.normal(size=(200, 3)), g.normal(size=(50, 12))
    X[:, 4] = 2.0   # a constant feature (sd 0): left unscaled
    got = _ridge_predict(Xn, _ridge_fit(X, Y), LAMBDAS)
    mu, sd = X.mean(0), np.where(X.std(0) > 1e-12, X.std(0), 1.0)
    Z, Zn = (X - mu) / sd, (Xn - mu) / sd
    for lam, pred in zip(LAMBDAS, got):
        W = np.linalg.solve(Z.T @ Z + lam * len(X) * np.eye(12), Z.T @ (Y - Y.mean(0)))
        np.testing.assert_allclose(pred, Y.mean(0) + Zn @ W, rtol=1e-8, atol=1e-10)


def test_task_probe_splits_by_task_and_is_nan_with_a_reason_for_too_few_tasks():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(400, 8, generator=g)
    pool = torch.randn(1, 3, generator=g)
    v, note = ridge_probe_r2(feats, pool[torch.zeros(400, dtype=torch.long)], np.zeros(400, int))
    assert math.isnan(v) and "task" in note                     # M = 1: undefined, never −inf
    # 20 pool tasks, features = a one-hot of the task (a lookup table): split by sequence it
    # "reads" the task perfectly; split by task it cannot (the held-out tasks were never seen)
    M = 20
    pool = torch.randn(M, 3, generator=g)
    idx = torch.randint(0, M, (400,), generator=g)
    onehot = torch.nn.functional.one_hot(idx, M).double() + 0.01 * torch.randn(400, M, generator=g).double()
    by_seq, _ = ridge_probe_r2(onehot, pool[idx].double())
    by_task, _ = ridge_probe_r2(onehot, pool[idx].double(), idx.numpy())
    assert by_seq > 0.9 and by_task < 0.1


def test_ridge_estimates_match_the_ridge_predictor_and_probe_table_shape():
    m, b = model_and_batch()
    t_hat = ridge_estimates(b.xs, b.ys, 0.125)
    torch.testing.assert_close((t_hat * b.xs.double()).sum(-1).float(), ridge(b.xs, b.ys, 0.125))
    out = probes(m, b, 0.125)
    assert len([k for k in out if k[0] == "probe_task_r2"]) == 3 * 10
    assert len([k for k in out if k[0] == "probe_ridge_r2"]) == 3 * 8
    assert all(np.isfinite(v) or note for v, note in out.values())


def test_layernorm_collapse_counts_small_weights():
    m, _ = model_and_batch()
    with torch.no_grad():
        m.blocks[1].ln1.weight[:4] = 0.0
        m.blocks[1].ln1.weight[4:] = 1.0
    assert layernorm_collapse(m, 0.05)["blocks.1.ln1"] == 4 / 16


def test_mech_for_run_uses_the_metrics_ood_set_and_is_finite_at_m1(tmp_path):
    m, _ = model_and_batch(1)
    run = tmp_path / "run"
    keys = {"run_id": "M1-B8-none-s0", "M": 1, "seed": 0, "batch": 8, "noise": "none"}
    spec = {**run_spec(load_params("params.yaml"), "M1-B8-none-s0"), "keys": keys,   # a full spec, our data
            "data": {"D": 3, "K": 5, "noise_var": 0.125, "pool_seed": 0},
            "eval": {"n_sequences": 48, "n_root": 8, "eval_seed": 7, "icl_tokens": [1, 5]}}
    write_json(spec, run / "run.json")
    state = {"model": m.state_dict(), "model_config": CFG.to_dict(), "adam": None, "spec_hash": "x"}
    write_json({"3": save_torch(state, checkpoint_path(run, 3))}, run / "checkpoints.json")
    df = mech_for_run(run, Mech(n_probe=60, ln_threshold=0.05, seed=0))
    assert list(df.columns) == MECH_SCHEMA.names and set(df.step) == {3}
    assert not np.isinf(df.value).any()
    nan = df[df.value.isna()]
    assert len(nan) and (nan.note != "").all() and set(nan.probe) == {"probe_task_r2"}
    ood = eval_set("ood", 1, 48, 5, 3, 0.125, 0, 7)                   # what evaluate.Evaluator uses
    ref = head_ablation(m, ood.xs, ood.ys, (1, 5))[(1, 0)]["ablation_icl_drop"]
    row = df[(df.probe == "ablation_icl_drop") & (df.layer == 1) & (df["head"] == 0)].iloc[0]
    assert (row.value, row.se) == pytest.approx(ref)
    s = run_summary(df)
    assert s["attn_to_y_excess"] == pytest.approx(s["attn_to_y_max"] - uniform_attention_masses(5)["attn_to_y"])
    assert math.isnan(s["probe_task_r2_max"]) and np.isfinite(s["icl_drop_max"])


def test_run_summary_takes_the_last_step():
    rows = [{"step": st, "probe": p, "value": v} for st, p, v in
            [(1, "attn_to_y", 0.9), (5, "attn_to_y", 0.6), (5, "attn_to_y", 0.7), (5, "attn_to_y_chance", 0.4),
             (5, "ablation_icl_drop", 0.2), (5, "ablation_icl_drop", -0.1), (5, "probe_task_r2", np.nan),
             (5, "probe_task_r2", 0.3), (5, "probe_ridge_r2", 0.5), (5, "ablation_ood_loss_increase", 0.05)]]
    s = run_summary(pd.DataFrame(rows))
    assert s == pytest.approx({"attn_to_y_max": 0.7, "attn_to_y_excess": 0.3, "icl_drop_max": 0.2,
                               "ood_loss_increase_max": 0.05, "probe_task_r2_max": 0.3, "probe_ridge_r2_max": 0.5})
