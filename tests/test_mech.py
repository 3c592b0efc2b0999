"""Mechanistic probes: hooks really ablate, attention masses add up, probes find planted signals."""
import torch

from iclnoise.mech import ablate_head_hook, attention_masses, head_ablation, layernorm_collapse, probes, ridge_estimates, ridge_probe_r2
from iclnoise.model import ModelConfig, build_model
from iclnoise.predictors import ridge
from iclnoise.tasks import BatchSampler, task_pool


def model_and_batch():
    m = build_model(ModelConfig(D=3, K=5, d_model=16, n_layers=2, n_heads=2, d_mlp=16), 0).eval()
    for p in m.parameters():  # a non-trivial random model (init is close to uniform attention)
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    return m, BatchSampler(task_pool(0, 8, 3), 5, 3, 0.125, 0).batch(0, 64)


def test_ablation_hook_changes_output_and_noop_hook_does_not():
    m, b = model_and_batch()
    base = m(b.xs, b.ys)
    noop = m.run_with_hooks(b.xs, b.ys, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z)])
    assert torch.equal(base, noop)
    abl = m.run_with_hooks(b.xs, b.ys, fwd_hooks=[("blocks.0.attn.hook_z", ablate_head_hook(1))])
    assert (abl - base).abs().max() > 1e-3
    assert torch.equal(m(b.xs, b.ys), base)          # hooks are removed after run_with_hooks
    # ablating a head equals zeroing its rows of W_O (weight surgery as an independent check)
    m2, _ = model_and_batch()
    with torch.no_grad():
        m2.blocks[0].attn.W_O[1] = 0
    torch.testing.assert_close(m2(b.xs, b.ys), abl)
    res = head_ablation(m, b.xs, b.ys, (1, 5))
    assert set(res) == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_attention_masses_add_up_to_one():
    m, b = model_and_batch()
    for vals in attention_masses(m, b.xs, b.ys).values():
        total = vals["attn_to_y"] + vals["attn_to_x"] + vals["attn_to_self"]
        assert abs(total - 1) < 1e-5 and min(vals.values()) >= 0


def test_probe_recovers_planted_linear_signal_and_not_noise():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2000, 20, generator=g)
    W = torch.randn(20, 3, generator=g)
    assert ridge_probe_r2(feats, feats @ W + 0.01 * torch.randn(2000, 3, generator=g), lam=1e-4) > 0.99
    assert abs(ridge_probe_r2(feats, torch.randn(2000, 3, generator=g), lam=1e-4)) < 0.03


def test_ridge_estimates_match_the_ridge_predictor_and_probe_table_shape():
    m, b = model_and_batch()
    t_hat = ridge_estimates(b.xs, b.ys, 0.125)
    torch.testing.assert_close((t_hat * b.xs.double()).sum(-1).float(), ridge(b.xs, b.ys, 0.125))
    out = probes(m, b, 0.125)
    assert len([k for k in out if k[0] == "probe_task_r2"]) == 3 * 10
    assert len([k for k in out if k[0] == "probe_ridge_r2"]) == 3 * 8


def test_layernorm_collapse_counts_small_weights():
    m, _ = model_and_batch()
    with torch.no_grad():
        m.blocks[1].ln1.weight[:4] = 0.0
        m.blocks[1].ln1.weight[4:] = 1.0
    assert layernorm_collapse(m, 0.05)["blocks.1.ln1"] == 4 / 16
