"""The first-order pathwise estimator's replays (iclnoise.run.pathwise), measured side by side in one process (ratios).

  together : `--realisations` realisations replayed one after another (sensitivity) against together in one
             ensemble (sensitivities); the same g each
  layers   : one realisation per layer group (blocks.0, blocks.1, rest: three tangents, split_sensitivities)
             against the whole noise's one tangent (sensitivity); the groups' g add up to the whole's

(The second-order pass of the removed linearised replay took 2.34-2.39× the first-order one: docs/benchmarks.md.)

The setting is experiments/reproductions/crn_pathwise.py's (the tests' tiny model, 200 steps, M = 8, batch 64, late
diagonal noise over the last half; `--source grad` at budget 0.003, `param` at 0.05), replayed from step 100. Arms
alternate in rounds so machine noise hits both; prints each arm's seconds, the ratio and whether the g agree.

Usage: OMP_NUM_THREADS=1 python bench/bench_pathwise.py [--source grad|param] [--realisations 4] [--rounds 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from iclnoise.config.grid import run_spec
from iclnoise.core.runspec import RunSpec
from iclnoise.run.crn import counterfactual, member_spec
from iclnoise.run.pathwise import fork_state, sensitivities, sensitivity, split_sensitivities

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "reproductions"))
from tiny import params  # noqa: E402  (the tiny setting, one definition)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("grad", "param"), default="grad")
    ap.add_argument("--realisations", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    steps = 200
    p = params(steps)
    p["train"]["checkpoints"] = {"linear": 2, "log": 2}
    p["noise"]["conditions"]["late"] = {"source": a.source, "shape": "diagonal", "schedule": "late", "fraction": 0.5,
                                        "budget": 0.003 if a.source == "grad" else 0.05}
    spec = run_spec(p, "M8-B64-late-s0")
    state = fork_state(spec, steps // 2)
    own = counterfactual("self", p["noise"]["conditions"], RunSpec.of(spec))
    specs = [RunSpec.of(member_spec(spec, own, i)) for i in range(a.realisations)]

    def split() -> list[dict]:
        by = split_sensitivities(specs[:1], state, 64, ["blocks.0", "blocks.1"])[0]
        return [{k: sum(g[k] for g in by.values()) for k in next(iter(by.values()))}]

    arms = {"together": (lambda: [sensitivity(s, state, 64) for s in specs], lambda: sensitivities(specs, state, 64),
                         "the same g"),
            "layers": (split, lambda: [sensitivity(specs[0], state, 64)], "the groups add up to the whole")}
    for name, (slow, fast, what) in arms.items():
        ts, tf, same = [], [], True
        for _ in range(a.rounds):
            s, gs = timed(slow)
            f, gf = timed(fast)
            ts.append(s)
            tf.append(f)
            same &= all(abs(x[k] - y[k]) <= 1e-4 * abs(y[k]) + 1e-9 for x, y in zip(gs, gf) for k in y)
        print(f"{name}: {min(ts):.1f} s against {min(tf):.1f} s, {min(ts) / min(tf):.2f}x; {what}: {same}")

if __name__ == "__main__":
    main()
