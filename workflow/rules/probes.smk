# One job per probed run: its LLC (the stages read from it, the refined LLC and susceptibilities at a few of its
# checkpoints: llc.refined), geometry and mechanistic probes run in one
# process (`iclnoise each`), so a run pays the interpreter, torch and transformer_lens start-up (~4 s) once,
# not once per probe: 18 jobs instead of 72 on the default grid. Which probes a run gets: each section's
# `enabled` and `seeds` (iclnoise.config.grid.jobs). Rules are generated per run, named probe_<run>.


def probe_command(run, sections):
    """The `iclnoise each` argument list of one run's probes, shell-quoted: each probe gets its params section
    (llc, stages and refined the llc section), so the rule's param changes with any of them."""
    d = f"{RES}/runs/{run}"
    cmds = []
    if "llc" in sections:
        cmds += [["llc", "--run-dir", d, "--cfg", cfg("llc"), "--threads", "1"],
                 ["stages", "--run-dir", d, "--cfg", cfg("llc")]]
    if "geometry" in sections:
        cmds.append(["geometry", "--run-dir", d, "--cfg", cfg("geometry")])
    if "mech" in sections:
        cmds.append(["mech", "--run-dir", d, "--cfg", cfg("mech"), "--figure", f"{RES}/figures/heads/{run}"])
    if "refined" in sections:   # last: the other probes' numbers are those of a job without it
        cmds.append(["refined", "--run-dir", d, "--cfg", cfg("llc"), "--threads", "1"])
    return " ".join(shlex.quote(a) for c in cmds for a in ["--", *c])


def probe_outputs(run, sections):
    """The run's probe tables (iclnoise.config.grid.PROBE_TABLES) and, with mech, its heads figure."""
    heads = [f"{RES}/figures/heads/{run}{e}" for e in (".pdf", ".png", ".parquet")] if "mech" in sections else []
    return [f"{RES}/runs/{run}/{f}" for s in sections for f in PROBE_TABLES[s]] + heads


for _run, _sections in JOBS["probe"].items():
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
