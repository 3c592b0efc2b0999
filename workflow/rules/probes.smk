rule geometry:
    """Hessian trace, top eigenvalue, SAM sharpness (and A·H·A trace) on held-out batches."""
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
        f"{RES}/runs/{{run}}/checkpoints.json",
    output:
        f"{RES}/runs/{{run}}/geometry.parquet",
    params:
        cfg=lambda w: probe_cfg("geometry"),
        every=PARAMS["geometry"].get("every", 1),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/geometry/{run}.log",
    benchmark:
        "benchmarks/geometry/{run}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=60,
    conda:
        CONDA_ENV
    shell:
        "iclnoise geometry --run-dir {params.run_dir} --every {params.every} --cfg {params.cfg:q} > {log} 2>&1"


rule mech:
    """Attention to x/y tokens, head ablations, layer-norm collapse, linear probes; per-run head figure."""
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
        f"{RES}/runs/{{run}}/checkpoints.json",
    output:
        mech=f"{RES}/runs/{{run}}/mech.parquet",
        fig=multiext(f"{RES}/figures/heads/{{run}}", ".pdf", ".png", ".parquet"),
    params:
        res=RES,
        cfg=lambda w: probe_cfg("mech"),
        every=PARAMS["mech"].get("every", 1),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/mech/{run}.log",
    benchmark:
        "benchmarks/mech/{run}.tsv"
    threads: 1
    resources:
        mem_mb=3000,
        runtime=60,
    conda:
        CONDA_ENV
    shell:
        "iclnoise mech --run-dir {params.run_dir} --every {params.every} --cfg {params.cfg:q} "
        "--figure {params.res}/figures/heads/{wildcards.run} > {log} 2>&1"
