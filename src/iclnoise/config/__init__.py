"""Parameters: params.yaml and overrides loaded (load), checked against the schema and across fields (validate), the
schema itself, generated from the typed sections (schema), the grid of runs and jobs they define (grid), and what it
costs (cost, memory). The typed sections, where every key is declared, are iclnoise.core.sections and its siblings."""
from ..core.sections import ParamsError
from .load import (
    CHECKPOINT_PROBES,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    RESOURCE_KEY,
    TYPED,
    UniqueKeyLoader,
    check_yaml_files,
    every_at,
    load_params,
    merge_params,
    noise_conditions,
    parse_overrides,
    read_bounded,
    read_yaml,
    run_options,
    source_names,
    switch,
    typed,
)
from .validate import dotted_key, validate_params

__all__ = [
    "CHECKPOINT_PROBES", "MAX_YAML_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "RESOURCE_KEY", "TYPED", "ParamsError",
    "UniqueKeyLoader", "check_yaml_files", "dotted_key", "every_at", "load_params", "merge_params", "noise_conditions",
    "parse_overrides", "read_bounded", "read_yaml", "run_options", "source_names", "switch", "typed", "validate_params",
]
