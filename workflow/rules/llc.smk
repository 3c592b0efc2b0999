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
