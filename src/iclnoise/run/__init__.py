"""The run level: training ensembles of runs (train, ensemble, evaluate), run directories (runs), the per-run probe
drivers (probing), and counterfactual noise: by common random numbers (crn) and by the first-order pathwise estimator
(pathwise, through AdamW's linearised step: linearised)."""
