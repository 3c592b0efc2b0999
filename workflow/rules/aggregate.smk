# The dose tables exist only where the grid has a dose series (iclnoise.config.grid.has_dose_series).
DOSE_TABLES = ([f"{RES}/aggregate/{name}" for name in ("dose.parquet", "dose_levels.parquet", "dose.md",
                                                          "dose_levels.md")] if has_dose_series(PARAMS) else [])
# The batch axis (issue 70): an arm of ≥ 3 batch sizes (iclnoise.config.grid.has_batch_axis).
BATCH_TABLES = ([f"{RES}/aggregate/{name}" for name in ("batch_levels.parquet", "batch_levels.md")]
                if has_batch_axis(PARAMS) else [])
# H5 (issue 45): the noise-shaped runs' injection logs carry the alignment figure 6 by noise shape draws.
SHAPED = [r for r in RUNS if (SPECS[r].noise.shape or "").startswith("nap")]
ALIGNED = any(SPECS[r].noise.shape == "nap" for r in SHAPED)


rule aggregate:
    """Outcomes per run, task-diversity thresholds, gated hypothesis tests (H1-H5), metrics.json."""
    input:
        metrics=run_files("metrics.parquet"),
        llc=probe_files("llc", "llc.parquet"),
        geometry=probe_files("geometry", "geometry.parquet"),
        mech=probe_files("mech", "mech.parquet"),
        exposure=[f for r in RUNS for f in train_outputs(r) if f.endswith("exposure.parquet")],
    output:
        outcomes=report(f"{RES}/aggregate/outcomes.parquet", caption="../report/outcomes.rst", category="Tables"),
        thresholds=f"{RES}/aggregate/thresholds.parquet",
        tests=f"{RES}/aggregate/tests.parquet",
        metrics=f"{RES}/aggregate/metrics.json",
        md=multiext(f"{RES}/aggregate/", "outcomes.md", "thresholds.md", "tests.md"),
        dose=DOSE_TABLES,   # a dose series in the grid (issue 43): dose.parquet, dose_levels.parquet (+ .md)
        batch=BATCH_TABLES,   # the batch axis (issue 70): batch_levels.parquet (+ .md)
    params:
        res=RES,
        cfg=cfg("stats"),
        run_dirs=lambda w, input: sorted({str(Path(p).parent) for p in input.metrics}),
    log:
        "logs/aggregate.log",
    benchmark:
        "benchmarks/aggregate.tsv"
    resources:
        mem_mb=4000,
    conda:
        CONDA_ENV
    shell:
        "iclnoise aggregate {params.run_dirs} --out {params.res}/aggregate --cfg {params.cfg:q} > {log} 2>&1"


rule aggregate_figures:
    """method §12 figures 6-10 from the aggregate tables and the runs' exposure logs (H5: the shaped runs' alignment)."""
    input:
        outcomes=rules.aggregate.output.outcomes,
        thresholds=rules.aggregate.output.thresholds,
        tests=rules.aggregate.output.tests,
        exposure=sorted(f for r in RUNS for f in train_outputs(r) if f.endswith("exposure.parquet")),
        alignment=[f"{RES}/runs/{r}/injection.parquet" for r in SHAPED],
    output:
        **{f"f6_{k}": v for k, v in figure("fig06_threshold_vs_noise", "fig06", "Hypotheses").items()},
        **{f"f7_{k}": v for k, v in figure("fig07_icl_vs_exposure", "fig07", "Hypotheses").items()},
        **{f"f8_{k}": v for k, v in figure("fig08_early_late", "fig08", "Hypotheses").items()},
        **{f"f9_{k}": v for k, v in figure("fig09_geometry", "fig09", "Hypotheses").items()},
        **{f"f10_{k}": v for k, v in figure("fig10_exposure_series", "fig10", "Exposure").items()},
        **({f"f6d_{k}": v for k, v in figure("fig06_threshold_vs_noise_dose", "fig06", "Hypotheses").items()}
           if DOSE_TABLES else {}),
        **({f"f6b_{k}": v for k, v in figure("fig06_threshold_vs_noise_batch", "fig06", "Hypotheses").items()}
           if BATCH_TABLES else {}),
        **({f"f6s_{k}": v for k, v in figure("fig06_threshold_vs_noise_shape", "fig06", "Hypotheses").items()}
           if ALIGNED else {}),
    params:
        res=RES,
    log:
        "logs/figures/aggregate.log",
    benchmark:
        "benchmarks/figures/aggregate.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise aggregate-figures --aggregate {params.res}/aggregate --exposure {input.exposure} "
        "--alignment {input.alignment} --out-dir {params.res}/figures > {log} 2>&1"


rule report:
    """results/report.md: every figure, table and verdict on one page, with params and code version."""
    input:
        rules.aggregate.output,
        rules.aggregate_figures.output,
        rules.training_figures.output,
        rules.llc_figures.output if PARAMS["llc"]["enabled"] else [],
        rules.refined_figures.output if REFINED else [],
        expand(f"{RES}/ed/{{family}}/forms.parquet", family=list(ED_FAMILIES)),
        expand(f"{RES}/figures/fig05_ed_forms_{{family}}.png", family=list(ED_FAMILIES)),
    output:
        f"{RES}/report.md",
    params:
        res=RES,
        cfg=cfg(*PARAMS),
    log:
        "logs/report.log",
    benchmark:
        "benchmarks/report.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise report --results {params.res} --cfg {params.cfg:q} --out {output} > {log} 2>&1"
