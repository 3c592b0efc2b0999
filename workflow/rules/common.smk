def spec_json(wildcards):
    """The run's resolved spec: a params value, so Snakemake reruns a run when its spec changes."""
    return json.dumps(run_spec(PARAMS, wildcards.run), sort_keys=True)


def run_files(name):
    return expand(f"{RES}/runs/{{run}}/{name}", run=RUNS)


EXPOSURE = PARAMS.get("exposure", {}).get("enabled", False)


def probe_files(section, name):
    """Per-run files of a probe section (llc, geometry, mech): none when it is disabled, and only the
    runs whose seed is in `<section>.seeds` when that is set."""
    cfg = PARAMS.get(section, {})
    if not cfg.get("enabled", False):
        return []
    seeds = cfg.get("seeds")
    runs = [r for r in RUNS if seeds is None or parse_run_id(r).seed in seeds]
    return expand(f"{RES}/runs/{{run}}/{name}", run=runs)
