"""Validity gates and verdicts of the hypothesis tests H1–H5 (method §11, §13; issues 13, 42 and 45).

Every verdict carries validity gates (GATES): convergence of the M = ∞ runs to ridge, enough seeds, equal
data (H3 at matched steps: equal steps) and equal realised exposure between compared arms, LLC diagnostics, and
for H3 a noise manipulation with a measurable effect. A failed gate is a record (code, detail) in the table's
`gate_records` (and `gate_failures` reads them as 'code (detail); ...'); a verdict that fails a gate reads
'inconclusive: <gates>'. The Holm family is the tests that ran and passed their gates (`in_family`; sensitivity
rows stay out); each verdict follows its Holm-adjusted decision, with direction words only for significant
effects, and a null states the minimum detectable effect at 80 % power of its design (`mde`).

The modules: gates, rows (the tests table and Holm), h1, h1_dose, h2, h3, h4, h5, family (all of them).
"""
from ..convergence import converged_runs, ood_loss_fall
from .family import hypothesis_tests
from .gates import (
    CONDITION,
    CONVERGENCE_SCHEMA,
    GATE_FIELDS,
    GATE_RECORD,
    GATES,
    NO_MANIPULATION,
    condition_name,
    convergence,
    gate_columns,
    gate_convergence,
    gate_equal_data,
    gate_seeds,
    gate_text,
    optimizer_note,
    over_ridge,
)
from .h1 import h1_noise_beyond_eta_b
from .h3 import h3_rows
from .h5 import ALIGNED, SHAPE_CONTROLS, h5_alignment
from .rows import TESTS_SCHEMA

__all__ = [
    "ALIGNED",
    "CONDITION",
    "CONVERGENCE_SCHEMA",
    "GATES",
    "GATE_FIELDS",
    "GATE_RECORD",
    "NO_MANIPULATION",
    "SHAPE_CONTROLS",
    "TESTS_SCHEMA",
    "condition_name",
    "converged_runs",
    "convergence",
    "gate_columns",
    "gate_convergence",
    "gate_equal_data",
    "gate_seeds",
    "gate_text",
    "h1_noise_beyond_eta_b",
    "h3_rows",
    "h5_alignment",
    "hypothesis_tests",
    "ood_loss_fall",
    "optimizer_note",
    "over_ridge",
]
