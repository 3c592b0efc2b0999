"""The model on stacked parameters (a leading run axis) is R independent models, each computed alone."""
import pytest
import torch
from torch.func import functional_call, stack_module_state

from iclnoise.model import ModelConfig, build_model, mse_loss


@pytest.mark.parametrize("layer_norm", [True, False])
def test_stacked_runs_equal_each_model_alone(layer_norm):
    cfg = ModelConfig(D=3, K=5, d_model=16, n_layers=2, n_heads=2, d_mlp=24, layer_norm=layer_norm)
    # float64: stacked (bmm) and alone (F.linear) are different kernels, whose float32 round-off depends on the CPU
    models = [build_model(cfg, s).double() for s in range(3)]
    params, _ = stack_module_state(models)
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    buffers = dict(models[0].named_buffers())
    xs, ys = torch.randn(3, 7, cfg.K, cfg.D, dtype=torch.float64), torch.randn(3, 7, cfg.K, dtype=torch.float64)

    def stacked(a, b):
        return functional_call(models[0], (params, buffers), (a, b))

    out = stacked(xs, ys)
    assert out.shape == (3, 7, cfg.K)
    # values and gradients O(1), each from ≲ 1e3 roundings: ≲ 1e3·ε64 ≈ 2e-13; another run's parameters are O(1) off
    for r, m in enumerate(models):
        torch.testing.assert_close(out[r], m(xs[r], ys[r]), rtol=1e-12, atol=1e-12)
    losses = mse_loss(stacked, xs, ys)
    alone = [mse_loss(m, xs[r], ys[r]) for r, m in enumerate(models)]
    torch.testing.assert_close(losses, torch.stack(alone).detach(), rtol=1e-12, atol=1e-12)
    # gradients: run r's loss moves only run r's slice, and equals the model's own gradient
    grads = torch.autograd.grad(losses.sum(), list(params.values()))
    for r, m in enumerate(models):
        own = torch.autograd.grad(alone[r], list(m.parameters()))
        for g, o in zip(grads, own):
            torch.testing.assert_close(g[r], o, rtol=1e-12, atol=1e-12)   # b_K's are round-off about 0: atol


def test_a_different_input_for_one_run_changes_only_that_run():
    cfg = ModelConfig(D=2, K=4, d_model=8, n_layers=1, n_heads=2, d_mlp=8)
    models = [build_model(cfg, s) for s in range(4)]
    params, _ = stack_module_state(models)
    buffers = dict(models[0].named_buffers())
    xs, ys = torch.randn(4, 3, cfg.K, cfg.D), torch.randn(4, 3, cfg.K)
    a = functional_call(models[0], (params, buffers), (xs, ys))
    xs2 = xs.clone()
    xs2[2] += 1.0
    b = functional_call(models[0], (params, buffers), (xs2, ys))
    changed = (a - b).abs().flatten(1).amax(1) > 0   # same code path, same machine: bitwise for untouched runs
    assert changed.tolist() == [False, False, True, False]
