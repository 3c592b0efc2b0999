"""Per-run head figure (attention to y/x tokens and ablation effects over training) and figure 9."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import style


def fig_heads(mech: pd.DataFrame, path: str | Path) -> None:
    """Per head over training: attention mass to earlier y and x tokens (dotted: a uniform head's
    chance level), and the ablation ICL drop (base − ablated, positive = the head helps) ± 2 se."""
    style.setup()
    panels = [("attn_to_y", "attention mass to earlier y-tokens"), ("attn_to_x", "attention mass to earlier x-tokens"),
              ("ablation_icl_drop", "ICL-score drop when zero-ablated (± 2 se)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    heads = mech[mech["head"] >= 0][["layer", "head"]].drop_duplicates().sort_values(["layer", "head"])
    colours = plt.get_cmap("tab10")
    chance = mech.loc[mech.probe == "attn_to_y_chance", "value"]
    for ax, (probe, label) in zip(axes, panels):
        for i, (_, h) in enumerate(heads.iterrows()):
            d = mech[(mech.probe == probe) & (mech.layer == h.layer) & (mech["head"] == h["head"])].sort_values("step")
            ax.plot(d.step + 1, d.value, marker="o", ms=3, color=colours(i), label=f"L{h.layer}H{h['head']}")
            if probe.startswith("ablation") and d.se.notna().any():
                ax.fill_between(d.step + 1, d.value - 2 * d.se, d.value + 2 * d.se, color=colours(i), alpha=0.15, lw=0)
        if probe.startswith("attn") and len(chance):
            ax.axhline(float(chance.iloc[0]), color="black", ls=":", lw=1.2, label="chance (uniform head)")
        if probe.startswith("ablation"):
            ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training step + 1")
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=7, loc="best")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Attention heads of {mech.run_id.iloc[0]}", y=1.03)
    fig.tight_layout()
    style.save_figure(fig, path, mech[(mech["head"] >= 0) | (mech.probe == "attn_to_y_chance")])


def fig_geometry(out: pd.DataFrame, path: str | Path) -> None:
    """Figure 9: end-of-training geometry (Hessian trace, top eigenvalue, SAM) against exposure and r."""
    cols = [c for c in ("hessian_trace", "top_eigenvalue", "min_eigenvalue", "sam_sharpness")
            if c in out and out[c].notna().any()]
    style.setup()
    if not cols:  # the figure is a declared output: it says why it is empty
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.text(0.5, 0.5, "no geometry probes (geometry.enabled: false)", ha="center", va="center", color="grey")
        ax.set_axis_off()
        style.save_figure(fig, path, out.iloc[:0])
        return
    xcol = "integrated_pne" if "integrated_pne" in out and out.integrated_pne.notna().any() else "integrated_lr_over_b"
    pal = style.m_palette(out.M)
    marks = style.arm_markers(out)
    fig, axes = plt.subplots(2, len(cols), figsize=(4.2 * len(cols), 7), squeeze=False)
    for j, c in enumerate(cols):
        for (M, b, n, o), g in out.groupby(["M", "batch", "noise", "optimizer"]):
            kw = dict(color=pal[M], marker=marks[(int(b), str(n), str(o))], s=30, edgecolor="white", lw=0.5)
            axes[0, j].scatter(g[xcol], g[c], **kw)
            if M != -1:
                axes[1, j].scatter(g.r, g[c], **kw)
        axes[0, j].set_xscale("log")
        axes[0, j].set_xlabel(style.axis_label(xcol))
        axes[1, j].set_xlabel("ridge-likeness r")
        for i in range(2):
            axes[i, j].set_ylabel(style.axis_label(c))
            if np.nanmin(out[c]) > 0:
                axes[i, j].set_yscale("log")
    axes[0, -1].legend(handles=style.m_arm_legend(out.M, pal, marks), loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("Loss-landscape geometry at the end of training (H4; held-out batches)", y=1.01)
    fig.tight_layout()
    style.save_figure(fig, path, out)
