"""Formulas of the problem itself: typed params sections, tasks and data streams, the dMMSE and ridge predictors,
the model, AdamW's preconditioner, schedules, the linear-attention theory, atomic file I/O (docs/method.md §2-§4)."""
