"""Figure 3 (end-of-training loss and LLC against M), figure 4 (LLC over training with stages) and the SGLD
calibration sweep of `iclnoise llc-calibrate`."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ...analysis.verdicts import optimizer_note
from ...core.io import read_parquet
from ...core.tasks import M_INF, m_label
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
    df = style.with_optimizer(summary.merge(last, on="run_id", how="left"))
    pos = _m_positions(df.M)
    df["x"] = df.M.map(pos)
    batches = sorted({(int(b), o) for b, o in zip(df.batch, df.optimizer)})   # a column per (batch, optimizer)
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 7), squeeze=False, sharex=True)
    for j, (B, opt) in enumerate(batches):
        sub = df[(df.batch == B) & (df.optimizer == opt)]
        ax = axes[0, j]
        for col, lab, kw in (("ood_loss", "transformer, OOD", dict(color="C0", marker="o")),
                             ("id_loss", "transformer, in-distribution", dict(color="C0", marker="o", ls="--",
                                                                              mfc="white")),
                             ("ood_loss_dmmse", "dMMSE_M, OOD", dict(color="C3", marker="D", ls=":")),
                             ("ood_loss_ridge", "ridge, OOD", dict(color="black", ls="-", lw=1))):
            g = sub.groupby("x")[col].agg(["mean", "std"]).reset_index()
            ax.errorbar(g.x, g["mean"], yerr=g["std"].fillna(0), label=lab, capsize=2, **kw)
        ax.set_title(f"batch {B}{optimizer_note(opt)}: end-of-training loss")
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
    style.save_figure(fig, path, df.drop(columns=["x", "optimizer"]))


SAMPLER_FLAGS = ("unstable", "escaped")   # λ̂ measures the sampler, not the geometry (method §7)
FLAGS = ("diverged", "negative", "not_levelled", *SAMPLER_FLAGS)


def flagged(df: pd.DataFrame, flags: tuple[str, ...] = FLAGS) -> pd.Series:
    """Estimates a reader must not take at face value (any of `flags` set; default: every SGLD diagnostic)."""
    cols = [c for c in flags if c in df]
    return df[cols].fillna(False).astype(bool).any(axis=1) if cols else pd.Series(False, index=df.index)


def fig_llc_over_training(llc: pd.DataFrame, stages: pd.DataFrame | None, path: str | Path) -> None:
    """Figure 4: LLC over training per M (every batch size).

    Trusted estimates are joined by a line with a ± standard-error band (markers only when there are
    few checkpoints); flagged estimates are never joined: hollow markers where the chains diverged, went
    negative or did not level off, crosses where the estimate measures the sampler (unstable or escaped,
    method §7; a cross wins where both apply). Stage boundaries of the first seed are ▼ ticks on the top edge in the
    M's colour, so they cannot be read as data.
    """
    style.setup()
    pal = style.m_palette(llc.M)
    llc = style.with_optimizer(llc)
    batches = sorted({(int(b), o) for b, o in zip(llc.batch, llc.optimizer)})   # a panel per (batch, optimizer)
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.8), squeeze=False, sharey=True)
    drew = [False, False, False]   # hollow-flagged, sampler-flagged, stage markers anywhere
    for j, (B, opt) in enumerate(batches):
        ax = axes[0, j]
        sub = llc[(llc.batch == B) & (llc.optimizer == opt)]
        seed0 = sub.seed.min()
        for M in style.m_order(sub.M):
            for seed, r in sub[sub.M == M].groupby("seed"):
                drew = [a or b for a, b in zip(drew, _llc_run(ax, r.sort_values("step"), M, pal[M], seed == seed0,
                                                             stages))]
        ax.set_xscale("log")
        ax.set_title(f"batch {B}{optimizer_note(opt)}", pad=14)
        ax.set_xlabel("training step + 1")
    axes[0, 0].set_ylabel("LLC λ̂ (band: ± s.e. over chains)")
    any_flagged, any_sampler, any_stage = drew
    handles, labels = axes[0, -1].get_legend_handles_labels()
    if any_flagged:
        handles.append(plt.Line2D([], [], ls="", marker="o", mfc="none", mec="grey"))
        labels.append("flagged: diverged / negative / not levelled")
    if any_sampler:
        handles.append(plt.Line2D([], [], ls="", marker="x", color="grey"))
        labels.append("flagged: unstable / escaped (measures the sampler)")
    if any_stage:
        handles.append(plt.Line2D([], [], ls="", marker="v", color="grey"))
        labels.append("stage boundary (seed %d)" % llc.seed.min())
    axes[0, -1].legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("Local learning coefficient over training", y=1.02)
    fig.tight_layout()
    style.save_figure(fig, path, llc.drop(columns=["llc_per_chain", "optimizer"], errors="ignore"))


def _llc_run(ax: plt.Axes, r: pd.DataFrame, M, colour, first: bool, stages: pd.DataFrame | None) -> tuple:
    """One run's λ̂ over training on `ax` (`r`: its rows by step; `first`: the batch's first seed, drawn bold with
    its band and stage ticks). Returns whether it drew (hollow flagged, sampler-flagged, stage) markers."""
    bad = flagged(r)
    ok = r[~bad]
    few = len(r) <= 40
    se = ok.llc_se if "llc_se" in ok else ok.llc_std
    ax.plot(ok.step + 1, ok.llc_mean, color=colour, lw=1.6 if first else 0.7, alpha=1 if first else 0.4,
            marker="o" if few else None, ms=3, label=style.m_legend_label(M) if first else None)
    if first:
        ax.fill_between(ok.step + 1, ok.llc_mean - se, ok.llc_mean + se, color=colour, alpha=0.15, lw=0)
    sampler = flagged(r, SAMPLER_FLAGS)
    other = bad & ~sampler
    if other.any():
        ax.scatter(r.step[other] + 1, r.llc_mean[other], s=22, facecolors="none", edgecolors=colour,
                   linewidths=0.9, alpha=0.8 if first else 0.35, zorder=3)
    if sampler.any():
        ax.scatter(r.step[sampler] + 1, r.llc_mean[sampler], s=26, marker="x", color=colour,
                   linewidths=1.0, alpha=0.8 if first else 0.35, zorder=3)
    st = stages[(stages.run_id == r.run_id.iloc[0]) & (stages.kind != "end")] if stages is not None and first else []
    if len(st):
        ax.scatter(st.step + 1, np.ones(len(st)), transform=ax.get_xaxis_transform(), marker="v",
                   s=36, color=colour, clip_on=False, zorder=4)
    return bool(other.any()), bool(sampler.any()), bool(len(st))


def llc_figures(summary: str | Path, llc_files: list, stages_files: list, out: Path) -> list[Path]:
    """Figures 3 and 4 into `out` from summary.parquet and the runs' llc.parquet (and stages.parquet)."""
    llc = pd.concat([read_parquet(p) for p in llc_files], ignore_index=True)
    stages = pd.concat([read_parquet(p) for p in stages_files], ignore_index=True) if stages_files else None
    fig_llc_vs_m(read_parquet(summary), llc, out / "fig03_loss_llc_vs_m")
    fig_llc_over_training(llc, stages, out / "fig04_llc_over_training")
    return [out / "fig03_loss_llc_vs_m.png", out / "fig04_llc_over_training.png"]


def fig_llc_calibration(table: pd.DataFrame, path: str | Path) -> None:
    """The `iclnoise llc-calibrate` sweep: λ̂ ± s.e. against ε, one panel per checkpoint, one line per (γ, nβ);
    flagged estimates (any of FLAGS) are crosses, the chosen setting is ringed."""
    style.setup()
    steps = sorted(table.step.unique())
    fig, axes = plt.subplots(1, len(steps), figsize=(3.6 * len(steps), 3.2), squeeze=False)
    for ax, step in zip(axes[0], steps):
        sub = table[table.step == step]
        for i, ((g, nb), r) in enumerate(sub.groupby(["gamma", "nbeta"])):
            r = r.sort_values("epsilon")
            bad = flagged(r)
            ax.errorbar(r.epsilon, r.llc_mean, yerr=r.llc_se, color=f"C{i}", marker="o", ms=3, capsize=2,
                        label=f"γ={g:g}, nβ={nb:.4g}")
            ax.scatter(r.epsilon[bad], r.llc_mean[bad], marker="x", s=40, color="firebrick", zorder=4)
            ch = r[r.chosen]
            ax.scatter(ch.epsilon, ch.llc_mean, s=120, facecolors="none", edgecolors="black", zorder=5)
        ax.set_xscale("log")
        ax.set_title(f"step {step}", fontsize=9)
        ax.set_xlabel("SGLD step size ε")
    axes[0, 0].set_ylabel("λ̂ (± s.e.)")
    axes[0, -1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5),
                       title="× flagged, ○ chosen", title_fontsize=7)
    fig.suptitle("LLC calibration: the largest ε whose estimate is unflagged and has levelled off in ε", fontsize=9)
    fig.tight_layout()
    style.save_figure(fig, path, table)
