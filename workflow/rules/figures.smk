rule training_figures:
    """method §12 figure 1 (OOD loss over training per M, t_crit marked) and the end-of-training summary."""
    input:
        run_files("metrics.parquet"),
    output:
        **figure("fig01_ood_loss", "fig01", "Training"),
        summary=f"{RES}/summary.parquet",
        summary_md=f"{RES}/summary.md",
    params:
        res=RES,
    log:
        "logs/figures/training.log",
    benchmark:
        "benchmarks/figures/training.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise figures --out-dir {params.res} {input} > {log} 2>&1"
