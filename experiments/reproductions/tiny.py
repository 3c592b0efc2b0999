"""The tests' tiny setting, the small-scale CNR checks' one definition (crn_pathwise.py, bench/bench_pathwise.py,
tests/test_crn.py): params.yaml with a 16-wide, 2-layer model, small evaluation sets and `steps` steps."""
from __future__ import annotations

from iclnoise.config import load_params


def params(steps: int = 60) -> dict:
    p = load_params("params.yaml")
    p["train"]["checkpoints"] = {"linear": 3, "log": 3}
    p["train"]["micro_batch"] = 8
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16, n_layers=2)
    p["exposure"].update(every=10, groups=8, curvature_probes=4, heldout=16)
    p["train"]["budget"] = {"mode": "steps", "steps": steps}
    return p
