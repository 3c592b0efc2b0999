"""Figure 8 (early vs late noise at equal exposure, H2) and figure 10 (P-NE* time series per condition)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ...analysis.verdicts import optimizer_note
from ...core.tasks import M_INF
from . import style


def _empty(ax: plt.Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def fig_schedules(out: pd.DataFrame, path: str | Path) -> None:
    """Ridge-likeness at the end of training, early against late noise, one point per (M, seed, batch).

    Points above the diagonal: late noise gave more ICL (H2). Both schedules have the same integrated
    injected exposure by construction (noise.budget), shown in the title."""
    style.setup()
    fin = out[(out.M != M_INF) & ~out.diverged]
    pairs = fin[fin.noise_schedule.isin(["early", "late"])].pivot_table(   # an optimizer's runs pair among themselves
        index=["M", "seed", "batch", "optimizer"], columns="noise_schedule", values="r").dropna().reset_index()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    if {"early", "late"} <= set(pairs.columns) and len(pairs):
        pal = style.m_palette(pairs.M)
        marks = dict(zip(sorted(pairs.optimizer.unique()), "osD^"))
        for (M, o), g in pairs.groupby(["M", "optimizer"]):
            ax.scatter(g.early, g.late, color=pal[M], marker=marks[o], s=40, edgecolor="black", lw=0.4,
                       label=style.m_legend_label(M) + optimizer_note(o))
        lo, hi = np.nanmin(pairs[["early", "late"]].to_numpy()), np.nanmax(pairs[["early", "late"]].to_numpy())
        pad = 0.05 * (hi - lo + 1e-9)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", ls="--", lw=1, label="late = early")
        ax.set_xlabel("ridge-likeness r, noise early")
        ax.set_ylabel("ridge-likeness r, noise late")
        ax.legend(fontsize=7)
        if "integrated_ne_injected" in fin:
            e = fin[fin.noise_schedule.isin(["early",
                                             "late"])].groupby("noise_schedule").integrated_ne_injected.median()
            ax.set_title("Early vs late noise (H2)\n" + ", ".join(f"{k}: Σ NE_inj = {v:.3g}" for k, v in e.items()),
                         fontsize=9)
    else:
        _empty(ax, "no early/late pair in the grid\n(add both schedules to grid.noise, e.g. configs/noise.yaml)")
        ax.set_title("Early vs late noise (H2)")
    fig.tight_layout()
    style.save_figure(fig, path, pairs)


def fig_exposure_series(exposure: pd.DataFrame, path: str | Path) -> None:
    """P-NE* (after clipping) over training, one panel per (noise condition, batch, optimizer), one line per M (mean
    over seeds); the batch-noise part NE/Curv dashed where noise is injected."""
    style.setup()
    if exposure.empty:
        fig, ax = plt.subplots(figsize=(5, 3))
        _empty(ax, "no exposure logs (exposure.enabled: false)")
        style.save_figure(fig, path, exposure)
        return
    df = style.with_optimizer(exposure)
    df["pne_batch"] = df["ne"] * df.clip_coef ** 2 / df.curv.clip(lower=1e-12)
    panels = sorted(df.groupby(["noise", "batch", "optimizer"]).groups)
    n = len(panels)
    cols = min(n, 3)
    rows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.3 * rows), squeeze=False, sharey=True)
    pal = style.m_palette(df.M)
    for ax, (noise, B, opt) in zip(axes.flat, panels):
        g = df[(df.noise == noise) & (df.batch == B) & (df.optimizer == opt)]
        mean = g.groupby(["M", "step"], as_index=False)[["pne_postclip", "pne_batch", "ne_injected"]].mean()
        for M in style.m_order(mean.M):
            h = mean[mean.M == M]
            ax.plot(h.step, h.pne_postclip, color=pal[M], lw=1.4, label=style.m_legend_label(M))
            if (h.ne_injected > 0).any():
                ax.plot(h.step, h.pne_batch, color=pal[M], lw=0.9, ls="--")
        ax.set_yscale("log")
        ax.set_title(f"{noise}, batch {B}{optimizer_note(opt)}", fontsize=9)
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("P-NE* (post-clip)")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[min(n, cols) - 1].legend(loc="upper right", fontsize=7)
    fig.suptitle("Preconditioned noise exposure over training (dashed: batch noise alone)", y=1.01)
    fig.tight_layout()
    style.save_figure(fig, path, df.drop(columns=["aca_eigs"], errors="ignore"))
