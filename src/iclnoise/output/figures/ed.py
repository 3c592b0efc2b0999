"""Figure 2 (essential subspace) and figure 5 (plane curves, osculating circles, evolute, forms).

`iclnoise ed-figures` draws both from the tables `iclnoise ed` wrote (figures import ed; ed never imports
figures).
"""
from __future__ import annotations

from itertools import combinations
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ...core.io import read_parquet
from ...core.probe_sections import ED
from ...probes.ed import curvature, log_time, smooth_curve
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
                ax.scatter(c[k, i - 1], c[k, j - 1], marker="o", s=45, facecolor="none", edgecolor=pal[M],
                           lw=1.5, zorder=4)
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


def fig_forms(pcs: pd.DataFrame, forms: pd.DataFrame, events: pd.DataFrame, cfg: ED, path: str | Path,
              run_id: str | None = None, sampling: pd.DataFrame | None = None) -> None:
    """For one run (default: the one with the most forms): each PC-pair plane curve as smoothed for
    detection (a function of log-step, colour = log-step), its evolute, osculating circles at the kept
    vertices, cusps, forms (black X, on the curve at the form's time); below, PCs against log-step
    with forms dashed and the end margins shaded. Says "no forms" on the figure when there are none."""
    style.setup()
    run_id = _most_forms(pcs, forms) if run_id is None else run_id
    steps, c = _curve(pcs, run_id)
    tau = log_time(steps)
    grid, (sm, d1, d2) = smooth_curve(tau, c, cfg.bandwidth, derivatives=True)
    n = min(cfg.n_form_pcs, c.shape[1])
    pairs = list(combinations(range(n), 2))
    f_tau = forms[forms.run_id == run_id].log_step.to_numpy()
    ev_run = events[(events.run_id == run_id) & events.kept] if len(events) else events
    inner = (grid >= grid[0] + cfg.margin) & (grid <= grid[-1] - cfg.margin)
    fig = plt.figure(figsize=(4.2 * len(pairs), 7.5))
    gs = fig.add_gridspec(2, len(pairs), height_ratios=[1.3, 1])
    for p, (i, j) in enumerate(pairs):
        sc = _form_plane(fig.add_subplot(gs[0, p]), i, j, grid, sm, d1, d2, c, inner, ev_run, f_tau)
    fig.colorbar(sc, ax=fig.axes[len(pairs) - 1], label="log(step + 1)", shrink=0.8)
    fig.axes[0].legend(handles=_form_legend(), fontsize=7, loc="best")
    ax = fig.add_subplot(gs[1, :])
    for k in range(n):
        ax.plot(grid, sm[:, k], lw=1.5, color=f"C{k}", label=f"PC{k + 1}")
        ax.scatter(tau, c[:, k], s=8, color=f"C{k}")
    for t in f_tau:
        ax.axvline(t, color="black", ls="--", lw=1)
    for lo, hi in ((grid[0], grid[0] + cfg.margin), (grid[-1] - cfg.margin, grid[-1])):
        ax.axvspan(lo, hi, color="0.9", zorder=0)
    ax.set_xlabel("log(step + 1)  (shaded: end margins, no events)")
    ax.set_ylabel("PC value")
    ax.legend(ncol=n, fontsize=8)
    under = sampling is not None and bool(sampling[sampling.run_id == run_id].undersampled.any())
    if len(f_tau) == 0:
        msg = "inconclusive: checkpoints too sparse for the bandwidth" if under else "no forms"
        ax.text(0.5, 0.9, msg, transform=ax.transAxes, ha="center", fontsize=12, color="C3",
                bbox={"facecolor": "white", "edgecolor": "C3"})
    fig.suptitle(f"Essential dynamics of {run_id}: {len(f_tau)} form(s) where every PC pair has a significant "
                 f"vertex or cusp within ±{cfg.tolerance} log-step (bandwidth {cfg.bandwidth})")
    fig.tight_layout()
    style.save_figure(fig, path, pcs[pcs.run_id == run_id])


def _most_forms(pcs: pd.DataFrame, forms: pd.DataFrame) -> str:
    """The run with the most forms, ties to the largest finite M."""
    runs = pcs[pcs.kind == "run"]
    order = runs.groupby("run_id").M.first().map(lambda m: m if m > 0 else 0).rename("M").to_frame()
    order["forms"] = forms.run_id.value_counts().reindex(order.index).fillna(0)
    return order.sort_values(["forms", "M"]).index[-1]


def _form_legend() -> list:
    """The legend of figure 5's planes."""
    return [plt.Line2D([], [], color="0.6", label="trajectory (smoothed)"),
            plt.Line2D([], [], marker=".", ls="", color="black", label="checkpoints (raw)"),
            plt.Line2D([], [], color="C1", label="evolute"),
            plt.Line2D([], [], marker="o", ls="", color="C2", label="vertex (osculating circle)"),
            plt.Line2D([], [], marker="^", ls="", color="C3", label="cusp"),
            plt.Line2D([], [], marker="X", ls="", color="black", label="form")]


def _form_plane(ax: plt.Axes, i: int, j: int, grid: np.ndarray, sm: np.ndarray, d1: np.ndarray, d2: np.ndarray,
                c: np.ndarray, inner: np.ndarray, ev_run: pd.DataFrame, f_tau: np.ndarray):
    """The (PC i, PC j) plane: the smoothed curve (colour = log-step inside the margins), the raw checkpoints `c`,
    the evolute, an osculating circle at each kept vertex, cusps, and the forms at `f_tau`. Returns the colour
    scatter (for the colour bar)."""
    at = lambda t: int(np.abs(grid - t).argmin())  # noqa: E731
    g = curvature(sm[:, i], sm[:, j], d1[:, i], d1[:, j], d2[:, i], d2[:, j])   # as detect_events
    ax.plot(sm[:, i], sm[:, j], color="0.75", lw=1, zorder=1)
    sc = ax.scatter(sm[inner, i], sm[inner, j], c=grid[inner], cmap="viridis", s=4, zorder=2)
    ax.scatter(c[:, i], c[:, j], s=8, color="black", marker=".", zorder=2, label="checkpoints")
    lim = np.array([ax.get_xlim(), ax.get_ylim()])
    ok = inner & np.isfinite(g["ex"]) & np.isfinite(g["ey"])
    ax.plot(np.where(ok, g["ex"], np.nan), np.where(ok, g["ey"], np.nan), color="C1", lw=0.8, alpha=0.7)
    for _, e in ev_run[(ev_run.pc_i == i + 1) & (ev_run.pc_j == j + 1)].iterrows():
        k = at(e.log_step)
        if e.kind == "vertex" and np.isfinite(g["ex"][k]):
            ax.add_patch(plt.Circle((g["ex"][k], g["ey"][k]), 1 / abs(g["kappa"][k]), fill=False, color="grey",
                                    lw=0.6, alpha=0.7))
        ax.scatter(sm[k, i], sm[k, j], marker="^" if e.kind == "cusp" else "o", s=30,
                   color="C3" if e.kind == "cusp" else "C2", zorder=4)
    for t in f_tau:
        ax.scatter(sm[at(t), i], sm[at(t), j], marker="X", s=110, color="black", zorder=5)
    pad = 0.15 * np.ptp(lim, axis=1)
    ax.set_xlim(lim[0] + [-pad[0], pad[0]])
    ax.set_ylim(lim[1] + [-pad[1], pad[1]])
    ax.set_aspect("equal", adjustable="datalim")
    ax.set_xlabel(f"PC{i + 1}")
    ax.set_ylabel(f"PC{j + 1}")
    return sc


def ed_figures(run_dirs: list, family: str, ed: Path, figs: Path, cfg: ED) -> None:
    """Figures 2 and 5 of `family` into `figs` from the tables `iclnoise ed` wrote to `ed` (and the runs'
    metrics.parquet: t_crit)."""
    pcs, var = read_parquet(ed / "pcs.parquet"), read_parquet(ed / "variance.parquet")
    metrics = pd.concat([read_parquet(Path(d) / "metrics.parquet") for d in run_dirs])
    fig_essential_subspace(pcs, var, metrics, figs / f"fig02_essential_subspace_{family}")
    sampling = read_parquet(ed / "sampling.parquet") if (ed / "sampling.parquet").exists() else None
    fig_forms(pcs, read_parquet(ed / "forms.parquet"), read_parquet(ed / "events.parquet"), cfg,
              figs / f"fig05_ed_forms_{family}", sampling=sampling)
