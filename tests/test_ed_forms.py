"""Forms on planted polygons whose vertices are known exactly per PC pair (method §8, issue 27 items 2-3).

Each PC is continuous and piecewise linear in τ = log(step + 1), so every PC pair (i, j) is a polygon
whose vertices are exactly the kink times of PC i and PC j. A turn at t kinks PC p at t + o_p with
o_p ~ U(−JITTER, JITTER) drawn per replicate, so the events of one form fall at different times in
different pairs. Cases (default ed config: bandwidth 0.7, tolerance 1.0, margin 1.4; checkpoints 0 and
n − 1 log-spaced in [1, 2500], τ ∈ [0, 7.82]):

- two: two opposite turns 2 × tolerance apart (a window; centres 3 and 5): in-pair vertex separations
  ≥ 1.7 log-step. Hit = exactly two forms, each within ± tolerance of its turn.
- lobe: one sharp turn at t ~ U(3.5, 4.5). False = a form further than tolerance from t (a side lobe).
- start / end: one turn inside an end margin (t ~ U(0.3, 1.1) or τ_max − that). False = any form.

Noisy replicates go through the pipeline's bootstrap exactly as in test_ed.py (B = 64 sequences,
noise NOISE × each PC's standard deviation per checkpoint, 50 resamples, z_min 3). Measured with
`python experiments/forms_rates.py` (200 replicates per cell, seed 0; ed.py local-cubic smoother):

    rate                      noise    n=20   n=50   n=200
    two-forms hit             free     1.000  1.000  1.000
    two-forms hit             0.5 %    1.000  1.000  1.000
    side-lobe false form      free     0.000  0.000  0.000
    side-lobe false form      0.5 %    0.000  0.005  0.000
    start-margin false form   free     0.000  0.000  0.000
    start-margin false form   0.5 %    0.000  0.000  0.000
    end-margin false form     free     0.000  0.000  0.000
    end-margin false form     0.5 %    0.005  0.000  0.000

The tests rerun REPS replicates per cell with other seeds and assert hit ≥ 0.9, false ≤ 0.05.
"""
import dataclasses

import numpy as np
import pytest

from iclnoise.config import read_yaml
from iclnoise.core.probe_sections import ED
from iclnoise.probes.ed import bootstrap_curves, detect_events, forms, log_time

TOTAL = 2500
B_SEQ = 64
NOISE = 0.005      # as test_ed.NOISE
JITTER = 0.15      # per-PC kink offset around a turn's time: the pairs' vertices differ by up to 0.3
SLOPES = np.array([[1.0, -1.0], [0.5, -1.0], [1.0, -0.3]])   # per PC: slope before / after an odd turn
REPS = 25          # replicates per (case, density, noise) in the tests
DEFAULTS = ED.from_dict(read_yaml("params.yaml")["ed"])
TAU_MAX = float(np.log1p(TOTAL))


def log_spaced(n: int) -> np.ndarray:
    """n checkpoint steps: 0 and n − 1 log-spaced in [1, TOTAL] (as test_ed.log_spaced)."""
    return np.concatenate([[0.0], np.geomspace(1, TOTAL, n - 1)])


def polygon(tau: np.ndarray, kinks: np.ndarray) -> np.ndarray:
    """(n, 3) curve: PC p = ∫ slope, slope SLOPES[p, 0] switching to SLOPES[p, 1] at kinks[0, p], back
    at kinks[1, p], and so on (kinks (turns, 3), increasing per PC). Pair (i, j) is a polygon whose
    vertices are exactly kinks[:, i] ∪ kinks[:, j] (slopes chosen so every kink turns every pair)."""
    out = SLOPES[:, 0] * tau[:, None]
    for m, row in enumerate(kinks):
        step = (SLOPES[:, 1] - SLOPES[:, 0]) * (1 if m % 2 == 0 else -1)
        out = out + step * np.maximum(tau[:, None] - row, 0)
    return out


def turns(times, rng: np.random.Generator) -> np.ndarray:
    """Kink times (turns, 3): each turn's time plus an independent U(−JITTER, JITTER) offset per PC."""
    t = np.asarray(times, float)[:, None]
    return t + rng.uniform(-JITTER, JITTER, (len(t), 3))


def case(name: str, rng: np.random.Generator, tolerance: float) -> tuple[np.ndarray, list[float], bool]:
    """(kinks, planted form times, whether only false forms are scored) of one replicate of a case."""
    if name == "two":
        centres = [4 - tolerance, 4 + tolerance]        # 2 × tolerance apart: a window
        return turns(centres, rng), centres, False
    if name == "lobe":
        t = rng.uniform(3.5, 4.5)
        return turns([t], rng), [t], True
    t = rng.uniform(0.3, 1.1) if name == "start" else TAU_MAX - rng.uniform(0.3, 1.1)
    return turns([t], rng), [], True


def noisy(curve: np.ndarray, rng: np.random.Generator, n_boot: int, noise: float) -> np.ndarray:
    """(1 + n_boot, n, 3) through the pipeline's bootstrap: B sequences each see the curve plus
    independent noise; the observed curve is their mean (noise × std per PC), as test_ed.noisy."""
    n = len(curve)
    seq = curve[:, None, :] + noise * np.sqrt(B_SEQ) * curve.std(0) * rng.standard_normal((n, B_SEQ, 3))
    comps = np.zeros((3, B_SEQ * 3))
    for p in range(3):
        comps[p, p::3] = 1.0 / B_SEQ
    return bootstrap_curves(seq.reshape(n, B_SEQ * 3), np.zeros(B_SEQ * 3), comps, B_SEQ, n_boot,
                            int(rng.integers(1 << 31)))


def form_rate(name: str, n_points: int, reps: int, noise: float, seed: int, cfg: ED = DEFAULTS) -> float:
    """Hit rate (case "two": exactly the planted forms, each within ± tolerance) or false-form rate (the
    other cases: some form further than tolerance from every planted turn) over `reps` replicates."""
    tau = log_time(log_spaced(n_points))
    rng = np.random.default_rng(seed)
    score = 0
    for _ in range(reps):
        kinks, truth, false_only = case(name, rng, cfg.tolerance)
        curve = polygon(tau, kinks)
        curves = noisy(curve, rng, cfg.n_boot, noise) if noise > 0 else curve
        f = forms(detect_events(tau, curves, cfg), 3, cfg.tolerance)
        if false_only:
            score += any(all(abs(a - b) > cfg.tolerance for b in truth) for a in f)
        else:
            score += len(f) == len(truth) and all(abs(a - b) <= cfg.tolerance for a, b in zip(f, truth))
    return score / reps


@pytest.mark.unit
def test_planted_polygon_has_its_vertices_exactly_at_the_kinks():
    """Closed form: every kink turns every pair containing its PC (the direction changes), and between
    kinks each pair is straight (no other vertex)."""
    tau = np.linspace(0, TAU_MAX, 4001)
    kinks = turns([3.0, 5.0], np.random.default_rng(0))
    c = polygon(tau, kinks)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        v = np.diff(c[:, [i, j]], axis=0)
        cross = v[:-1, 0] * v[1:, 1] - v[:-1, 1] * v[1:, 0]
        turned = tau[1:-1][np.abs(cross) > 1e-9 * np.abs(v).max() ** 2]
        exact = np.sort(np.concatenate([kinks[:, i], kinks[:, j]]))
        assert len(turned) <= 2 * len(exact)          # a kink between grid points turns at 2 grid points
        assert all(np.abs(exact - t).min() <= tau[1] for t in turned)
        assert all(np.abs(turned - t).min() <= tau[1] for t in exact)


@pytest.mark.validation
@pytest.mark.parametrize("noise", [0.0, NOISE])
@pytest.mark.parametrize("n_points", [20, 50, 200])
def test_two_forms_a_window_apart_stay_two(n_points, noise):
    """Resolution = the tolerance window: two opposite turns 2 × tolerance apart (in-pair vertex
    separations ≥ 1.7 log-step) are two forms. Measured 1.000 at every density, noise-free and noisy
    (experiments/forms_rates.py, 200 replicates); the ringing local-quadratic smoother merged such turns."""
    assert form_rate("two", n_points, REPS, noise, seed=10 + n_points) >= 0.9


@pytest.mark.validation
@pytest.mark.parametrize("name", ["lobe", "start", "end"])
@pytest.mark.parametrize("noise", [0.0, NOISE])
@pytest.mark.parametrize("n_points", [20, 50, 200])
def test_no_false_forms_from_side_lobes_or_end_margins(n_points, noise, name):
    """A sharp turn has no side-lobe form, and a turn inside an end margin gives no form anywhere.
    Measured ≤ 0.005 in every cell (experiments/forms_rates.py, 200 replicates; the ringing local-quadratic
    smoother: 0.25-0.38 side-lobe and 0.95-1.0 margin false forms noise-free, 0.05-0.63 noisy, at 40)."""
    assert form_rate(name, n_points, REPS, noise, seed=20 + n_points) <= 0.05


@pytest.mark.unit
def test_defaults_are_what_the_measurements_assume():
    assert (DEFAULTS.bandwidth, DEFAULTS.tolerance, DEFAULTS.margin) == (0.7, 1.0, 1.4)
    assert 1.1 + JITTER < DEFAULTS.margin                # end-margin turns lie wholly inside the margin
    assert dataclasses.replace(DEFAULTS).n_form_pcs == 3
