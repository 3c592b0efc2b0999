"""Run every noise condition of params.yaml twice on a device and check the numbers are identical.

A smoke and determinism check for accelerators (CI has none): each condition trains a short run with
exposure logging; the two runs' metrics, exposure and injection tables must match exactly.

Usage: python experiments/check_device.py [--device cuda] [--steps 400] [--batch 64]
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

from iclnoise.config import validate_params
from iclnoise.config.grid import run_spec
from iclnoise.core.io import read_parquet
from iclnoise.run.train import train_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    p = validate_params(yaml.safe_load(open(a.params)))
    p["train"].update(budget={"mode": "steps", "steps": a.steps}, device=a.device)
    p["exposure"]["every"] = max(1, a.steps // 8)
    failures = 0
    for name in p["noise"]["conditions"]:
        spec = run_spec(copy.deepcopy(p), f"M16-B{a.batch}-{name}-s0")
        tables = []
        for _ in range(2):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                m = train_run(spec, d, progress=False)
                dt = time.perf_counter() - t0
                extra = {f: read_parquet(Path(d) / f"{f}.parquet") for f in ("exposure", "injection")
                         if (Path(d) / f"{f}.parquet").exists()}
                tables.append((m, extra))
        same = tables[0][0].equals(tables[1][0]) and all(
            tables[0][1][k].drop(columns="aca_eigs", errors="ignore").equals(
                tables[1][1][k].drop(columns="aca_eigs", errors="ignore")) for k in tables[0][1])
        failures += not same
        e = tables[0][1].get("exposure", pd.DataFrame())
        pne = f"{e.pne_postclip.median():.3g}" if len(e) else "-"
        print(f"{name:14s} {dt:6.1f}s  ood_loss {tables[0][0].ood_loss.iloc[-1]:.4f}  median P-NE* {pne}  "
              f"{'identical' if same else 'DIFFERENT'} across two runs")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
