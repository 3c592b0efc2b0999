#!/usr/bin/env bash
# Issue 43 item 0 on a lent GPU, in one call: the closed loop's books against method §6's exact recomputation
# (experiments/dose_accuracy.py) at configs/dose.yaml's curvature setting (16 probes every 10 steps) and at every dose
# level of both sources, one process per (source, dose), all at once, each stopped after DEADLINE seconds with the
# steps it reached. Rows into $OUT/dose_accuracy_device.csv, the log into $OUT/dose_accuracy_device.log.
#   scripts/device/dose_accuracy_device.sh                                        on the device (root of the copy; .whl carried)
#   DEVICE=cpu STOP=40 DEADLINE=20 HELDOUT=4 EXTRA="--early 20 --late 30" scripts/device/dose_accuracy_device.sh   a trial
# HELDOUT: the exact references' held-out sizes, side by side in each run (one held-out batch's curvature reads
# the dose ≈ 2 % high at 32 sequences; see bench_dose_accuracy.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dose_accuracy}; mkdir -p "$OUT" /tmp/acc
DEVICE=${DEVICE:-cuda}; STOP=${STOP:-20000}; DEADLINE=${DEADLINE:-420}; EXTRA=${EXTRA:-}; HELDOUT=${HELDOUT:-32 256}
exec > >(tee -a "$OUT/dose_accuracy_device.log") 2>&1
. scripts/device/device_env.sh
# configs/dose.yaml's budgets: 0.003x-1x both sources, param 3x, grad 2x (x 0.055, the batch noise's own P-NE*)
pids=()
for s in param grad; do
    top=$([ $s = param ] && echo 0.165 || echo 0.11)
    for d in 0.000165 0.00055 0.00165 0.0055 0.0165 0.055 $top; do
        # shellcheck disable=SC2086
        $PY experiments/dose_accuracy.py --device "$DEVICE" --stop "$STOP" --settings 16:10 --sources $s --dose $d \
            --heldout $HELDOUT --deadline "$DEADLINE" --out "/tmp/acc/$s-$d.csv" $EXTRA > "/tmp/acc/$s-$d.log" 2>&1 &
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
