"""CNR's predicted change of a run's final metrics against the change retraining realised (method §13, issue 46)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import style

PANELS = ("ood_loss", "r")


def fig_cnr(table: pd.DataFrame, path: str | Path) -> list[Path]:
    """One panel per metric (PANELS present in `table`): realised change (retrained − run) against CNR's predicted
    change, one point per (counterfactual, seed), CNR's 95 % interval as a horizontal bar; the diagonal is a perfect
    prediction. `table` has columns metric, counterfactual, delta, lo_delta, hi_delta, realised."""
    style.setup()
    metrics = [m for m in PANELS if m in set(table.metric)]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4.6 * max(len(metrics), 1), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        d = table[table.metric == metric]
        cfs = sorted(d.counterfactual.unique())
        colours = plt.cm.tab10(np.linspace(0, 1, max(len(cfs), 1)))
        for c, colour in zip(cfs, colours):
            g = d[d.counterfactual == c]
            ax.errorbar(g.delta, g.realised, xerr=[g.delta - g.lo_delta, g.hi_delta - g.delta], fmt="o", ms=4,
                        color=colour, lw=0.8, capsize=2, label=c)
        vals = np.concatenate([d.delta.to_numpy(), d.realised.to_numpy()])
        vals = vals[np.isfinite(vals)]
        if len(vals):
            lo, hi = vals.min(), vals.max()
            ax.plot([lo, hi], [lo, hi], color="grey", ls="--", lw=1)
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.set_xlabel(f"predicted change of {metric} (CNR)")
        ax.set_ylabel(f"realised change of {metric} (retrained)")
        ax.legend(fontsize=6)
    return style.save_figure(fig, path, table)
