"""Figure 6 by noise shape (H5, issue 45): r against M under aligned (nap), misaligned, isotropic, within-task and no
injected noise; H5's contrasts with their intervals; and each shape's logged alignment with the task family over
training (injection.parquet's `alignment`, thinned to the steps where it changes: `alignment_rows`)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pyarrow as pa

from ...analysis.thresholds import t_interval
from ...analysis.verdicts import ALIGNED, SHAPE_CONTROLS
from ...core.tasks import M_INF
from . import style

SHAPES = {ALIGNED: "aligned (nap)", **SHAPE_CONTROLS, "none": "no injection"}
COLOURS = dict(zip(SHAPES, ("C3", "C0", "C2", "C4", "dimgrey")))
# a reference set's runs/<id>/alignment.parquet (export.export: injection.parquet stays out of the set)
ALIGNMENT_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("step", pa.int64()), pa.field("alignment", pa.float64())])


def has_aligned(out: pd.DataFrame) -> bool:
    """The outcomes hold an aligned condition (H5's treatment), so the figure is drawn."""
    return bool((out.noise_shape == ALIGNED).any())


def alignment_rows(injection: pd.DataFrame) -> pd.DataFrame:
    """(run_id, step, alignment) at each step where a run's logged alignment changes (a NAP refresh), from
    injection.parquet rows (one per injecting step: alignment is constant between refreshes); none for shapes
    without one (NaN)."""
    d = injection.loc[injection.alignment.notna(), ["run_id", "step", "alignment"]].sort_values(["run_id", "step"])
    new = d.alignment.ne(d.groupby("run_id").alignment.shift())
    return d[new].reset_index(drop=True)


def fig_noise_shape(out: pd.DataFrame, tests: pd.DataFrame, alignment: pd.DataFrame, path: str | Path) -> None:
    """Three panels for the aligned condition's batch (outcomes `out`, tests.parquet `tests`, `alignment_rows` of the
    shaped runs): (a) r against M per shape, mean over seeds with 95 % t-intervals (finite M); (b) H5's by-seed
    contrasts, aligned − each control in r with their intervals (filled: in the Holm family and significant after
    Holm; hollow otherwise; a gated row is labelled inconclusive); (c) alignment cos_F(R', Σ̂_b) over training per
    shape, median over runs with the inter-quartile band."""
    style.setup()
    batch = int(out[out.noise_shape == ALIGNED].batch.iloc[0])
    d = out[(out.batch == batch) & out.noise_shape.isin(SHAPES) & (out.M != M_INF) & out.r.notna()]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _r_by_shape(axes[0], d)
    _contrasts(axes[1], tests[(tests.hypothesis == "H5") & tests.test.str.startswith("paired t by seed")])
    _alignment(axes[2], alignment.merge(d[["run_id", "noise_shape"]].drop_duplicates(), on="run_id"))
    dose = d[d.noise_shape == ALIGNED].integrated_pne_injected.mean()
    fig.suptitle(f"Does noise aligned with the task family raise ICL? (H5; batch {batch}, realised injected "
                 f"P-NE* {dose:.3g} in every injected arm)", y=1.02)
    fig.tight_layout()
    style.save_figure(fig, path, d)


def _r_by_shape(ax: plt.Axes, d: pd.DataFrame) -> None:
    ms = sorted(d.M.unique())
    for k, (shape, label) in enumerate(SHAPES.items()):
        g = d[d.noise_shape == shape]
        if not len(g):
            continue
        cells = [t_interval(g[g.M == m].groupby("seed").r.mean().to_numpy(), 0.95) for m in ms]
        mean = np.array([c[0] for c in cells])
        half = np.array([c[1] * c[2] if np.isfinite(c[1]) else 0.0 for c in cells])
        x = np.log2(ms) + 0.04 * (k - 2)
        ax.errorbar(x, mean, yerr=half, marker="o", capsize=3, color=COLOURS[shape], label=label)
    ax.set_xticks(np.log2(ms), [str(int(m)) for m in ms])
    ax.set_xlabel("task diversity M")
    ax.set_ylabel("ridge-likeness r (95 % CI over seeds)")
    ax.set_title("(a) r by noise shape")
    ax.legend(fontsize=8)


def _contrasts(ax: plt.Axes, t: pd.DataFrame) -> None:
    ax.axvline(0, color="grey", lw=1)
    for i, r in enumerate(t.itertuples()):
        label = r.term.removeprefix("aligned − ")
        filled = bool(r.in_family and r.p_holm < 0.05)
        ax.errorbar([r.estimate], [i], xerr=[[r.estimate - r.ci_lo], [r.ci_hi - r.estimate]], fmt="o", capsize=3,
                    color="C3", mfc="C3" if filled else "white")
        note = "inconclusive" if not r.gates_passed else f"Holm p {r.p_holm:.2g}" if r.in_family else ""
        ax.annotate(note, (r.ci_hi, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=7)
        ax.text(-0.02, i, label, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8)
    if not len(t):
        ax.text(0.5, 0.5, "no H5 contrast ran", transform=ax.transAxes, ha="center", color="grey")
    ax.set_yticks([])
    ax.set_ylim(-0.7, max(len(t), 1) - 0.3)
    ax.set_xlabel("Δr, aligned − control (mean over M by seed, 95 % CI)")
    ax.set_title("(b) H5: aligned − control")


def _alignment(ax: plt.Axes, a: pd.DataFrame) -> None:
    for shape, label in SHAPES.items():
        g = a[a.noise_shape == shape]
        if not len(g):
            continue
        q = g.groupby("step").alignment.quantile([0.25, 0.5, 0.75]).unstack()
        ax.plot(q.index, q[0.5], color=COLOURS[shape], label=label, drawstyle="steps-post")
        ax.fill_between(q.index, q[0.25], q[0.75], color=COLOURS[shape], alpha=0.2, lw=0, step="post")
    if not len(a):
        ax.text(0.5, 0.5, "no alignment logged (injection.parquet)", transform=ax.transAxes, ha="center",
                color="grey")
    ax.set_xlabel("training step")
    ax.set_ylabel("alignment cos_F(R', Σ̂ between-task)")
    ax.set_title("(c) injected noise's alignment with the task family")
    ax.legend(fontsize=8)
