# Two entry points for a fresh machine: `make run` (embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup run test test-slurm bench figures clean-results

setup: $(VENV)/.installed

# torch is installed first and pinned: the CPU build of 2.13.0 (an unpinned torch pulls CUDA).
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[pipeline,dev]"
	touch $@

run: setup
	snakemake --cores $(CORES)
	@echo "Done. Figures: results/figures/  Summary: results/summary.md  Report: results/report.md"

test: setup
	pytest -q -p no:cacheprovider

# The tiny DAG through `snakemake --profile slurm-cpu` on a real single-node SLURM cluster started on this
# machine (needs root: apt-get installs slurm-wlm and munge if missing); the cluster is stopped at the end.
test-slurm: setup
	scripts/test-slurm.sh

bench: setup
	$(BIN)/python bench/bench_train.py
	$(BIN)/python bench/bench_llc.py
	$(BIN)/python bench/bench_noise.py

# Rerun only aggregation, figures and the report from existing per-run artifacts.
figures: setup
	snakemake --cores $(CORES) --forcerun training_figures llc_figures aggregate report
