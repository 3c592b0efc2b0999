rule train:
    """One training run; resumes from results/runs/{run}/checkpoints if it was killed."""
    output:
        metrics=f"{RES}/runs/{{run}}/metrics.parquet",
        tokens=f"{RES}/runs/{{run}}/token_losses.parquet",
        root=f"{RES}/runs/{{run}}/root_preds.parquet",
        exposure=[f"{RES}/runs/{{run}}/exposure.parquet"] if EXPOSURE else [],
    params:
        spec=spec_json,
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/train/{run}.log",
    benchmark:
        "benchmarks/train/{run}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=120,
    group:
        "train"
    shell:
        "iclnoise train --spec {params.spec:q} --run-dir {params.run_dir} --threads {threads} > {log} 2>&1"
