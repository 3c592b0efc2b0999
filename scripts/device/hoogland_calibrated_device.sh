#!/usr/bin/env bash
# Issue 44 item 4: our Hoogland-setting trajectory (configs/hoogland.yaml, seeds 0 and 1, to step 40 000) at a
# calibrated sampler, at every one of their released steps up to 40k (80), with the stages of both trajectories
# side by side. Phases, guarded by a time budget (BUDGET, default 470 s):
#   train      the two runs as one ensemble (`iclnoise train`, the train rule's command), unless RUNS has them
#   pack       (--pack DIR, then stop) a copy of the two runs with only the 80 steps' checkpoints, model weights
#              only (≈ 33 MB: `run`'s carry limit is 64 MiB), and a manifest of those files
#   calibrate  `iclnoise llc-calibrate` on seed 0 at the checkpoints nearest 984, 4232, 12221 and 40000 (before the
#              rise, where their sampler turns unstable, the curvature peak, the end): ε × γ × nβ (EPSILONS, GAMMAS,
#              NBETAS); chains and lengths: SAMPLER, merged over configs/hoogland.yaml's llc.sampler
#   trajectory `iclnoise llc` at the 80 steps, both seeds at once, at the choice (or, when no setting is clean and
#              levelled off in ε, the clean setting of largest ε whose stability ratio stays <= MARGIN (0.75) at
#              every calibration checkpoint; the log says which), then `iclnoise stages`
#   compare    experiments/reproductions/hoogland_release.py: theirs (hoogland_release.csv) and ours: levels, ratios,
#              flags, stages per seed
# Training on a GPU alone takes ≈ 8 min (169 run-steps/s for these 2 runs × batch 256 on an H200, README
# Benchmarks): train on the CPU first (≈ 40 min per run on one thread) and carry the pack:
#   RUNS=results/hoogland-cal/runs scripts/device/hoogland_calibrated_device.sh /tmp/hc --pack carry-hc
#   run(carry=["carry-hc"]): RUNS=carry-hc scripts/device/hoogland_calibrated_device.sh $OUT
# On the CPU (no GPU lent): train as above, then `--calibrate` (calibrate and the bias check, on the checkpoints saved
# so far: none is trained) and the whole script once the runs are trained (it finds the choice and the bias in OUT):
#   LLC_DEVICE=cpu SAMPLER=<shortened> FULL_SAMPLER=<the default SAMPLER> PAR=2 BUDGET=... ... OUT --calibrate
# FULL_SAMPLER set: the shortened sampler's bias, the full one at the choice on seed 0 at CAL_AT (bias.csv).
# --quick: every phase (train, pack, calibrate, trajectory, compare) on the CPU at toy size (300 training steps,
# tiny chains), to check the script runs. Environment: RUNS (default results/hoogland-cal/runs), BUDGET (s),
# LLC_DEVICE (default cuda), EPSILONS, GAMMAS, NBETAS, SAMPLER (JSON), CAL_AT, FULL_SAMPLER (JSON), THREADS (of
# calibrate and bias, default 2), PAR (CPU: 2 runs the two seeds' trajectories side by side). OUT_DIR receives the logs,
# llc_calibration.*, each run's llc*.parquet and stages.parquet, and hoogland_calibrated.csv; an `iclnoise llc` cut
# short by the budget leaves its partial tables there.
set -uo pipefail
OUT=${1:?out dir}; MODE=${2:-}; PACK=${3:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); HERE=$ROOT/experiments/reproductions; DATA=$ROOT/reference/reproductions
BUDGET=${BUDGET:-470}; T0=$(date +%s)
left() { local t=$(( BUDGET - ($(date +%s) - T0) )); echo $(( t > 1 ? t : 1 )); }   # timeout 0 would mean none
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src}
RUNS=${RUNS:-results/hoogland-cal/runs}; DEV=${LLC_DEVICE:-cuda}
EPSILONS=${EPSILONS:-1e-5 3e-5 1e-4}; GAMMAS=${GAMMAS:-100 1000}; NBETAS=${NBETAS:-266.67 1000}
# 4 chains × (200 + 800) steps at batch 128 from n = 65 536: 160 checkpoints × 4 chains × 1000 steps ≈ 82M sequence
# steps (their sweep: 51M per checkpoint); L(w*) over 65 536 sequences, not 2^20 (the estimate's n is nβ, not n)
SAMPLER=${SAMPLER:-'{"chains": 4, "burn_in": 200, "draws": 800, "batch": 128, "n": 65536, "trace_points": 100}'}
STOP=40000; CAL_AT=${CAL_AT:-984 4232 12221 40000}; THREADS=${THREADS:-2}; PAR=${PAR:-1}; FULL_SAMPLER=${FULL_SAMPLER:-}
MARGIN=${MARGIN:-0.75}   # the fallback's stability margin: λ_max between the calibration checkpoints may be higher
if [ "$MODE" = "--quick" ]; then
  DEV=cpu; THREADS=1; STOP=300; CAL_AT="14 100 300"; EPSILONS="3e-5 1e-4"; GAMMAS="1000"; NBETAS="266.67"
  SAMPLER='{"chains": 2, "burn_in": 4, "draws": 12, "batch": 16, "n": 64, "trace_points": 4}'
fi
mkdir -p "$OUT" "$RUNS"
python3 - "$OUT" "$STOP" "$SAMPLER" "$DATA/hoogland_release.csv" <<'PY' || exit 1
import json, sys
import pandas as pd
from iclnoise.config import load_params
from iclnoise.config.grid import shared_spec
out, stop, sampler, theirs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
p = load_params("params.yaml", ["configs/hoogland.yaml"])
p["train"]["budget"]["stop_at"] = stop
json.dump(shared_spec(p, ["Minf-B256-none-s0"]), open(f"{out}/spec.json", "w"))
steps = sorted({min(int(s), stop) for s in pd.read_csv(theirs).step})   # their 80 released steps up to 40k (40292: 40k)
llc = {**p["llc"], "sampler": {**p["llc"]["sampler"], **sampler}, "at": {"steps": steps}}
json.dump({"llc": llc}, open(f"{out}/llc_base.json", "w"))
print(f"{len(steps)} released steps, {steps[0]}-{steps[-1]}; sampler {llc['sampler']}")
PY

if [ -f "$RUNS/Minf-B256-none-s0/checkpoints.json" ] && [ -f "$RUNS/Minf-B256-none-s1/checkpoints.json" ]; then
  echo "train: $RUNS has both runs"
elif [ "$MODE" = "--calibrate" ]; then
  echo "train: skipped (--calibrate samples the checkpoints saved so far: CAL_AT's must exist)"
else
  t1=$(date +%s)
  timeout "$(left)" python3 -m iclnoise.cli train --spec "@$OUT/spec.json" --runs Minf-B256-none-s0,Minf-B256-none-s1 \
    --results "$(dirname "$RUNS")" --threads $THREADS --no-progress > "$OUT/train.log" 2>&1 \
    || { tail -5 "$OUT/train.log"; exit 1; }
  echo "train: $(( $(date +%s) - t1 )) s"
fi

if [ "$MODE" = "--pack" ] || [ "$MODE" = "--quick" ]; then
  DEST=${PACK:-$OUT/pack}
  python3 - "$RUNS" "$DEST" "$OUT/llc_base.json" <<'PY' || exit 1
import json, shutil, sys
from pathlib import Path
from iclnoise.run import runs
from iclnoise.core.io import write_json
from iclnoise.run.probing import llc_steps
src, dst, cfg = Path(sys.argv[1]), Path(sys.argv[2]), json.load(open(sys.argv[3]))
for r in ("Minf-B256-none-s0", "Minf-B256-none-s1"):
    (dst / r / runs.CKPT_DIR).mkdir(parents=True, exist_ok=True)
    for f in ("run.json", "metrics.parquet"):
        shutil.copy(src / r / f, dst / r / f)
    manifest = {}
    for s in llc_steps(src / r, 1, cfg["llc"]["at"]):
        state = runs.load_checkpoint(src / r, s)
        state.pop("adam", None)            # the sampler needs the weights only
        manifest[str(s)] = runs.save_torch(state, runs.checkpoint_path(dst / r, s))
    write_json(manifest, dst / r / runs.MANIFEST)
    print(f"pack: {dst / r}: {len(manifest)} checkpoints")
PY
  [ "$MODE" = "--pack" ] && exit 0
  RUNS=$DEST
fi
A="$RUNS/Minf-B256-none-s0"; B="$RUNS/Minf-B256-none-s1"

CAL=$(python3 -c "from iclnoise import runs; from iclnoise.core.schedules import steps_at
print(*steps_at(runs.saved_steps('$A'), steps=[$(echo $CAL_AT | tr ' ' ,)]))") || exit 1   # nearest checkpoints
if [ -f "$OUT/llc_calibration.parquet" ]; then
  echo "calibrate: $OUT holds the sweep (delete its llc_calibration.* to sweep again)"
else
t1=$(date +%s)
timeout "$(left)" python3 -m iclnoise.cli llc-calibrate --run-dir "$A" --cfg "@$OUT/llc_base.json" --device "$DEV" \
  --threads $THREADS --steps $CAL --epsilons $EPSILONS --gammas $GAMMAS --nbetas $NBETAS > "$OUT/calibrate.log" 2>&1
echo "calibrate: rc $?, $(( $(date +%s) - t1 )) s"; tail -n 3 "$OUT/calibrate.log"
cp "$A"/llc_calibration.* "$OUT/" 2>/dev/null
fi
python3 - "$OUT" "$MARGIN" <<'PY' || exit 1
import json, sys
import pandas as pd
out, margin = sys.argv[1], float(sys.argv[2])
choice = json.load(open(f"{out}/llc_calibration.json"))["choice"]
if choice is None:   # no plateau in ε: the clean setting of largest ε (then smallest γ) with a stability margin
    t = pd.read_parquet(f"{out}/llc_calibration.parquet")
    k = ["nbeta", "gamma", "epsilon"]
    s = t.groupby(k).agg(clean=("clean", "all"), ratio=("stability_ratio", "max")).reset_index()
    s = s[s.clean & (s.ratio <= margin)].sort_values(["epsilon", "gamma"], ascending=[False, True])
    if s.empty:
        sys.exit(f"calibrate: no setting is unflagged with stability ratio <= {margin} at every checkpoint: widen "
                 "EPSILONS / GAMMAS / NBETAS")
    choice = s.iloc[0][k].to_dict()
    print(f"calibrate: no setting levelled off in ε; using the clean setting of largest ε whose stability ratio "
          f"stays <= {margin} at every checkpoint ({s.iloc[0].ratio:.3f}): {choice}")
else:
    print(f"calibrate: choice {choice}")
cfg = json.load(open(f"{out}/llc_base.json"))
cfg["llc"]["sampler"].update({k: float(v) for k, v in choice.items()})
json.dump(cfg, open(f"{out}/llc_calibrated.json", "w"))
PY

if [ -n "$FULL_SAMPLER" ] && [ -f "$OUT/bias/Minf-B256-none-s0/llc_calibration.parquet" ]; then
  echo "bias: $OUT/bias holds it"
elif [ -n "$FULL_SAMPLER" ]; then   # the shortened sampler's bias: the full one at the choice, seed 0, the CAL steps
  BIAS="$OUT/bias/Minf-B256-none-s0"; mkdir -p "$BIAS/checkpoints"; cp "$A/run.json" "$BIAS/"
  for s in $CAL; do ln -sf "$(cd "$A" && pwd)/checkpoints/$(printf 'step_%07d.pt' "$s")" "$BIAS/checkpoints/"; done
  python3 -c "import json, sys
cfg = json.load(open('$OUT/llc_calibrated.json')); cfg['llc']['sampler'].update(json.loads(sys.argv[1]))
json.dump(cfg, open('$OUT/llc_full.json', 'w'))" "$FULL_SAMPLER" || exit 1
  read -r E G NB < <(python3 -c "import json; s = json.load(open('$OUT/llc_calibrated.json'))['llc']['sampler']
print(s['epsilon'], s['gamma'], s['nbeta'])")
  t1=$(date +%s)
  timeout "$(left)" python3 -m iclnoise.cli llc-calibrate --run-dir "$BIAS" --cfg "@$OUT/llc_full.json" --device "$DEV" \
    --threads $THREADS --steps $CAL --epsilons "$E" --gammas "$G" --nbetas "$NB" > "$OUT/bias.log" 2>&1
  echo "bias (full sampler $FULL_SAMPLER): rc $?, $(( $(date +%s) - t1 )) s"
  python3 - "$OUT" <<'PY' || exit 1
import json, sys
import pandas as pd
out = sys.argv[1]
s = json.load(open(f"{out}/llc_calibrated.json"))["llc"]["sampler"]
cols = ["step", "llc_mean", "llc_se", "mean_sampling_loss", "stability_ratio", "unstable", "escaped"]
pick = lambda t: t[(t.epsilon == s["epsilon"]) & (t.gamma == s["gamma"]) & (t.nbeta == s["nbeta"])][cols]
short = pick(pd.read_parquet(f"{out}/llc_calibration.parquet"))
full = pick(pd.read_parquet(f"{out}/bias/Minf-B256-none-s0/llc_calibration.parquet"))
t = short.merge(full, on="step", suffixes=("_short", "_full"))
t["bias"] = t.llc_mean_short / t.llc_mean_full - 1
t["z"] = (t.llc_mean_short - t.llc_mean_full) / (t.llc_se_short ** 2 + t.llc_se_full ** 2) ** 0.5
t.to_csv(f"{out}/bias.csv", index=False)
print(t[["step", "llc_mean_short", "llc_se_short", "llc_mean_full", "llc_se_full", "bias", "z"]].to_string(index=False))
PY
fi
[ "$MODE" = "--calibrate" ] && exit 0

t1=$(date +%s)
for r in "$A" "$B"; do
  timeout "$(left)" python3 -m iclnoise.cli llc --run-dir "$r" --cfg "@$OUT/llc_calibrated.json" --device "$DEV" \
    --threads 1 > "$OUT/llc-$(basename "$r").log" 2>&1 &
  [ "$DEV" = cpu ] && [ "$PAR" -lt 2 ] && wait   # one process at a time on the CPU unless PAR=2
done
wait
echo "trajectory: $(( $(date +%s) - t1 )) s"
for r in "$A" "$B"; do
  python3 -m iclnoise.cli stages --run-dir "$r" --cfg "@$OUT/llc_calibrated.json" >> "$OUT/stages.log" 2>&1
  mkdir -p "$OUT/$(basename "$r")"
  cp "$r"/llc*.parquet "$r"/llc*.json "$r"/stages.parquet "$OUT/$(basename "$r")/" 2>/dev/null
done
PYTHONPATH="$PYTHONPATH:$HERE" python3 "$HERE/hoogland_release.py" --runs "$A" "$B" \
  --ours-csv "$OUT/hoogland_calibrated.csv" --figure "$OUT/hoogland_calibrated.png" --csv "$DATA/hoogland_release.csv" 2>&1 | tee "$OUT/compare.log"
echo "total: $(( $(date +%s) - T0 )) s"
