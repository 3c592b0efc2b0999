"""DVC from a fresh clone: the repository itself is a DVC repository (.dvc/config committed).

One scenario, as a user meets it: clone → `dvc repro` → `dvc push` to the default remote (a directory
beside the clone) → a second clone `dvc pull`s identical results → `dvc repro` there is a no-op → one
changed statistics parameter reruns only the aggregation and the report → `dvc metrics show` →
`dvc exp run -S train.optimizer.lr=…` retrains and shows in `dvc exp show`.
"""
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_pipeline import ENV, ROOT, tiny_params

from iclnoise.core.io import read_parquet

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("git") is None, reason="git is required"),
]

# TODO(lead): results/aggregate/metrics.json is written by `iclnoise aggregate` on the stats branch. Once it
# is merged, set this to False so that `dvc metrics show` / `dvc exp show` must print the metric.
METRICS_JSON_PENDING = False
# TODO(lead): a run whose spec changed resumes from its old final checkpoint and returns its old numbers
# (issue 14, "run identity"). Once runs restart when their spec changes, set this to False.
STALE_RESUME_PENDING = False

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "init.defaultBranch=main"]


def sh(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**ENV, "PYTHONPATH": str(cwd / "src")}  # the clone's code, not this worktree's
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def dvc(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh([str(Path(ENV["PATH"].split(os.pathsep)[0]) / "dvc"), *args], cwd, check)


def dvc_params() -> dict:
    """Two runs (M = 1, 4), 30 steps, probes off: the DVC mechanics, not the science, in about a minute."""
    p = tiny_params(Ms=(1, 4))
    p["grid"].update(batch_sizes=[16], noise=["none"])
    for section in ("llc", "geometry", "mech", "ed"):
        p[section]["enabled"] = False
    return p


def origin_repo(tmp: Path) -> Path:
    """A bare git repository holding this worktree's files (tracked and untracked-but-not-ignored, as they
    are now) with the tiny params.yaml: what a user clones."""
    work = tmp / "origin-work"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src, dst = ROOT / name, work / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the worktree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    (work / "params.yaml").write_text(yaml.safe_dump(dvc_params()))
    sh([*GIT, "init", "-q"], work)
    sh([*GIT, "add", "-A"], work)
    sh([*GIT, "commit", "-q", "-m", "tiny"], work)
    sh([*GIT, "clone", "-q", "--bare", str(work), str(tmp / "origin.git")], tmp)
    return tmp / "origin.git"


def digests(root: Path, *paths: str) -> dict[str, str]:
    """sha256 of every file below `paths` (relative to root)."""
    out = {}
    for p in paths:
        for f in sorted((root / p).rglob("*")):
            if f.is_file():
                out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.mark.timeout(1800)
def test_dvc_from_a_fresh_clone_repro_push_pull_noop_and_partial_rerun(tmp_path):
    origin = origin_repo(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    sh([*GIT, "clone", "-q", str(origin), str(a)], tmp_path)
    assert (a / ".dvc/config").exists()  # a DVC repository as cloned, no `dvc init`

    first = dvc(a, "repro")
    assert "Running stage 'pipeline'" in first.stdout
    assert "Hypothesis verdicts" in (a / "results/report.md").read_text()
    assert sorted((a / "results/runs/M1-B16-none-s0/checkpoints").glob("*.pt")), "training wrote no checkpoints"
    pushed = dvc(a, "push")
    assert (tmp_path / "iclnoise-dvc-remote").is_dir(), pushed.stdout  # the committed default remote
    sh([*GIT, "add", "dvc.lock"], a)
    sh([*GIT, "commit", "-q", "-m", "results of the tiny grid"], a)
    sh([*GIT, "push", "-q", "origin", "HEAD"], a)

    sh([*GIT, "clone", "-q", str(origin), str(b)], tmp_path)
    dvc(b, "pull")
    outs = ("results", ".snakemake/metadata")
    # identical results; checkpoints and resume states stay out of DVC (.dvcignore): neither pushed nor pulled
    unversioned = re.compile(r"/checkpoints/|/resume[^/]*\.pt$")
    assert digests(b, *outs) == {k: v for k, v in digests(a, *outs).items() if not unversioned.search(k)}
    assert not list(b.glob("results/runs/*/checkpoints")) and not list(b.glob("results/runs/*/resume*.pt"))
    assert "Data and pipelines are up to date" in dvc(b, "status").stdout
    # pulled files are copies (or reflinks), never links to the cache: a file truncated in place leaves the
    # cached object whole, `dvc status` names the change and `dvc checkout` restores the file
    pulled = b / "results/runs/M1-B16-none-s0/metrics.parquet"
    good = pulled.read_bytes()
    assert not pulled.is_symlink() and pulled.stat().st_nlink == 1, pulled.stat()
    os.truncate(pulled, 10)
    assert "modified" in dvc(b, "status").stdout
    dvc(b, "checkout", "--force")
    assert pulled.read_bytes() == good
    assert "Data and pipelines are up to date" in dvc(b, "status").stdout
    noop = dvc(b, "repro")
    assert "Running stage" not in noop.stdout and "didn't change" in noop.stdout, noop.stdout

    # a statistics setting: the stage reruns, Snakemake reruns aggregate and report, trains nothing
    p = yaml.safe_load((b / "params.yaml").read_text())
    p["stats"]["equivalence_fraction"] += 0.01
    (b / "params.yaml").write_text(yaml.safe_dump(p))
    trained = digests(b, "results/runs")
    report = (b / "results/report.md").read_text()
    rerun = dvc(b, "repro")
    assert "Running stage 'pipeline'" in rerun.stdout
    log = rerun.stdout + rerun.stderr
    assert "rule aggregate" in log and "rule train_" not in log, log[-3000:]
    # (mtimes say nothing here: DVC copies linked `persist` outputs back into the workspace before a rerun)
    assert digests(b, "results/runs") == trained
    assert (b / "results/report.md").read_text() != report

    plots = dvc(b, "plots", "show", "-o", str(tmp_path / "plots"))  # warns that it cannot read the PDFs
    assert (tmp_path / "plots/static/workspace_results_figures_fig01_ood_loss.png").exists(), plots.stdout
    shown = dvc(b, "metrics", "show")
    if not METRICS_JSON_PENDING:
        # M* itself is null on two M values (too few to fit), so DVC shows its gates and reasons
        assert "results/aggregate/metrics.json" in shown.stdout and "thresholds.none/B16" in shown.stdout, shown.stdout

    # an experiment on the learning rate: retrains, and is listed with its parameter value
    before = read_parquet(a / "results/runs/M1-B16-none-s0/metrics.parquet")
    exp = dvc(a, "exp", "run", "-S", "train.optimizer.lr=0.005")  # the default is 0.003
    assert "Ran experiment" in exp.stdout + exp.stderr
    table = dvc(a, "exp", "show", "--no-pager", "--csv").stdout
    rows = list(csv.DictReader(io.StringIO(table)))
    exps = [r for r in rows if r["Experiment"] and r["train.optimizer.lr"] == "0.005"]  # named experiment rows
    assert len(exps) == 1, table[-3000:]
    if not METRICS_JSON_PENDING:
        assert any(k.startswith("thresholds.") and v not in ("", "-") for k, v in exps[0].items()), exps[0]
    after = read_parquet(a / "results/runs/M1-B16-none-s0/metrics.parquet")  # the experiment, applied
    if not STALE_RESUME_PENDING:
        assert after.lr.max() != before.lr.max() and not after.train_loss.equals(before.train_loss)
