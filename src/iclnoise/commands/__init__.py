"""The command layer: every `iclnoise <command>`, by topic. `iclnoise.cli.COMMANDS` maps a command to
`iclnoise.commands.<topic>:<function>`, the function named as the command with - as _:

- runs: train, check, schema, verify
- probes: llc, llc-calibrate, refined, stages, geometry, mech, ed
- results: figures, llc-figures, refined-figures, ed-figures, aggregate, aggregate-figures, report, export, paper

A command parses its arguments, builds the typed params sections once, calls plain functions of the other
modules and prints. Nothing else in the package parses arguments (pyproject's import-linter contracts).

Params sections come one way: `--cfg JSON` (or `--cfg @file.json`), a mapping {section name: the section
exactly as in params.yaml}, e.g. '{"geometry": {...}}'. A command names the sections it reads (none: it reads
the whole resolved params, as `report` does) and types them with iclnoise.config.typed (`typed(cfg, "llc.sampler")`,
never indexing the dict); the typed sections ignore the workflow's keys enabled and seeds, and the probes
read `every` (and llc `at`) from their section with iclnoise.config.every_at. The Snakemake rules
pass a command the sections it reads less the keys that only select jobs (seeds, families), so a changed
section reruns the rules that read it. (`train`
takes a run spec, `--spec`; `check` and `export` a params file and its overrides, which they validate or record.)
"""
from __future__ import annotations

import argparse
import importlib
import json


def doc(module: str) -> str:
    """The docstring of a module of the package ("figures.llc"), as a command's description."""
    return importlib.import_module(f"iclnoise.{module}").__doc__ or ""


def at_file(text: str) -> str:
    """A JSON option's text: `@file.json` is read from the file, bounded as a params file (a device or a pipe
    included, iclnoise.config.read_bounded); SystemExit names a file that is too long or unreadable."""
    from ..config import ParamsError, read_bounded

    if not text.startswith("@"):
        return text
    try:
        return read_bounded(text[1:]).decode("utf-8", errors="replace")
    except ParamsError as e:
        raise SystemExit(str(e)) from None


def add_cfg(ap: argparse.ArgumentParser, *names: str) -> None:
    """`--cfg` of a command that reads the params sections `names` (none: every section)."""
    what = ", ".join(f'"{n}": {{...}}' for n in names) if names else '"<section>": {...}, ...'
    ap.add_argument("--cfg", required=True, help=f"JSON {{{what}}}: the params.yaml section(s) as they are there "
                    "(or @file.json)")


def sections(text: str, *names: str) -> dict:
    """The mapping {section name: section} of a `--cfg` value (JSON, or @file.json). With `names`, it must hold
    exactly those sections: a rule passes a command the sections it reads, no more (SystemExit otherwise)."""
    try:
        cfg = json.loads(at_file(text))
    except json.JSONDecodeError as e:
        raise SystemExit(f"--cfg is not JSON ({e})") from None
    if not isinstance(cfg, dict) or not all(isinstance(v, dict) for v in cfg.values()):
        raise SystemExit("--cfg must be a mapping {section name: the section as in params.yaml}")
    if names and sorted(cfg) != sorted(names):
        raise SystemExit(f"--cfg holds the section(s) {', '.join(sorted(cfg)) or 'none'}; this command reads "
                         f"exactly {', '.join(names)}")
    return cfg
