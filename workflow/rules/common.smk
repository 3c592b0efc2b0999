def run_files(name):
    return expand(f"{RES}/runs/{{run}}/{name}", run=RUNS)


EXPOSURE = PARAMS["exposure"]["enabled"]


def probe_runs(section):
    """The runs a probe section (llc, geometry, mech) covers: none when it is disabled, and only the runs
    whose seed is in `<section>.seeds` when that is set."""
    cfg = PARAMS[section]
    if not cfg["enabled"]:
        return []
    seeds = cfg.get("seeds")  # optional: absent = every seed
    return [r for r in RUNS if seeds is None or parse_run_id(r).seed in seeds]


def probe_files(section, name):
    """Per-run files of a probe section, for the runs it covers."""
    return expand(f"{RES}/runs/{{run}}/{name}", run=probe_runs(section))


PROBED = {s: set(probe_runs(s)) for s in ("llc", "geometry", "mech")}


REFINED_RUNS = [r for r in RUNS if refined_covers(PARAMS, parse_run_id(r))]   # llc.seeds and llc.refined.M
REFINED = bool(REFINED_RUNS)


def probe_sections(run):
    """The probe sections a run gets: llc, geometry, mech, and refined (llc.refined, where it covers the run)."""
    secs = [s for s, runs in PROBED.items() if run in runs]
    return secs + ["refined"] if run in REFINED_RUNS else secs


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


def train_outputs(run):
    keys = parse_run_id(run)
    cond = PARAMS["noise"]["conditions"][keys.noise]
    names = ["metrics.parquet", "token_losses.parquet", "root_preds.parquet", "checkpoints.json"]
    names += ["exposure.parquet"] if EXPOSURE or cond["source"] != "none" else []
    names += ["injection.parquet"] if cond["source"] != "none" else []
    return [f"{RES}/runs/{run}/{n}" for n in names]


SELECTION_KEYS = ("seeds", "families", "refined.M")   # which jobs exist, not what a job computes (in a section)


def without(sec, keys):
    """`sec` less `keys`, dotted keys reaching into its subsections."""
    if not isinstance(sec, dict):
        return sec
    return {k: without(v, [x.split(".", 1)[1] for x in keys if x.startswith(k + ".")])
            for k, v in sec.items() if k not in keys}


def cfg(*names):
    """A command's --cfg: the params sections it reads, as in params.yaml (iclnoise.commands) less the keys that
    only select jobs. As a rule's param it reruns the rule when what it computes changes, and only then: probing
    one more seed, or refining one more M, adds jobs and reruns none."""
    return json.dumps({n: without(PARAMS[n], SELECTION_KEYS) for n in names})
