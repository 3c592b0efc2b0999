"""`iclnoise [--log-level LEVEL] <command> ...`: the entry points the Snakemake rules call.

COMMANDS maps each command to `iclnoise.commands.<topic>:<function>`, the function named as the command with
- as _; it parses the command's arguments (iclnoise.commands). `iclnoise each -- A ... -- B ...` runs several
commands in one process, in order.

Logging is configured once, here: records go to stderr as `LEVEL iclnoise <command> module: message`, at the
level of `--log-level` (anywhere on the command line), else $ICLNOISE_LOG_LEVEL, else INFO. Modules log with
`logging.getLogger(__name__)`; Python warnings are logged too.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

COMMANDS = {  # command -> ("iclnoise.commands.<topic>:<command with - as _>", help)
    "train": ("iclnoise.commands.runs:train", "train runs as one ensemble (resumes from their resume states)"),
    "check": ("iclnoise.commands.runs:check", "validate a params file, print the grid and its cost estimate"),
    "schema": ("iclnoise.commands.runs:schema", "write src/iclnoise/params.schema.yaml from the typed sections "
               "(--check: exit 1 where it differs)"),
    "verify": ("iclnoise.commands.runs:verify", "read every table of a results directory; name the unreadable ones"),
    "llc": ("iclnoise.commands.probes:llc", "local learning coefficient per checkpoint of a run"),
    "llc-calibrate": ("iclnoise.commands.probes:llc_calibrate", "choose SGLD's ε, γ, nβ in the stable, non-escaped "
                      "region: a sweep at three checkpoints of a run"),
    "refined": ("iclnoise.commands.probes:refined", "refined LLC per component and susceptibilities at a few "
                "checkpoints of a run"),
    "stages": ("iclnoise.commands.probes:stages", "developmental stages from a run's LLC curve"),
    "geometry": ("iclnoise.commands.probes:geometry", "Hessian trace, top eigenvalue, SAM sharpness per checkpoint"),
    "mech": ("iclnoise.commands.probes:mech", "attention, head ablation, layer-norm and linear probes per "
             "checkpoint"),
    "cnr": ("iclnoise.commands.probes:cnr", "counterfactual noise response by common random numbers: a run forked "
            "at t0 into counterfactual noise x N noise streams, retrained together (crn.parquet)"),
    "cnr-pathwise": ("iclnoise.commands.probes:cnr_pathwise", "CNR's first-order pathwise estimator: a run's "
                     "final metrics had its noise level been k times as large, without retraining "
                     "(cnr_pathwise.parquet)"),
    "ed": ("iclnoise.commands.probes:ed", "essential dynamics of a family of runs"),
    "figures": ("iclnoise.commands.results:figures", "training-curve figures (method §12 fig. 1) and the summary "
                "table"),
    "llc-figures": ("iclnoise.commands.results:llc_figures", "figures 3 (loss and LLC against M) and 4 (LLC over "
                    "training)"),
    "refined-figures": ("iclnoise.commands.results:refined_figures", "figures 11 (refined LLC per head over "
                        "training) and 12 (susceptibilities)"),
    "cnr-figure": ("iclnoise.commands.results:cnr_figure", "CNR's ground truth by common random numbers and an "
                   "estimator's predictions beside it (from a CRN table)"),
    "ed-figures": ("iclnoise.commands.results:ed_figures", "figures 2 and 5 from results/ed/<family>"),
    "aggregate": ("iclnoise.commands.results:aggregate", "outcomes, thresholds and hypothesis tests over all runs"),
    "aggregate-figures": ("iclnoise.commands.results:aggregate_figures", "figures 6-10 from the aggregate tables"),
    "report": ("iclnoise.commands.results:report", "results/report.md from the aggregate tables and figures"),
    "export": ("iclnoise.commands.results:export", "copy a finished results directory's paper tables to a "
               "reference set"),
    "paper": ("iclnoise.commands.results:paper", "every figure and the report again from reference sets (no "
              "training)"),
}
EACH = "several commands in one process: iclnoise each -- llc ARGS -- geometry ARGS ..."
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_ENV = "ICLNOISE_LOG_LEVEL"


def pop_log_level(argv: list[str]) -> tuple[str, list[str]]:
    """(level, argv without `--log-level X` / `--log-level=X`); the level from $ICLNOISE_LOG_LEVEL or INFO when
    the option is absent. An unknown level raises SystemExit naming the allowed ones."""
    level, rest, i = os.environ.get(LOG_ENV) or "INFO", [], 0
    source = f"${LOG_ENV}" if os.environ.get(LOG_ENV) else "default"
    while i < len(argv):
        a = argv[i]
        if a == "--log-level":
            if i + 1 == len(argv):
                raise SystemExit(f"--log-level needs a value; allowed: {', '.join(LEVELS)}")
            level, source, i = argv[i + 1], "--log-level", i + 2
            continue
        if a.startswith("--log-level="):
            level, source = a.split("=", 1)[1], "--log-level"
        else:
            rest.append(a)
        i += 1
    if level.upper() not in LEVELS:
        raise SystemExit(f"{source} = {level!r} is not allowed; allowed: {', '.join(LEVELS)} (any case)")
    return level.upper(), rest


def setup_logging(level: str, command: str) -> None:
    """One stderr handler on the root logger (replacing any earlier one), format naming the command. The
    package logs at `level`; other libraries' records below WARNING are dropped (pydot, matplotlib debug)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s iclnoise {command} %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(max(logging.getLevelName(level), logging.WARNING))
    logging.getLogger("iclnoise").setLevel(level)
    logging.captureWarnings(True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    level, argv = pop_log_level(argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] not in COMMANDS and argv[0] != "each"):
        helps = {**{c: h for c, (_, h) in COMMANDS.items()}, "each": EACH}
        width = max(map(len, helps))
        lines = "\n".join(f"  {c:<{width}}  {h}" for c, h in helps.items())
        print(f"usage: iclnoise [--log-level {{{','.join(LEVELS)}}}] <command> [options]\n\n"
              f"commands:\n{lines}\n\nlog level: --log-level, else ${LOG_ENV}, else INFO")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    cmds = split_each(argv[1:]) if argv[0] == "each" else [argv]
    for cmd in cmds:  # all checked before the first runs
        if not cmd or cmd[0] not in COMMANDS:
            raise SystemExit(f"iclnoise each: {cmd[:1]} is not a command; allowed: {', '.join(COMMANDS)}")
    from .core.io import code_commit

    code_commit()   # the commit of the code this process runs: read now, not when a later commit may have landed
    for cmd in cmds:
        run_command(level, cmd)


def split_each(argv: list[str]) -> list[list[str]]:
    """`-- llc A -- stages B` → [["llc", *A], ["stages", *B]]: the commands one `iclnoise each` process runs
    in order (a probe job pays the interpreter and torch start-up once, not once per probe)."""
    out: list[list[str]] = []
    for a in argv:
        if a == "--":
            out.append([])
        elif not out:
            raise SystemExit("iclnoise each: start every command with --, e.g. iclnoise each -- llc ... -- mech ...")
        else:
            out[-1].append(a)
    return out


def run_command(level: str, argv: list[str]) -> None:
    setup_logging(level, argv[0])
    module, name = COMMANDS[argv[0]][0].split(":")
    getattr(importlib.import_module(module), name)(argv[1:])


if __name__ == "__main__":
    main()
