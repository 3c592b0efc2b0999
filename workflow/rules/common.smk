def spec_json(wildcards):
    """The run's resolved spec: a params value, so Snakemake reruns a run when its spec changes."""
    return json.dumps(run_spec(PARAMS, wildcards.run), sort_keys=True)


def run_files(name):
    return expand(f"{RES}/runs/{{run}}/{name}", run=RUNS)


EXPOSURE = PARAMS.get("exposure", {}).get("enabled", False)
