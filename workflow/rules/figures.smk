rule training_figures:
    """SPEC §12 figure 1 (OOD loss over training per M, t_crit marked) and the end-of-training summary."""
    input:
        run_files("metrics.parquet"),
    output:
        fig=multiext(f"{RES}/figures/fig01_ood_loss", ".pdf", ".png", ".parquet"),
        summary=f"{RES}/summary.parquet",
        summary_md=f"{RES}/summary.md",
    log:
        "logs/figures/training.log",
    shell:
        "iclnoise figures --out-dir {RES} {input} > {log} 2>&1"
