"""Stage detection on synthetic LLC curves with planted plateaus, at several checkpoint densities."""
import numpy as np
import pytest

from iclnoise.core.schedules import checkpoint_steps
from iclnoise.probes.stages import milestones, smooth_log_time, stages

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

KEYS = {"run_id": "r", "M": 1, "seed": 0, "batch": 8, "noise": "none"}


def planted(steps, noise=0.0, seed=0):
    """Rise around 10^1.5, plateau, rise around 10^2.5, plateau, fall around 10^3.4 (t = log10 step)."""
    t = np.log10(np.asarray(steps, float) + 1)
    llc = 5 + 10 / (1 + np.exp(-(t - 1.5) * 12)) + 8 / (1 + np.exp(-(t - 2.5) * 12)) - 9 / (1 + np.exp(-(t - 3.4) * 12))
    return llc + noise * np.random.default_rng(seed).standard_normal(len(t)), t


DENSITIES = {
    "log60": np.unique(np.round(np.geomspace(1, 10_000, 60)).astype(int)),
    "log400": np.unique(np.round(np.geomspace(1, 10_000, 400)).astype(int)),
    # Hoogland-like: dense linear spacing (every 20 steps) plus 40 log-spaced early checkpoints
    "linear500+log40": np.array(checkpoint_steps(10_000, 500, 40)),
}


@pytest.mark.parametrize("density", DENSITIES)
def test_milestones_sit_on_the_planted_plateaus_at_any_density(density):
    """Smoothing in log-time: the same milestones whatever the checkpoint spacing (index smoothing
    would smooth the dense linear tail ~25× less in log-time than the early log-spaced part)."""
    steps = DENSITIES[density]
    llc, t = planted(steps, noise=0.05)
    found = [t[i] for i, _ in milestones(steps, llc, sigma=0.1, plateau_tol=0.1)]
    assert any(1.8 < x < 2.3 for x in found), (density, found)      # plateau between the rises
    assert any(2.7 < x < 3.2 for x in found), (density, found)      # top, between rise and fall
    assert len(found) <= 3, (density, found)


def test_smoothing_is_in_log_time():
    """A step at t = 2 smoothed with σ = 0.1 decade: halfway at t = 2 and within 3 % at t = 2 ± 0.2,
    on a log grid and on a dense linear grid alike."""
    for steps in (np.unique(np.round(np.geomspace(1, 10_000, 200)).astype(int)), np.arange(0, 10_001, 5)):
        t = np.log10(steps + 1.0)
        y = smooth_log_time(steps, (t > 2).astype(float), 0.1)
        assert abs(np.interp(2.0, t, y) - 0.5) < 0.1
        assert np.interp(2.2, t, y) > 0.97 and np.interp(1.8, t, y) < 0.03


def test_stage_types_follow_the_llc():
    steps = DENSITIES["log60"]
    llc, _ = planted(steps, noise=0.05)
    df = stages(KEYS, steps, llc, np.linspace(1, 0.1, len(steps)), sigma=0.2, plateau_tol=0.1)
    assert df.type.iloc[0] == "A" and df.type.iloc[-1] == "B"
    assert np.isclose(df.delta_llc.sum(), llc[-1] - llc[0])
    assert (df.end_step.to_numpy()[:-1] == df.start_step.to_numpy()[1:]).all()


def test_monotone_curve_without_plateau_is_one_stage():
    steps = np.arange(1, 50)
    df = stages(KEYS, steps, np.log(steps) * 3, np.zeros(49), sigma=0.1, plateau_tol=0.01)
    assert len(df) == 1 and df.type.iloc[0] == "A"
