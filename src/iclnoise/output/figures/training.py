"""Figure 1 (OOD loss over training per M, t_crit marked, predictor levels) and the run summary."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pyarrow as pa

from ...analysis.verdicts import optimizer_note
from ...core.io import read_parquet, write_parquet, write_text
from ...core.runspec import KEY_FIELDS
from ...core.tasks import m_label
from . import style

SUMMARY_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("steps", pa.int64()), pa.field("ood_loss", pa.float64()), pa.field("id_loss", pa.float64()),
    pa.field("ood_loss_dmmse", pa.float64()), pa.field("ood_loss_ridge", pa.float64()),
    pa.field("id_loss_dmmse", pa.float64()), pa.field("id_loss_ridge", pa.float64()),
    pa.field("delta_dmmse", pa.float64()), pa.field("delta_ridge", pa.float64()), pa.field("r", pa.float64()),
    pa.field("icl_score", pa.float64()), pa.field("t_crit", pa.int64()), pa.field("ood_loss_at_t_crit", pa.float64()),
    pa.field("diverged", pa.bool_()),
])


def load_metrics(paths: list[str | Path]) -> pd.DataFrame:
    return pd.concat([read_parquet(p) for p in paths], ignore_index=True)


def t_crit(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per run: the checkpoint with minimal OOD loss (the transient-ridge dip), excluding step 0."""
    m = metrics[metrics.step > 0]
    idx = m.groupby("run_id").ood_loss.idxmin()
    return m.loc[idx, ["run_id", "step", "ood_loss"]].rename(columns={"step": "t_crit",
                                                                      "ood_loss": "ood_loss_at_t_crit"})


def summary(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run at the end of training, with t_crit."""
    last = metrics.sort_values("step").groupby("run_id").tail(1).rename(columns={"step": "steps"})
    last = last.merge(t_crit(metrics), on="run_id", how="left")
    last["diverged"] = metrics.groupby("run_id").diverged.any().reindex(last.run_id).to_numpy()
    return last[SUMMARY_SCHEMA.names].sort_values(["noise", "batch", "M", "seed", "run_id"],   # run_id: optimizers
                                                  key=lambda s: s.where(s != -1, 1 << 40) if s.name == "M" else s)


def panel_grid(n: int) -> tuple[int, int]:
    """(rows, columns) for n panels: one row up to 4; else the column count in 4, 3, 5 that fills every row, else
    ⌈√n⌉ columns (the unused slots at the end are removed)."""
    if n <= 4:
        return 1, max(n, 1)
    ncols = next((c for c in (4, 3, 5) if n % c == 0), math.ceil(math.sqrt(n)))
    return math.ceil(n / ncols), ncols


def fig_ood_loss(metrics: pd.DataFrame, path: str | Path) -> None:
    """Figure 1: OOD loss/D over training per M; one panel per (noise condition, batch size, optimizer) that was
    trained, so a condition run at only some batch sizes leaves no empty slot."""
    style.setup()
    metrics = style.with_optimizer(metrics)
    pairs = sorted({(int(b), n, o) for b, n, o in zip(metrics.batch, metrics.noise, metrics.optimizer)},
                   key=lambda p: (p[1] != "none", p[1], p[0], p[2]))   # batch noise first, then condition, batch
    nrows, ncols = panel_grid(len(pairs))
    pal = style.m_palette(metrics.M)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False, sharex=True, sharey=True)
    for ax in axes.flat[len(pairs):]:
        fig.delaxes(ax)
    tc = t_crit(metrics).set_index("run_id")
    for k, (B, noise, opt) in enumerate(pairs):
        ax = axes.flat[k]
        sub = metrics[(metrics.batch == B) & (metrics.noise == noise) & (metrics.optimizer == opt)]
        for M in style.m_order(sub.M):
            runs = sub[sub.M == M]
            mean = runs.groupby("step").ood_loss.mean()
            ax.plot(mean.index + 1, mean.values, color=pal[M], lw=2, label=style.m_legend_label(M))
            for rid, r in runs.groupby("run_id"):
                ax.plot(r.step + 1, r.ood_loss, color=pal[M], lw=0.6, alpha=0.35)
                if rid in tc.index:  # not for a run that diverged at its first update
                    ax.scatter(tc.loc[rid, "t_crit"] + 1, tc.loc[rid, "ood_loss_at_t_crit"], s=22,
                               facecolor="white", edgecolor=pal[M], zorder=3, lw=1.2)
            dm = runs.ood_loss_dmmse.iloc[0]
            if np.isfinite(dm):
                ax.axhline(dm, color=pal[M], ls=":", lw=1, alpha=0.8)
        ax.axhline(sub.ood_loss_ridge.iloc[0], color="black", ls="--", lw=1.2, label="ridge (Bayes for q∞)")
        ax.set_xscale("log")
        ax.set_title(f"noise: {noise}, batch {B}{optimizer_note(opt)}")
        if k + ncols >= len(pairs):      # lowest panel of its column
            ax.set_xlabel("training step + 1")
            ax.xaxis.set_tick_params(labelbottom=True)
        if k % ncols == 0:
            ax.set_ylabel("OOD loss / D")
    seen: dict[str, object] = {}
    for ax in axes.flat[:len(pairs)]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = [style.m_legend_label(M) for M in style.m_order(metrics.M)]
    labels = [lab for lab in order if lab in seen] + [lab for lab in seen if lab not in order]
    handles = [seen[lab] for lab in labels]
    handles.append(plt.Line2D([], [], color="grey", ls=":", lw=1))
    labels.append("dMMSE_M (same colour)")
    handles.append(plt.Line2D([], [], marker="o", ls="", mfc="white", mec="grey"))
    labels.append("t_crit (min OOD loss)")
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("Out-of-distribution loss over training (thin: seeds, thick: mean)", y=1.01)
    fig.tight_layout()
    style.save_figure(fig, path, metrics[["run_id", "M", "seed", "batch", "noise", "step", "ood_loss",
                                          "ood_loss_dmmse", "ood_loss_ridge"]])


def _markdown(df: pd.DataFrame) -> str:
    show = df.assign(M=df.M.map(m_label))
    return show.to_markdown(index=False, floatfmt=".4g") + "\n"


def training_figures(metric_files: list, out: Path) -> pd.DataFrame:
    """Figure 1 into <out>/figures and the end-of-training summary (<out>/summary.parquet and .md) from the
    runs' metrics.parquet; returns the summary."""
    metrics = load_metrics(metric_files)
    fig_ood_loss(metrics, out / "figures" / "fig01_ood_loss")
    s = summary(metrics)
    write_parquet(s, out / "summary.parquet", SUMMARY_SCHEMA)
    write_text("# End-of-training summary (losses are MSE / D)\n\n" + _markdown(s), out / "summary.md")
    return s
