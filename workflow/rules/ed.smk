ED_FAMILIES = JOBS["ed"]
if ed_families(PARAMS, single=True):
    logger.info(f"ed: no family for {', '.join(ed_families(PARAMS, single=True))} (one run each: a condition at "
                f"one M, or a grid with one M): essential dynamics needs two runs")


rule ed:
    """Essential dynamics of one family of runs: joint PCA, curve geometry in log-step time, forms (method §8)."""
    input:
        preds=lambda w: expand(f"{RES}/runs/{{run}}/root_preds.parquet", run=ED_FAMILIES[w.family]),
        stages=lambda w: (expand(f"{RES}/runs/{{run}}/stages.parquet", run=ED_FAMILIES[w.family])
                          if PARAMS["llc"]["enabled"] else []),
    output:
        multiext(f"{RES}/ed/{{family}}/", "pcs.parquet", "variance.parquet", "events.parquet", "forms.parquet",
                 "sampling.parquet"),
    params:
        res=RES,
        cfg=cfg("ed"),
        run_dirs=lambda w: [f"{RES}/runs/{r}" for r in ED_FAMILIES[w.family]],
    log:
        "logs/ed/{family}.log",
    benchmark:
        "benchmarks/ed/{family}.tsv"
    resources:
        mem_mb=4000,
    conda:
        CONDA_ENV
    shell:
        "iclnoise ed {params.run_dirs} --family {wildcards.family} --out {params.res}/ed/{wildcards.family} "
        "--cfg {params.cfg:q} > {log} 2>&1"


rule ed_figures:
    """method §12 figures 2 (essential subspace) and 5 (plane curves, evolutes, forms) of one family."""
    input:
        rules.ed.output,
        metrics=lambda w: expand(f"{RES}/runs/{{run}}/metrics.parquet", run=ED_FAMILIES[w.family]),
    output:
        **{f"sub_{k}": v for k, v in figure("fig02_essential_subspace_{family}", "fig02", "Essential dynamics").items()},
        **{f"forms_{k}": v for k, v in figure("fig05_ed_forms_{family}", "fig05", "Essential dynamics").items()},
    params:
        res=RES,
        cfg=cfg("ed"),
        run_dirs=lambda w: [f"{RES}/runs/{r}" for r in ED_FAMILIES[w.family]],
    log:
        "logs/ed/{family}_figures.log",
    benchmark:
        "benchmarks/ed/{family}_figures.tsv"
    conda:
        CONDA_ENV
    shell:
        "iclnoise ed-figures {params.run_dirs} --family {wildcards.family} --ed {params.res}/ed/{wildcards.family} "
        "--figures {params.res}/figures --cfg {params.cfg:q} > {log} 2>&1"
