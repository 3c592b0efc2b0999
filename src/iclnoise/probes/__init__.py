"""Formulas of the per-checkpoint probes: LLC and its SGLD sampler (refined per-component LLC included), stages,
essential dynamics, loss geometry and mechanistic probes (docs/method.md §7-§10). The drivers that run them on a
run's checkpoints are iclnoise.run.probing."""
