#!/bin/bash
# Issue 43, item 2: train configs/dose.yaml's jobs in priority order on N lanes (default 1), each job resumable, and
# probe each job's runs as soon as it ends, so that a session's finished jobs can be added to reference/dose
# (`iclnoise export --add`) before the session stops:
#   nohup experiments/dose_ladder.sh 2 > dose_ladder.log 2>&1 &
# The order is experiments/dose_device.py's plan (the threshold ladders first, dose 0's and then every dose's, H2 among them;
# then the rest of the full M grids; the doses beyond the regime last). A lane takes the next job no lane has claimed
# (mkdir is atomic; DOSE_CLAIMS names the claims directory, shared by invocations started apart); the lanes'
# snakemake runs take no lock (--nolock), which is safe because each job writes only its own runs and reads nothing
# another job writes. A job whose runs reference/dose holds (a session before this one trained them and added them
# with `iclnoise export --add`) is not run again; DOSE_SKIP names another file of run ids to skip. An invocation
# reads the plan once, at its start, and walks it to the end: to hold a job back from lanes already running, claim it
# yourself (mkdir "$DOSE_CLAIMS/<group>"); removing a claim lets only a lane that has not yet passed it take it.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}   # this checkout's code (a worktree's, not the editable install's)
lanes=${1:-1}
configs=(configs/science.yaml configs/dose.yaml)
claims=${DOSE_CLAIMS:-}
own=${claims:+no}
[ -n "$claims" ] && mkdir -p "$claims" || claims=$(mktemp -d)
plan=$(mktemp)
if [ -z "${DOSE_SKIP:-}" ] && [ -f reference/dose/provenance.json ]; then
  DOSE_SKIP=$(mktemp)
  python -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["spec_hash"]))' \
    reference/dose/provenance.json > "$DOSE_SKIP"
fi
python experiments/dose_device.py plan "${configs[@]}" | cut -f1,2 > "$plan" || exit 1
run() {  # one ensemble job and its runs' probes
  local lane=$1 group=$2 runs=$3 targets=()
  for r in ${runs//,/ }; do targets+=("results/runs/$r/mech.parquet"); done
  echo "== lane $lane: $group $(date -u +%FT%TZ)"
  nice -n 5 snakemake --cores 1 --nolock "${targets[@]}" --configfile "${configs[@]}" --config confirm_cost=true \
    > "logs/dose_ladder.$group.log" 2>&1 || echo "!! lane $lane: $group failed (logs/dose_ladder.$group.log)"
  echo "== lane $lane: $group done $(date -u +%FT%TZ)"
}
lane() {
  while IFS=$'\t' read -r group runs; do
    if [ -n "${DOSE_SKIP:-}" ] && ! tr ',' '\n' <<< "$runs" | grep -vxqFf "$DOSE_SKIP"; then continue; fi
    if mkdir "$claims/$group" 2>/dev/null; then run "$1" "$group" "$runs"; fi
  done < "$plan"
}
mkdir -p logs
for l in $(seq "$lanes"); do lane "$l" & done
wait
[ -z "$own" ] && rm -rf "$claims"
rm -f "$plan"
echo "== all done $(date -u +%FT%TZ)"
