# One job per probed run: its LLC (and the stages read from it), geometry and mechanistic probes run in one
# process (`iclnoise each`), so a run pays the interpreter, torch and transformer_lens start-up (~4 s) once,
# not once per probe: 18 jobs instead of 72 on the default grid. Which probes a run gets: each section's
# `enabled` and `seeds` (common.smk, probe_sections). Rules are generated per run, named probe_<run>.


def probe_command(run, sections):
    """The `iclnoise each` argument list of one run's probes, shell-quoted."""
    d, p = f"{RES}/runs/{run}", PARAMS
    cmds = []
    if "llc" in sections:
        st = p["llc"]["stages"]
        cmds += [["llc", "--run-dir", d, "--sampler", json.dumps(p["llc"]["sampler"]), "--every",
                  str(p["llc"]["every"]), "--at", json.dumps(p["llc"].get("at")), "--threads", "1"],
                 ["stages", "--run-dir", d, "--sigma", str(st["sigma"]), "--plateau-tol", str(st["plateau_tol"])]]
    if "geometry" in sections:
        cmds.append(["geometry", "--run-dir", d, "--every", str(p["geometry"]["every"]), "--cfg",
                     probe_cfg("geometry")])
    if "mech" in sections:
        cmds.append(["mech", "--run-dir", d, "--every", str(p["mech"]["every"]), "--cfg", probe_cfg("mech"),
                     "--figure", f"{RES}/figures/heads/{run}"])
    return " ".join(shlex.quote(a) for c in cmds for a in ["--", *c])


def probe_outputs(run, sections):
    d = f"{RES}/runs/{run}"
    out = {"llc": [f"{d}/llc.parquet", f"{d}/llc_traces.parquet", f"{d}/stages.parquet"],
           "geometry": [f"{d}/geometry.parquet"],
           "mech": [f"{d}/mech.parquet", *(f"{RES}/figures/heads/{run}{e}" for e in (".pdf", ".png", ".parquet"))]}
    return [f for s in sections for f in out[s]]


for _run in RUNS:
    _sections = probe_sections(_run)
    if not _sections:
        continue

    rule:
        name:
            f"probe_{_run}".replace("-", "_")
        input:
            f"{RES}/runs/{_run}/metrics.parquet",
            f"{RES}/runs/{_run}/checkpoints.json",
        output:
            probe_outputs(_run, _sections),
        params:
            cmd=probe_command(_run, _sections),
        log:
            f"logs/probe/{_run}.log",
        benchmark:
            f"benchmarks/probe/{_run}.tsv"
        threads: 1
        resources:
            mem_mb=3000,
            runtime=120,
        conda:
            CONDA_ENV
        shell:
            "iclnoise each {params.cmd} > {log} 2>&1"
