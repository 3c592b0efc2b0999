"""CNR's ground truth by common random numbers, with an estimator's predictions beside it (method §13, issue 67)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import style

CRN_PANELS = ("r", "ood_loss", "ood_delta_ridge", "id_loss")


def fig_crn(effects: pd.DataFrame, path: str | Path) -> list[Path]:
    """CNR's ground truth (method §13, "CNR by common random numbers"): one panel per metric (CRN_PANELS present),
    one row per counterfactual, ΔE f against the run's own noise with its 95 % t-interval over the realisations,
    one point per seed (offset); an estimator's prediction, where `effects` has `predicted` (and predicted_lo,
    predicted_hi), as a hollow circle beside it, and its linear-in-k form `predicted_linear` (crn_check.py) where
    present, as a hollow square. `effects`: columns counterfactual, seed, metric, n_realisations,
    crn_mean, crn_se."""
    from scipy import stats as sps

    style.setup()
    metrics = [m for m in CRN_PANELS if m in set(effects.metric)]
    cfs = list(effects[effects.metric == metrics[0]].groupby("counterfactual").crn_mean.mean().sort_values().index)
    seeds = sorted(effects.seed.unique())
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.4 * len(metrics), 0.45 * len(cfs) + 1.6), squeeze=False,
                             sharey=True)
    for ax, metric in zip(axes[0], metrics):
        d = effects[effects.metric == metric]
        for k, seed in enumerate(seeds):
            g = d[d.seed == seed].set_index("counterfactual").reindex(cfs)
            y = np.arange(len(cfs)) + (k - (len(seeds) - 1) / 2) * 0.18
            half = sps.t.ppf(0.975, (g.n_realisations - 1).clip(lower=1)) * g.crn_se
            ax.errorbar(g.crn_mean, y, xerr=half, fmt="o", ms=3.5, lw=0.8, capsize=2, color=f"C{k}",
                        label=f"seed {seed}")
            for col, dy, mark in (("predicted", 0.07, "o"), ("predicted_linear", -0.07, "s")):
                if col in g:
                    err = np.vstack([g[col] - g[f"{col}_lo"], g[f"{col}_hi"] - g[col]]).clip(min=0)
                    ax.errorbar(g[col], y + dy, xerr=err, fmt=mark, mfc="none", ms=3.5, lw=0.6, color=f"C{k}")
        ax.axvline(0, color="grey", lw=0.6)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))   # small effects' long tick labels otherwise collide
        ax.set_xlabel(f"ΔE {metric} (CRN, 95 % CI)")
        ax.set_yticks(np.arange(len(cfs)), cfs)
    axes[0, 0].legend(fontsize=6, loc="best")
    fig.suptitle("counterfactual noise against the run's own: retrained with common random numbers (filled)"
                 + ("; an estimator's prediction (hollow)" if "predicted" in effects else "")
                 + (": ḡ ln k (circle), ḡ (k − 1) (square)" if "predicted_linear" in effects else ""), fontsize=10)
    fig.tight_layout()
    return style.save_figure(fig, path, effects)
