"""The counter-based stream (iclnoise.core.rng, train.rng counter): SplitMix64's known answers, a run's draws
independent of its ensemble, and batches equal in distribution to the generator stream's."""
import numpy as np
import pytest
import torch
from scipy import stats

from iclnoise.core import rng
from iclnoise.core.sections import TaskPrior
from iclnoise.core.tasks import BatchSampler, CounterSampler, task_pool

pytestmark = pytest.mark.unit
MASK = (1 << 64) - 1


def splitmix64(state: int, n: int) -> list[int]:
    """The reference generator in Python integers (Steele, Lea and Flood 2014): state += γ, then the finaliser."""
    out = []
    for _ in range(n):
        state = (state + rng.GAMMA) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_mix64_is_splitmix64_in_wrapping_int64():
    """Seed 0's first output is SplitMix64's published 0xE220A8397B1DCDAF; bits(key, step, n) is the reference
    generator started at mix64(key + (step+1)γ), for keys across the int64 range."""
    assert splitmix64(0, 1)[0] == 0xE220A8397B1DCDAF
    keys = [0, 1, 2**62 + 12345, -(2**63), -1, 0x1234_5678_9ABC_DEF0]
    b = rng.bits(torch.tensor(keys), 7, 5)
    for key, row in zip(keys, b.tolist()):
        start = splitmix64((key + 7 * rng.GAMMA) & MASK, 1)[0]
        assert [x & MASK for x in row] == splitmix64(start, 5)


def test_a_runs_draws_do_not_depend_on_its_ensemble():
    """Run r's words are the same in an ensemble of 1, 3 or 50 runs, in any position."""
    keys = torch.randint(-(2**62), 2**62, (50,), generator=torch.Generator().manual_seed(0))
    whole = rng.bits(keys, 123, 1000)
    assert torch.equal(rng.bits(keys[17:18], 123, 1000)[0], whole[17])
    assert torch.equal(rng.bits(keys[[40, 17, 3]], 123, 1000), whole[[40, 17, 3]])


def test_normals_and_integers_have_their_distributions():
    """2·10⁵ normals: Kolmogorov–Smirnov against N(0, 1) (p > 0.001), mean and variance inside 4 standard errors,
    neighbouring words and neighbouring steps uncorrelated (|ρ| < 4/√n); integers below 7: χ² p > 0.001."""
    keys = torch.tensor([11, 12])
    z = rng.normal(rng.bits(keys, 0, 100_000)).double()
    n = z.numel()
    assert stats.kstest(z.flatten().numpy(), "norm").pvalue > 1e-3
    assert abs(float(z.mean())) < 4 / n**0.5 and abs(float(z.var()) - 1) < 4 * (2 / n) ** 0.5
    nxt = rng.normal(rng.bits(keys, 1, 100_000)).double()
    for a, b in ((z[:, 1:], z[:, :-1]), (z, nxt), (z[0], z[1])):
        assert abs(float((a * b).mean())) < 4 / a.numel() ** 0.5
    k = rng.below(rng.bits(keys, 2, 70_000), torch.tensor(7))
    assert int(k.min()) == 0 and int(k.max()) == 6
    assert stats.chisquare(np.bincount(k.flatten().numpy(), minlength=7)).pvalue > 1e-3


PRIOR = TaskPrior.from_dict({"spectrum": "power_law", "exponent": 1.0, "basis_seed": 3})


def samplers(counter: bool) -> list[BatchSampler]:
    prior = PRIOR
    return [BatchSampler(task_pool(7, 4, 5), 8, 5, 0.25, 0, counter=counter),
            BatchSampler(task_pool(7, 1, 5), 8, 5, 0.25, 1, counter=counter),
            BatchSampler(None, 8, 5, 0.25, 2, counter=counter),
            BatchSampler(None, 8, 5, 0.25, 3, prior=prior, counter=counter)]


def test_the_counter_draw_is_every_runs_own_batch_bit_for_bit():
    """Pooled runs of different M and fresh tasks in one CounterSampler, and a shaped prior's fresh tasks beside a
    pooled run of that prior: each run's slice is torch.equal to its own sampler's batch (its ensemble of itself
    alone). Runs of different priors cannot share one (one data section per ensemble)."""
    ss = samplers(True)
    shaped = [BatchSampler(task_pool(7, 3, 5, PRIOR), 8, 5, 0.25, 4, prior=PRIOR, counter=True), ss[3]]
    for group in (ss[:3], shaped):
        for step in (0, 7, 1234):
            b = CounterSampler(group).batch(step, 16)
            assert b.xs.shape == (len(group), 16, 8, 5) and b.ys.shape == (len(group), 16, 8)
            for r, s in enumerate(group):
                own = s.batch(step, 16)
                assert all(torch.equal(getattr(b, f)[r], getattr(own, f)) for f in ("xs", "ys", "tasks")), (step, r)
    with pytest.raises(ValueError, match="one task prior"):
        CounterSampler(ss)


def test_counter_batches_equal_the_generators_in_distribution():
    """200 batches of 64 from each stream, per sampler: two-sample KS on xs and on the label noise y − t·x (p > 0.001),
    and a χ² test of equal task frequencies over the pool (p > 0.001); fresh tasks (isotropic and shaped): KS per
    coordinate (p > 0.001, Bonferroni over 5)."""
    draws = {}
    for counter in (False, True):
        for r, s in enumerate(samplers(counter)):
            bs = [s.batch(t, 64) for t in range(200)]
            xs, ys, ts = (torch.cat([getattr(b, f) for b in bs]) for f in ("xs", "ys", "tasks"))
            draws[counter, r] = (xs, ys - torch.einsum("bkd,bd->bk", xs, ts), ts, s.pool)
    for r in range(4):
        (xg, eg, tg, pool), (xc, ec, tc, _) = draws[False, r], draws[True, r]
        assert stats.ks_2samp(xg.flatten()[:50_000], xc.flatten()[:50_000]).pvalue > 1e-3, r
        assert stats.ks_2samp(eg.flatten(), ec.flatten()).pvalue > 1e-3, r
        if pool is not None and len(pool) > 1:
            counts = [((t[:, None] == pool).all(-1).float().sum(0)).numpy() for t in (tg, tc)]
            assert stats.chi2_contingency(np.stack(counts)).pvalue > 1e-3, r
        elif pool is None:
            assert all(stats.ks_2samp(tg[:, d], tc[:, d]).pvalue > 1e-3 / 5 for d in range(5)), r
