#!/bin/bash
# Issue 43, item 2: train configs/dose.yaml's jobs one at a time in priority order (each resumes where it stopped):
#   nohup bench/dose_ladder.sh > dose_ladder.log 2>&1 &
# Order: the threshold ladder's extremes first (dose 0 and each source's top dose at M 16-64, then M 1-8), then the
# ladder's doses from the top down, H2, and the full grid's M 256 and inf last.
set -u
cd "$(dirname "$0")/.."
run() {  # one ensemble job, named by one of its runs
  echo "== $1 $(date -u +%FT%TZ)"
  nice -n 5 snakemake --cores 1 "results/runs/$1/metrics.parquet" --configfile configs/science.yaml configs/dose.yaml \
    --config confirm_cost=true || echo "!! $1 failed"
}
for c in none param_x3 grad_x2; do run M16-B64-$c-s0; done
for c in none param_x3 grad_x2; do run M1-B64-$c-s0; done
for d in 1 0p3 0p1 0p03; do for s in param grad; do run M8-B64-${s}_x$d-s0; done; done
for c in h2_early h2_late; do run M16-B64-$c-s0; done
for c in none param_x3 grad_x2; do run Minf-B64-$c-s0; done
for c in param_x1 grad_x1 param_x0p3 grad_x0p3; do run Minf-B64-$c-s1; done
echo "== all done $(date -u +%FT%TZ)"
