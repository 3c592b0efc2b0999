"""Form detector on planted polygons (method §8, issue 27): resolution and false-form rates.

Prints, at 20, 50 and 200 log-spaced checkpoints, noise-free and noisy (0.5 % of each PC's standard
deviation per checkpoint, through the pipeline's bootstrap): the hit rate of two opposite turns one
tolerance window (2 × tolerance) apart, and the false-form rates next to a sharp turn (side lobes) and
from a turn inside the start or the end margin. The planted curves and the scoring are those of
tests/test_ed_forms.py (its docstring holds the table this prints). Fixed seed; default ed config.

Usage: PYTHONPATH=src python experiments/forms_rates.py [--reps 200] [--noise 0.005] [--seed 0]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_ed_forms import NOISE, form_rate  # noqa: E402

ROWS = [("two", "two-forms hit"), ("lobe", "side-lobe false form"), ("start", "start-margin false form"),
        ("end", "end-margin false form")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--noise", type=float, default=NOISE)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    print(f"{'rate':25s} {'noise':6s} {'n=20':>6s} {'n=50':>6s} {'n=200':>6s}")
    for name, label in ROWS:
        for noise in (0.0, a.noise):
            r = [form_rate(name, n, a.reps, noise, seed=a.seed + n) for n in (20, 50, 200)]
            tag = "free" if noise == 0 else f"{100 * noise:g} %"
            print(f"{label:25s} {tag:6s} " + " ".join(f"{x:6.3f}" for x in r), flush=True)
    print(f"{a.reps} replicates per cell, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
