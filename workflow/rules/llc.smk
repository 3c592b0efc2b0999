rule llc:
    """Local learning coefficient at every k-th checkpoint of a run (SPEC §7)."""
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
        f"{RES}/runs/{{run}}/checkpoints.json",
    output:
        llc=f"{RES}/runs/{{run}}/llc.parquet",
        traces=f"{RES}/runs/{{run}}/llc_traces.parquet",
    params:
        sampler=lambda w: json.dumps(PARAMS["llc"]["sampler"]),
        every=PARAMS.get("llc", {}).get("every", 1),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/llc/{run}.log",
    benchmark:
        "benchmarks/llc/{run}.tsv"
    threads: 1
    resources:
        mem_mb=2000,
        runtime=60,
    shell:
        "iclnoise llc --run-dir {params.run_dir} --sampler {params.sampler:q} --every {params.every} "
        "--threads {threads} > {log} 2>&1"


rule stages:
    """Developmental stages from the LLC curve (Hoogland et al.)."""
    input:
        f"{RES}/runs/{{run}}/llc.parquet",
    output:
        f"{RES}/runs/{{run}}/stages.parquet",
    params:
        sigma=PARAMS.get("llc", {}).get("stages", {}).get("sigma", 1.0),
        tol=PARAMS.get("llc", {}).get("stages", {}).get("plateau_tol", 0.1),
        run_dir=lambda w: f"{RES}/runs/{w.run}",
    log:
        "logs/stages/{run}.log",
    shell:
        "iclnoise stages --run-dir {params.run_dir} --sigma {params.sigma} --plateau-tol {params.tol} > {log} 2>&1"


rule llc_figures:
    """SPEC §12 figures 3 and 4."""
    input:
        summary=f"{RES}/summary.parquet",
        llc=probe_files("llc", "llc.parquet"),
        stages=probe_files("llc", "stages.parquet"),
    output:
        multiext(f"{RES}/figures/fig03_loss_llc_vs_m", ".pdf", ".png", ".parquet"),
        multiext(f"{RES}/figures/fig04_llc_over_training", ".pdf", ".png", ".parquet"),
    log:
        "logs/figures/llc.log",
    shell:
        "iclnoise llc-figures --summary {input.summary} --llc {input.llc} --stages {input.stages} "
        "--out-dir {RES}/figures > {log} 2>&1"
