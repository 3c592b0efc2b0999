#!/bin/bash
# A design that takes several sessions to train (issue 43's dose set, issue 70's exposure sets), trained job by job on
# LANES lanes and grown into its committed set reference/SET session by session:
#   nohup experiments/ladder.sh SET LANES CONFIG... > logs/ladder.SET.log 2>&1 &
#   e.g. experiments/ladder.sh exposure 2 configs/science.yaml configs/exposure.yaml
# and before the session stops, the finished runs added to the set (its aggregate, summary and report computed again):
#   iclnoise export --add --results results --configfile CONFIG... --out reference/SET
# Each job is one ensemble of the workflow (experiments/dose_device.py's plan and order: dose's threshold ladders
# first, then the rest; the exposure design's doses whole, 10x and 1x first; other labels by group name), run by
# snakemake to the tables the set
# takes from its runs (iclnoise.output.export.set_tables: training, and the probes their sections enable), so a
# killed job resumes from its runs' resume states. A job whose runs reference/SET holds (a session before this one
# added them) is not run again, so a new machine starts where the committed set ends; LADDER_SKIP names another file
# of run ids to skip. A lane takes the next job no lane has claimed (mkdir is atomic; LADDER_CLAIMS names the claims
# directory, shared by invocations started apart); the lanes' snakemake runs take no lock (--nolock), which is safe
# because each job writes only its own runs and reads nothing another job writes. An invocation reads the plan once,
# at its start, and walks it to the end: to hold a job back from lanes already running, claim it yourself
# (mkdir "$LADDER_CLAIMS/<group>"); removing a claim lets only a lane that has not yet passed it take it.
# It runs in the current directory (the checkout's root, or a work directory holding params.yaml): its results/,
# logs/ and reference/SET; the code and the Snakefile are those of the checkout the script lies in.
set -u
[ $# -ge 3 ] || { echo "usage: experiments/ladder.sh SET LANES CONFIG... (e.g. exposure 2 configs/science.yaml configs/exposure.yaml)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}   # this checkout's code (a worktree's, not the editable install's)
set_dir=reference/$1 lanes=$2
shift 2
configs=("$@")
claims=${LADDER_CLAIMS:-}
own=${claims:+no}
[ -n "$claims" ] && mkdir -p "$claims" || claims=$(mktemp -d)
plan=$(mktemp)
skip=$(mktemp)   # the runs the set holds, and LADDER_SKIP's
[ -n "${LADDER_SKIP:-}" ] && cat "$LADDER_SKIP" > "$skip"
if [ -f "$set_dir/provenance.json" ]; then
  python -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["spec_hash"]))' \
    "$set_dir/provenance.json" >> "$skip"
fi
LADDER_SKIP=$skip
# one line per job: group, its runs, the files snakemake is asked for (each run's tables the set takes)
python "$root/experiments/dose_device.py" plan "${configs[@]}" | cut -f1,2 | python -c '
import sys
from iclnoise.config import load_params
from iclnoise.output.export import set_tables
params = load_params("params.yaml", sys.argv[1:])
for line in sys.stdin:
    group, runs = line.rstrip("\n").split("\t")
    files = [f"results/runs/{r}/{f}" for r in runs.split(",") for f in sum(set_tables(params, r), [])]
    print(group, runs, " ".join(files), sep="\t")
' "${configs[@]}" > "$plan" || exit 1
echo "== $(wc -l < "$plan") jobs, $lanes lane(s), $(sort -u "$LADDER_SKIP" | grep -c .) runs held by $set_dir or named by LADDER_SKIP $(date -u +%FT%TZ)"
run() {  # one ensemble job and its runs' probes
  local lane=$1 group=$2 files=$3
  echo "== lane $lane: $group $(date -u +%FT%TZ)"
  # shellcheck disable=SC2086
  nice -n 5 snakemake --snakefile "$root/Snakefile" --cores 1 --nolock $files --configfile "${configs[@]}" --config confirm_cost=true \
    > "logs/ladder.$group.log" 2>&1 || echo "!! lane $lane: $group failed (logs/ladder.$group.log)"
  echo "== lane $lane: $group done $(date -u +%FT%TZ)"
}
lane() {
  while IFS=$'\t' read -r group runs files; do
    if [ -n "${LADDER_SKIP:-}" ] && ! tr ',' '\n' <<< "$runs" | grep -vxqFf "$LADDER_SKIP"; then continue; fi
    if mkdir "$claims/$group" 2>/dev/null; then run "$1" "$group" "$files"; fi
  done < "$plan"
}
mkdir -p logs
for l in $(seq "$lanes"); do lane "$l" & done
wait
[ -z "$own" ] && rm -rf "$claims"
rm -f "$plan"
echo "== all done $(date -u +%FT%TZ)"
