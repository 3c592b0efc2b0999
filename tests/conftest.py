"""Shared fixtures: the shipped params.yaml shrunk to a few seconds of training; one torch thread for a module."""
import pytest
import torch
import yaml

from iclnoise.config import validate_params


@pytest.fixture(scope="module")
def tiny() -> dict:
    with open("params.yaml") as f:
        p = validate_params(yaml.safe_load(f))
    p["train"]["budget"] = {"mode": "steps", "steps": 60}
    p["train"]["checkpoints"] = {"linear": 3, "log": 3}
    p["train"]["micro_batch"] = 8
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16, n_layers=2)  # the tests' measured numbers are on 2 layers
    p["exposure"].update(every=10, groups=8, curvature_probes=4, heldout=16)
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
