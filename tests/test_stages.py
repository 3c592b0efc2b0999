"""Stage detection on synthetic LLC curves with planted plateaus."""
import numpy as np

from iclnoise.stages import milestones, stages


def planted_curve(noise=0.0, seed=0):
    steps = np.unique(np.round(np.geomspace(1, 10_000, 60)).astype(int))
    t = np.log10(steps)
    # rise around 10^1.5, plateau, rise around 10^2.5, plateau, fall around 10^3.4
    llc = 5 + 10 / (1 + np.exp(-(t - 1.5) * 12)) + 8 / (1 + np.exp(-(t - 2.5) * 12)) - 9 / (1 + np.exp(-(t - 3.4) * 12))
    llc += noise * np.random.default_rng(seed).standard_normal(len(t))
    return steps, llc, t


def test_milestones_sit_on_the_planted_plateaus():
    steps, llc, t = planted_curve()
    ms = milestones(steps, llc, sigma=1.0)
    found = [t[i] for i, _ in ms]
    # one milestone in each planted plateau/extremum: between the rises, and between rise and fall
    assert any(1.7 < x < 2.3 for x in found), found
    assert any(2.7 < x < 3.2 for x in found), found
    assert len(found) <= 3


def test_stage_types_follow_the_llc():
    steps, llc, _ = planted_curve(noise=0.05)
    df = stages({"run_id": "r", "M": 1, "seed": 0, "batch": 8, "noise": "none"}, steps, llc,
                np.linspace(1, 0.1, len(steps)), sigma=1.5)
    assert df.type.iloc[0] == "A" and df.type.iloc[-1] == "B"
    assert np.isclose(df.delta_llc.sum(), llc[-1] - llc[0])
    assert (df.end_step.to_numpy()[:-1] == df.start_step.to_numpy()[1:]).all()


def test_monotone_curve_without_plateau_is_one_stage():
    steps = np.arange(1, 50)
    df = stages({"run_id": "r", "M": 1, "seed": 0, "batch": 8, "noise": "none"}, steps, np.log(steps) * 3,
                np.zeros(49), sigma=1.0, plateau_tol=0.01)
    assert len(df) == 1 and df.type.iloc[0] == "A"
