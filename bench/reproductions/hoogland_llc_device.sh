#!/usr/bin/env bash
# Hoogland et al.'s full LLC sweep (configs/hoogland.yaml: 8 chains × (500 + 500) SGLD steps, gradient batch
# 1024, n = 131 072) on our two trained runs' checkpoints, on one GPU, through `iclnoise llc` (issue 29, part 5).
#   bench/reproductions/hoogland_llc_device.sh RUNS_DIR OUT_DIR [SECONDS]
# RUNS_DIR holds Minf-B256-none-s{0,1} (run.json, checkpoints.json, the checkpoints at configs/hoogland.yaml's
# llc.at steps). Three phases, each one `iclnoise llc` per seed (both on the GPU at once), most telling first:
#   key   their sampler at the steps the reduced CPU sweep used (0, 1k, 2.5k, 5k, 12k, 40k)
#   b256  the same steps, their chain length, gradient batch 256 (the CPU sweep's): what the batch alone does
#   rest  their sampler at the other 20 steps of configs/hoogland.yaml
# Each phase writes OUT_DIR/<phase>.tar (llc.parquet, llc_traces.parquet, or the partial tables of a phase cut
# short by SECONDS, default 500) and OUT_DIR/<phase>.log. Environment: LLC_DEVICE (default cuda), SMOKE (a JSON
# merged into every sampler, e.g. '{"chains": 2, "burn_in": 2, "draws": 3, "n": 256}', to try the driver).
set -uo pipefail
R=${1:?runs dir}; OUT=${2:?out dir}; BUDGET=${3:-500}
export PYTHONUNBUFFERED=1
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
mkdir -p "$OUT"
python3 - "${SMOKE:-{\}}" <<'EOF'
import json, sys
from iclnoise.config import load_params
p = load_params("params.yaml", ["configs/hoogland.yaml"])
s = {**p["llc"]["sampler"], **json.loads(sys.argv[1])}
key = [0, 984, 2490, 5050, 12221, 40000]
rest = [t for t in p["llc"]["at"]["steps"] if t not in key]
for name, sampler, steps in [("key", s, key), ("b256", {**s, "batch": 256}, key), ("rest", s, rest)]:
    json.dump({"llc": {**p["llc"], "sampler": sampler, "at": {"steps": steps}}}, open(f"/tmp/{name}.json", "w"))
EOF
for phase in key b256 rest; do
  t=$(left); [ "$t" -gt 30 ] || { echo "$phase: no time left"; continue; }
  rm -rf "/tmp/$phase"; mkdir -p "/tmp/$phase"; cp -r "$R"/Minf-B256-none-s* "/tmp/$phase/"
  t1=$(date +%s)
  for run in /tmp/$phase/Minf-B256-none-s*; do
    timeout "$t" python3 -m iclnoise.cli llc --run-dir "$run" --cfg "@/tmp/$phase.json" --device "${LLC_DEVICE:-cuda}" \
      --threads 4 > "$run.log" 2>&1 &
  done
  wait
  echo "$phase: $(( $(date +%s) - t1 )) s"
  cat /tmp/$phase/*.log > "$OUT/$phase.log"
  grep -hE "batched pass|λ̂" /tmp/$phase/*.log | tail -n 40
  (cd "/tmp/$phase" && tar -cf "$OUT/$phase.tar" $(ls */llc*.parquet */llc.partial.json 2>/dev/null))
done
