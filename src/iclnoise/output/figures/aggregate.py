"""Figures 6-10 from the tables `iclnoise aggregate` wrote (`iclnoise aggregate-figures`): M* against noise,
ICL against exposure, early against late noise, geometry, and the P-NE* series of the runs' exposure logs; figure 6
against the dose (a dose series) and by noise shape (an aligned condition: H5)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...analysis.aggregate import read_outcomes
from ...core.io import read_parquet
from .align import alignment_rows, fig_noise_shape, has_aligned
from .noise import fig_exposure_series, fig_schedules
from .probes import fig_geometry
from .stats import fig_batch_axis, fig_dose, fig_icl_vs_exposure, fig_threshold_vs_noise

STEMS = ("fig06_threshold_vs_noise", "fig07_icl_vs_exposure", "fig08_early_late", "fig09_geometry",
         "fig10_exposure_series")
DOSE_STEM = "fig06_threshold_vs_noise_dose"   # the report shows it under figure 6's caption
SHAPE_STEM = "fig06_threshold_vs_noise_shape"   # likewise
BATCH_STEM = "fig06_threshold_vs_noise_batch"   # likewise


def aggregate_figures(agg: Path, exposure_files: list, figs: Path, alignment_files: list = ()) -> list[Path]:
    """Figures 6-10 into `figs` from outcomes.parquet and thresholds.parquet in `agg` and the runs'
    exposure.parquet (concatenated in the order given), figure 6 against the dose where `agg` holds
    dose_levels.parquet, on the batch axis where it holds batch_levels.parquet, and by noise shape where the
    outcomes hold an aligned condition (with tests.parquet and the shaped runs' injection.parquet or
    alignment.parquet, `alignment_files`); returns the PNGs."""
    out, th = read_outcomes(agg / "outcomes.parquet"), read_parquet(agg / "thresholds.parquet")
    fig_threshold_vs_noise(th, figs / "fig06_threshold_vs_noise")
    fig_icl_vs_exposure(out, figs / "fig07_icl_vs_exposure")
    fig_schedules(out, figs / "fig08_early_late")
    fig_geometry(out, figs / "fig09_geometry")
    fig_exposure_series(pd.concat([read_parquet(f) for f in exposure_files]) if exposure_files else pd.DataFrame(),
                        figs / "fig10_exposure_series")
    stems = list(STEMS)
    if (agg / "dose_levels.parquet").exists():   # a dose series (issue 43): figure 6 against the dose
        fig_dose(read_parquet(agg / "dose_levels.parquet"), figs / DOSE_STEM)
        stems.insert(1, DOSE_STEM)
    if (agg / "batch_levels.parquet").exists():   # an arm of ≥ 3 batch sizes (issue 70): the batch axis
        fig_batch_axis(read_parquet(agg / "batch_levels.parquet"), figs / BATCH_STEM)
        stems.insert(1, BATCH_STEM)
    if has_aligned(out):   # H5 (issue 45): figure 6 by noise shape
        rows = [alignment_rows(read_parquet(f)) for f in alignment_files]
        fig_noise_shape(out, read_parquet(agg / "tests.parquet"),
                        pd.concat(rows) if rows else pd.DataFrame(columns=["run_id", "step", "alignment"]),
                        figs / SHAPE_STEM)
        stems.insert(1, SHAPE_STEM)
    return [figs / f"{s}.png" for s in stems]
