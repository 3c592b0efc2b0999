"""From per-run tables to answers: the aggregate tables, thresholds, the dose-response fits, statistics and the
verdicts on the hypotheses (docs/method.md §11)."""
