import pytest
import torch

from iclnoise.core.tasks import M_INF, BatchSampler, eval_set, parse_m, task_pool

pytestmark = [pytest.mark.unit, pytest.mark.numerics]


def test_pools_are_nested_and_share_the_root_task():
    big = task_pool(7, 1000, 8)   # torch.equal: NumPy's sequential draws, not arithmetic along two code paths
    for M in (1, 2, 37, 512):
        assert torch.equal(task_pool(7, M, 8), big[:M])
    assert not torch.equal(task_pool(8, 4, 8), big[:4])


def test_batches_are_deterministic_and_independent_of_splitting():
    s = BatchSampler(task_pool(0, 16, 4), 8, 4, 0.125, data_seed=3)
    a, b = s.batch(5, 64), s.batch(5, 64)   # same code path, same machine: bitwise
    assert torch.equal(a.xs, b.xs) and torch.equal(a.ys, b.ys)
    parts = a.split(4)
    assert torch.equal(torch.cat([p.xs for p in parts]), a.xs)
    assert not torch.equal(s.batch(6, 64).xs, a.xs)
    held = BatchSampler(task_pool(0, 16, 4), 8, 4, 0.125, data_seed=3, stream=1)
    assert not torch.equal(held.batch(5, 64).xs, a.xs)


def test_finite_pool_batches_only_use_pool_tasks_and_labels_follow_the_model():
    pool = task_pool(0, 3, 4)
    b = BatchSampler(pool, 8, 4, 0.0001, data_seed=0).batch(0, 256)
    assert all(any(torch.equal(t, p) for p in pool) for t in b.tasks)
    resid = b.ys - torch.einsum("bkd,bd->bk", b.xs, b.tasks)
    assert resid.std() < 0.02


def test_infinite_pool_draws_fresh_tasks():
    b = BatchSampler(None, 8, 4, 0.125, data_seed=0).batch(0, 512)
    assert len({tuple(t.tolist()) for t in b.tasks}) == 512
    assert abs(b.tasks.var().item() - 1) < 0.1


def test_eval_sets_are_fixed_and_shared():
    a = eval_set("ood", 4, 32, 8, 4, 0.125, 0, 1)   # same draws, same code path: bitwise
    assert torch.equal(a.xs, eval_set("ood", 64, 32, 8, 4, 0.125, 0, 1).xs)
    root = eval_set("root", 4, 32, 8, 4, 0.125, 0, 1)
    assert torch.equal(root.tasks, task_pool(0, 1, 4).expand(32, 4))
    assert torch.equal(eval_set("id", M_INF, 32, 8, 4, 0.125, 0, 1).xs, a.xs)


def test_parse_m():
    assert parse_m("inf") == M_INF and parse_m(16) == 16 and parse_m(float("inf")) == M_INF
