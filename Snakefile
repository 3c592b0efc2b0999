# Snakemake entry point. params.yaml is the single source of truth; it is validated here, at
# parse time, so a bad value stops the workflow before any job starts. Rules stay thin: each
# calls one `iclnoise <command>`; the package never imports Snakemake.
import hashlib
import json
import shlex
from pathlib import Path

from snakemake.utils import min_version

from iclnoise.config import (
    ParamsError,
    check_yaml_files,
    merge_params,
    parse_overrides,
    run_options,
    source_names,
    switch,
    validate_params,
)
from iclnoise.config.cost import PARAMS_RECORD, check_cost, format_cost, rerun_note
from iclnoise.core.io import write_json
from iclnoise.config.grid import (
    PROBE_TABLES, ed_families, expand_grid, has_batch_axis, has_dose_series, job_cfg, jobs, shared_spec, typed_spec,
)
from iclnoise.run.runs import missing_checkpoints

min_version("9.0")


configfile: "params.yaml"


# Keys that configure how the workflow runs, not what it computes (not part of params.yaml's schema).
RUN_KEYS = ("train_resources", "train_gpu_resources", "train_threads", "confirm_cost")
# --config key=value. Snakemake reads a mapping's values as strings: the params keys' are read as YAML scalars, as
# in a file (the run keys keep their words: `confirm_cost=yes` must not read as true).
CONFIG_ARGS = dict(workflow.config_settings.config)
OVERRIDES = parse_overrides({k: v for k, v in CONFIG_ARGS.items() if k not in RUN_KEYS})
try:
    check_yaml_files(["params.yaml", *workflow.configfiles])  # duplicate keys, syntax errors with line numbers
    VALUES = merge_params(config, OVERRIDES)
    PARAMS = validate_params({k: v for k, v in VALUES.items() if k not in RUN_KEYS})
    confirmed = switch(VALUES.get("confirm_cost", False), "confirm_cost")
    TRAIN_THREADS, TRAIN_RESOURCES = run_options(VALUES, PARAMS["train"]["device"])
    COST = check_cost(PARAMS, confirmed=confirmed) if workflow.is_main_process else None
except ParamsError as err:
    raise WorkflowError(f"{source_names(['params.yaml', *workflow.configfiles], CONFIG_ARGS)}: {err}") from None
if COST:
    logger.info(f"grid: {format_cost(COST)}")
    NOTE = rerun_note(PARAMS, "results")
    if NOTE:
        logger.info(NOTE)

RUNS = [k.run_id for k in expand_grid(PARAMS)]
JOBS = jobs(PARAMS)   # the jobs of the DAG, by kind (iclnoise.config.grid.jobs, which iclnoise.config.cost counts)
GROUPS = JOBS["train"]
RES = "results"


wildcard_constraints:
    run=r"M(inf|\d+)-B\d+-[a-z0-9_]+(-sgd_momentum)?-s\d+",
    family=r"(bym|bynoise)-[A-Za-z0-9_-]+",
    tag=r"[0-9a-f]{12}",


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/llc.smk"
include: "workflow/rules/ed.smk"
include: "workflow/rules/probes.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/cnr.smk"


# Snakemake rebuilds a missing file only when a target asks for it, not when a file made from it is
# present: so `all` names every artifact, and any deleted or failed output is rebuilt by plain `snakemake`.
rule all:
    """Every artifact: each run's training and probe outputs, essential dynamics, figures, aggregate, report."""
    input:
        [f for r in RUNS for f in train_outputs(r)],
        list(CKPT_MISSING.values()),
        [f for r, secs in JOBS["probe"].items() for f in probe_outputs(r, secs)],
        expand(rules.ed.output, family=list(ED_FAMILIES)),
        expand(rules.ed_figures.output, family=list(ED_FAMILIES)),
        rules.training_figures.output,
        rules.llc_figures.output if "llc_figures" in JOBS["single"] else [],
        rules.refined_figures.output if REFINED else [],
        rules.aggregate.output,
        rules.aggregate_figures.output,
        rules.report.output,
    default_target: True


onsuccess:
    write_json(PARAMS, f"{RES}/{PARAMS_RECORD}")  # what the next run's rerun note compares against
