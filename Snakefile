# Snakemake entry point. params.yaml is the single source of truth; it is validated here, at
# parse time, so a bad value stops the workflow before any job starts. Rules stay thin: each
# calls one `iclnoise <command>`; the package never imports Snakemake.
import json
from pathlib import Path

from snakemake.utils import min_version, validate

from iclnoise.config import ParamsError, ed_families, expand_grid, parse_run_id, run_spec, validate_params

min_version("9.0")


configfile: "params.yaml"


try:
    PARAMS = validate_params(config)
except ParamsError as err:
    raise WorkflowError(f"params.yaml: {err}") from None
validate(config, "workflow/schemas/params.schema.yaml")

RUNS = [k.run_id for k in expand_grid(PARAMS)]
RES = "results"


wildcard_constraints:
    run=r"M(inf|\d+)-B\d+-[a-z0-9_]+-s\d+",
    family=r"(bym|bynoise)-[A-Za-z0-9_-]+",


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/llc.smk"
include: "workflow/rules/ed.smk"
include: "workflow/rules/probes.smk"
include: "workflow/rules/aggregate.smk"


rule all:
    input:
        rules.report.output,
    default_target: True
