"""results/report.md: figures, tables and hypothesis verdicts on one page, with provenance."""
from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
from pathlib import Path

import yaml

from . import __version__
from .io import read_parquet, write_text

FIGURES = [
    ("fig01_ood_loss", "1. OOD loss over training per M (t_crit circles; dotted: dMMSE_M, dashed: ridge)"),
    ("fig02_essential_subspace", "2. Essential subspace: joint trajectory PCA with dMMSE_M (◆) and ridge (■)"),
    ("fig03_loss_llc_vs_m", "3. End-of-training loss and LLC against M"),
    ("fig04_llc_over_training", "4. LLC over training with stage boundaries"),
    ("fig05_ed_forms", "5. Essential-dynamics plane curves, evolutes and forms"),
    ("fig06_threshold_vs_noise", "6. Task-diversity threshold M* against noise level (headline)"),
    ("fig07_icl_vs_exposure", "7. ICL outcome against integrated exposure (H1, H3)"),
    ("fig08_early_late", "8. Early vs late noise at equal exposure (H2)"),
    ("fig09_geometry", "9. Geometry probes against exposure and ICL (H4)"),
    ("fig10_exposure_series", "10. P-NE time series per condition"),
]


def code_version(root: Path) -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return f"git {out.stdout.strip()} (iclnoise {__version__})"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"iclnoise {__version__} (no git checkout)"


def build(results: Path, params: dict, root: Path) -> str:
    agg, figs = results / "aggregate", results / "figures"
    lines = ["# Does stochastic gradient noise drive in-context learning? — report", "",
             f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC} from {code_version(root)}.", ""]
    if (agg / "tests.parquet").exists():
        tests = read_parquet(agg / "tests.parquet")
        lines += ["## Hypothesis verdicts", "",
                  "Effect sizes with 95 % CIs; p-values Holm-adjusted across the family. "
                  "A test that could not run says why.", ""]
        for _, t in tests.iterrows():
            if t.status == "run":
                lines.append(f"- **{t.hypothesis}** — {t.test}, {t.outcome}: estimate {t.estimate:.3g} "
                             f"[{t.ci_lo:.3g}, {t.ci_hi:.3g}], effect size {t.effect_size:.3g}, n = {t.n}. {t.verdict}.")
            else:
                lines.append(f"- **{t.hypothesis}** — {t.test}, {t.outcome}: {t.status}.")
        lines.append("")
    lines += ["## Figures", ""]
    for stem, caption in FIGURES:
        pngs = sorted(figs.glob(f"{stem}.png")) + sorted(figs.glob(f"{stem}_*.png"))
        if pngs:
            lines += [f"### {caption}", ""]
            lines += [f"![{png.stem}]({os.path.relpath(png, results)})" for png in pngs] + [""]
    for name, title in (("thresholds", "Task-diversity thresholds"), ("outcomes", "Outcomes per run"),
                        ("tests", "Hypothesis tests (full table)")):
        md = agg / f"{name}.md"
        if md.exists():
            lines += [f"## {title}", "", md.read_text(), ""]
    lines += ["## Parameters", "", "```yaml", yaml.safe_dump(params, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise report", description=__doc__)
    ap.add_argument("--results", default="results")
    ap.add_argument("--params", default="{}", help="the resolved parameters as JSON/YAML")
    ap.add_argument("--out", default="results/report.md")
    a = ap.parse_args(argv)
    params = yaml.safe_load(a.params) or {}
    write_text(build(Path(a.results), params, Path.cwd()), a.out)
    print(f"wrote {a.out}")
