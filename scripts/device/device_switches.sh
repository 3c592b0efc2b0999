#!/usr/bin/env bash
# Issue 41's second GPU visit (after device_engine.sh): the step with train.cuda_graphs, and with TF32 beside it, on
# the GPU rows of bench_device.py --science (18 and 288 runs), and configs/science.yaml's training with CUDA graphs,
# into $OUT/device_graphs.csv, $OUT/device_graphs_tf32.csv, $OUT/device_science_graphs.csv (log:
# $OUT/device_switches.log). Speed only: TF32's effect on the outcomes is not measured here. About 6 minutes.
#   scripts/device/device_switches.sh           on CUDA
#   scripts/device/device_switches.sh --quick   the same calls at a tiny size on the CPU (is the script sound)
set -uo pipefail
OUT=${OUT:-reference/measurements}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
if [ "${1:-}" = "--quick" ]; then
    dev=cpu rows=(--runs 2 --batches 16 --steps 4) big=(--runs 2 --batches 16 --steps 4) S=3 limits=(120 120 300)
else
    dev=cuda rows=(--runs 18 288 --steps 200) big=(--runs 288 --batches 64 --steps 200) S=75 limits=(150 60 110)
fi
bench=("$PY" bench/bench_device.py --science --devices "$dev")
{
    date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    echo "== 1. cuda_graphs rows"
    timeout "${limits[0]}" "${bench[@]}" "${rows[@]}" --engine cuda_graphs --csv "$OUT/device_graphs.csv"
    echo "== 2. cuda_graphs+tf32 rows (exit $?)"
    timeout "${limits[1]}" "${bench[@]}" "${big[@]}" --engine cuda_graphs+tf32 --csv "$OUT/device_graphs_tf32.csv"
    echo "== 3. configs/science.yaml trained with cuda_graphs for at most $S s (exit $?)"
    timeout "${limits[2]}" "${bench[@]}" --train-only --engine cuda_graphs --science-train "$S" --first-stop 200 \
        --science-csv "$OUT/device_science_graphs.csv"
    echo "== done (exit $?)"; date -u
} 2>&1 | tee "$OUT/device_switches.log"
