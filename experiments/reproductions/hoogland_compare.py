"""Our LLC trajectory (reference/reproductions/hoogland.csv) against Hoogland et al.'s released values.

Their values are read from the release, never retyped: `analysis/L2H4Minf/llcs.pt` of
timaeus-research/icl (commit 5baf730), a pickled pandas frame (950 rows: 5 model seeds × 190 steps)
written with pandas < 2, so its numeric index classes are mapped to pd.Index on load. Per row,
`llc/mean/<k>` (k = 0..7) is the LLC of the loss at context position k and `llc/mean/mean` their
mean over positions, i.e. the LLC of the sequence-mean loss (the quantity ours estimates).

  git clone https://github.com/timaeus-research/icl && git -C icl checkout 5baf730
  PYTHONPATH=src python experiments/reproductions/hoogland_compare.py --theirs icl/analysis/L2H4Minf/llcs.pt

After the configs/hoogland.yaml runs, add --from-runs results/runs/Minf-B256-none-s* to write
hoogland.csv from their llc.parquet. Writes hoogland_theirs.csv (step, seed, llc) extracted from the
release, prints their seed mean ± sd at ≈ 1k, 5k and 40k steps next to ours, and plots
hoogland_compare.png (ours: hoogland.csv, if present).
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "reference" / "reproductions"  # the tables and figures these scripts write
OURS_COLUMNS = ["step", "seed", "llc_mean", "llc_se", "mala_accept", "init_loss", "mean_sampling_loss", "chains",
                "burn_in", "draws", "batch_size", "n", "epsilon", "nbeta", "gamma", "device"]
CHECK_STEPS = (1_000, 5_000, 40_000)
TOLERANCE = 0.20   # the criterion: within 20 % of their published mean


def load_release(path: str | Path) -> pd.DataFrame:
    """One pickled pandas frame of their release (analysis/L2H4Minf/*.pt)."""
    import torch

    shim = types.ModuleType("pandas.core.indexes.numeric")     # pandas < 2 index classes
    shim.Int64Index = shim.Float64Index = shim.UInt64Index = shim.NumericIndex = pd.Index
    sys.modules.setdefault("pandas.core.indexes.numeric", shim)
    # the upstream release's pickled pandas DataFrame: weights_only cannot build one, so this unpickles
    # arbitrary objects; run it on that published release only, never on a file of unknown origin
    return torch.load(path, map_location="cpu", weights_only=False)


def read_theirs(path: str | Path) -> pd.DataFrame:
    """(step, seed, llc) from their llcs.pt."""
    raw = load_release(path)
    return (raw[["step", "model_seed", "llc/mean/mean"]]
            .rename(columns={"model_seed": "seed", "llc/mean/mean": "llc"})
            .astype({"step": int, "seed": int}).sort_values(["seed", "step"]).reset_index(drop=True))


def ours_from_runs(run_dirs: list[str], device: str) -> pd.DataFrame:
    """hoogland.csv rows from the llc.parquet of our configs/hoogland.yaml runs (nbeta in our loss units,
    i.e. D × theirs)."""
    from iclnoise.core.io import read_parquet

    df = pd.concat([read_parquet(Path(d) / "llc.parquet") for d in run_dirs], ignore_index=True)
    return df.assign(device=device)[OURS_COLUMNS].sort_values(["seed", "step"])


def reduced(run_dirs: list[str], chains: int, draws: int) -> pd.DataFrame:
    """What a shorter sweep would have read: λ̂ = nβ (mean over the first `chains` chains and their first `draws`
    SGLD steps − L(w*)), from a full sweep's llc_traces.parquet (its trace points, read with trace_points ≥ 1000),
    beside the full sweep's λ̂."""
    from iclnoise.core.io import read_parquet

    rows = []
    for d in run_dirs:
        llc, tr = read_parquet(Path(d) / "llc.parquet"), read_parquet(Path(d) / "llc_traces.parquet")
        for r in llc.itertuples():
            t = tr[(tr.step == r.step) & (tr.chain < chains) & (tr.sgld_step >= r.burn_in)
                   & (tr.sgld_step < r.burn_in + draws)]
            per_chain = r.nbeta * (t.groupby("chain").loss.mean() - r.init_loss)
            rows.append({"seed": r.seed, "step": r.step, "full": r.llc_mean, "reduced": per_chain.mean(),
                         "reduced_se": per_chain.std(ddof=1) / len(per_chain) ** 0.5,
                         "points": len(t), "chains": chains, "draws": draws})
    out = pd.DataFrame(rows)
    return out.assign(bias=(out.reduced - out.full) / out.full)


def nearest(df: pd.DataFrame, step: int) -> pd.DataFrame:
    """Each seed's row at the step nearest to `step`."""
    return df.loc[df.assign(d=(df.step - step).abs()).groupby("seed").d.idxmin()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--theirs", help="path to their analysis/L2H4Minf/llcs.pt (default: hoogland_theirs.csv)")
    ap.add_argument("--ours", default=str(DATA / "hoogland.csv"))
    ap.add_argument("--out", default=str(DATA / "hoogland_compare.png"))
    ap.add_argument("--from-runs", nargs="*", default=[], help="our run directories: (re)write --ours from their "
                    "llc.parquet first")
    ap.add_argument("--device", default="cpu", help="device the runs' LLCs were estimated on (for --from-runs)")
    ap.add_argument("--reduced", nargs=2, type=int, metavar=("CHAINS", "DRAWS"),
                    help="with --from-runs: also print what CHAINS chains of DRAWS steps would have read")
    a = ap.parse_args()
    if a.from_runs:
        ours_from_runs(a.from_runs, a.device).to_csv(a.ours, index=False)
        if a.reduced:
            print(reduced(a.from_runs, *a.reduced).to_string(index=False, float_format="%.3f"))
    if a.theirs:
        theirs = read_theirs(a.theirs)
        theirs.to_csv(DATA / "hoogland_theirs.csv", index=False)
    else:
        theirs = pd.read_csv(DATA / "hoogland_theirs.csv")
    ours = pd.read_csv(a.ours) if Path(a.ours).exists() else pd.DataFrame(columns=OURS_COLUMNS)
    missing = set(OURS_COLUMNS) - set(ours.columns)
    if missing:
        raise SystemExit(f"{a.ours} lacks columns {sorted(missing)}")
    for s in CHECK_STEPS:
        t = nearest(theirs, s)
        line = f"step ≈ {s:>6}: theirs {t.llc.mean():7.2f} ± {t.llc.std(ddof=1):5.2f} (sd over {len(t)} seeds, " \
               f"steps {sorted(set(t.step))})"
        if len(ours):
            o = nearest(ours, s)
            gap = o.llc_mean.mean() / t.llc.mean() - 1
            each = ", ".join(f"s{r.seed} {r.llc_mean:.2f} ± {r.llc_se:.2f}" for r in o.itertuples())
            line += f"; ours {each} (steps {sorted(set(o.step))}): mean {gap:+.1%}, " \
                    f"{'within' if abs(gap) <= TOLERANCE else 'OUTSIDE'} ±{TOLERANCE:.0%}"
        else:
            line += "; ours: inconclusive: no hoogland.csv yet"
        print(line)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    g = theirs.groupby("step").llc.agg(["mean", "std"]).reset_index()
    ax.plot(g.step + 1, g["mean"], color="black", lw=1.2,
            label=f"Hoogland et al. (mean of {theirs.seed.nunique()} seeds)")
    ax.fill_between(g.step + 1, g["mean"] - g["std"], g["mean"] + g["std"], color="black", alpha=0.15, lw=0,
                    label="± sd over their seeds")
    for (seed, chains, draws), r in ours.groupby(["seed", "chains", "draws"]):
        r = r.sort_values("step")
        full = (chains, draws) == (ours.chains.max(), ours.draws.max())
        ax.errorbar(r.step + 1, r.llc_mean, yerr=r.llc_se, marker="o" if full else "s", ms=4, ls="none", capsize=2,
                    mfc=None if full else "none", color=f"C{seed}",
                    label=f"ours, seed {seed} (± s.e.)" + ("" if full else f", {chains} chains × {draws} steps"))
    for s in CHECK_STEPS:
        ax.axvline(s, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training step + 1")
    ax.set_ylabel("LLC λ̂")
    ax.set_title("L2H4, M = ∞: LLC over training", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=150)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
