"""Shared fixtures: the shipped params.yaml shrunk to a few seconds of training; one torch thread for a module.

The tiers (docs/development.md, "Test tiers"): every test carries exactly one of the markers `unit` (`make test`),
`integration` (Snakemake, DVC, subprocesses, end-to-end training) or `validation` (Monte-Carlo coverage, power,
size); collection fails naming any test that has none or several. `numerics` is added to tests whose results depend
on float32 reduction order: `make test-float` reruns them under other kernels and thread counts.
"""
import os

import pytest
import torch
import yaml

from iclnoise.config import validate_params

TIERS = ("unit", "integration", "validation")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):   # one torch thread per worker: the workers share the cores
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects: a test without a tier is refused, whatever is selected
def pytest_collection_modifyitems(config, items):
    bad = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            bad.append(f"{item.nodeid}: {', '.join(tiers) or 'no tier'}")
    if bad:
        raise pytest.UsageError("every test needs exactly one tier marker, pytest.mark.unit, integration or "
                                "validation (tests/conftest.py):\n  " + "\n  ".join(bad))


@pytest.fixture(scope="module")
def tiny() -> dict:
    with open("params.yaml") as f:
        p = validate_params(yaml.safe_load(f))
    p["train"]["budget"] = {"mode": "steps", "steps": 60}
    p["train"]["checkpoints"] = {"linear": 3, "log": 3}
    p["train"]["micro_batch"] = 8
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16, n_layers=2)  # the tests' measured numbers are on 2 layers
    # Hutchinson probes every 25 steps (params.yaml's curvature before the exact default): the tests' measured
    # numbers and the ensemble's stacked path are on it; tests/test_books.py runs the defaults
    p["exposure"].update(every=10, groups=8, curvature="ggn", curvature_probes=4, curvature_every=25, heldout=16)
    # a torch.Generator per run (params.yaml's stream before the counter-based default): the single-seed tests'
    # measured numbers are on its draws; tests/test_engine.py and tests/test_rng.py run the counter stream
    p["train"]["rng"] = "generator"
    return p


@pytest.fixture(scope="module")
def one_thread():
    """A module's small chains on one thread (more costs more than it gives); the count is restored after, so the rest
    of the suite keeps the thread count it was started with (make test-float varies it). Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def with_dose_references(monkeypatch, n_heldout: int) -> list:
    """Every injecting run trained after this call gets a DoseReference (method §6's exposure recomputed beside it,
    iclnoise.noise.dose_check) on `n_heldout` held-out sequences, first among its hooks (on_grads sees A and Ĥ
    before the injector adds its noise); returns the list they are appended to, in training order."""
    import iclnoise.run.member as member  # Member.setup builds the hooks
    from iclnoise.noise.dose_check import DoseReference

    made, build = [], member.build_hooks

    def with_reference(spec, device):
        hooks = build(spec, device)
        inj = [h for h in hooks if h.name == "injection"]
        if inj:
            made.append(DoseReference(inj[0], n_heldout))
            hooks.insert(0, made[-1])
        return hooks

    monkeypatch.setattr(member, "build_hooks", with_reference)
    return made
