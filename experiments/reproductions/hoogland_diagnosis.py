"""Why our LLCs and Hoogland et al.'s differ (issue 29, part 5): the sweeps side by side with what the chains did.

Reads (1) our sweeps' llc.parquet (run directories per sweep: the reduced CPU sweep, their full sweep on the GPU,
the full sweep at gradient batch 256), (2) our top Hessian eigenvalues (hoogland_sharpness.csv, from
hoogland_sharpness.py), (3) their release (timaeus-research/icl @ 5baf730, read for numbers only): per seed and
step, `llc/mean/mean`, their chains' mean sampled loss `batch-loss/mean/mean` (analysis/L2H4Minf/llcs.pt) and
the top Hessian eigenvalue `hessian/evals/0` (analysis/L2H4Minf/hessian_stats.pt). Their loss is D = 4 times
ours (mean (f − y)², ours divides by D), so their losses and eigenvalues are divided by 4 here.

Writes hoogland_sweeps.csv (every sweep's rows with init loss L(w*), mean sampled loss, MALA acceptance) and
hoogland_diagnosis.csv (per step: ours and theirs, λ̂, sampled loss, λ_max, and nβ (c − L(w*)) with their
sampled loss c: the LLC ours would read if our chains settled where theirs do).

  git clone https://github.com/timaeus-research/icl && git -C icl checkout 5baf730
  PYTHONPATH=src python experiments/reproductions/hoogland_diagnosis.py --release icl \\
      --sweep "cpu-reduced=results/hoogland/runs" "gpu-full=/tmp/hg/key" "gpu-full-b256=/tmp/hg/b256"
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import types
from io import BytesIO
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "reference" / "reproductions"  # the tables and figures these scripts write
D = 4
STEPS = (0, 985, 2491, 5050, 12222, 40000)
DEVICES = {"cpu-reduced": "cpu (2-core machine, 1 thread per run)", "gpu-full": "NVIDIA H200",
           "gpu-full-b256": "NVIDIA H200"}


def release_table(release: Path, path: str) -> pd.DataFrame:
    import torch

    shim = types.ModuleType("pandas.core.indexes.numeric")     # pandas < 2 index classes
    shim.Int64Index = shim.Float64Index = shim.UInt64Index = shim.NumericIndex = pd.Index
    sys.modules.setdefault("pandas.core.indexes.numeric", shim)
    f = release / path
    blob = f.read_bytes() if f.exists() else subprocess.run(
        ["git", "-C", str(release), "show", f"HEAD:{path}"], capture_output=True, check=True).stdout
    # the upstream release's pickled pandas DataFrame: weights_only cannot build one, so this unpickles
    # arbitrary objects; run it on that published release only, never on a file of unknown origin
    return torch.load(BytesIO(blob), map_location="cpu", weights_only=False)


def theirs(release: Path) -> pd.DataFrame:
    llc = release_table(release, "analysis/L2H4Minf/llcs.pt")
    llc = llc.rename(columns={"model_seed": "seed", "llc/mean/mean": "llc", "batch-loss/mean/mean": "sampled"})
    h = release_table(release, "analysis/L2H4Minf/hessian_stats.pt")
    h = h.rename(columns={"model_seed": "seed", "hessian/evals/0": "top_eigenvalue"})
    h["top_eigenvalue"] = h.top_eigenvalue.map(lambda v: float(np.mean(v)))
    df = llc[["seed", "step", "llc", "sampled"]].merge(h[["seed", "step", "top_eigenvalue"]], on=["seed", "step"],
                                                       how="left")
    df[["sampled", "top_eigenvalue"]] /= D
    return df.astype({"seed": int, "step": int})


def ours(sweeps: list[str]) -> pd.DataFrame:
    from iclnoise.core.io import read_parquet

    frames = []
    for s in sweeps:
        name, root = s.split("=", 1)
        for f in sorted(Path(root).glob("Minf-B256-none-s*/llc.parquet")):
            frames.append(read_parquet(f).assign(sweep=name, device=DEVICES.get(name, "")))
    return pd.concat(frames, ignore_index=True)[
        ["sweep", "seed", "step", "llc_mean", "llc_se", "init_loss", "mean_sampling_loss", "mala_accept", "diverged",
         "chains", "burn_in", "draws", "batch_size", "n", "epsilon", "nbeta", "gamma", "device"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", required=True, help="a clone of timaeus-research/icl at 5baf730")
    ap.add_argument("--sweep", nargs="+", required=True, help="NAME=DIR holding Minf-B256-none-s*/llc.parquet")
    a = ap.parse_args()
    sw = ours(a.sweep).sort_values(["sweep", "seed", "step"])
    sw.to_csv(DATA / "hoogland_sweeps.csv", index=False)
    sharp = pd.read_csv(DATA / "hoogland_sharpness.csv")
    th = theirs(Path(a.release))
    full = sw[sw.sweep == "gpu-full"]
    rows = []
    for step in STEPS:
        t = th.loc[th.assign(d=(th.step - step).abs()).groupby("seed").d.idxmin()]
        o, s = full[full.step == step], sharp[sharp.step == step]
        red = sw[(sw.sweep == "cpu-reduced") & (sw.step == step)]
        rows.append({"step": step, "ours_llc": o.llc_mean.mean(), "ours_llc_reduced": red.llc_mean.mean(),
                     "ours_init_loss": o.init_loss.mean(), "ours_sampled_loss": o.mean_sampling_loss.mean(),
                     "ours_top_eigenvalue": s.top_eigenvalue.mean(), "stability_limit": s.stability_limit.mean(),
                     "theirs_step": int(t.step.median()), "theirs_llc": t.llc.mean(), "theirs_llc_sd": t.llc.std(),
                     "theirs_sampled_loss": t.sampled.mean(), "theirs_top_eigenvalue": t.top_eigenvalue.mean(),
                     "ours_at_their_sampled_loss": o.nbeta.mean() * (t.sampled.mean() - o.init_loss.mean())})
    out = pd.DataFrame(rows)
    out.to_csv(DATA / "hoogland_diagnosis.csv", index=False)
    print(out.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
