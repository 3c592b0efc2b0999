#!/usr/bin/env bash
# Issue 41's whole GPU measurement in one call (under 8 minutes on an H100), from the repository root:
#   1. the stacked step's CUDA check: tests/test_engine.py's sync-debug test (it runs only where CUDA is);
#   2. bench/bench_device.py --science: the science model's step at 18, 72, 288 runs, GPU then CPU, into
#      $OUT/device.csv (copy it to reference/measurements/device.csv, naming the device in the README beside the figures);
#   3. configs/science.yaml's 54 runs trained on the GPU for at most $SCIENCE_S seconds, into $OUT/device_science.csv
#      (measured where a group finished, else projected from the pace of its last stretch).
# Each phase has its own time limit, so a slow phase leaves the others their time; the log is $OUT/device_engine.log.
#   scripts/device/device_engine.sh           the measurement (needs CUDA)
#   scripts/device/device_engine.sh --quick   the same phases at a tiny size on the CPU (is the script sound: seconds)
# Set ICLNOISE_COMMIT to the commit measured when the copy has no .git.
set -uo pipefail
OUT=${OUT:-reference/measurements}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PY=${PYTHON:-python3}
log="$OUT/device_engine.log"
if [ "${1:-}" = "--quick" ]; then
    tests=(-k "draw_is_every") bench=(--devices cpu --runs 2 4 --batches 16 --steps 4 --workers 2)
    SCIENCE_S=${SCIENCE_S:-5} FIRST=5 limits=(120 300 300)
else
    tests=(-k "cuda or draw_is_every") bench=(--devices cuda cpu --steps 300 --workers 15)
    SCIENCE_S=${SCIENCE_S:-75} FIRST=200 limits=(90 300 $((SCIENCE_S + 25)))
fi
{
    date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
    echo "== 1. tests/test_engine.py"
    timeout "${limits[0]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_engine.py "${tests[@]}"
    echo "== 2. bench_device.py --science (exit $?)"
    timeout "${limits[1]}" "$PY" bench/bench_device.py --science "${bench[@]}" --csv "$OUT/device.csv"
    echo "== 3. configs/science.yaml trained for at most ${SCIENCE_S} s (exit $?)"
    dev=$([ "${1:-}" = "--quick" ] && echo cpu || echo cuda)
    timeout "${limits[2]}" "$PY" bench/bench_device.py --science --train-only --devices "$dev" \
        --science-train "$SCIENCE_S" --first-stop "$FIRST" --science-csv "$OUT/device_science.csv"
    echo "== done (exit $?)"; date -u
} 2>&1 | tee "$log"
