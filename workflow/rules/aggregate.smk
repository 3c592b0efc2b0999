rule aggregate:
    """Outcomes per run, task-diversity thresholds, hypothesis tests (H1-H4), figures 6-8 and 10 (9 with geometry)."""
    input:
        metrics=run_files("metrics.parquet"),
        llc=probe_files("llc", "llc.parquet"),
        geometry=probe_files("geometry", "geometry.parquet"),
        mech=probe_files("mech", "mech.parquet"),
        exposure=run_files("exposure.parquet") if EXPOSURE else [],
    output:
        outcomes=f"{RES}/aggregate/outcomes.parquet",
        thresholds=f"{RES}/aggregate/thresholds.parquet",
        tests=f"{RES}/aggregate/tests.parquet",
        md=multiext(f"{RES}/aggregate/", "outcomes.md", "thresholds.md", "tests.md"),
        figs=multiext(f"{RES}/figures/fig06_threshold_vs_noise", ".pdf", ".png", ".parquet")
        + multiext(f"{RES}/figures/fig07_icl_vs_exposure", ".pdf", ".png", ".parquet")
        + multiext(f"{RES}/figures/fig08_early_late", ".pdf", ".png", ".parquet")
        + multiext(f"{RES}/figures/fig10_exposure_series", ".pdf", ".png", ".parquet"),
    params:
        cfg=json.dumps(PARAMS.get("stats", {})),
        run_dirs=lambda w, input: sorted({str(Path(p).parent) for p in input.metrics}),
    log:
        "logs/aggregate.log",
    benchmark:
        "benchmarks/aggregate.tsv"
    shell:
        "iclnoise aggregate {params.run_dirs} --out {RES}/aggregate --figures {RES}/figures "
        "--cfg {params.cfg:q} > {log} 2>&1"


rule report:
    """results/report.md: every figure, table and verdict on one page, with params and code version."""
    input:
        rules.aggregate.output,
        rules.training_figures.output,
        lambda w: rules.llc_figures.output if PARAMS.get("llc", {}).get("enabled", False) else [],
        expand(f"{RES}/ed/{{family}}/forms.parquet", family=list(ED_FAMILIES)),
    output:
        f"{RES}/report.md",
    params:
        params=json.dumps(PARAMS),
    log:
        "logs/report.log",
    shell:
        "iclnoise report --results {RES} --params {params.params:q} --out {output} > {log} 2>&1"
