# Counterfactual noise replay (iclnoise.run.replay), off by default (cnr.enabled): one job per run that injects noise
# (of cnr.seeds), writing its cnr.parquet; the target `snakemake cnr` asks for all of them (`all` does not).

CNR = PARAMS.get("cnr", {})
CNR_RUNS = [r for r in RUNS if CNR.get("enabled")
            and SPECS[r].injects and SPECS[r].keys.seed in CNR.get("seeds", [SPECS[r].keys.seed])]


rule cnr_run:
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
    output:
        f"{RES}/runs/{{run}}/cnr.parquet",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        cfg=cfg("noise"),
        cfs=" ".join(shlex.quote(c) for c in CNR.get("counterfactuals", [])),
        probes=CNR.get("probes", 16),
        jac_batch=CNR.get("jac_batch", 16),
    log:
        "logs/cnr/{run}.log",
    threads: 1
    resources:
        mem_mb=3000,
        runtime=240,
    conda:
        CONDA_ENV
    shell:
        "iclnoise cnr-replay {params.run_dir} --counterfactual {params.cfs} --cfg {params.cfg:q} "
        "--probes {params.probes} --jac-batch {params.jac_batch} > {log} 2>&1"


rule cnr:
    """Every replayed run's cnr.parquet (cnr.enabled)."""
    input:
        [f"{RES}/runs/{r}/cnr.parquet" for r in CNR_RUNS],
