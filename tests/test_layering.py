"""The layering (issues 16 and 64), checked by the import-linter contracts in pyproject.toml.

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


@pytest.mark.integration
def test_contracts_kept() -> None:
    code, out, broken = lint_imports(ROOT / "src")
    assert code == 0 and not broken, out


def stand_in(tmp_path: Path) -> Path:
    """An `iclnoise` package with the real one's subpackages and modules, each module empty."""
    pkg = ROOT / "src" / "iclnoise"
    for path in pkg.rglob("*.py"):
        dest = tmp_path / "iclnoise" / path.relative_to(pkg)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("")
    return tmp_path


@pytest.mark.integration
def test_stand_in_keeps_every_contract(tmp_path: Path) -> None:
    code, out, broken = lint_imports(stand_in(tmp_path))
    assert code == 0 and not broken, out


@pytest.mark.integration
@pytest.mark.parametrize(
    "planted, contract",
    [
        ({"probes/ed.py": "from ..output.figures import style\n"}, "layers"),  # a formula drawing through figures/
        ({"probes/llc.py": "def f():\n    from ..run import runs\n"}, "layers"),  # even a lazy import counts
        ({"core/tasks.py": "from ..config import grid\n"}, "layers"),  # core is the bottom layer
        ({"probes/geometry.py": "import argparse\n"}, "parse-in-commands"),
        ({"analysis/aggregate.py": "import argparse\n"}, "parse-in-commands"),   # outside the command layer, nowhere
        ({"output/figures/style.py": "import argparse\n"}, "parse-in-commands"),  # however deep
        ({"output/paper.py": "from .. import cli\n"}, "layers"),  # nothing imports the command layer
        ({"cli.py": "from .commands import runs\n"}, "layers"),  # cli finds commands by name only
        ({"probes/mech.py": "import matplotlib.pyplot\n"}, "no-drawing"),
        ({"run/train.py": "from ..output.figures import style\n"}, "layers"),
        ({"noise/hooks.py": "from ..analysis import aggregate\n"}, "layers"),
        ({"noise/exposure.py": "from . import injection\n"}, "noise-one-way"),  # the hook path reads one way
        ({"noise/nap.py": "from . import hooks\n"}, "noise-one-way"),
        ({"output/report.py": "from . import paper\n", "output/paper.py": "from . import report\n"}, "acyclic"),
    ],
)
def test_planted_import_breaks_its_contract(tmp_path: Path, planted: dict[str, str], contract: str) -> None:
    src = stand_in(tmp_path)
    for name, text in planted.items():
        (src / "iclnoise" / name).write_text(text)
    code, out, broken = lint_imports(src)
    assert code != 0 and broken == {contract}, out


@pytest.mark.integration
def test_the_command_layer_parses_arguments(tmp_path: Path) -> None:
    src = stand_in(tmp_path)
    (src / "iclnoise" / "commands" / "runs.py").write_text("import argparse\n")
    code, out, broken = lint_imports(src)
    assert code == 0 and not broken, out


@pytest.mark.unit
def test_every_module_has_a_layer() -> None:
    """A new module or subpackage must be placed in a layer of pyproject's [tool.importlinter] before the
    contracts see it: every entry of the package but __init__ is a layer, and every layer exists."""
    contracts = {c["id"]: c for c in tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]}
    layered = {name.strip() for layer in contracts["layers"]["layers"] for name in layer.split("|")}
    pkg = ROOT / "src" / "iclnoise"
    present = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    present |= {p.name for p in pkg.iterdir() if (p / "__init__.py").exists()}
    assert present - layered == set(), "add these modules to a layer in pyproject's [tool.importlinter]"
    assert layered - present == set(), "these layers no longer exist"
    noise = {p.stem for p in (pkg / "noise").glob("*.py") if p.stem != "__init__"}
    ordered = {name.strip() for layer in contracts["noise-one-way"]["layers"] for name in layer.split("|")}
    assert noise == ordered, "place every module of iclnoise.noise in the noise-one-way contract"


@pytest.mark.integration
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
