def run_files(name):
    return expand(f"{RES}/runs/{{run}}/{name}", run=RUNS)


def probe_runs(section):
    """The runs a probe section (llc, geometry, mech) covers (iclnoise.config.grid.jobs)."""
    return [r for r, secs in JOBS["probe"].items() if section in secs]


def probe_files(section, name):
    """Per-run files of a probe section, for the runs it covers."""
    return expand(f"{RES}/runs/{{run}}/{name}", run=probe_runs(section))


REFINED_RUNS = probe_runs("refined")   # llc.seeds and llc.refined.M
REFINED = "refined_figures" in JOBS["single"]


CONDA_ENV = "../envs/iclnoise.yaml"


def figure(stem, caption, category, subcategory=None):
    """A figure's outputs: the PNG in `snakemake --report` (with its caption), the PDF and the plotted data."""
    base = f"{RES}/figures/{stem}"
    return {"png": report(f"{base}.png", caption=f"../report/{caption}.rst", category=category,
                          subcategory=subcategory),
            "pdf": f"{base}.pdf", "data": f"{base}.parquet"}




def missing_marker(run):
    """The marker of a run whose checkpoints.json lists a checkpoint gone from disk (train.smk), None for the others;
    its name changes whenever checkpoints.json is written again, so a marker left behind never hides a later loss."""
    d = Path(RES) / "runs" / run
    gone = missing_checkpoints(d)
    if not gone:
        return None
    key = f"{(d / 'checkpoints.json').stat().st_mtime_ns} {' '.join(map(str, gone))}"
    return f"{d}/checkpoints.missing.{hashlib.sha256(key.encode()).hexdigest()[:12]}"


CKPT_MISSING = {r: m for r in RUNS if (m := missing_marker(r))}  # rule `all` asks for these markers
if workflow.is_main_process:
    for _r in CKPT_MISSING:
        _gone = ", ".join(map(str, missing_checkpoints(f"{RES}/runs/{_r}")))
        logger.warning(f"{_r}: checkpoints {_gone} are missing: its training job trains the run again")


SPECS = {r: typed_spec(PARAMS, r) for r in RUNS}   # each run's typed spec: its hooks, window and outputs


def train_outputs(run):
    """What a run's training job writes: its files and its hooks' tables (iclnoise.core.sections.RunSpec.outputs)."""
    return [f"{RES}/runs/{run}/{n}" for n in SPECS[run].outputs]


def cfg(*names):
    """A command's --cfg (iclnoise.config.grid.job_cfg): the params sections it reads, as in params.yaml (iclnoise.commands),
    less the keys that only select jobs. As a rule's param it reruns the rule when what it computes changes, and
    only then: probing one more seed, or refining one more M, adds jobs and reruns none."""
    return json.dumps(job_cfg(PARAMS, *names))
