# Snakemake entry point. params.yaml is the single source of truth; it is validated here, at
# parse time, so a bad value stops the workflow before any job starts. Rules stay thin: each
# calls one `iclnoise <command>`; the package never imports Snakemake.
import json

from snakemake.utils import min_version, validate

from iclnoise.config import ParamsError, expand_grid, grid_ms, run_spec, section, validate_params

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


include: "workflow/rules/common.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/llc.smk"


def final_outputs():
    out = list(rules.training_figures.output)
    if PARAMS.get("llc", {}).get("enabled", False):
        out += rules.llc_figures.output
    return out


rule all:
    input:
        final_outputs(),
    default_target: True
