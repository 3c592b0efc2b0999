#!/usr/bin/env bash
# The command of dvc.yaml's `pipeline` stage: Snakemake on params.yaml, on all local cores, or through a
# Snakemake profile when SNAKEMAKE_PROFILE is set (`SNAKEMAKE_PROFILE=slurm dvc repro`; `slurm-cpu` for
# a cluster without GPUs). ICLNOISE_CONFIGFILE adds an override file (`configs/carroll.yaml`); DVC does not
# see environment variables, so switching it needs `dvc repro -f` (Snakemake still reruns only what the
# change affects).
#
# Snakemake decides what to rerun from its records in .snakemake/metadata (params, code, input set per
# output), which dvc.yaml versions with the results so that a clone that `dvc pull`s them knows what
# they were made from. Without `mtime` among the triggers: files restored by `dvc pull`/`dvc checkout`
# carry checkout times, not the order they were made in.
set -euo pipefail
# DVC links cached files read-only into the workspace; Snakemake rewrites its records in place, so
# give each record its own copy first (a few kB each).
if [[ -d .snakemake/metadata ]]; then
    find .snakemake/metadata \( -type l -o -type f -links +1 \) -print0 |
        while IFS= read -r -d '' f; do cp "$f" "$f.tmp" && mv -f "$f.tmp" "$f" && chmod u+w "$f"; done
fi
args=(--rerun-triggers params input code software-env)
if [[ -n ${SNAKEMAKE_PROFILE:-} ]]; then args+=(--profile "$SNAKEMAKE_PROFILE"); else args+=(--cores all); fi
if [[ -n ${ICLNOISE_CONFIGFILE:-} ]]; then args+=(--configfile "$ICLNOISE_CONFIGFILE"); fi
snakemake "${args[@]}" "$@"
# every table readable before DVC records it (a corrupt file that no rule reads would be versioned as data)
iclnoise verify results
# directory outputs of dvc.yaml that a configuration may leave empty (ed: false writes no results/ed)
mkdir -p results/runs results/ed results/aggregate results/figures
