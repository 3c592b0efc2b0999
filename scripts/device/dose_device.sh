#!/usr/bin/env bash
# Issue 43 on a lent GPU, in one call: configs/dose.yaml's training jobs (experiments/dose_device.py plan: the threshold
# ladder first) on CUDA, LANES jobs at once, until DEADLINE seconds; then the finished runs packed into
# $OUT/dose_runs.tar.gz (checkpoints reduced to the first and last) with the job logs in $OUT/dose_logs.tar.gz and the
# timeline in $OUT/dose_device.log. A job killed at the deadline leaves nothing (its runs are not packed).
#   scripts/device/dose_device.sh                       on the device (root of the copy; .whl carried)
#   CONFIGS="configs/science.yaml my.yaml" DEADLINE=60 LANES=2 scripts/device/dose_device.sh   a trial (on the CPU too)
# Runs trained on CUDA draw their data streams there, so they are not the CPU plan's runs (their spec names the
# device): a GPU dose experiment is a set of its own. Not built yet: its probes and export (the packed first and last
# checkpoints are what the probes read). With a short DEADLINE the job logs measure the GPU's pace on the real jobs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dose_out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-420}; LANES=${LANES:-12}
CONFIGS=${CONFIGS:-configs/science.yaml configs/dose.yaml configs/dose_gpu.yaml}
start=$(date +%s)
log="$OUT/dose_device.log"
exec > >(tee -a "$log") 2>&1
. scripts/device/device_env.sh
# shellcheck disable=SC2086
$PY experiments/dose_device.py plan $CONFIGS > /tmp/dose_jobs.tsv || exit 1
echo "$(wc -l < /tmp/dose_jobs.tsv) jobs, $LANES lanes, deadline ${DEADLINE} s"
mkdir -p results logs/train
job() {  # one line of the plan: group, runs, spec
    IFS=$'\t' read -r group runs spec <<< "$1"
    left=$((DEADLINE - ($(date +%s) - start)))
    [ "$left" -le 10 ] && { echo "-- $group: not started (deadline)"; return; }
    t0=$(date +%s)
    echo "== $group start at $((t0 - start)) s ($left s left)"
    timeout "$left" $PY -c 'from iclnoise.cli import main; main()' train --spec "$spec" --runs "$runs" \
        --results results --threads 1 --no-progress > "logs/train/$group.log" 2>&1
    rc=$?
    echo "== $group exit $rc after $(($(date +%s) - t0)) s (at $(($(date +%s) - start)) s)"
}
export -f job; export start DEADLINE PY
tr '\n' '\0' < /tmp/dose_jobs.tsv | xargs -0 -P "$LANES" -I{} bash -c 'job "$1"' _ {}
$PY experiments/dose_device.py pack results "$OUT/dose_runs.tar.gz"
tar -czf "$OUT/dose_logs.tar.gz" logs/train
date -u
