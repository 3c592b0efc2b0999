"""Figure 3 (end-of-training loss and LLC against M), figure 4 (LLC over training with stages) and the SGLD
calibration sweep of `iclnoise llc-calibrate`."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..io import read_parquet
from ..sections import LLCConfig, RunSpec
from ..tasks import M_INF, m_label
from . import style


def _m_positions(ms) -> dict[int, float]:
    """log2 M on the x axis; ∞ one step (2 octaves) right of the largest finite M."""
    finite = [m for m in style.m_order(ms) if m != M_INF]
    pos = {m: float(np.log2(m)) for m in finite}
    if M_INF in set(ms):
        pos[M_INF] = (max(pos.values()) if pos else 0.0) + 2.0
    return pos


def fig_llc_vs_m(summary: pd.DataFrame, llc: pd.DataFrame, path: str | Path) -> None:
    """Figure 3: end-of-training OOD/ID loss (transformer vs dMMSE_M, ridge) and final LLC against M."""
    style.setup()
    last = llc.sort_values("step").groupby("run_id").tail(1)[["run_id", "llc_mean", "llc_std"]]
    df = summary.merge(last, on="run_id", how="left")
    pos = _m_positions(df.M)
    df["x"] = df.M.map(pos)
    batches = sorted(df.batch.unique())
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 7), squeeze=False, sharex=True)
    for j, B in enumerate(batches):
        sub = df[df.batch == B]
        ax = axes[0, j]
        for col, lab, kw in (("ood_loss", "transformer, OOD", dict(color="C0", marker="o")),
                             ("id_loss", "transformer, in-distribution", dict(color="C0", marker="o", ls="--",
                                                                              mfc="white")),
                             ("ood_loss_dmmse", "dMMSE_M, OOD", dict(color="C3", marker="D", ls=":")),
                             ("ood_loss_ridge", "ridge, OOD", dict(color="black", ls="-", lw=1))):
            g = sub.groupby("x")[col].agg(["mean", "std"]).reset_index()
            ax.errorbar(g.x, g["mean"], yerr=g["std"].fillna(0), label=lab, capsize=2, **kw)
        ax.set_title(f"batch {B}: end-of-training loss")
        ax.set_ylabel("loss / D")
        ax = axes[1, j]
        g = sub.groupby("x").llc_mean.agg(["mean", "std", "count"]).reset_index()
        seeds = int(g["count"].max()) if len(g) else 0
        ax.errorbar(g.x, g["mean"], yerr=g["std"].fillna(0), marker="s", color="C2", capsize=2,
                    label="LLC (mean ± sd over seeds)" if seeds > 1 else "LLC (one probed seed: no error bar)")
        inf = sub[sub.M == M_INF].llc_mean
        if len(inf) and np.isfinite(inf).any():
            ax.axhline(inf.mean(), color="black", ls="--", lw=1, label="M = ∞ (ridge reference)")
        ax.set_ylabel("final LLC λ̂")
        ax.set_xlabel("task diversity M")
        ax.set_xticks(sorted(pos.values()), [m_label(m) if m != M_INF else "∞" for m in sorted(pos, key=pos.get)])
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=8)
    fig.suptitle("End of training against task diversity", y=1.0)
    fig.tight_layout()
    style.save_figure(fig, path, df.drop(columns=["x"]))


FLAGS = ("diverged", "negative", "not_levelled")


def _flagged(df: pd.DataFrame) -> pd.Series:
    """Estimates a reader must not take at face value (any SGLD diagnostic flag set)."""
    cols = [c for c in FLAGS if c in df]
    return df[cols].any(axis=1) if cols else pd.Series(False, index=df.index)


def fig_llc_over_training(llc: pd.DataFrame, stages: pd.DataFrame | None, path: str | Path) -> None:
    """Figure 4: LLC over training per M (every batch size).

    Trusted estimates are joined by a line with a ± standard-error band (markers only when there are
    few checkpoints); flagged estimates (diverged, negative, not levelled) are hollow grey-edged
    markers, never joined. Stage boundaries of the first seed are ▼ ticks on the top edge in the
    M's colour, so they cannot be read as data.
    """
    style.setup()
    pal = style.m_palette(llc.M)
    batches = sorted(llc.batch.unique())
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.8), squeeze=False, sharey=True)
    any_flagged = any_stage = False
    for j, B in enumerate(batches):
        ax = axes[0, j]
        sub = llc[llc.batch == B]
        seed0 = sub.seed.min()
        for M in style.m_order(sub.M):
            for seed, r in sub[sub.M == M].groupby("seed"):
                r = r.sort_values("step")
                bad = _flagged(r)
                ok = r[~bad]
                first = seed == seed0
                few = len(r) <= 40
                se = ok.llc_se if "llc_se" in ok else ok.llc_std
                ax.plot(ok.step + 1, ok.llc_mean, color=pal[M], lw=1.6 if first else 0.7, alpha=1 if first else 0.4,
                        marker="o" if few else None, ms=3, label=style.m_legend_label(M) if first else None)
                if first:
                    ax.fill_between(ok.step + 1, ok.llc_mean - se, ok.llc_mean + se, color=pal[M], alpha=0.15, lw=0)
                if bad.any():
                    any_flagged = True
                    ax.scatter(r.step[bad] + 1, r.llc_mean[bad], s=22, facecolors="none", edgecolors=pal[M],
                               linewidths=0.9, alpha=0.8 if first else 0.35, zorder=3)
                if stages is not None and first:
                    st = stages[(stages.run_id == r.run_id.iloc[0]) & (stages.kind != "end")]
                    if len(st):
                        any_stage = True
                        ax.scatter(st.step + 1, np.ones(len(st)), transform=ax.get_xaxis_transform(), marker="v",
                                   s=36, color=pal[M], clip_on=False, zorder=4)
        ax.set_xscale("log")
        ax.set_title(f"batch {B}", pad=14)
        ax.set_xlabel("training step + 1")
    axes[0, 0].set_ylabel("LLC λ̂ (band: ± s.e. over chains)")
    handles, labels = axes[0, -1].get_legend_handles_labels()
    if any_flagged:
        handles.append(plt.Line2D([], [], ls="", marker="o", mfc="none", mec="grey"))
        labels.append("flagged estimate (not joined)")
    if any_stage:
        handles.append(plt.Line2D([], [], ls="", marker="v", color="grey"))
        labels.append("stage boundary (seed %d)" % llc.seed.min())
    axes[0, -1].legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("Local learning coefficient over training", y=1.02)
    fig.tight_layout()
    style.save_figure(fig, path, llc.drop(columns=["llc_per_chain"], errors="ignore"))


def llc_figures(summary: str | Path, llc_files: list, stages_files: list, out: Path) -> list[Path]:
    """Figures 3 and 4 into `out` from summary.parquet and the runs' llc.parquet (and stages.parquet)."""
    llc = pd.concat([read_parquet(p) for p in llc_files], ignore_index=True)
    stages = pd.concat([read_parquet(p) for p in stages_files], ignore_index=True) if stages_files else None
    fig_llc_vs_m(read_parquet(summary), llc, out / "fig03_loss_llc_vs_m")
    fig_llc_over_training(llc, stages, out / "fig04_llc_over_training")
    return [out / "fig03_loss_llc_vs_m.png", out / "fig04_llc_over_training.png"]


def llc_calibration(run_dir: str | Path, base: LLCConfig, step: int | None, epsilons: list[float],
                    gammas: list[float], out: Path) -> pd.DataFrame:
    """Estimate the LLC of one checkpoint (default: the last) at every ε × γ, the other settings `base`'s;
    draw each setting's traces at `out` (pick the largest ε whose traces level off without divergence, the
    smallest γ that keeps the chains local) and return the table of estimates and flags."""
    from .. import runs
    from ..llc import estimate_llc
    from ..model import mse_loss
    from ..probes import sampling_data

    run_dir = Path(run_dir)
    spec = RunSpec.of(runs.read_spec(run_dir))
    step = step if step is not None else max(runs.checkpoint_steps(run_dir))
    xs, ys = sampling_data(spec, base.n)
    model = runs.load_model(run_dir, step)
    style.setup()
    fig, axes = plt.subplots(len(gammas), len(epsilons), figsize=(3 * len(epsilons), 2.4 * len(gammas)),
                             squeeze=False, sharex=True)
    rows = []
    for i, g in enumerate(gammas):
        for j, e in enumerate(epsilons):
            cfg = LLCConfig(**{**asdict(base), "epsilon": e, "gamma": g})
            r = estimate_llc(model, mse_loss, xs, ys, cfg)
            ax = axes[i, j]
            for tr in r.traces:
                ax.plot(r.nbeta * (tr - r.init_loss), lw=0.7)
            ax.axvline(cfg.burn_in, color="grey", ls=":")
            ax.axhline(0, color="black", lw=0.5)
            bad = [k for k, v in r.flags.items() if v]
            flags = f" [{', '.join(bad)}]" if bad else ""
            ax.set_title(f"ε={e:g} γ={g:g}\nλ̂={r.llc_mean:.2f}±{r.llc_std:.2f}" + flags,
                         fontsize=8, color="firebrick" if bad else "black")
            rows.append({"epsilon": e, "gamma": g, "llc_mean": r.llc_mean, "llc_std": r.llc_std, **r.flags})
    for ax in axes[-1]:
        ax.set_xlabel("SGLD step")
    for ax in axes[:, 0]:
        ax.set_ylabel("nβ·(L − L(w*))")
    fig.suptitle(f"LLC calibration, {spec.keys.run_id} step {step}: pick the largest ε whose traces level "
                 f"off without divergence, and the smallest γ that keeps chains local", fontsize=9)
    fig.tight_layout()
    table = pd.DataFrame(rows)
    style.save_figure(fig, out, table)
    return table
