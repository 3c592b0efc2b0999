# One rule per ensemble (iclnoise.config.grid.ensemble_groups): one job trains all its runs in one process.
# Its outputs are every member run's files, so a deleted or incomplete run reruns its ensemble; the
# members' specs are a rule parameter, so a changed spec reruns it (runs whose spec did not change
# rewrite their outputs from their final resume state without training; a changed run trains afresh).
# Cluster resources of these jobs: config key `train_resources` (see slurm/config.yaml).
# A run whose checkpoints.json lists a checkpoint gone from disk (checkpoints are not outputs: a diverged run has
# fewer) gets a marker, checkpoints.missing.<tag> (common.smk), that rule `all` asks for and its training job
# reads: plain snakemake and `-n` plan that job, which trains the run again, and every job after it; Snakemake
# removes the marker (temp) once `all` has it.


rule checkpoints_missing:
    output:
        temp(f"{RES}/runs/{{run}}/checkpoints.missing.{{tag}}"),
    params:
        missing=lambda w: " ".join(map(str, missing_checkpoints(f"{RES}/runs/{w.run}"))),
    localrule: True
    shell:
        "echo {params.missing:q} > {output}"


for _group, _runs in GROUPS.items():

    rule:
        name:
            f"train_{_group}".replace("-", "_")
        input:
            [CKPT_MISSING[r] for r in _runs if r in CKPT_MISSING],
        output:
            [f for r in _runs for f in train_outputs(r)],
        params:
            res=RES,
            spec=json.dumps(shared_spec(PARAMS, _runs), sort_keys=True),
            runs=",".join(_runs),
        log:
            f"logs/train/{_group}.log",
        benchmark:
            f"benchmarks/train/{_group}.tsv"
        threads: TRAIN_THREADS
        resources:
            **{"mem_mb": 4000, "runtime": 240, **TRAIN_RESOURCES},
        conda:
            CONDA_ENV
        shell:
            "iclnoise train --spec {params.spec:q} --runs {params.runs} --results {params.res} "
            "--threads {threads} --no-progress > {log} 2>&1"
