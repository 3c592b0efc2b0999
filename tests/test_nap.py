"""NAP (issue 45, iclnoise.noise.nap): the task sketch against a planted covariance, the controls' spectra and
alignment,
and the four shapes under the closed loop at equal realised exposure."""
import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch

from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet
from iclnoise.core.sections import ParamsError
from iclnoise.noise import CovModel
from iclnoise.noise.nap import (
    NAP_SHAPES,
    OVERSAMPLE,
    TaskSketch,
    alignment,
    distinct_tasks,
    factor_eig,
    frobenius,
    nap_covariance,
    random_orthonormal,
    task_factors,
)
from iclnoise.run.train import train_run

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

P, R = 60, 3
SPECTRUM = torch.tensor([9.0, 6.0, 4.0], dtype=torch.float64)


def planted(seed=0):
    """Σ_b = U0 diag(9, 6, 4) U0ᵀ between tasks; within tasks 20 in 5 other directions plus 0.1 I, so the raw
    covariance of m = 4 per-task means carries 20/4 = 5 > 4 in the within directions."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(P, R + 5, generator=g, dtype=torch.float64))[0]
    return Q[:, :R], Q[:, R:], g


def stream(U0, Uw, g, J=16, m=4):
    """One refresh's per-sequence gradients (J, m, P): g_jk = μ_j + ξ_jk."""
    mu = (torch.randn(J, R, generator=g, dtype=torch.float64) * SPECTRUM.sqrt()) @ U0.T
    xi = (torch.randn(J, m, 5, generator=g, dtype=torch.float64) * math.sqrt(20.0)) @ Uw.T
    return mu[:, None] + xi + 0.1 ** 0.5 * torch.randn(J, m, P, generator=g, dtype=torch.float64)


def sin_max(U, V):
    """The largest principal angle's sine between the column spaces of U and V (orthonormal, same rank)."""
    s = torch.linalg.svdvals(U.T @ V)
    return float((1 - s.min().clamp(max=1) ** 2).sqrt())


def sketch_of(U0, Uw, g, refreshes, memory, debias=True):
    sk, wk = TaskSketch.empty(P, U0), TaskSketch.empty(P, U0)
    for _ in range(refreshes):
        (Fb, wb), (Fw, ww) = task_factors(stream(U0, Uw, g))
        if not debias:   # the raw covariance of the per-task means: Σ_b + Σ_w / m
            Fb, wb = Fb[:16], wb[:16]
        sk.update(Fb, wb, OVERSAMPLE * R, memory)
        wk.update(Fw, ww, OVERSAMPLE * R, memory)
    return sk, wk


def test_the_sketch_recovers_a_planted_between_task_covariance():
    """30 refreshes of 16 tasks × 4 sequences, merged (memory 30): the largest principal angle between the top-3
    subspace and the planted one has sin θ < 0.2 (measured 0.139: the merged sketch is the exact running mean, whose
    own sampling error this is), its eigenvalues are within 20 % (measured 9.34, 6.02, 4.46) and the trace
    Tr Σ_b = 19 within 10 % (18.35); the covariance of the per-task means without the Σ_w / m correction is pulled
    to the within-task directions (sin θ = 0.974); the within sketch's top directions lie in the within span."""
    U0, Uw, g = planted()
    sk, wk = sketch_of(U0, Uw, g, 30, 30)
    U, lam = sk.top(R)
    assert sin_max(U, U0) < 0.2
    np.testing.assert_allclose(lam.numpy(), SPECTRUM.numpy(), rtol=0.2)
    assert sk.trace == pytest.approx(19.0, rel=0.1)
    assert float(torch.linalg.svdvals(Uw.T @ wk.top(R)[0]).min()) > 0.95
    raw, _ = sketch_of(*planted(), 30, 30, debias=False)
    assert sin_max(raw.top(R)[0], U0) > 0.9


def test_one_refresh_alone_is_noisier_and_memory_averages():
    """memory 1 keeps the latest refresh only (sin θ 0.74); memory 30 averages (0.14): eigenpairs of either sign are
    kept, so noise cancels across refreshes (clipping them to the PSD part at each merge left 0.92 at λ = 1)."""
    U0, Uw, _ = planted()
    one = sketch_of(U0, Uw, torch.Generator().manual_seed(5), 30, 1)[0]
    avg = sketch_of(U0, Uw, torch.Generator().manual_seed(5), 30, 30)[0]
    assert sin_max(avg.top(R)[0], U0) < 0.5 * sin_max(one.top(R)[0], U0)


def test_frobenius_of_low_rank_plus_diagonal_matches_dense():
    g = torch.Generator().manual_seed(1)
    mk = lambda r: CovModel(torch.linalg.qr(torch.randn(P, r, generator=g, dtype=torch.float64))[0],  # noqa: E731
                            torch.rand(r, generator=g, dtype=torch.float64), torch.rand(P, generator=g,
                                                                                         dtype=torch.float64))
    a, b = mk(3), mk(5)
    assert frobenius(a, b) == pytest.approx(float((a.dense() * b.dense()).sum()), rel=1e-12)
    assert alignment(a, a) == pytest.approx(1.0, rel=1e-12)


def test_controls_share_the_spectrum_and_only_nap_is_aligned():
    """From one sketch: nap_misaligned has nap's dense spectrum exactly, nap_isotropic its trace; against the
    planted Σ_b nap aligns (cos_F 0.989), misaligned is near chance (0.089; a random 3-dim basis in 60 dims has
    E ≈ Tr Λ Tr Σ_b / (P ‖Λ‖ ‖Σ_b‖) = 0.045) and below even the isotropic control's 0.213, and within_task ≈ 0
    (its directions are the within-task ones)."""
    U0, Uw, g = planted()
    sk, wk = sketch_of(U0, Uw, g, 30, 30)
    Q = random_orthonormal(P, R, 7, dtype=torch.float64)
    covs = {s: nap_covariance(s, sk, wk, Q, R) for s in NAP_SHAPES}
    ev = {s: np.sort(np.linalg.eigvalsh(c.dense().numpy())) for s, c in covs.items()}
    np.testing.assert_allclose(ev["nap_misaligned"], ev["nap"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(ev["nap_within_task"], ev["nap"], rtol=1e-6, atol=1e-12)
    tr = max(sk.trace, float(sk.top(R)[1].sum()))   # here the top 3 hold more than the trace: λ = 0
    for s, c in covs.items():
        assert float(c.diag().sum()) == pytest.approx(tr, rel=1e-9), s
    np.testing.assert_allclose(covs["nap_isotropic"].dense().numpy(), tr / P * np.eye(P), rtol=1e-9)
    task = CovModel(U0, SPECTRUM, torch.zeros(P, dtype=torch.float64))
    al = {s: alignment(c, task) for s, c in covs.items()}
    assert al["nap"] > 0.95 and al["nap_misaligned"] < 0.15 and al["nap_within_task"] < 0.01, al
    assert al["nap_misaligned"] < al["nap_isotropic"], al
    assert al["nap_isotropic"] == pytest.approx(float(SPECTRUM.sum()) / math.sqrt(P * float(SPECTRUM.square().sum())),
                                                rel=1e-6)


@pytest.mark.parametrize("n, p", [(12, 40), (12, 7)])
def test_factor_eig_is_the_dense_eigendecomposition(n, p):
    """Fᵀ diag(w) F with weights of both signs, more or fewer rows than columns: the eigenpairs from the Gram matrix
    rebuild the dense matrix and their eigenvalues are its nonzero ones."""
    g = torch.Generator().manual_seed(2)
    F = torch.randn(n, p, generator=g, dtype=torch.float64)
    w = torch.linspace(-0.5, 1.0, n, dtype=torch.float64)
    dense = (F.T * w) @ F
    U, ev = factor_eig(F, w)
    torch.testing.assert_close((U * ev) @ U.T, dense)
    torch.testing.assert_close(U.T @ U, torch.eye(len(ev), dtype=torch.float64))
    full = torch.linalg.eigvalsh(dense)
    np.testing.assert_allclose(np.sort(ev.numpy()), np.sort(full[full.abs() > 1e-9].numpy()), atol=1e-9)


def test_distinct_tasks_keeps_the_order_of_first_appearance():
    t = torch.tensor([[3.0, 0], [1.0, 0], [3.0, 0], [2.0, 0], [1.0, 0], [0.0, 0]])
    assert distinct_tasks(t, 3).tolist() == [[3.0, 0], [1.0, 0], [2.0, 0]]


def nap_params(tiny, budget):
    p = copy.deepcopy(tiny)
    p["train"]["budget"] = {"mode": "steps", "steps": 40}
    p["grid"]["M"] = [4, 16, "inf"]
    for s in NAP_SHAPES:
        p["noise"]["conditions"][s] = {"source": "grad", "shape": s, "rank": 2, "nap_tasks": 8, "nap_per_task": 2,
                                       "nap_memory": 4, "schedule": "constant", "budget": budget}
    p["grid"]["noise"] = ["none", *NAP_SHAPES]
    return validate_params(p)


def test_the_four_shapes_realise_equal_injected_exposure(tiny, tmp_path):
    """M = ∞, 40 steps, refreshed every 10, a budget of half the batch noise's integrated post-clip P-NE*: each of
    nap and its three controls books its budget within 5 % (hence each other), and logs its alignment on every
    active row; nap's mean alignment with the measured Σ̂_b is the highest of the four and misaligned's the lowest
    (measured: each books 1.000 E; mean alignment nap 0.66, within_task 0.37, isotropic 0.024, misaligned 0.0006)."""
    p = nap_params(tiny, 1.0)
    train_run(run_spec(p, "Minf-B16-none-s0"), tmp_path / "none", progress=False)
    E = 0.5 * float((lambda e: (e.pne_postclip * e.interval).sum())(read_parquet(tmp_path / "none/exposure.parquet")))
    p = nap_params(tiny, E)
    booked, al = {}, {}
    for s in NAP_SHAPES:
        train_run(run_spec(p, f"Minf-B16-{s}-s0"), tmp_path / s, progress=False)
        inj = read_parquet(tmp_path / s / "injection.parquet")
        booked[s], al[s] = float(inj.pne_injected.sum()) / E, inj.alignment
        assert inj.alignment.notna().all(), s
    assert all(abs(b - 1) < 0.05 for b in booked.values()), booked
    mean = {s: float(a.mean()) for s, a in al.items()}
    assert mean["nap"] == max(mean.values()) and mean["nap_misaligned"] == min(mean.values()), mean


@pytest.mark.parametrize("edit, match", [
    (lambda q: q["noise"]["conditions"]["nap"].pop("nap_tasks"), "nap_tasks"),
    (lambda q: q["noise"]["conditions"]["nap"].update(rank=8), "rank = 8 must be < nap_tasks"),
    (lambda q: q["grid"].update(M=[1, 16]), "M = 1"),
    (lambda q: q["noise"]["conditions"]["early"].update(nap_tasks=4), "nap shapes only"),
    (lambda q: (q["noise"]["conditions"]["nap"].pop("budget"), q["noise"]["conditions"]["nap"].update(
        emulate_batch=4)), "not emulate_batch"),
])
def test_validation_names_the_nap_keys(tiny, edit, match):
    q = nap_params(tiny, 1e-3)
    edit(q)
    with pytest.raises(ParamsError, match=match):
        validate_params(q)


def test_resume_of_nap_under_heavy_ball_gives_identical_numbers(tiny, tmp_path):
    """An ensemble of two nap_within_task runs trained with sgd_momentum, killed after step 25 and resumed, writes
    the tables of the uninterrupted one: the sketches (both), the alignment and SGD's momentum buffer are in the
    resume state."""
    from iclnoise.run.train import train_ensemble

    p = nap_params(tiny, 1e-4)
    p["grid"]["optimizer"] = ["adamw", "sgd_momentum"]
    p["train"]["sgd_momentum"] = {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}
    p = validate_params(p)
    specs = [run_spec(p, f"M{m}-B16-nap_within_task-sgd_momentum-s0") for m in (4, "inf")]
    full, part = [tmp_path / "f0", tmp_path / "f1"], [tmp_path / "p0", tmp_path / "p1"]
    a = train_ensemble(specs, full, progress=False)[0]
    train_ensemble(specs, part, progress=False, stop_after=25)
    b = train_ensemble(specs, part, progress=False)[0]
    pd.testing.assert_frame_equal(a, b)
    for name in ("exposure", "injection"):
        pd.testing.assert_frame_equal(read_parquet(full[0] / f"{name}.parquet"),
                                      read_parquet(part[0] / f"{name}.parquet"))
    assert read_parquet(full[0] / "injection.parquet").alignment.notna().all()
