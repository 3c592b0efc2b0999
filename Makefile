# Two entry points for a fresh machine: `make run` (embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup run test test-all test-integration test-validation test-float test-slurm bench figures paper \
	clean-results lint schema

setup: $(VENV)/.installed

# The exact environment from requirements.lock (Python 3.11, Linux x86-64; see its header). Its torch pin
# is the CPU build (torch==2.13.0+cpu), which PyPI lacks: installed first from pip's configuration (a
# local wheel folder or index), else from the PyTorch CPU index. Another Python than 3.11 gets
# pyproject's ranges instead of the lock.
TORCH_PIN := $(shell grep -m1 '^torch==' requirements.lock)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps "$(TORCH_PIN)" 2>/dev/null || \
	  $(BIN)/pip install -q --no-deps --index-url $(TORCH_INDEX) "$(TORCH_PIN)"
	if $(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
	  $(BIN)/pip install -q -r requirements.lock && $(BIN)/pip install -q --no-deps -e .; \
	else \
	  echo "Python is not 3.11: installing from pyproject's ranges, not requirements.lock"; \
	  $(BIN)/pip install -q -e ".[pipeline,dev]"; \
	fi
	touch $@

# Style (ruff: pycodestyle, pyflakes, import order) and layering (import-linter contracts in pyproject).
lint: setup
	ruff check --no-cache src tests bench experiments; status=$$?; \
	PYTHONPATH=src lint-imports --no-cache || status=1; exit $$status

# src/iclnoise/params.schema.yaml from the typed sections' key(...) declarations (docs/development.md, "Adding a
# parameter"); tests/test_schema.py fails until the committed file is the generated one.
schema: setup
	iclnoise schema

run: setup
	snakemake --cores $(CORES)
	@echo "Done. Figures: results/figures/  Summary: results/summary.md  Report: results/report.md"

# The tiers (docs/development.md, "Test tiers"): every test is unit, integration or validation; numerics marks
# those whose numbers depend on float32 reduction order. `make test` is the README's test command: lint, then the
# unit tier on every core (pytest-xdist, one torch thread per worker).
PYTEST := pytest -q -p no:cacheprovider
test: lint
	$(PYTEST) -m unit -n $(CORES)

# Snakemake, DVC, subprocesses, end-to-end training (the SLURM tests skip here: make test-slurm runs them); a
# file's tests on one worker (--dist loadfile: tests/test_pipeline.py's finished DAG is built once).
test-integration: setup
	$(PYTEST) -m integration -n $(CORES) --dist loadfile

# Monte-Carlo coverage, power and size of the estimators.
test-validation: setup
	$(PYTEST) -m validation -n $(CORES)

# The unit tier's numerics tests under other float32 reduction orders (portable kernels; AVX2), on every core: half the test
# files under each, the halves swapped with the commit's parity (FLOAT_ALL=1: every test under both).
test-float: setup
	scripts/test-float.sh

# Every tier, each timed: what CI runs (then make test-slurm).
test-all: test test-integration test-validation test-float

# The tiny DAG through `snakemake --profile slurm-cpu` on a real single-node SLURM cluster started on this
# machine (needs root: apt-get installs slurm-wlm and munge if missing); the cluster is stopped at the end.
test-slurm: setup
	scripts/test-slurm.sh

bench: setup
	$(BIN)/python bench/bench_ensemble.py
	$(BIN)/python bench/bench_step.py
	$(BIN)/python bench/bench_train.py
	$(BIN)/python bench/bench_llc.py
	$(BIN)/python bench/bench_noise.py
	test -d results/runs/M16-B64-none-s0 && $(BIN)/python bench/bench_probes.py || echo "bench_probes: needs a finished make run"

# The paper's figures and a report per committed reference set (reference/*/ with a provenance.json; reference/
# measurements and reference/reproductions hold the benchmarks' and reproductions' tables), from their tables alone:
# nothing trains; $(PAPER_OUT)/<set>/figures/*.png and $(PAPER_OUT)/<set>/report.md. Each set is first checked
# against its provenance.json. PAPER_OUT=/elsewhere: from a read-only checkout, or beside another make paper.
PAPER_OUT ?= paper
paper: setup
	iclnoise paper $(dir $(wildcard reference/*/provenance.json)) --out $(PAPER_OUT)

# Rerun only aggregation, figures and the report from existing per-run artifacts.
figures: setup
	snakemake --cores $(CORES) --forcerun training_figures llc_figures refined_figures aggregate aggregate_figures report
