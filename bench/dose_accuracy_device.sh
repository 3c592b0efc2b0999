#!/usr/bin/env bash
# Issue 43 item 0 on a lent GPU, in one call: the closed loop's books against SPEC §6's exact recomputation
# (bench/bench_dose_accuracy.py) at configs/dose.yaml's curvature setting (16 probes every 10 steps) and at every dose
# level of both sources, one process per (source, dose), all at once, each stopped after DEADLINE seconds with the
# steps it reached. Rows into $OUT/dose_accuracy_device.csv, the log into $OUT/dose_accuracy_device.log.
#   bench/dose_accuracy_device.sh                                        on the device (root of the copy; .whl carried)
#   DEVICE=cpu STOP=40 DEADLINE=20 EXTRA="--heldout 4 --early 20 --late 30" bench/dose_accuracy_device.sh   a trial
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dose_accuracy}; mkdir -p "$OUT" /tmp/acc
DEVICE=${DEVICE:-cuda}; STOP=${STOP:-20000}; DEADLINE=${DEADLINE:-420}; EXTRA=${EXTRA:-}
exec > >(tee -a "$OUT/dose_accuracy_device.log") 2>&1
PY=${PYTHON:-python3}
if ! $PY -c 'import transformer_lens, jsonschema' 2> /dev/null && ls .whl/*.whl > /dev/null 2>&1; then   # the device
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
# Many one-run processes share the GPU: with MPS their small kernels run side by side rather than time-sliced.
if [ "$DEVICE" = cuda ] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d && timeout 60 $PY -c 'import torch; torch.ones(1, device="cuda").sum().item()'; then
        echo "MPS on"
    else
        echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "MPS off (it did not start)"
    fi
fi
$PY -c 'import torch, transformer_lens; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 1
# configs/dose.yaml's budgets: 0.01x-1x both sources, param 3x, grad 2x (x 0.055, the batch noise's own P-NE*)
pids=()
for s in param grad; do
    top=$([ $s = param ] && echo 0.165 || echo 0.11)
    for d in 0.00055 0.00165 0.0055 0.0165 0.055 $top; do
        # shellcheck disable=SC2086
        $PY bench/bench_dose_accuracy.py --device "$DEVICE" --stop "$STOP" --settings 16:10 --sources $s --dose $d \
            --deadline "$DEADLINE" --out "/tmp/acc/$s-$d.csv" $EXTRA > "/tmp/acc/$s-$d.log" 2>&1 &
        pids+=($!)
    done
done
wait "${pids[@]}"   # not a bare wait: that would also wait for the log's tee
grep -h "realised/booked" /tmp/acc/*.log
tail -n 3 /tmp/acc/*.log | grep -i "error\|Traceback" && echo "(errors above)"
first=1
for f in /tmp/acc/*.csv; do
    if [ $first = 1 ]; then cat "$f"; first=0; else tail -n +2 "$f"; fi
done > "$OUT/dose_accuracy_device.csv"
date -u
