"""The run level: training ensembles of runs (train, ensemble, evaluate), run directories (runs), the per-run probe
drivers (probing) and counterfactual replay (replay)."""
