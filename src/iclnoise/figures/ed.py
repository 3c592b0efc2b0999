"""Figure 2 (essential subspace) and figure 5 (plane curves, osculating circles, evolute, forms)."""
from __future__ import annotations

from itertools import combinations
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from scipy.ndimage import gaussian_filter1d

from ..ed import plane_geometry
from . import style


def _curve(pcs: pd.DataFrame, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    w = pcs[(pcs.run_id == run_id) & (pcs.kind == "run")].pivot(index="step", columns="pc", values="value")
    return w.index.to_numpy(), w.to_numpy()


def fig_essential_subspace(pcs: pd.DataFrame, var: pd.DataFrame, metrics: pd.DataFrame, path: str | Path) -> None:
    """PC1–PC2 (and PC1–PC3) trajectories per M; dMMSE_M ◆ and ridge ■ projected; t_crit ○; end ★."""
    style.setup()
    runs = pcs[pcs.kind == "run"]
    pal = style.m_palette(runs.M)
    n_pc = int(pcs.pc.max())
    pairs = [(1, 2)] + ([(1, 3)] if n_pc >= 3 else [])
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.2 * len(pairs), 4.6), squeeze=False)
    evr = var.set_index("pc").explained_variance_ratio
    m = metrics[metrics.step > 0].reset_index(drop=True)
    tcrit = m.loc[m.groupby("run_id").ood_loss.idxmin()].set_index("run_id").step
    for ax, (i, j) in zip(axes[0], pairs):
        for rid in runs.run_id.unique():
            steps, c = _curve(pcs, rid)
            M = int(runs[runs.run_id == rid].M.iloc[0])
            ax.plot(c[:, i - 1], c[:, j - 1], color=pal[M], lw=1.4, alpha=0.9)
            ax.scatter(c[-1, i - 1], c[-1, j - 1], marker="*", s=140, color=pal[M], edgecolor="black", lw=0.5, zorder=4)
            if rid in tcrit.index and tcrit[rid] in steps:
                k = int(np.nonzero(steps == tcrit[rid])[0][0])
                ax.scatter(c[k, i - 1], c[k, j - 1], marker="o", s=45, facecolor="none", edgecolor=pal[M], lw=1.5, zorder=4)
        for kind, marker, size in (("dmmse", "D", 50), ("ridge", "s", 70)):
            for _, g in pcs[pcs.kind == kind].groupby("run_id"):
                v = g.set_index("pc").value
                M = int(g.M.iloc[0])
                ax.scatter(v[i], v[j], marker=marker, s=size, color=pal.get(M, "black") if kind == "dmmse" else "black",
                           edgecolor="black", lw=0.6, zorder=5)
        ax.set_xlabel(f"PC{i} ({evr[i]:.1%})")
        ax.set_ylabel(f"PC{j} ({evr[j]:.1%})")
    handles = [plt.Line2D([], [], color=pal[M], lw=2, label=style.m_legend_label(M)) for M in style.m_order(runs.M)]
    handles += [plt.Line2D([], [], marker="D", ls="", color="grey", mec="black", label="dMMSE_M"),
                plt.Line2D([], [], marker="s", ls="", color="black", label="ridge"),
                plt.Line2D([], [], marker="o", ls="", mfc="none", mec="grey", label="t_crit"),
                plt.Line2D([], [], marker="*", ls="", color="grey", mec="black", ms=12, label="end of training")]
    axes[0, -1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Essential subspace (joint PCA, {evr.iloc[:2].sum():.1%} of variance in two PCs)", y=1.01)
    fig.tight_layout()
    style.save_figure(fig, path, pcs)


def fig_forms(pcs: pd.DataFrame, forms: pd.DataFrame, events: pd.DataFrame, cfg: dict, path: str | Path,
              run_id: str | None = None) -> None:
    """For one run (default: the one with the most forms): each PC-pair plane curve (smoothed) with
    osculating circles at the vertices, the evolute, forms marked; below, PCs over time with forms dashed."""
    style.setup()
    runs = pcs[pcs.kind == "run"]
    if run_id is None:  # the run with the most forms, ties to the largest finite M
        order = runs.groupby("run_id").M.first().map(lambda m: m if m > 0 else 0).rename("M").to_frame()
        order["forms"] = forms.run_id.value_counts().reindex(order.index).fillna(0)
        run_id = order.sort_values(["forms", "M"]).index[-1]
    steps, c = _curve(pcs, run_id)
    sm = gaussian_filter1d(c, cfg.get("sigma", 1.0), axis=0, mode="nearest")
    n = min(cfg.get("n_form_pcs", 3), c.shape[1])
    pairs = list(combinations(range(n), 2))
    fig = plt.figure(figsize=(4.2 * len(pairs), 7.5))
    gs = fig.add_gridspec(2, len(pairs), height_ratios=[1.3, 1])
    f_idx = forms[forms.run_id == run_id]["index"].to_numpy()
    for p, (i, j) in enumerate(pairs):
        ax = fig.add_subplot(gs[0, p])
        g = plane_geometry(sm[:, i], sm[:, j])
        ax.plot(sm[:, i], sm[:, j], color="C0", lw=1.8, label="trajectory (smoothed)")
        lim = np.array([ax.get_xlim(), ax.get_ylim()])
        finite = np.isfinite(g["ex"]) & np.isfinite(g["ey"])
        ax.plot(g["ex"][finite], g["ey"][finite], color="C1", lw=0.8, alpha=0.7, label="evolute")
        ev = events[(events.run_id == run_id) & (events.pc_i == i + 1) & (events.pc_j == j + 1)]
        for _, e in ev.iterrows():
            k = int(e["index"])
            if e.kind == "vertex" and np.isfinite(g["ex"][k]):
                r = 1 / abs(g["kappa"][k])
                ax.add_patch(plt.Circle((g["ex"][k], g["ey"][k]), r, fill=False, color="grey", lw=0.6, alpha=0.6))
            ax.scatter(sm[k, i], sm[k, j], marker="^" if e.kind == "cusp" else "o", s=28,
                       color="C2" if e.kind == "vertex" else "C3", zorder=4)
        for k in f_idx:
            ax.scatter(sm[k, i], sm[k, j], marker="X", s=90, color="black", zorder=5)
        pad = 0.15 * np.ptp(lim, axis=1)
        ax.set_xlim(lim[0] + [-pad[0], pad[0]])
        ax.set_ylim(lim[1] + [-pad[1], pad[1]])
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_xlabel(f"PC{i + 1}")
        ax.set_ylabel(f"PC{j + 1}")
    handles = [plt.Line2D([], [], color="C0", label="trajectory"), plt.Line2D([], [], color="C1", label="evolute"),
               plt.Line2D([], [], marker="o", ls="", color="C2", label="vertex (osculating circle)"),
               plt.Line2D([], [], marker="^", ls="", color="C3", label="cusp"),
               plt.Line2D([], [], marker="X", ls="", color="black", label="form")]
    fig.axes[0].legend(handles=handles, fontsize=7, loc="best")
    ax = fig.add_subplot(gs[1, :])
    for k in range(n):
        ax.plot(steps + 1, c[:, k], label=f"PC{k + 1}", lw=1.5)
    for k in f_idx:
        ax.axvline(steps[k] + 1, color="black", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("training step + 1")
    ax.set_ylabel("PC value")
    ax.legend(ncol=n, fontsize=8)
    fig.suptitle(f"Essential dynamics of {run_id}: forms (dashed) where every PC pair has a vertex or cusp")
    fig.tight_layout()
    style.save_figure(fig, path, pcs[pcs.run_id == run_id])
