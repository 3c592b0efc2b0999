"""Real Snakemake runs of a minimal grid in temporary directories (DVC: test_dvc.py, SLURM: test_slurm.py)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from iclnoise.core.io import read_parquet
from iclnoise.core.schedules import refined_steps

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
ENV = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}


def tiny_params(Ms=(1, "inf")) -> dict:
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p["grid"].update(M=list(Ms), seeds=[0], batch_sizes=[8, 16], noise=["none", "inj"])
    p["noise"]["conditions"]["inj"] = {"source": "grad", "shape": "lowrank", "rank": 2, "schedule": "constant",
                                       "emulate_batch": 8, "batch_sizes": [16]}
    p["exposure"].update(every=10, groups=4, curvature_probes=2, heldout=8)
    p["train"]["budget"] = {"mode": "steps", "steps": 30}
    p["train"]["checkpoints"] = {"linear": 2, "log": 3}
    p["eval"].update(n_sequences=64, n_root=16)
    p["model"].update(d_model=16, d_mlp=16)
    p["llc"]["every"] = 3
    p["llc"]["sampler"].update(chains=2, burn_in=5, draws=10, batch=16, n=64)
    p["geometry"].update(every=3, probes=2, lanczos_iters=3, n_heldout=16)
    p["mech"].update(every=3, n_probe=32)
    p["llc"]["refined"].update(enabled=True, M=None, n_obs=16, burn_in=None, draws=None)   # the sampler's 5 and 10
    return p


def run(cmd, cwd, check=True):
    r = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def snakemake_cmd(workdir, *args) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
            "--cores", "2", *args]


def snakemake(workdir, *args, check=True):
    return run(snakemake_cmd(workdir, *args), cwd=workdir, check=check)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The tiny grid run once through Snakemake (3 M × 2 batch sizes + an injected condition, 1 seed)."""
    d = tmp_path_factory.mktemp("dag")
    (d / "params.yaml").write_text(yaml.safe_dump(tiny_params(Ms=(1, 4, "inf"))))
    snakemake(d)
    return d


def test_snakemake_minimal_grid_produces_parquet_and_figure(finished):
    d = finished
    p = yaml.safe_load((d / "params.yaml").read_text())
    m = read_parquet(d / "results/runs/M1-B16-none-s0/metrics.parquet")
    assert m.step.iloc[-1] == 30 and {"ood_loss", "r", "delta_ridge"} <= set(m.columns)
    assert (d / "results/figures/fig01_ood_loss.png").stat().st_size > 10_000
    for f in ("llc", "stages", "geometry", "mech"):
        assert (d / f"results/runs/M1-B16-none-s0/{f}.parquet").exists()
    assert (d / "results/ed/bym-none-B16-s0/forms.parquet").exists()
    assert (d / "results/figures/fig05_ed_forms_bym-none-B16-s0.png").exists()
    tests = read_parquet(d / "results/aggregate/tests.parquet")
    assert set(tests.hypothesis) == {"H1", "H2", "H3", "H4"}
    assert {"gates_passed", "gate_failures"} <= set(tests.columns)
    # one training job per ensemble: (batch 8, none), (batch 16, none), (batch 16, inj)
    assert sorted(p.name for p in (d / "benchmarks/train").glob("*.tsv")) == [
        "B16-inj.tsv", "B16-none.tsv", "B8-none.tsv"]
    # the noise axis: batch 8 against batch 16 + injection emulating 8, with exposure logged in every run
    assert not (d / "results/runs/M1-B8-inj-s0").exists()  # inj runs only at batch 16
    inj = read_parquet(d / "results/runs/M1-B16-inj-s0/injection.parquet")
    assert len(inj) == 30 and (inj.trace_injected > 0).all()
    exp = read_parquet(d / "results/runs/M1-B8-none-s0/exposure.parquet")
    assert list(exp.step) == [0, 9, 19, 29] and (exp.curv > 0).all() and exp.interval.sum() == 30
    out = read_parquet(d / "results/aggregate/outcomes.parquet")
    assert out.integrated_pne.notna().all() and len(out) == 9
    assert (d / "results/aggregate/metrics.json").exists()
    assert (d / "results/figures/fig10_exposure_series.png").exists()
    assert (d / "results/figures/fig09_geometry.png").exists()
    # the refined LLC of every component and the susceptibilities, in every probed run's probe job (llc.seeds)
    heads = {f"l{i}h{h}" for i in range(p["model"]["n_layers"]) for h in range(p["model"]["n_heads"])}
    probed = sorted((d / "results/runs").glob("*-s0"))
    assert len(probed) == 9
    for run in probed:
        rllc = read_parquet(run / "rllc.parquet")
        assert heads <= set(rllc.component) and {"all", "embed", "unembed", "l0mlp"} <= set(rllc.component)
        llc_steps = read_parquet(run / "llc.parquet").step.tolist()
        assert sorted(rllc.step.unique()) == refined_steps(llc_steps, p["llc"]["refined"]["checkpoints"])
        assert np.isfinite(rllc.llc_mean).mean() >= 0.9, run.name
        sus = read_parquet(run / "susceptibility.parquet")
        assert set(sus.component) == set(rllc.component) and (sus.perturbation == "new_tasks").all()
    assert (read_parquet(d / "results/runs/Minf-B16-none-s0/susceptibility.parquet").chi == 0).all()  # q_∞ = q_M
    for stem in ("fig11_rllc_over_training", "fig12_susceptibility"):
        assert (d / f"results/figures/{stem}.png").stat().st_size > 10_000
    assert "fig11_rllc_over_training.png" in (d / "results/report.md").read_text()
    assert "What this run shows" in (d / "results/report.md").read_text()
    assert (d / "logs/train/B16-none.log").exists()


def test_a_second_invocation_has_nothing_to_do(finished):
    assert "Nothing to be done" in snakemake(finished, "-n").stdout


def plan(dry_run: str) -> list[tuple[str, str]]:
    """(rule, reason) of every job a dry run lists."""
    return re.findall(r"^(?:local)?rule (\w+):\n(?:    .*\n)*?    reason: (.*)$", dry_run, re.M)


def test_any_deleted_output_is_rebuilt_by_plain_snakemake_and_nothing_else(finished, tmp_path):
    """Rule `all` asks for every artifact (issue 30): a deleted output of any job (training, a probe, essential
    dynamics, a figure, the summary, aggregate, the report) is made again by plain `snakemake`, by its own job (then
    the jobs that read it); no other job reruns. Snakemake removes a failed job's outputs: the same repair."""
    d = finished
    made_by = {
        "results/runs/M1-B8-none-s0/token_losses.parquet": "train_B8_none",
        "results/runs/M4-B16-none-s0/geometry.parquet": "probe_M4_B16_none_s0",
        "results/figures/heads/M1-B16-inj-s0.png": "probe_M1_B16_inj_s0",
        "results/ed/bym-none-B16-s0/forms.parquet": "ed",
        "results/figures/fig02_essential_subspace_bym-inj-B16-s0.png": "ed_figures",
        "results/summary.md": "training_figures",
        "results/figures/fig04_llc_over_training.pdf": "llc_figures",
        "results/figures/fig12_susceptibility.parquet": "refined_figures",
        "results/aggregate/tests.md": "aggregate",
        "results/figures/fig08_early_late.parquet": "aggregate_figures",
        "results/report.md": "report",
    }
    aside = {f: tmp_path / str(i) for i, f in enumerate(made_by)}
    for f, a in aside.items():
        os.replace(d / f, a)
    try:
        jobs = plan(snakemake(d, "-n").stdout)
    finally:
        for f, a in aside.items():
            os.replace(a, d / f)   # a rename keeps the file's mtime: the results are as before
    missing = [(rule, m.group(1).split(", ")) for rule, reason in jobs
               if (m := re.search(r"Missing output files: ([^;]*)", reason))]
    for f, rule in made_by.items():
        assert any(r == rule and f in files for r, files in missing), (f, rule, jobs)
    untouched = {"train_B16_none", "train_B16_inj", "probe_M1_B16_none_s0", "probe_Minf_B16_inj_s0"}
    assert not untouched & {rule for rule, _ in jobs}, jobs
    assert "Nothing to be done" in snakemake(d, "-n").stdout


def _mtime_ns(path):
    """A file's mtime, or -1 where it vanished since it was listed (Snakemake removes a forced job's outputs)."""
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return -1


def test_a_killed_aggregate_is_rerun_by_plain_snakemake(finished):
    """Ctrl-C (SIGINT to the process group) while aggregate writes its tables: its outputs are marked incomplete.
    The workflow profile (profiles/default: rerun-incomplete) is found and applied, so plain `snakemake` reruns
    aggregate instead of stopping with IncompleteFilesException (issue 30); then nothing is left to do."""
    import signal
    import time

    d = finished
    agg = d / "results/aggregate"
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(d),
           "--cores", "1", "--forcerun", "aggregate", "--until", "aggregate"]
    start = time.time_ns()
    proc = subprocess.Popen(cmd, cwd=d, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(_mtime_ns(p) > start for p in agg.glob("*.parquet")):   # its first new table
            assert proc.poll() is None and time.monotonic() < deadline, "aggregate ended or never started"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait()
    # Where the signal lands decides what is left (all three seen on this machine): the outputs marked incomplete
    # (what the profile repairs), or removed by Snakemake on its way out, or the job finished before Snakemake
    # stopped (then aggregate has nothing to redo). In the first two plain snakemake must plan aggregate.
    try:
        bare = snakemake(d, "-n", "--workflow-profile", "none", check=False)
        killed = bool(bare.returncode) or "aggregate" in {rule for rule, _ in plan(bare.stdout)}
        if bare.returncode:
            assert "IncompleteFilesException" in bare.stdout + bare.stderr
        r = snakemake(d, "-n")
        assert f"workflow specific profile {ROOT / 'profiles/default'}" in r.stderr
        assert ("aggregate" in {rule for rule, _ in plan(r.stdout)}) == killed
    finally:
        snakemake(d)   # the shared run is left complete for the tests after this one, whatever failed above
    assert "Nothing to be done" in snakemake(d, "-n").stdout


def test_snakemake_report_holds_the_figures(finished):
    """`snakemake --report` (issue 19): an HTML report with the figures marked by report()."""
    import zipfile
    snakemake(finished, "--report", "report.zip")
    names = zipfile.ZipFile(finished / "report.zip").namelist()
    for fig in ("fig01_ood_loss.png", "fig06_threshold_vs_noise.png", "fig10_exposure_series.png"):
        assert any(n.endswith(fig) for n in names), (fig, names[:20])


def test_export_then_paper_redraws_every_figure_from_the_reference_tables_alone(finished, tmp_path):
    """`iclnoise export` keeps the paper's tables (no checkpoint, no resume state) with their provenance;
    `iclnoise paper` on that set alone draws every figure the workflow drew and the report, and its rerun
    aggregate equals the exported one. A reference table that no longer follows from the per-run tables
    (edited by hand) is refused, naming the table."""
    import json
    ref, out = tmp_path / "reference" / "tiny", tmp_path / "paper"
    run([sys.executable, "-m", "iclnoise.cli", "export", "--results", str(finished / "results"), "--params",
         str(finished / "params.yaml"), "--workdir", str(finished), "--out", str(ref)], cwd=finished)
    files = [p for p in ref.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix == ".pt" or p.name in ("token_losses.parquet", "root_preds.parquet")]
    prov = json.loads((ref / "provenance.json").read_text())
    runs = sorted(p.name for p in (finished / "results/runs").iterdir())
    assert sorted(prov["spec_hash"]) == runs and prov["params"]["grid"]["M"] == [1, 4, "inf"]
    assert prov["wall_time"]["total_s"] > 0 and prov["versions"]["torch"]
    r = run([sys.executable, "-m", "iclnoise.cli", "paper", str(ref), "--out", str(out)], cwd=tmp_path)
    drawn = {p.name for p in (out / "tiny/figures").glob("*.png")}
    assert drawn == {p.name for p in (finished / "results/figures").glob("*.png")} and len(drawn) >= 8, drawn
    assert (out / "tiny/report.md").read_text().count(".png") >= len(drawn)
    assert "tiny: " in r.stdout
    th = read_parquet(ref / "aggregate/thresholds.parquet")
    th.loc[0, "batch"] += 1
    th.to_parquet(ref / "aggregate/thresholds.parquet")
    r = run([sys.executable, "-m", "iclnoise.cli", "paper", str(ref), "--out", str(out)], cwd=tmp_path, check=False)
    assert r.returncode != 0 and "thresholds.parquet differs from its sha256 in provenance.json" in r.stderr
    from iclnoise.output.paper import rehash
    rehash(ref)   # the edit sealed into provenance.json: the rerun aggregate still refuses it
    r = run([sys.executable, "-m", "iclnoise.cli", "paper", str(ref), "--out", str(out)], cwd=tmp_path, check=False)
    assert r.returncode != 0 and "thresholds.parquet: the aggregate rerun from the set's per-run tables" in r.stderr


def test_a_deleted_run_is_rebuilt(finished):
    """Delete one run directory: plain `snakemake` reruns its ensemble (issue 20). The members that were
    complete rewrite their tables from their final resume state, byte for byte; the deleted run trains again,
    now in an ensemble of one, and equals the original to float32 round-off (the same bits on one thread, README
    "Determinism"; a job's other thread counts may change the last bits)."""
    import pandas as pd
    d = finished
    runs = d / "results/runs"
    lost, kept = runs / "M4-B8-none-s0", runs / "M1-B8-none-s0"
    before = {f.name: read_parquet(f) for f in lost.glob("*.parquet")}
    kept_bytes = {f.name: f.read_bytes() for f in kept.glob("*.parquet")}
    shutil.rmtree(lost)
    plan = snakemake(d, "-n").stdout
    assert "train_B8_none" in plan and "Nothing to be done" not in plan
    snakemake(d)
    for name, data in kept_bytes.items():
        assert (kept / name).read_bytes() == data, name
    for name, df in before.items():   # exposure: a = 1/(sqrt(v̂) + δ) amplifies last-bit differences of small v̂,
        new = read_parquet(lost / name)   # and the eigenvalue list's near-zero tail is round-off
        tol = dict(rtol=5e-2, atol=1e-8) if name in ("exposure.parquet", "injection.parquet") else dict(rtol=1e-4,
                                                                                                        atol=1e-6)
        listy = [c for c in df.columns if df[c].dtype == object and isinstance(df[c].iloc[0], (list, np.ndarray))]
        pd.testing.assert_frame_equal(new.drop(columns=listy), df.drop(columns=listy), check_exact=False, **tol)
    assert "Nothing to be done" in snakemake(d, "-n").stdout


def test_a_killed_llc_leaves_no_partial_file_and_reruns_to_the_same_bytes(finished):
    """SIGKILL `iclnoise llc` at several moments: its table is either absent or complete, never partial;
    the rerun gives the same bytes as the uninterrupted run (issue 14 faults)."""
    import json
    import signal
    import time

    d = finished
    run_dir = d / "results/runs/M4-B16-none-s0"
    ref = (run_dir / "llc.parquet").read_bytes()
    llc = yaml.safe_load((d / "params.yaml").read_text())["llc"]
    cmd = [str(Path(BIN) / "iclnoise"), "llc", "--run-dir", str(run_dir), "--cfg"]
    for delay in (0.5, 2.0):   # at every checkpoint: longer, more moments to be killed at
        (run_dir / "llc.parquet").unlink(missing_ok=True)
        proc = subprocess.Popen(cmd + [json.dumps({"llc": {**llc, "every": 1}})], env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if (run_dir / "llc.parquet").exists():   # it finished before the kill: then it must be whole
            read_parquet(run_dir / "llc.parquet")
    run(cmd + [json.dumps({"llc": llc})], d)
    assert (run_dir / "llc.parquet").read_bytes() == ref


def test_a_killed_aggregate_leaves_no_partial_file_and_reruns_to_the_same_tables(finished, tmp_path):
    """SIGKILL `iclnoise aggregate` at several moments: every table it has written is complete (readable),
    never partial; the rerun writes the same tables as the pipeline did (issue 14 faults)."""
    import json
    import signal
    import time

    import pandas as pd

    d = finished
    stats = json.dumps({"stats": yaml.safe_load((d / "params.yaml").read_text())["stats"]})
    runs = sorted(str(p) for p in (d / "results/runs").iterdir())
    out = tmp_path / "aggregate"
    cmd = [str(Path(BIN) / "iclnoise"), "aggregate", *runs, "--out", str(out), "--cfg", stats]
    for delay in (1.0, 3.0):
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for f in out.glob("*.parquet"):
            read_parquet(f)   # complete if present
    run(cmd, d)
    for f in (d / "results/aggregate").glob("*.parquet"):
        pd.testing.assert_frame_equal(read_parquet(out / f.name), read_parquet(f))   # same code path, same machine


BAD_RUN_OPTIONS = {
    "train_threads=abc": "--config train_threads='abc': allowed: a whole number 1-256",
    "train_threads=0": "--config train_threads=0: allowed: a whole number 1-256",
    "train_resources=5": "--config train_resources=5: allowed: a mapping of resources",
    "train_resources={mem_mb: -1}": "--config train_resources.mem_mb=-1: allowed: a whole number >= 0",
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """Plain snakemake on each bad input of the tests below (an invalid params.yaml; each bad run option on a valid
    one), all started at once, each in its own directory: {case: (directory, its CompletedProcess)}. They stop at
    parse time and share nothing, so two cores run them side by side instead of five start-ups end to end."""
    bad = tiny_params()
    bad["train"]["lr_schedule"]["kind"] = "cyclic"
    cases = {"invalid params": (bad, []), **{o: (tiny_params(), ["--config", o]) for o in BAD_RUN_OPTIONS}}
    started = {}
    for case, (p, args) in cases.items():
        d = tmp_path_factory.mktemp("refused")
        (d / "params.yaml").write_text(yaml.safe_dump(p))
        cmd = snakemake_cmd(d, *args)
        started[case] = d, cmd, subprocess.Popen(cmd, cwd=d, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)
    done = {}
    for case, (d, cmd, proc) in started.items():
        out, err = proc.communicate()
        done[case] = d, subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return done


def test_invalid_params_stop_before_any_job(refused):
    d, r = refused["invalid params"]
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "train.lr_schedule.kind" in out and "warmup_cosine" in out
    assert not (d / "results").exists()


@pytest.mark.parametrize("override, expect", BAD_RUN_OPTIONS.items())
def test_bad_run_options_stop_before_any_job_naming_the_key(refused, override, expect):
    """The `--config` keys the profiles set (train_threads, train_resources) are checked with params.yaml."""
    d, r = refused[override]
    assert r.returncode != 0 and expect in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    assert not (d / "results").exists()


@pytest.mark.numerics
def test_a_deleted_checkpoint_is_named_and_planned_by_a_dry_run(finished, tmp_path):
    """Issue 48 (15): a checkpoint of a run that its ensemble's training job trained deleted: `snakemake -n` names
    the checkpoint and plans the ensemble's training job (which trains the run again: test_train) and the probe.
    (The shared run's ensemble, not one trained here for the test: the checkpoint is put back afterwards.)"""
    from iclnoise.run.runs import checkpoint_path, manifest

    d = finished
    run_id = "M1-B8-none-s0"
    rd = d / "results/runs" / run_id
    gone = checkpoint_path(rd, sorted(manifest(rd))[2])
    os.replace(gone, tmp_path / gone.name)
    try:
        r = snakemake(d, "-n")
    finally:
        os.replace(tmp_path / gone.name, gone)   # a rename keeps the file's mtime: the results are as before
    jobs = dict(plan(r.stdout))
    assert f"{run_id}: checkpoints {gone.relative_to(d)} are missing" in r.stdout + r.stderr
    assert "checkpoints.missing." in jobs["train_B8_none"], jobs
    assert f"probe_{run_id}".replace("-", "_") in jobs
