rule llc_figures:
    """method §12 figures 3 and 4."""
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


rule refined_figures:
    """Figures 11 (refined LLC per head over training) and 12 (susceptibilities to new tasks) of the runs llc.refined
    covers."""
    input:
        rllc=expand(f"{RES}/runs/{{run}}/rllc.parquet", run=REFINED_RUNS),
        susceptibility=expand(f"{RES}/runs/{{run}}/susceptibility.parquet", run=REFINED_RUNS),
    output:
        **{f"r_{k}": v for k, v in figure("fig11_rllc_over_training", "fig11", "LLC").items()},
        **{f"s_{k}": v for k, v in figure("fig12_susceptibility", "fig12", "LLC").items()},
    params:
        res=RES,
    log:
        "logs/figures/refined.log",
    benchmark:
        "benchmarks/figures/refined.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise refined-figures --rllc {input.rllc} --susceptibility {input.susceptibility} "
        "--out-dir {params.res}/figures > {log} 2>&1"
