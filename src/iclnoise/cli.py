"""`iclnoise [--log-level LEVEL] <command> ...`: the entry points the Snakemake rules call (one module per command).

Logging is configured once, here: records go to stderr as `LEVEL iclnoise <command> module: message`, at the
level of `--log-level` (anywhere on the command line), else $ICLNOISE_LOG_LEVEL, else INFO. Modules log with
`logging.getLogger(__name__)`; Python warnings are logged too.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

COMMANDS = {  # command -> (module whose `cli` (or `cli_<command>`, or the function named in commands) runs it, help)
    "train": ("iclnoise.train", "train runs as one ensemble (resumes from their resume states)"),
    "figures": ("iclnoise.figures.training", "training-curve figures (SPEC §12 fig. 1) and the summary table"),
    "llc": ("iclnoise.commands", "local learning coefficient per checkpoint of a run"),
    "llc-calibrate": ("iclnoise.commands", "sweep SGLD step size / localization on one checkpoint"),
    "stages": ("iclnoise.commands", "developmental stages from a run's LLC curve"),
    "llc-figures": ("iclnoise.figures.llc", "figures 3 (loss and LLC against M) and 4 (LLC over training)"),
    "ed": ("iclnoise.commands", "essential dynamics of a family of runs"),
    "ed-figures": ("iclnoise.figures.ed", "figures 2 and 5 from results/ed/<family>"),
    "geometry": ("iclnoise.commands", "Hessian trace, top eigenvalue, SAM sharpness per checkpoint"),
    "mech": ("iclnoise.commands", "attention, head ablation, layer-norm and linear probes per checkpoint"),
    "aggregate": ("iclnoise.aggregate", "outcomes, thresholds and hypothesis tests over all runs"),
    "report": ("iclnoise.report", "results/report.md from the aggregate tables and figures"),
    "check": ("iclnoise.config", "validate a params file, print the grid and its cost estimate"),
    "verify": ("iclnoise.commands", "read every table of a results directory; name the unreadable ones"),
    "export": ("iclnoise.paper", "copy a finished results directory's paper tables to a reference set"),
    "paper": ("iclnoise.paper", "every figure and the report again from reference sets (no training)"),
    "each": ("iclnoise.cli", "several commands in one process: iclnoise each -- llc ARGS -- geometry ARGS ..."),
}
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
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {c:<{width}}  {h}" for c, (_, h) in COMMANDS.items())
        print(f"usage: iclnoise [--log-level {{{','.join(LEVELS)}}}] <command> [options]\n\n"
              f"commands:\n{lines}\n\nlog level: --log-level, else ${LOG_ENV}, else INFO")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    cmds = split_each(argv[1:]) if argv[0] == "each" else [argv]
    for cmd in cmds:  # all checked before the first runs
        if not cmd or cmd[0] not in COMMANDS or cmd[0] == "each":
            raise SystemExit(f"iclnoise each: {cmd[:1]} is not a command; allowed: {', '.join(COMMANDS)}")
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
    module = importlib.import_module(COMMANDS[argv[0]][0])
    name = argv[0].replace("-", "_")
    fn = getattr(module, name if module.__name__ == "iclnoise.commands" else "cli_" + name, None) or module.cli
    fn(argv[1:])


if __name__ == "__main__":
    main()
