#!/usr/bin/env bash
# `make test-slurm`: start the single-node SLURM cluster, run tests/test_slurm.py against it (its two cluster tests
# beside each other, each reading only the jobs its own Snakemake run submitted), and stop the cluster whatever
# happens (trap). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'scripts/slurm-cluster.sh stop' EXIT
trap 'exit 130' INT TERM
scripts/slurm-cluster.sh start
eval "$(scripts/slurm-cluster.sh env)"
ICLNOISE_SLURM=1 python -m pytest -q -p no:cacheprovider -m slow -n "${CORES:-2}" tests/test_slurm.py "$@"
