#!/usr/bin/env bash
# Hoogland et al.'s L2H4 M = ∞ runs (configs/hoogland.yaml: their network, their schedule stopped at step
# 40 000) and their LLC sweep on one GPU, through the commands the Snakemake rules run (`iclnoise train`
# for the ensemble, `iclnoise llc` per run), for a machine without Snakemake. Then bench/bench_device.py.
#   scripts/device/hoogland_device.sh RESULTS_DIR OUT_DIR [smoke]
# smoke: 300 steps and 20-draw chains on 3 checkpoints, to check the machine before the long run.
# Writes OUT_DIR/hoogland.csv (experiments/reproductions/hoogland_compare.py --from-runs), the runs' tables and a
# few checkpoints (tables.tar), the logs and bench_device.txt.
set -euo pipefail
R=${1:?results dir}; OUT=${2:?out dir}; MODE=${3:-full}
export PYTHONUNBUFFERED=1
ICL="python3 -m iclnoise.cli"
mkdir -p "$R" "$OUT"
python3 - "$R" "$MODE" <<'EOF'
import json, sys
from iclnoise.config import load_params
from iclnoise.config.grid import ensemble_groups, shared_spec
R, mode = sys.argv[1:]
p = load_params("params.yaml", ["configs/hoogland.yaml"])
if mode == "smoke":
    p["train"]["budget"]["stop_at"] = 300
    p["llc"]["sampler"].update(burn_in=10, draws=20)
    p["llc"]["at"] = {"steps": [0, 100, 300]}
(group, runs), = ensemble_groups(p).items()
json.dump(shared_spec(p, runs), open(f"{R}/spec.json", "w"))
open(f"{R}/runs.txt", "w").write(",".join(runs))
json.dump({"llc": p["llc"]}, open(f"{R}/llc.json", "w"))   # iclnoise llc --cfg: the llc section
EOF
t0=$(date +%s)
$ICL train --spec "@$R/spec.json" --runs "$(cat "$R/runs.txt")" --results "$R" --threads 4 --no-progress \
  2>&1 | tee "$OUT/train.log" | grep -v "step .*/.*mean OOD" || true
echo "train: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
for run in $(tr , ' ' < "$R/runs.txt"); do   # both runs' chains share the GPU
  $ICL llc --run-dir "$R/runs/$run" --cfg "@$R/llc.json" \
    --device "${LLC_DEVICE:-cuda}" --threads 4 > "$OUT/llc_$run.log" 2>&1 &
done
wait
echo "llc: $(( $(date +%s) - t0 )) s"
tail -n 30 "$OUT"/llc_*.log
dev=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
python3 experiments/reproductions/hoogland_compare.py --from-runs "$R"/runs/Minf-B256-none-s* --device "$dev" \
  --ours "$OUT/hoogland.csv" --out "$OUT/hoogland_compare.png"
(cd "$R" && tar -cf "$OUT/tables.tar" runs/*/llc.parquet runs/*/llc_traces.parquet runs/*/metrics.parquet \
  runs/*/run.json runs/*/checkpoints.json)
(cd "$R" && tar -cf "$OUT/checkpoints.tar" $(python3 -c "
import glob, pandas as pd
for d in glob.glob('runs/*'):
    for s in pd.read_parquet(d + '/llc.parquet').step: print(f'{d}/checkpoints/step_{s:07d}.pt')"))
