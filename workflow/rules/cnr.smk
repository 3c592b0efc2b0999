# A run's response to counterfactual noise, off by default (cnr.enabled), one job per run that injects noise (of
# cnr.seeds): by common random numbers (iclnoise.run.crn; crn.parquet; the target `snakemake crn`), and by the
# first-order pathwise estimator (iclnoise.run.pathwise; cnr_pathwise.parquet; the target `snakemake cnr`). `all`
# asks for neither.

CNR = PARAMS.get("cnr", {})
CNR_RUNS = [r for r in RUNS if CNR.get("enabled")
            and SPECS[r].injects and SPECS[r].keys.seed in CNR.get("seeds", [SPECS[r].keys.seed])]


rule cnr_run:
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
    output:
        f"{RES}/runs/{{run}}/cnr_pathwise.parquet",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        k=" ".join(str(k) for k in CNR.get("k", [])),   # every key is required once cnr.enabled (validate)
        realisations=CNR.get("realisations"),
        jac_batch=CNR.get("jac_batch"),
    log:
        "logs/cnr/{run}.log",
    threads: 1
    resources:
        mem_mb=3000,
        runtime=240,
    conda:
        CONDA_ENV
    shell:
        "iclnoise cnr-pathwise {params.run_dir} --k {params.k} --realisations {params.realisations} "
        "--jac-batch {params.jac_batch} > {log} 2>&1"


rule cnr:
    """Every such run's cnr_pathwise.parquet (cnr.enabled): the pathwise estimator's predictions."""
    input:
        [f"{RES}/runs/{r}/cnr_pathwise.parquet" for r in CNR_RUNS],


rule crn_run:
    input:
        f"{RES}/runs/{{run}}/metrics.parquet",
    output:
        f"{RES}/runs/{{run}}/crn.parquet",
        f"{RES}/runs/{{run}}/crn_realisations.parquet",
    params:
        run_dir=lambda wc: f"{RES}/runs/{wc.run}",
        cfg=cfg("noise"),
        cfs=" ".join(shlex.quote(c) for c in CNR.get("counterfactuals", [])),
        realisations=CNR.get("realisations"),
    log:
        "logs/crn/{run}.log",
    threads: 1
    resources:
        mem_mb=3000,
        runtime=480,
    conda:
        CONDA_ENV
    shell:
        "iclnoise cnr {params.run_dir} --counterfactual {params.cfs} --cfg {params.cfg:q} "
        "--realisations {params.realisations} > {log} 2>&1"


rule crn:
    """Every such run's crn.parquet (cnr.enabled): CNR's ground truth by common random numbers."""
    input:
        [f"{RES}/runs/{r}/crn.parquet" for r in CNR_RUNS],
