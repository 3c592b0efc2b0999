#!/usr/bin/env bash
# Hoogland et al.'s released LLC sweep (configs/hoogland.yaml: 10 chains × 5000 SGLD steps from w*, gradient batch
# 1024, n = 1 048 576, their ε, nβ, γ) on our two trained runs' checkpoints, on one GPU, through `iclnoise llc`
# (issue 29).   scripts/device/hoogland_llc_device.sh RUNS_DIR OUT_DIR [SECONDS]
# RUNS_DIR holds Minf-B256-none-s{0,1} (run.json, checkpoints.json, the checkpoints at configs/hoogland.yaml's
# llc.at steps). Phases, each one `iclnoise llc` per seed and checkpoint (all on the GPU at once: the chains are
# launch-bound there, so processes overlap), most telling first:
#   key   steps ≈ 1k and 40k (the issue's comparison), 1000 trace points per chain (what a shorter sweep would
#         have read: experiments/reproductions/hoogland_compare.py --reduced)
#   mid   step ≈ 5k
#   late  steps 0, ≈ 2.5k and ≈ 12k
#   rest  the other steps of llc.at
# PHASES (default "key mid late rest") runs only some.
# Each phase writes OUT_DIR/<phase>.tar (llc.parquet and llc_traces.parquet, or the partial tables of a phase cut
# short by SECONDS, default 500) and OUT_DIR/<phase>.log. Environment: LLC_DEVICE (default cuda), SMOKE (a JSON
# merged into every sampler, e.g. '{"chains": 2, "draws": 8, "n": 256}', to try the driver).
set -uo pipefail
R=${1:?runs dir}; OUT=${2:?out dir}; BUDGET=${3:-500}
export PYTHONUNBUFFERED=1
T0=$(date +%s); left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
mkdir -p "$OUT"
python3 - "${SMOKE:-{\}}" <<'PY'
import json, sys
from iclnoise.config import load_params
p = load_params("params.yaml", ["configs/hoogland.yaml"])
s = {**p["llc"]["sampler"], **json.loads(sys.argv[1])}
phases = {"key": [984, 40000], "mid": [5050], "late": [0, 2490, 12221]}
phases["rest"] = [t for t in p["llc"]["at"]["steps"] if all(t not in v for v in phases.values())]
for name, steps in phases.items():
    sampler = {**s, "trace_points": 1000} if name == "key" else s
    json.dump({"llc": {**p["llc"], "sampler": sampler, "at": {"steps": steps}}}, open(f"/tmp/{name}.json", "w"))
PY
for phase in ${PHASES:-key mid late rest}; do
  t=$(left); [ "$t" -gt 30 ] || { echo "$phase: no time left"; continue; }
  rm -rf "/tmp/$phase"; mkdir -p "/tmp/$phase"
  t1=$(date +%s)
  groups=$(python3 -c "import json; s = json.load(open('/tmp/$phase.json'))['llc']['at']['steps']
print(*(s if '$phase' != 'rest' else [','.join(map(str, s))]))")   # rest: one batched process per seed
  for step in $groups; do
    mkdir -p "/tmp/$phase/$step"; cp -r "$R"/Minf-B256-none-s* "/tmp/$phase/$step/"
    python3 -c "import json; c = json.load(open('/tmp/$phase.json')); c['llc']['at']['steps'] = [$step]
json.dump(c, open('/tmp/$phase/$step.json', 'w'))"
    for run in /tmp/$phase/$step/Minf-B256-none-s*; do
      timeout "$t" python3 -m iclnoise.cli llc --run-dir "$run" --cfg "@/tmp/$phase/$step.json" \
        --device "${LLC_DEVICE:-cuda}" --threads 2 > "$run.log" 2>&1 &
    done
  done
  wait
  echo "$phase: $(( $(date +%s) - t1 )) s"
  cat /tmp/$phase/*/*.log > "$OUT/$phase.log"
  grep -hE "batched pass|λ̂|Error|error" /tmp/$phase/*/*.log | tail -n 16
  (cd "/tmp/$phase" && tar -cf "$OUT/$phase.tar" $(ls */*/llc*.parquet */*/llc.partial.json 2>/dev/null))
done
