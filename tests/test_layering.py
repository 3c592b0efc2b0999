"""The layering of issue 16, checked by the import-linter contracts in pyproject.toml.

`test_contracts_kept` runs them on the package. The other tests show the contracts bite: on a stand-in
package with the same module names and no imports every contract is kept, and each planted import that
the architecture forbids breaks exactly the contract written for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the dev extra (make setup installs it)")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"
CONTRACTS = {c["id"]: c["name"] for c in tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]}
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(src: Path) -> tuple[int, str, set[str]]:
    """Run lint-imports on the `iclnoise` package under `src`; return its exit code, output and broken ids."""
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "250"}
    proc = subprocess.run(
        [sys.executable, "-c", LINT, "--config", str(CONFIG), "--no-cache", "--no-logo"],
        cwd=src, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    broken = {cid for cid, name in CONTRACTS.items() if f"{name} BROKEN" in out}
    return proc.returncode, out, broken


def test_contracts_kept() -> None:
    code, out, broken = lint_imports(ROOT / "src")
    assert code == 0 and not broken, out


def stand_in(tmp_path: Path) -> Path:
    """An `iclnoise` package holding every module the contracts name, each empty."""
    names = {m for c in tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]
             for key in ("source_modules", "forbidden_modules") for m in c.get(key, [])}
    pkg = tmp_path / "iclnoise"
    (pkg / "figures").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "figures" / "__init__.py").write_text("")
    (pkg / "figures" / "style.py").write_text("")
    for name in names:
        if name.startswith("iclnoise.") and name != "iclnoise.figures" and "*" not in name:
            (pkg / f"{name.split('.', 1)[1]}.py").write_text("")
    return tmp_path


def test_stand_in_keeps_every_contract(tmp_path: Path) -> None:
    code, out, broken = lint_imports(stand_in(tmp_path))
    assert code == 0 and not broken, out


@pytest.mark.parametrize(
    "planted, contract",
    [
        ({"ed.py": "from .figures import style\n"}, "formulas"),  # a formula drawing through figures/
        ({"llc.py": "def f():\n    from . import runs\n"}, "formulas"),  # even a lazy import counts
        ({"geometry.py": "import argparse\n"}, "parse-in-commands"),
        ({"aggregate.py": "import argparse\n"}, "parse-in-commands"),   # outside the command layer, nowhere
        ({"paper.py": "from . import cli\n"}, "commands-top"),
        ({"mech.py": "import matplotlib.pyplot\n"}, "formulas-pure"),
        ({"train.py": "from .figures import style\n"}, "run-level"),
        ({"hooks.py": "from . import aggregate\n"}, "run-level"),
        ({"report.py": "from . import aggregate\n", "aggregate.py": "from . import report\n"}, "acyclic"),
    ],
)
def test_planted_import_breaks_its_contract(tmp_path: Path, planted: dict[str, str], contract: str) -> None:
    src = stand_in(tmp_path)
    for name, text in planted.items():
        (src / "iclnoise" / name).write_text(text)
    code, out, broken = lint_imports(src)
    assert code != 0 and broken == {contract}, out


def test_the_command_layer_parses_arguments(tmp_path: Path) -> None:
    src = stand_in(tmp_path)
    (src / "iclnoise" / "commands.py").write_text("import argparse\n")
    code, out, broken = lint_imports(src)
    assert code == 0 and not broken, out


def test_every_module_has_a_tier() -> None:
    """A new module must be placed among formulas, run level or commands before the contracts see it."""
    contracts = {c["id"]: c for c in tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]}
    tiered = set(contracts["formulas"]["source_modules"]) | set(contracts["formulas"]["forbidden_modules"])
    pkg = ROOT / "src" / "iclnoise"
    present = {f"iclnoise.{p.stem}" for p in pkg.glob("*.py") if p.stem != "__init__"}
    present |= {f"iclnoise.{p.name}" for p in pkg.iterdir() if (p / "__init__.py").exists()}
    assert present - tiered == set(), "add these modules to a tier in pyproject's [tool.importlinter]"
    assert tiered - present == set(), "these tiered modules no longer exist"


def test_snakemake_builds_the_dag_without_importing_torch() -> None:
    """Snakemake imports the package to build the DAG (its main process, and each SLURM job again): torch and
    transformer_lens take seconds to import, so the modules the Snakefile reaches (config, validate, cost, grid,
    io, runs, schedules) import them only where a job uses them. On the default's DAG, with its cost check."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "iclnoise.config" in imported, "the profile did not see the Snakefile's imports"
    assert not {"torch", "transformer_lens"} & imported, sorted(m for m in imported if m.startswith("iclnoise"))
