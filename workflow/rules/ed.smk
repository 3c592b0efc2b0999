ED_FAMILIES = ed_families(PARAMS)


rule ed:
    """Essential dynamics of one family of runs: joint PCA, curve geometry, forms, figures 2 and 5."""
    input:
        preds=lambda w: expand(f"{RES}/runs/{{run}}/root_preds.parquet", run=ED_FAMILIES[w.family]),
        stages=lambda w: (expand(f"{RES}/runs/{{run}}/stages.parquet", run=ED_FAMILIES[w.family])
                          if PARAMS.get("llc", {}).get("enabled", False) else []),
    output:
        multiext(f"{RES}/ed/{{family}}/", "pcs.parquet", "variance.parquet", "events.parquet", "forms.parquet"),
        multiext(f"{RES}/figures/fig02_essential_subspace_{{family}}", ".pdf", ".png", ".parquet"),
        multiext(f"{RES}/figures/fig05_ed_forms_{{family}}", ".pdf", ".png", ".parquet"),
    params:
        cfg=json.dumps({k: v for k, v in PARAMS.get("ed", {}).items() if k not in ("enabled", "families", "seeds")}),
        run_dirs=lambda w: [f"{RES}/runs/{r}" for r in ED_FAMILIES[w.family]],
    log:
        "logs/ed/{family}.log",
    benchmark:
        "benchmarks/ed/{family}.tsv"
    shell:
        "iclnoise ed {params.run_dirs} --family {wildcards.family} --out {RES}/ed/{wildcards.family} "
        "--figures {RES}/figures --cfg {params.cfg:q} > {log} 2>&1"
