"""What Hoogland et al.'s released LLC trajectory measures (issue 44), and ours beside it.

From their release (analysis/L2H4Minf of timaeus-research/icl at 7b6988a: llcs.pt, hessian_stats.pt,
evals_over_time.pt), at every released step up to 40k of their 5 seeds: λ̂; the chains' mean sampled loss
(`loss/mean/mean`, the mean over chains and draws of each draw's batch loss); L(w*) (`pretrain/mse` of their
evaluations) and the L(w*) their λ̂ implies (E − λ̂/nβ); their top Hessian eigenvalue (`hessian/evals/0`); the
stability ratio ε (nβ λ_max + γ) / 4 of their sampler (method §7; the same in their units and ours); and the flags
`unstable` (ratio > 1) and `escaped` (sampled level above the trivial predictor's (D + σ²)/D while L(w*) is
below it). Their loss is ours × D: every loss and λ_max below is divided by D = 4.

  fetch github:timaeus-research/icl (or git clone it), then
  git -C icl show 7b6988a:analysis/L2H4Minf/llcs.pt > /tmp/icl/llcs.pt   (and hessian_stats.pt, evals_over_time.pt)
  PYTHONPATH=src python experiments/reproductions/hoogland_release.py --release /tmp/icl

prints the level, the fit λ̂ = a (c − L(w*)), the ratio and the stages (iclnoise.probes.stages, configs/hoogland.yaml's
llc.stages) of each seed, and writes hoogland_release.csv. With --runs (our configs/hoogland.yaml run dirs, e.g. at
a calibrated setting: hoogland_calibrated_device.sh) their llc.parquet too: the same columns and stages, side by
side with theirs, into --ours-csv.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from hoogland_compare import load_release

from iclnoise.config import load_params
from iclnoise.core.io import read_parquet
from iclnoise.probes.llc import stability_ratio
from iclnoise.probes.stages import stages

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[1] / "reference" / "reproductions"  # the tables and figures these scripts write
ROOT = HERE.parents[1]
D, NOISE_VAR = 4, 0.125
TRIVIAL = (D + NOISE_VAR) / D           # loss of predicting 0, per D: 1.03125
EPSILON, NBETA, GAMMA = 3e-4, 0.01 * 2 / 3e-4, 0.001 * 2 / 3e-4   # 7b6988a's sweep, their units (nβ 66.67)
LAST_STEP = 40_292                      # their released steps up to 40k: 80 per seed


def release_table(release: Path) -> pd.DataFrame:
    """One row per (seed, released step ≤ LAST_STEP): their λ̂, sampled level, L(w*), λ_max (per D), ratio, flags."""
    llc = load_release(release / "llcs.pt")[["model_seed", "step", "llc/mean/mean", "loss/mean/mean"]]
    hess = load_release(release / "hessian_stats.pt")[["model_seed", "step", "hessian/evals/0"]]
    evals = load_release(release / "evals_over_time.pt")[["model_seed", "step", "pretrain/mse"]]
    df = llc.merge(hess, on=["model_seed", "step"]).merge(evals, on=["model_seed", "step"])
    df = df.rename(columns={"model_seed": "seed", "llc/mean/mean": "llc", "loss/mean/mean": "level",
                            "hessian/evals/0": "lambda_max", "pretrain/mse": "init_loss"})
    df = df.astype({"seed": int, "step": int}).query("step <= @LAST_STEP").sort_values(["seed", "step"])
    df["stability_ratio"] = stability_ratio(df.lambda_max, EPSILON, GAMMA, NBETA)
    df["init_implied"] = df.level - df.llc / NBETA
    for c in ("level", "init_loss", "init_implied", "lambda_max"):
        df[c] = df[c] / D
    df["unstable"] = df.stability_ratio > 1
    df["escaped"] = (df.level > TRIVIAL) & (df.init_loss < TRIVIAL)
    return df.reset_index(drop=True)


def ours_table(run_dirs: list[str]) -> pd.DataFrame:
    """The same columns from our runs' llc.parquet (per-D losses already)."""
    df = pd.concat([read_parquet(Path(d) / "llc.parquet") for d in run_dirs], ignore_index=True)
    return df.rename(columns={"llc_mean": "llc", "mean_sampling_loss": "level"})[
        ["seed", "step", "llc", "llc_se", "level", "init_loss", "lambda_max", "stability_ratio", "unstable", "escaped",
         "epsilon", "gamma", "nbeta", "chains", "draws"]].sort_values(["seed", "step"]).reset_index(drop=True)


def stage_rows(df: pd.DataFrame, who: str, cfg: dict) -> pd.DataFrame:
    """Stages (Type A: λ̂ rises, B: falls) of each seed's trajectory in df (step, llc, init_loss)."""
    return pd.concat([stages({"run_id": f"{who} s{s}", "M": "inf", "seed": s, "batch": 256, "noise": "none"},
                             g.step, g.llc, g.init_loss, cfg["sigma"], cfg["plateau_tol"])
                      for s, g in df.groupby("seed")], ignore_index=True)


def summary(df: pd.DataFrame, who: str) -> None:
    fit = np.polyfit(df.init_loss, df.llc, 1)
    r = np.corrcoef(df.init_loss, df.llc)[0, 1]
    print(f"{who}: {len(df)} seed-step rows, steps {df.step.min()}-{df.step.max()}")
    print(f"  sampled level per D {df.level.min():.4f}-{df.level.max():.4f} (trivial predictor {TRIVIAL:.4f}); "
          f"L(w*) per D {df.init_loss.min():.4f}-{df.init_loss.max():.4f}")
    print(f"  λ̂ against L(w*): λ̂ = {fit[0]:.2f} L(w*) + {fit[1]:.2f}, r = {r:.6f} "
          f"(the sampler's nβ per D: {NBETA * D if who == 'theirs' else df.nbeta.iloc[0]:.2f})")
    print(f"  stability ratio {df.stability_ratio.min():.2f}-{df.stability_ratio.max():.2f}; unstable "
          f"{int(df.unstable.sum())} of {len(df)} (first at step "
          f"{df[df.unstable].step.min() if df.unstable.any() else '-'}), escaped {int(df.escaped.sum())} of {len(df)}")


def peaks(df: pd.DataFrame, who: str) -> None:
    """Per seed: the step of the largest λ̂ (up to 40k) and λ̂ there."""
    for s, g in df.groupby("seed"):
        i = g.llc.idxmax()
        print(f"  {who} seed {s}: peak λ̂ {g.llc[i]:.1f} at step {g.step[i]}; λ̂ at the last step "
              f"{g.llc.iloc[-1]:.1f} ({g.step.iloc[-1]})")


def figure(theirs: pd.DataFrame, ours: pd.DataFrame, st: pd.DataFrame, out: Path) -> None:
    """λ̂ against step (log axis), theirs and ours on their own scales, milestones marked: shapes, not levels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for ax, (who, df) in zip(axes, (("theirs (release, their sampler)", theirs), ("ours (calibrated sampler)", ours))):
        for s, g in df.groupby("seed"):
            line, = ax.plot(g.step + 1, g.llc, marker=".", ms=3, lw=1, label=f"seed {s}")
            mark = st[st.run_id == f"{who.split()[0]} s{s}"]
            for step in mark[mark.kind != "end"].step:
                ax.axvline(step + 1, color=line.get_color(), ls=":", lw=1)
            bad = g[g.unstable | g.escaped]
            ax.plot(bad.step + 1, bad.llc, "x", color="k", ms=4, label="_")
        ax.set(xscale="log", xlabel="step + 1", ylabel="λ̂", title=who)
        ax.legend(fontsize=7, ncol=2)
    axes[1].annotate("x: unstable or escaped; dotted: stage boundaries", (0.02, 0.02), xycoords="axes fraction",
                     fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", help="folder with their llcs.pt, hessian_stats.pt, evals_over_time.pt (without it: "
                    "--csv, which a run with it wrote)")
    ap.add_argument("--runs", nargs="*", default=[], help="our run dirs (llc.parquet) to set beside theirs")
    ap.add_argument("--csv", default=str(DATA / "hoogland_release.csv"))
    ap.add_argument("--ours-csv", default=str(DATA / "hoogland_calibrated.csv"))
    ap.add_argument("--figure", default=str(DATA / "hoogland_calibrated.png"))
    ap.add_argument("--sigma", type=float, help="stage smoothing in decades (default: configs/hoogland.yaml's)")
    a = ap.parse_args()
    cfg = load_params(ROOT / "params.yaml", [ROOT / "configs/hoogland.yaml"])["llc"]["stages"]
    cfg["sigma"] = a.sigma or cfg["sigma"]
    if a.release:
        theirs = release_table(Path(a.release))
        theirs.to_csv(a.csv, index=False)
    else:
        theirs = pd.read_csv(a.csv)
    summary(theirs, "theirs")
    level = theirs.groupby("step")["level"].mean()
    print(f"  seed-mean level per step {level.min():.4f}-{level.max():.4f}")
    o = pd.read_csv(DATA / "hoogland.csv")   # ours at their sampler (configs/hoogland.yaml)
    esc = (o.mean_sampling_loss > TRIVIAL) & (o.init_loss < TRIVIAL)
    print(f"ours at their sampler (hoogland.csv): level per D {o.mean_sampling_loss.min():.4f}-"
          f"{o.mean_sampling_loss.max():.4f}; escaped at steps {sorted(set(o[esc].step))} of {sorted(set(o.step))}")
    st = [stage_rows(theirs, "theirs", cfg)]
    peaks(theirs, "theirs")
    if a.runs:
        ours = ours_table(a.runs)
        ours.to_csv(a.ours_csv, index=False)
        summary(ours, "ours")
        peaks(ours, "ours")
        st.append(stage_rows(ours, "ours", cfg))
    cols = ["run_id", "stage", "type", "start_step", "end_step", "kind", "llc_start", "llc_end"]
    print(pd.concat(st)[cols].to_string(index=False, float_format="%.1f"))
    if a.runs:
        ours_csv = Path(a.ours_csv)
        pd.concat(st)[cols].to_csv(ours_csv.with_name(f"{ours_csv.stem}_stages.csv"), index=False)
        figure(theirs, ours, pd.concat(st), Path(a.figure))


if __name__ == "__main__":
    main()
