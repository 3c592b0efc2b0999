"""`iclnoise <command> ...`: the entry points the Snakemake rules call (one module per command)."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("iclnoise.train", "train one run (resumes from its last checkpoint)"),
    "figures": ("iclnoise.figures.training", "training-curve figures (SPEC §12 fig. 1) and the summary table"),
    "llc": ("iclnoise.llc", "local learning coefficient per checkpoint of a run"),
    "llc-calibrate": ("iclnoise.llc", "sweep SGLD step size / localization on one checkpoint"),
    "stages": ("iclnoise.stages", "developmental stages from a run's LLC curve"),
    "llc-figures": ("iclnoise.figures.llc", "figures 3 (loss and LLC against M) and 4 (LLC over training)"),
    "ed": ("iclnoise.ed", "essential dynamics of a family of runs"),
    "geometry": ("iclnoise.geometry", "Hessian trace, top eigenvalue, SAM sharpness per checkpoint"),
    "mech": ("iclnoise.mech", "attention, head ablation, layer-norm and linear probes per checkpoint"),
    "aggregate": ("iclnoise.aggregate", "outcomes, thresholds and hypothesis tests over all runs"),
    "report": ("iclnoise.report", "results/report.md from the aggregate tables and figures"),
    "check": ("iclnoise.config", "validate a params file and print the grid"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = "\n".join(f"  {c:<{width}}  {h}" for c, (_, h) in COMMANDS.items())
        print(f"usage: iclnoise <command> [options]\n\ncommands:\n{lines}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    fn = getattr(module, "cli_" + argv[0].replace("-", "_"), None) or module.cli
    fn(argv[1:])


if __name__ == "__main__":
    main()
