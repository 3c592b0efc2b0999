"""H1–H5 on each optimizer's runs apart, with one Holm family over all of them (method §11)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...core.probe_sections import Stats
from ...core.sections import OPTIMIZERS
from ...core.tasks import M_INF
from .gates import GATES, convergence, gate_convergence, gate_equal_data, gate_seeds
from .h1 import h1_batch_pairs, h1_exposure, h1_noise_beyond_eta_b
from .h1_batch import h1_batch_axis
from .h1_dose import h1_dose
from .h2 import h2_early_late
from .h3 import h3_rows
from .h4 import h4_rows
from .h5 import h5_alignment
from .rows import _verdicts


def hypothesis_tests(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame | None = None) -> pd.DataFrame:
    """H1–H5 on each optimizer's runs apart (grid.optimizer, method §13: runs under another optimizer are another
    arm, so no test pools them; rows carry their optimizer), with one Holm family over all of them."""
    conv = convergence(out, GATES["convergence_tol"]) if conv is None else conv
    groups = list(out.groupby("optimizer")) or [(OPTIMIZERS[0], out)]
    return _verdicts([{**r, "optimizer": opt} for opt, o in groups for r in _tests(o, cfg, conv)], cfg.alpha)


def _tests(out: pd.DataFrame, cfg: Stats, conv: pd.DataFrame) -> list[dict]:
    """The rows of H1–H5 on `out`, runs of one optimizer, before Holm (_verdicts)."""
    alpha = cfg.alpha
    gates = GATES
    every = out[(out.M != M_INF) & ~out.diverged].copy()
    every["log2M"] = np.log2(every.M)
    # H1, H2 and H4 compare runs at the sequence budget; an arm that trains another batch's steps
    # (steps_as_batch) sees more sequences and enters H3 only
    fin = every[every.steps_as_batch.fillna(0) == 0].copy()

    def common(runs, strata=None):
        return (gate_convergence(runs, conv) + gate_seeds(runs, gates["min_seeds"])
                + gate_equal_data(runs, gates["data_tol"], strata))

    exposure = "integrated_pne" if fin.integrated_pne.notna().all() and len(fin) else "integrated_lr_over_b"
    fin["log_exposure"] = np.log(fin[exposure])
    rows = h1_exposure(fin[fin.noise_source == "batch"], exposure, alpha, common)
    rows += h1_batch_pairs(fin, alpha, common)
    rows.append(h1_noise_beyond_eta_b(fin, common))
    rows += h2_early_late(fin, alpha, gates, common)
    rows += h3_rows(every, fin, cfg, conv)
    rows += h1_dose(out, cfg)   # nothing without a dose series in the grid
    rows += h1_batch_axis(every, alpha, common)   # nothing without ≥ 3 batch sizes in an arm
    rows += h5_alignment(fin, cfg, common)   # nothing without an aligned (nap) condition in the grid
    rows += h4_rows(fin, exposure, alpha, gates, common)
    return rows
