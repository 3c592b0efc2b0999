"""Aten ops dispatched by one quiet ensemble step (no hook acts, no checkpoint), per random stream and mode, at several
ensemble sizes: what a launch-bound device pays per step (issue 66). Counted on the CPU with a dispatch-mode counter.

Modes: plain (exposure off), exposure (logging on, none injected), closed loop (grad source, diagonal, a budget),
emulate (grad source, low rank, emulate_batch 16). Runs cycle M through ∞, 1, 2, 4, 8, 16 at batch 64; the model
and the rest are the params' (default params.yaml). tests/test_engine.py asserts the counter stream's equality at 2
and 8 runs on the tiny model.
Usage: PYTHONPATH=src python bench/bench_ops.py [--runs 2 8 32] [--params params.yaml]
"""
from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.runspec import RunSpec
from iclnoise.run.ensemble import LOOK_EVERY, Ensemble
from iclnoise.run.member import Member

MODES = {"plain": ("none", False, None), "exposure": ("none", True, None),
         "closed loop": ("grad_diag", True, {"source": "grad", "shape": "diagonal", "schedule": "constant",
                                             "budget": 0.002}),
         "emulate": ("grad_low", True, {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant",
                                        "emulate_batch": 16})}


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def quiet_ops(p: dict, noise: str, R: int, root: Path) -> int:
    ms, members = ["inf", 1, 2, 4, 8, 16], []
    for r in range(R):
        spec = RunSpec.of(run_spec(p, f"M{ms[r % 6]}-B64-{noise}-s{r // 6}"))
        (root / spec.keys.run_id / "checkpoints").mkdir(parents=True)
        members.append(Member(spec, root / spec.keys.run_id, spec_hash(spec.raw), torch.device("cpu")))
        members[-1].setup()
    e, step = Ensemble(members, 0, "ops"), 0
    while step < 2 or e._acting(step) or step + 1 in e.ckpt_at or step % LOOK_EVERY == 0:
        e._step(step, None)
        step += 1
    with Ops() as ops:
        e._step(step, None)
    return ops.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--params", default="params.yaml")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = validate_params(yaml.safe_load(Path(a.params).read_text()))
    base["train"]["budget"] = {"mode": "steps", "steps": 400}
    base["exposure"].update(curvature="ggn", curvature_every=25)   # quiet steps inside the injection window
    print("mode".ljust(12), "stream".ljust(10), "  ".join(f"{R:>5} runs" for R in a.runs))
    for mode, (noise, logging, cond) in MODES.items():
        for stream in ("generator", "counter"):
            p = copy.deepcopy(base)
            p["train"]["rng"], p["exposure"]["enabled"], p["grid"]["noise"] = stream, logging, [noise]
            if cond:
                p["noise"]["conditions"][noise] = cond
            with tempfile.TemporaryDirectory() as tmp:
                n = [quiet_ops(p, noise, R, Path(tmp) / str(R)) for R in a.runs]
            print(mode.ljust(12), stream.ljust(10), "  ".join(f"{x:>10}" for x in n))


if __name__ == "__main__":
    main()
