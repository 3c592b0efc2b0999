#!/bin/bash
# Issue 43, item 2: train configs/dose.yaml's jobs in priority order on N lanes (default 1), each job resumable:
#   nohup bench/dose_ladder.sh 2 > dose_ladder.log 2>&1 &
# Order: the threshold ladder's extremes first (dose 0 and the top doses at M 16-64, then param's at M 1-8), param's
# top dose at M 256 and inf (is it inside the regime?) and dose 0's, the 1x doses, H2 (short), M = inf at 1x (inside
# the regime?), the ladder's lower doses from the top down, M = inf at 0.3x, and last grad 2x at M 1-8 and 256-inf
# (it saturates at finite M: 0.095 booked against 0.11 at M 16-64, outside the regime). A lane takes the next job no
# lane has claimed (mkdir is atomic; DOSE_CLAIMS names the claims directory, shared by invocations started apart);
# the lanes' snakemake runs take no lock (--nolock), which is safe because each job writes only its own runs and
# reads nothing another job writes.
set -u
cd "$(dirname "$0")/.."
lanes=${1:-1}
claims=${DOSE_CLAIMS:-}
own=${claims:+no}
[ -n "$claims" ] && mkdir -p "$claims" || claims=$(mktemp -d)
jobs=()
for c in none param_x3 grad_x2; do jobs+=(M16-B64-$c-s0); done
for c in none param_x3; do jobs+=(M1-B64-$c-s0); done
jobs+=(M256-B64-param_x3-s0 Minf-B64-none-s0)   # Minf-B64-param_x3-s0 is the scan's run
for s in param grad; do jobs+=(M8-B64-${s}_x1-s0); done
for c in h2_early h2_late; do jobs+=(M16-B64-$c-s0); done
for c in param_x1 grad_x1; do jobs+=(Minf-B64-$c-s1); done
for d in 0p3 0p1 0p03 0p01; do for s in param grad; do jobs+=(M8-B64-${s}_x$d-s0); done; done
for c in param_x0p3 grad_x0p3; do jobs+=(Minf-B64-$c-s1); done
jobs+=(Minf-B64-grad_x2-s0 M1-B64-grad_x2-s0)
run() {  # one ensemble job, named by one of its runs
  echo "== lane $1: $2 $(date -u +%FT%TZ)"
  nice -n 5 snakemake --cores 1 --nolock "results/runs/$2/metrics.parquet" \
    --configfile configs/science.yaml configs/dose.yaml --config confirm_cost=true || echo "!! lane $1: $2 failed"
}
lane() {
  for j in "${jobs[@]}"; do
    if mkdir "$claims/$j" 2>/dev/null; then run "$1" "$j"; fi
  done
}
for l in $(seq "$lanes"); do lane "$l" & done
wait
[ -z "$own" ] && rm -rf "$claims"
echo "== all done $(date -u +%FT%TZ)"
