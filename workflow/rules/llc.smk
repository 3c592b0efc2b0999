rule llc:
    """Local learning coefficient at every k-th checkpoint of a run (SPEC §7)."""
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
        f"{RES}/runs/{{run}}/checkpoints.json",
    output:
        llc=f"{RES}/runs/{{run}}/llc.parquet",
        traces=f"{RES}/runs/{{run}}/llc_traces.parquet",
    params:
        sampler=json.dumps(PARAMS["llc"].get("sampler", {})),
        every=PARAMS["llc"].get("every", 1),
        at=json.dumps(PARAMS["llc"].get("at")),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/llc/{run}.log",
    benchmark:
        "benchmarks/llc/{run}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=60,
    conda:
        CONDA_ENV
    shell:
        "iclnoise llc --run-dir {params.run_dir} --sampler {params.sampler:q} --every {params.every} "
        "--at {params.at:q} --threads {threads} > {log} 2>&1"


rule stages:
    """Developmental stages from the LLC curve (Hoogland et al.), smoothed in log-step time."""
    input:
        f"{RES}/runs/{{run}}/llc.parquet",
    output:
        f"{RES}/runs/{{run}}/stages.parquet",
    params:
        sigma=PARAMS["llc"].get("stages", {}).get("sigma"),
        tol=PARAMS["llc"].get("stages", {}).get("plateau_tol"),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/stages/{run}.log",
    benchmark:
        "benchmarks/stages/{run}.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise stages --run-dir {params.run_dir} --sigma {params.sigma} --plateau-tol {params.tol} > {log} 2>&1"


rule llc_figures:
    """SPEC §12 figures 3 and 4."""
    input:
        summary=f"{RES}/summary.parquet",
        llc=probe_files("llc", "llc.parquet"),
        stages=probe_files("llc", "stages.parquet"),
    output:
        **{f"m_{k}": v for k, v in figure("fig03_loss_llc_vs_m", "fig03", "LLC").items()},
        **{f"t_{k}": v for k, v in figure("fig04_llc_over_training", "fig04", "LLC").items()},
    params:
        res=RES,
    log:
        "logs/figures/llc.log",
    benchmark:
        "benchmarks/figures/llc.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise llc-figures --summary {input.summary} --llc {input.llc} --stages {input.stages} "
        "--out-dir {params.res}/figures > {log} 2>&1"
