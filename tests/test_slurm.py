"""The tiny DAG on a real SLURM cluster through the shipped CPU profile (`make test-slurm`).

`make test-slurm` starts a single-node cluster on localhost (scripts/slurm-cluster.sh: slurmctld, slurmd,
munge; partitions `cpu` and `gpu` on the same node, no accounting database), sets ICLNOISE_SLURM=1 and
SLURM_CONF, runs this file and stops the cluster. Without that environment the cluster tests are skipped;
the dry runs of both profiles need no cluster.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_pipeline import ENV, ROOT, run, snakemake, tiny_params

from iclnoise.core.io import read_parquet

pytestmark = pytest.mark.integration

needs_cluster = pytest.mark.skipif(os.environ.get("ICLNOISE_SLURM") != "1",
                                   reason="needs the single-node SLURM cluster that `make test-slurm` starts")

# The shipped CPU profile. Two test-only settings: poll squeue every few seconds instead of the
# plugin's 40 s (the tiny jobs take seconds), and no account (the cluster has no accounting).
SLURM_ARGS = ["--profile", str(ROOT / "slurm-cpu"), "--slurm-init-seconds-before-status-checks", "2",
              "--slurm-no-account"]


def slurm_snakemake_cmd(workdir: Path, *targets: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
            str(workdir), *SLURM_ARGS, *targets]


# the comment the executor gives a training job: rule_train_<group or wildcards>, rule_train_ensemble_...
# (not rule_training_figures)
TRAIN_JOB = r"rule_train(_ensemble)?(_|$)"


def slurm_jobs(workdir: Path) -> pd.DataFrame:
    """The jobs slurmctld still knows (finished ones for MinJobAge = 3600 s) that a Snakemake run in `workdir`
    submitted (the executor's `sbatch -D`), so tests running beside each other see only their own: id, partition,
    comment, state."""
    out = run(["squeue", "--states=all", "--noheader", "--format=%i|%P|%k|%T|%Z"], cwd=ROOT).stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    jobs = pd.DataFrame(rows, columns=["id", "partition", "comment", "state", "workdir"]).astype({"id": int})
    return jobs[jobs.workdir == str(workdir.resolve())].drop(columns="workdir")


def write_params(workdir: Path, p: dict) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "params.yaml").write_text(yaml.safe_dump(p))


def small_grid() -> dict:
    """Two runs (M = 1, 4; batch 16; batch noise only), 30 steps, every probe on with tiny settings."""
    p = tiny_params(Ms=(1, 4))
    p["grid"].update(batch_sizes=[16], noise=["none"])
    return p


@pytest.mark.parametrize("profile, device, want", [
    ("slurm", "cuda", {"gpu": "1", "cpus_per_task": "4", "mem_mb": "16000", "slurm_partition": "gpu"}),
    ("slurm", "auto", {"gpu": None, "cpus_per_task": "4", "mem_mb": "16000", "slurm_partition": "gpu"}),
    ("slurm-cpu", "auto", {"gpu": None, "cpus_per_task": "1", "mem_mb": "3000", "slurm_partition": "gpu"}),
])
def test_profile_asks_for_one_training_jobs_resources(tmp_path, profile, device, want):
    """Dry run: every training job (`train`, or `train_ensemble` for a group of runs) is a SLURM job of its
    own with the resources of one job, with a GPU where train.device is cuda. Grouping several jobs
    (group-components: train=8) made Snakemake sum them: 8 GPUs, 32 CPUs and 128 GB for one group."""
    p = small_grid()
    p["train"]["device"] = device
    write_params(tmp_path, p)
    r = run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
             str(tmp_path), "--profile", str(ROOT / profile), "-n"], cwd=tmp_path)
    out = r.stdout
    assert f"and workflow specific profile {ROOT / 'profiles/default'}" in r.stderr   # rerun-incomplete applies too
    jobs = re.findall(r"rule (train_B\w+):\n(?:[ \t]+\w+:.*\n)*?[ \t]+resources: (.*)", out)
    assert jobs, out[-3000:]
    for _, resources in jobs:
        got = dict(kv.split("=", 1) for kv in resources.split(", "))
        assert {k: got.get(k) for k in want} == want, resources
    assert out.count("Group job") in (0, len(jobs)), out[-3000:]  # no group of several training jobs


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tiny_dag_runs_end_to_end_through_the_cpu_profile(tmp_path):
    write_params(tmp_path, small_grid())
    t0 = time.time()
    run(slurm_snakemake_cmd(tmp_path), cwd=tmp_path)
    print(f"tiny DAG through SLURM: {time.time() - t0:.0f} s")
    assert "Hypothesis verdicts" in (tmp_path / "results/report.md").read_text()
    assert (tmp_path / "results/figures/fig01_ood_loss.png").exists()
    m = read_parquet(tmp_path / "results/runs/M4-B16-none-s0/metrics.parquet")
    assert m.step.iloc[-1] == 30
    # every job ran as a SLURM job, training in partition gpu, everything else in cpu
    jobs = slurm_jobs(tmp_path)
    assert (jobs.state == "COMPLETED").all(), jobs
    train = jobs.comment.str.match(TRAIN_JOB)
    # two runs: two `train` jobs, or one or two `train_ensemble` jobs
    assert train.sum() in (1, 2) and (jobs.partition[train] == "gpu").all(), jobs
    assert len(jobs) >= 9 and (jobs.partition[~train] == "cpu").all(), jobs
    # one probe job per run (llc, stages, geometry and mech in one process: rules probe_<run>)
    probes = sorted(c.removeprefix("rule_probe_") for c in jobs.comment if c.startswith("rule_probe_"))
    assert probes == ["M1_B16_none_s0", "M4_B16_none_s0"], jobs
    for rule in ("ed", "llc_figures", "aggregate", "report"):
        assert jobs.comment.str.startswith(f"rule_{rule}").any(), (rule, jobs)
    assert "Nothing to be done" in snakemake(tmp_path, "-n").stdout


def checkpoints(run_dir: Path) -> dict[Path, int]:
    """Every checkpoint file of a run (any *.pt below its directory) with its mtime."""
    return {p: p.stat().st_mtime_ns for p in sorted(run_dir.rglob("*.pt"))}


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cancelled_training_job_resumes_from_its_checkpoint_to_the_same_numbers(tmp_path):
    """scancel a training job once it has written checkpoints; the profile's retry resumes it (the first
    checkpoint, step 0, is kept, not rewritten as a fresh start would) and its metrics equal an
    uninterrupted run's, value for value."""
    p = small_grid()
    p["grid"]["M"] = [4]
    p["train"]["budget"] = {"mode": "steps", "steps": 600}  # long enough to be caught mid-run
    p["train"]["checkpoints"] = {"linear": 8, "log": 0}
    p["exposure"]["every"] = 50
    run_id, target = "M4-B16-none-s0", "results/runs/M4-B16-none-s0/metrics.parquet"
    ref, work = tmp_path / "reference", tmp_path / "slurm"
    write_params(ref, p)
    write_params(work, p)
    snakemake(ref, target)  # uninterrupted, locally

    proc = subprocess.Popen(slurm_snakemake_cmd(work, target), cwd=work, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    run_dir, cancelled, kept = work / "results/runs" / run_id, None, {}
    deadline = time.time() + 600
    while cancelled is None and proc.poll() is None and time.time() < deadline:
        jobs = slurm_jobs(work)
        running = jobs[jobs.comment.str.match(TRAIN_JOB) & (jobs.state == "RUNNING")]
        kept = checkpoints(run_dir)
        if len(running) and len(kept) >= 2 and not (run_dir / "metrics.parquet").exists():
            cancelled = int(running.id.iloc[0])
            run(["scancel", str(cancelled)], cwd=work)
        time.sleep(0.2)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert cancelled is not None, f"the training job was never caught running with checkpoints:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-4000:]
    jobs = slurm_jobs(work)
    train = jobs[jobs.comment.str.match(TRAIN_JOB)]
    assert train.set_index("id").state.to_dict() == {cancelled: "CANCELLED", train.id.max(): "COMPLETED"}, train
    # resumed, not restarted: the oldest checkpoint from before the cancel (step 0) is the same file, untouched
    after = checkpoints(run_dir)
    first = min(kept, key=kept.get)
    assert after.get(first) == kept[first], (first, kept, after)
    assert len(after) > len(kept)
    got = read_parquet(run_dir / "metrics.parquet")
    want = read_parquet(ref / "results/runs" / run_id / "metrics.parquet")
    assert got.step.iloc[-1] == 600
    pd.testing.assert_frame_equal(got, want, check_exact=True)
