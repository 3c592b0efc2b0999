"""Noise as a controlled variable (docs/method.md §5, §6, §13), read in one direction:

  curvature   the loss curvature on held-out data that exposure divides by (Hutchinson; exact Gauss-Newton)
  exposure    noise exposure P-NE*: gradient-noise covariance, AdamW's preconditioner, the exposure columns
  covariance  the injected covariances, their shapes, PSD clipping, schedules and the controller
  nap         noise aligned with the task prior
  cnr         the first-order perturbation of a run's dynamics (CNR's pathwise estimator)
  hooks       the training step's hook protocol and the exposure logger (state between steps)
  injection   the injector hook: sets its scale from this step's measurement and adds the noise
  dose_check  the injected dose recomputed by method §6's definition beside a run (a check of the books)

Each imports only those above it in this list (pyproject's noise-one-way contract).
The package's own names are covariance's.
"""
from .covariance import (
    DENSE_CLIP_MAX,
    SCHEDULES,
    SHAPES,
    CovModel,
    PIController,
    parameter_mask,
    psd_clip,
    restricted,
    shaped_covariance,
    target_at,
)

__all__ = ["DENSE_CLIP_MAX", "SCHEDULES", "SHAPES", "CovModel", "PIController", "parameter_mask", "psd_clip",
           "restricted", "shaped_covariance", "target_at"]
