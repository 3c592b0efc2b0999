"""Figure 11 (refined LLC of every attention head over training, one panel per M and arm: Wang et al.'s view) and
figure 12 (susceptibility χ of every component to each data perturbation, a heatmap per M and arm), from the probed
runs' rllc.parquet and susceptibility.parquet (iclnoise.probes.refined)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ...core.io import read_parquet
from . import style
from .llc import flagged


def _arms(df: pd.DataFrame) -> list[tuple[int, str]]:
    return sorted({(int(b), str(n)) for b, n in zip(df.batch, df.noise)})


def head_palette(heads: pd.DataFrame) -> dict[str, tuple]:
    """A colour per head "l{i}h{h}": one hue family per layer (blues, oranges, greens, ...), lighter by head."""
    out = {}
    families = ["Blues", "Oranges", "Greens", "Purples", "Reds", "Greys"]
    n_heads = int(heads["head"].max()) + 1
    for layer in sorted(heads.layer.unique()):
        shades = sns.color_palette(families[int(layer) % len(families)], n_heads + 2)[2:][::-1]
        for h in range(n_heads):
            out[f"l{layer}h{h}"] = shades[h]
    return out


def fig_rllc_over_training(rllc: pd.DataFrame, path: str | Path) -> None:
    """Figure 11: refined λ̂ of each attention head against training step, one line per head (the first probed
    seed; ± s.e. band over chains), a panel per M (columns) and per arm, batch size and noise (rows). Flagged
    estimates (diverged, negative, not levelled) are hollow markers, not joined."""
    style.setup()
    heads = rllc[rllc["head"] >= 0]
    seed0 = heads[heads.seed == heads.seed.min()]
    ms, arms = style.m_order(heads.M), _arms(heads)
    pal = head_palette(heads)
    fig, axes = plt.subplots(len(arms), len(ms), figsize=(2.9 * len(ms) + 1.5, 2.6 * len(arms)), squeeze=False,
                             sharex=True, sharey="row")
    any_flagged = False
    for i, (B, noise) in enumerate(arms):
        for j, M in enumerate(ms):
            ax = axes[i, j]
            sub = seed0[(seed0.batch == B) & (seed0.noise == noise) & (seed0.M == M)]
            for comp, r in sub.groupby("component", sort=True):
                r = r.sort_values("step")
                bad = flagged(r)
                ok = r[~bad]
                ax.plot(ok.step + 1, ok.llc_mean, color=pal[comp], marker="o", ms=3, lw=1.4, label=comp)
                ax.fill_between(ok.step + 1, ok.llc_mean - ok.llc_se, ok.llc_mean + ok.llc_se, color=pal[comp],
                                alpha=0.15, lw=0)
                if bad.any():
                    any_flagged = True
                    ax.scatter(r.step[bad] + 1, r.llc_mean[bad], s=20, facecolors="none", edgecolors=pal[comp],
                               linewidths=0.9, zorder=3)
            ax.set_xscale("log")
            ax.set_title(f"{style.m_legend_label(M)}, {style.arm_label(B, noise)}", fontsize=9)
            if i == len(arms) - 1:
                ax.set_xlabel("training step + 1")
        axes[i, 0].set_ylabel("refined LLC λ̂ (head)")
    handles = [plt.Line2D([], [], color=c, marker="o", ms=3, label=k) for k, c in pal.items()]
    if any_flagged:
        handles.append(plt.Line2D([], [], ls="", marker="o", mfc="none", mec="grey", label="flagged (not joined)"))
    axes[0, -1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="head")
    fig.suptitle(f"Refined LLC per attention head over training (seed {int(heads.seed.min())}; band ± s.e.)",
                 y=1.01)
    fig.tight_layout()
    style.save_figure(fig, path, rllc)


def fig_susceptibility(sus: pd.DataFrame, path: str | Path) -> None:
    """Figure 12: χ of each component (rows) to each perturbation at each refined checkpoint (columns), a heatmap
    per M (columns of panels) and arm (rows of panels), the first probed seed; one diverging colour scale centred
    on 0 for the whole figure (its limit: the 98th percentile of |χ|), cells annotated where few."""
    style.setup()
    s = sus[sus.seed == sus.seed.min()].copy()
    ms, arms = style.m_order(s.M), _arms(s)
    comps = list(dict.fromkeys(s.component))          # the tables' order: heads, MLPs by layer, embed, unembed, all
    vals = np.abs(s.chi.to_numpy())
    vals = vals[np.isfinite(vals)]
    vmax = float(np.quantile(vals, 0.98)) if len(vals) and np.quantile(vals, 0.98) > 0 else 1.0
    s["column"] = s.perturbation + " @ " + s.step.astype(str)
    fig, axes = plt.subplots(len(arms), len(ms), figsize=(1.0 + 1.9 * len(ms), 0.9 + 0.28 * len(comps) * len(arms)),
                             squeeze=False, sharey=True)
    for i, (B, noise) in enumerate(arms):
        for j, M in enumerate(ms):
            ax = axes[i, j]
            sub = s[(s.batch == B) & (s.noise == noise) & (s.M == M)]
            if not len(sub):
                ax.set_axis_off()
                continue
            cols = list(dict.fromkeys(sub.sort_values(["perturbation", "step"]).column))
            grid = sub.pivot_table(index="component", columns="column", values="chi", aggfunc="mean",
                                   dropna=False).reindex(index=comps, columns=cols)
            sns.heatmap(grid, ax=ax, cmap="RdBu_r", center=0.0, vmin=-vmax, vmax=vmax, cbar=j == len(ms) - 1,
                        cbar_kws={"label": "χ (new tasks)"} if j == len(ms) - 1 else None,
                        annot=grid.size <= 60, fmt=".2g", annot_kws={"fontsize": 5}, linewidths=0.3)
            ax.set_title(f"{style.m_legend_label(M)}, {style.arm_label(B, noise)}", fontsize=9)
            ax.set_xlabel("perturbation @ step" if i == len(arms) - 1 else "")
            ax.set_ylabel("component" if j == 0 else "")
            ax.tick_params(axis="x", labelrotation=60, labelsize=7)
            ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"Susceptibility χ per component to new tasks (q_M → q_∞), seed {int(s.seed.min())}\n"
                 "χ = −n Cov(φ, Δℓ): red χ > 0, blue χ < 0; χ = 0 at M = ∞", y=1.02, fontsize=10)
    fig.tight_layout()
    style.save_figure(fig, path, sus)


def refined_figures(rllc_files: list, sus_files: list, out: Path) -> list[Path]:
    """Figures 11 and 12 into `out` from the runs' rllc.parquet and susceptibility.parquet."""
    rllc = pd.concat([read_parquet(p) for p in rllc_files], ignore_index=True)
    sus = pd.concat([read_parquet(p) for p in sus_files], ignore_index=True)
    fig_rllc_over_training(rllc, out / "fig11_rllc_over_training")
    fig_susceptibility(sus, out / "fig12_susceptibility")
    return [out / "fig11_rllc_over_training.png", out / "fig12_susceptibility.png"]
