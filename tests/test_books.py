"""The closed loop's books against method §6's exposure on a fast-moving model at the defaults (issue 65 item 5;
method §6, "Booked versus true exposure"): the test model from initialisation, injection windows of 20 of 80 steps
at the start (v̂ filling from g², the loss falling fastest) and at the end, clipping at 1.0, gradient-space noise.
The reference (noise.dose_check.DoseReference) recomputes every injecting step's P-NE* with that step's A and the
exact Gauss–Newton diagonal on 256 held-out sequences."""
import copy

import pytest
from conftest import with_dose_references

from iclnoise.config import read_yaml, validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet
from iclnoise.core.runspec import RunSpec
from iclnoise.noise.dose_check import books_unchecked
from iclnoise.run.train import train_run

pytestmark = pytest.mark.validation


def fast_model() -> dict:
    """The test model (2 layers, d_model 16), 80 steps, params.yaml's exposure defaults (rows every 40 steps)."""
    p = validate_params(read_yaml("params.yaml"))
    p["train"].update(budget={"mode": "steps", "steps": 80}, checkpoints={"linear": 3, "log": 3}, micro_batch=8,
                      grad_clip=1.0)
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16, n_layers=2)
    p["exposure"].update(every=40)
    return p


def windows(p: dict, seed: int, tmp_path, monkeypatch) -> dict[str, float]:
    """reference / books of the early and the late window of one seed; the budget a fifth of the batch noise's
    post-clip P-NE* over a window of 20 steps."""
    made = with_dose_references(monkeypatch, 256)
    train_run(run_spec(p, f"M4-B16-none-s{seed}"), tmp_path / f"none{seed}", progress=False)
    e = read_parquet(tmp_path / f"none{seed}/exposure.parquet")
    budget = 0.2 * 0.25 * float((e.pne_postclip * e.interval).sum())
    out = {}
    for name in ("early", "late"):
        p["noise"]["conditions"][name].update(source="grad", fraction=0.25, budget=budget)
        made.clear()
        train_run(run_spec(p, f"M4-B16-{name}-s{seed}"), tmp_path / f"{name}{seed}", progress=False)
        inj = read_parquet(tmp_path / f"{name}{seed}/injection.parquet")
        assert inj.pne_injected.sum() == pytest.approx(budget, rel=0.02)   # the books reach the budget
        out[name] = sum(made[0].pne) / float(inj.pne_injected.sum())
    return out


def test_the_defaults_book_a_fast_moving_window_within_5_percent(tmp_path, monkeypatch):
    """At params.yaml's defaults (the exact Gauss–Newton diagonal, refreshed every 2 steps in a window) the books of
    both windows agree with the definition: over seeds 0 and 1 within 3 % on average and each window within 6 % (its
    own 20 steps and the reference's held-out batches add scatter). Measured (2026-12-06, seeds 0-3): early 0.992,
    0.996, 1.001, 1.016; late 0.978, 0.996, 0.948, 1.028. At the former default (8 Hutchinson probes every 25
    steps) the same windows realised 1.69-2.07× (early) and 0.76-0.84× (late) their books; with the exact diagonal
    every 25 steps 1.71-2.32× and 0.77-1.04×; every 4 steps 1.03-1.12× and 0.97-1.08×; every step 0.97-1.01× and
    0.98-1.05×."""
    p = fast_model()
    assert p["exposure"]["curvature"] == "ggn_exact" and p["exposure"]["curvature_every"] == 2
    spec = RunSpec.of(run_spec(p, "M4-B16-early-s0"))
    assert books_unchecked(spec) == ""
    ratios = [windows(copy.deepcopy(p), seed, tmp_path, monkeypatch) for seed in range(2)]
    for name in ("early", "late"):
        r = [x[name] for x in ratios]
        assert abs(sum(r) / len(r) - 1) <= 0.03 and max(abs(x - 1) for x in r) <= 0.06, (name, r)


@pytest.mark.parametrize("exposure, model, unchecked", [
    ({"curvature": "ggn_exact", "curvature_every": 2}, {}, ""),
    ({"curvature": "ggn_exact", "curvature_every": 4}, {}, "ggn_exact every 4 steps"),
    ({"curvature": "ggn", "curvature_probes": 8, "curvature_every": 25}, {}, "ggn 8 probes every 25 steps"),
    ({"curvature": "ggn", "curvature_probes": 16, "curvature_every": 10}, {}, "ggn 16 probes every 10 steps"),
    ({"curvature": "ggn", "curvature_probes": 16, "curvature_every": 10}, {"science": True}, ""),
])
def test_books_are_checked_only_where_they_were_measured(exposure, model, unchecked):
    """noise.dose_check.books_unchecked: the exact diagonal every ≤ 2 steps anywhere; 16 probes every ≤ 10 steps only
    on the science model, where it was measured; a run without injection books nothing."""
    p = fast_model()
    p["exposure"].update(exposure)
    if model:
        p["data"]["D"] = 5
        p["model"].update(d_model=32, n_layers=3, d_mlp=64)
    assert books_unchecked(RunSpec.of(run_spec(p, "M4-B64-early-s0"))) == unchecked
    assert books_unchecked(RunSpec.of(run_spec(p, "M4-B64-none-s0"))) == ""
