"""Training: runs inside an ensemble equal runs alone, resume exactly, diverge alone, restart on a changed spec."""
import copy
import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.io import CorruptFileError, read_parquet
from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.core.schedules import checkpoint_steps, lr_lambda
from iclnoise.core.tasks import BatchSampler, task_pool
from iclnoise.run.member import Member
from iclnoise.run.runs import (
    ForeignFile,
    RunDirError,
    checkpoint_path,
    load_checkpoint,
    load_model,
    load_torch,
    manifest,
    missing_checkpoints,
    sha256,
)
from iclnoise.run.train import _resume_states, train_ensemble, train_run

RUNS = ["M4-B16-none-s0", "M1-B16-none-s1", "Minf-B16-none-s0"]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> tuple[list, list]:
    """The three RUNS trained once, uninterrupted, as one ensemble (read only): their tables and run directories,
    the reference that the resume, kill and divergence tests below compare against."""
    root = tmp_path_factory.mktemp("reference")
    dirs = [root / r for r in RUNS]
    return train_ensemble([run_spec(tiny, r) for r in RUNS], dirs, progress=False), dirs


class _BlowingUp(BatchSampler):
    """A sampler whose tasks are 1e4× larger from step 30 (so are its labels): `seeded(step)` sets the scale that
    `pool` then has (the ensemble's stacked draw and `batch` read the pool after seeding)."""

    @property
    def pool(self):
        return self._pool * (1e4 if self.at >= 30 else 1.0)

    def seeded(self, step):
        self.at = step
        return super().seeded(step)


def _diverging_at_30(orig):
    """Member.setup whose run RUNS[1] (M = 1) draws labels 1e4× larger from step 30 on: it diverges there."""
    def setup(self):
        orig(self)
        if self.run_id == RUNS[1]:
            self.sampler.__class__, self.sampler._pool = _BlowingUp, self.sampler.__dict__.pop("pool")
    return setup


@pytest.mark.unit
def test_checkpoint_schedule_is_union_of_linear_and_log():
    s = checkpoint_steps(1000, 4, 4)
    assert s[0] == 0 and s[-1] == 1000
    assert {250, 500, 750, 1, 10, 100} <= set(s)


@pytest.mark.unit
def test_lr_schedules():
    f = lr_lambda("warmup_cosine", 100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    t = lr_lambda("triangle", 100, 0.5)
    assert t(49) == pytest.approx(1.0) and t(100) == 0 and t(75) == pytest.approx(0.5)


def reference_steps(spec: dict, steps: int) -> dict:
    """One run trained the plain way, independently of the ensemble code: the hooked module, torch AdamW,
    torch's clip_grad_norm_, micro-batches accumulated, the run's own data stream."""
    d, t, k = spec["data"], spec["train"], spec["keys"]
    model = build_model(ModelConfig(D=d["D"], K=d["K"], **spec["model"]), k["seed"])
    o = t["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"],
                            eps=o["eps"])
    pool = None if k["M"] == -1 else task_pool(d["pool_seed"], k["M"], d["D"])
    sampler = BatchSampler(pool, d["K"], d["D"], d["noise_var"], k["seed"], "cpu", stream=0)
    f = lr_lambda(t["lr_schedule"]["kind"], t["steps"], t["lr_schedule"]["warmup_frac"],
                  t["lr_schedule"]["min_lr_frac"])
    n_micro = k["batch"] // t["micro_batch"]
    for step in range(steps):
        opt.param_groups[0]["lr"] = o["lr"] * f(step)
        opt.zero_grad()
        for mb in sampler.batch(step, k["batch"]).split(n_micro):
            (mse_loss(model, mb.xs, mb.ys) / n_micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.unit
@pytest.mark.numerics
def test_a_run_in_an_ensemble_is_the_run_trained_alone(tiny, tmp_path):
    """Three runs (different M, seed, pool) with per-run clipping active (clip 0.05 < every gradient norm,
    and the norms differ between runs): after 1 and after 7 steps every run's parameters equal an
    independent plain training loop of that run alone, to float32 round-off."""
    p = copy.deepcopy(tiny)
    p["exposure"]["enabled"] = False
    p["train"]["grad_clip"] = 0.05
    p["train"]["checkpoints"] = {"linear": 60, "log": 0}   # a checkpoint after every step
    specs = [run_spec(p, r) for r in RUNS]
    train_ensemble(specs, [tmp_path / r for r in RUNS], progress=False, stop_after=7)
    for steps in (1, 7):
        for spec, r in zip(specs, RUNS):
            ours = dict(load_model(tmp_path / r, steps).named_parameters())
            ref = reference_steps(spec, steps)
            for n, w in ref.items():
                # b_K's gradient is zero in exact arithmetic (it adds q·b_K to a whole row of scores, which the
                # softmax ignores); Adam turns its round-off into steps of up to lr, so it gets lr per step.
                # Others (float32; fused stacked AdamW vs torch's loop, bmm vs F.linear): Adam's direction m̂/√v̂
                # carries the gradient's relative error, ≲ 1e3·ε32 ≈ 1e-4 (no worse cancellation), so 7 steps of
                # lr = 3e-3 give ≲ 2e-6 (atol); w's own rounding over 7 updates ≪ 2e-5 |w| (rtol). Measured over 3 CPU
                # settings: ≤ 1.2e-7 (b_K: 1.2e-4 ≪ 2 lr·7); another run's parameters are ~1 off.
                tol = 2 * spec["train"]["optimizer"]["lr"] * steps if n.endswith("b_K") else 2e-6
                torch.testing.assert_close(ours[n].detach(), w, rtol=2e-5, atol=tol, msg=f"{r} {n} step {steps}")


@pytest.mark.unit
@pytest.mark.numerics
def test_resume_inside_an_ensemble_is_bitwise_identical(tiny, reference, tmp_path):
    """An ensemble stopped after step 25 (last resume state at the step-20 checkpoint, like a kill) and run
    again ends bitwise identical to an uninterrupted ensemble: metrics, checkpoints, exposure logs."""
    specs = [run_spec(tiny, r) for r in RUNS]
    full, full_dirs = reference
    part = [tmp_path / "part" / r for r in RUNS]
    assert train_ensemble(specs, part, progress=False, stop_after=25) == [None] * 3
    assert not (part[0] / "metrics.parquet").exists()
    resumed = train_ensemble(specs, part, progress=False)
    for a, b, fd, pd_ in zip(full, resumed, full_dirs, part):   # same code path, same machine: bitwise
        pd.testing.assert_frame_equal(a, b)
        pd.testing.assert_frame_equal(read_parquet(fd / "exposure.parquet"), read_parquet(pd_ / "exposure.parquet"))
        assert manifest(fd) == manifest(pd_)  # same bytes, per checkpoint


@pytest.mark.unit
@pytest.mark.numerics
def test_stop_at_writes_a_finished_run_on_the_whole_schedule_and_resumes_under_a_later_stop(tiny, reference,
                                                                                             tmp_path):
    """budget.stop_at 25 of 60: outputs as a finished run (rows on the 60-step checkpoint grid up to 25, plus 25;
    the 60-step learning rates); the same run with stop_at 60 resumes from step 25 (no retraining) and ends
    bitwise identical to an uninterrupted 60-step run (same code path, same machine)."""
    p = copy.deepcopy(tiny)
    full = reference[0]
    p["train"]["budget"]["stop_at"] = 25
    specs = [run_spec(p, r) for r in RUNS]
    part = [tmp_path / "part" / r for r in RUNS]
    stopped = train_ensemble(specs, part, progress=False)
    grid = checkpoint_steps(60, 3, 3)
    for a, b, d in zip(full, stopped, part):
        assert list(b.step) == [s for s in grid if s <= 25] + ([25] if 25 not in grid else [])
        common = a[a.step.isin(b.step)].reset_index(drop=True)
        pd.testing.assert_frame_equal(common, b[b.step.isin(a.step)].reset_index(drop=True))  # the 60-step lr
        assert sorted(manifest(d)) == list(b.step)
        assert (d / "exposure.parquet").exists() and (d / "token_losses.parquet").exists()
    p["train"]["budget"]["stop_at"] = 60
    resumed = train_ensemble([run_spec(p, r) for r in RUNS], part, progress=False)
    for a, whole in zip(full, resumed):
        assert len(whole) == len(a) + (25 not in grid)          # the row at the old stop stays
        b = whole[whole.step.isin(a.step)].reset_index(drop=True)
        # train_loss averages the updates since the previous row, and the row at 25 is one more row
        pd.testing.assert_frame_equal(a.drop(columns="train_loss"), b.drop(columns="train_loss"))
        pd.testing.assert_series_equal(a.train_loss[a.step <= 25], b.train_loss[b.step <= 25])
    assert spec_hash(specs[0]) == spec_hash(run_spec(tiny, RUNS[0]))  # where a run stops is not its identity


@pytest.mark.unit
@pytest.mark.numerics
def test_micro_batching_does_not_change_the_data_stream(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    spec1 = run_spec(p, "M4-B16-none-s0")
    p["train"]["micro_batch"] = 16
    spec2 = run_spec(p, "M4-B16-none-s0")
    m1 = train_run(spec1, tmp_path / "a", progress=False)
    m2 = train_run(spec2, tmp_path / "b", progress=False)
    # same data and same mean gradient up to float32 summation order: as in test_a_run_in_an_ensemble..., ≲ 1e-4
    # relative error in Adam's direction, 60 steps of lr ≤ 3e-3 → |δw| ≲ 2e-5, the loss moves by ≲ 1e-4 of itself
    # (measured over 3 CPU settings: ≤ 1.1e-7)
    np.testing.assert_allclose(m1.ood_loss, m2.ood_loss, rtol=1e-4)


@pytest.mark.unit
@pytest.mark.numerics
def test_outputs_and_learning(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    p["train"]["budget"]["steps"] = 200
    m = train_run(run_spec(p, "M1-B16-none-s0"), tmp_path, progress=False)
    assert list(m.step) == checkpoint_steps(200, 3, 3)
    assert m.id_loss.iloc[-1] < 0.5 * m.id_loss.iloc[0]         # M = 1 is learnable quickly
    assert not m.diverged.any()
    tok = read_parquet(tmp_path / "token_losses.parquet")
    assert set(tok.split) == {"id", "ood"} and tok.k.max() == p["data"]["K"]
    root = read_parquet(tmp_path / "root_preds.parquet")
    assert len(root.preds.iloc[0]) == 16 * p["data"]["K"]
    # analysis checkpoints: weights only, each in the sha256 manifest
    man = manifest(tmp_path)
    assert sorted(man) == list(m.step)
    assert all(sha256(checkpoint_path(tmp_path, s)) == h for s, h in man.items())
    state = torch.load(checkpoint_path(tmp_path, 200), weights_only=True)
    assert set(state) == {"model", "model_config", "adam", "spec_hash"}


@pytest.mark.unit
@pytest.mark.numerics
def test_a_diverging_run_is_frozen_and_recorded_while_the_others_go_on(tiny, reference, tmp_path):
    """Run 1's targets blow up from step 30: it is recorded as diverged at step 30 and kept; runs 0 and 2
    end exactly as in an ensemble without it going wrong."""
    specs = [run_spec(tiny, r) for r in RUNS]
    clean = reference[0]
    import iclnoise.run.train as tr

    orig = tr.Member.setup
    setup = _diverging_at_30(orig)
    tr.Member.setup = setup
    try:
        out = train_ensemble(specs, [tmp_path / "bad" / r for r in RUNS], progress=False)
    finally:
        tr.Member.setup = orig
    bad = out[1]
    assert bad.diverged.iloc[-1] and bad.step.iloc[-1] == 30 and not bad.diverged.iloc[:-1].any()
    assert (tmp_path / "bad" / RUNS[1] / "metrics.parquet").exists()
    for i in (0, 2):   # the same stacked code path for runs 0 and 2: bitwise in practice (measured: 0 apart)
        pd.testing.assert_frame_equal(out[i], clean[i], check_exact=False, rtol=1e-5)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_changed_spec_starts_fresh_never_resumes(tiny, tmp_path):
    """The lr-change scenario of issue 14: the rerun equals a fresh run with the new lr and differs from the old."""
    p = copy.deepcopy(tiny)
    old = train_run(run_spec(p, "M4-B16-none-s0"), tmp_path / "run", progress=False)
    p["train"]["optimizer"]["lr"] = 0.02
    new_spec = run_spec(p, "M4-B16-none-s0")
    rerun = train_run(new_spec, tmp_path / "run", progress=False)
    fresh = train_run(new_spec, tmp_path / "fresh", progress=False)
    pd.testing.assert_frame_equal(rerun, fresh)   # same code path, same machine: bitwise
    assert not np.allclose(rerun.train_loss.iloc[1:], old.train_loss.iloc[1:])
    assert json.loads((tmp_path / "run/run.json").read_text())["train"]["optimizer"]["lr"] == 0.02


@pytest.mark.unit
@pytest.mark.numerics
def test_a_corrupt_newest_resume_state_falls_back_to_the_previous_one(tiny, tmp_path):
    specs = [run_spec(tiny, RUNS[0])]
    full = train_ensemble(specs, [tmp_path / "full"], progress=False)[0]
    rd = tmp_path / "part"
    train_ensemble(specs, [rd], progress=False, stop_after=25)
    data = (rd / "resume.pt").read_bytes()
    (rd / "resume.pt").write_bytes(data[: len(data) // 2])           # a truncated newest state
    resumed = train_ensemble(specs, [rd], progress=False)[0]
    pd.testing.assert_frame_equal(full, resumed)   # same code path, same machine: bitwise


def files(d) -> dict:
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.unit
@pytest.mark.numerics
def test_a_corrupt_run_json_is_named_deletes_nothing_and_the_advice_repairs_it(tiny, tmp_path):
    """A truncated run.json is a corrupt file, not a changed spec (issue 30): training stops naming it and what to
    delete, and no file of the run changes. Doing what the message says resumes the run from its resume state: the
    same tables, the checkpoints and resume states untouched."""
    spec = run_spec(tiny, RUNS[0])
    rd = tmp_path / "results/runs" / RUNS[0]
    full = train_run(spec, rd, progress=False)
    data = (rd / "run.json").read_bytes()
    (rd / "run.json").write_bytes(data[: len(data) // 2])
    before = files(rd)
    with pytest.raises(CorruptFileError) as e:
        train_run(spec, rd, progress=False)
    assert f"{rd / 'run.json'}: unreadable JSON file" in str(e.value)
    assert f"rm {rd / 'run.json'} {rd / 'metrics.parquet'}" in str(e.value), e.value
    assert files(rd) == before
    (rd / "run.json").unlink()
    (rd / "metrics.parquet").unlink()
    pd.testing.assert_frame_equal(train_run(spec, rd, progress=False), full)
    after = files(rd)
    assert all(after[p] == b for p, b in before.items() if p.suffix == ".pt"), "a checkpoint or resume state changed"
    assert json.loads(after[rd / "run.json"]) == json.loads(data)


@pytest.mark.unit
@pytest.mark.numerics
def test_corrupt_run_files_name_the_run_directory_never_its_parent(tiny, tmp_path, caplog):
    """Every repair message names the run's own directory or file, never results/runs (issue 30: both resume states
    corrupt said to delete results/runs). Both corrupt: training starts again from step 0, to the same numbers."""
    spec = run_spec(tiny, RUNS[0])
    rd = tmp_path / "results/runs" / RUNS[0]
    full = train_run(spec, rd, progress=False)
    step = max(manifest(rd))
    ckpt = checkpoint_path(rd, step)
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(CorruptFileError, match=f"Delete the run directory {rd} and rerun"):
        load_checkpoint(rd, step)
    man = (rd / "checkpoints.json").read_bytes()
    (rd / "checkpoints.json").write_bytes(man[: len(man) // 2])
    with pytest.raises(CorruptFileError) as e:
        load_checkpoint(rd, step)
    msg = str(e.value)
    assert f"{rd / 'checkpoints.json'}: unreadable JSON file" in msg and f"rm {rd / 'checkpoints.json'})" in msg, msg
    (rd / "checkpoints.json").write_bytes(man)
    for name in ("resume.pt", "resume.prev.pt"):
        (rd / name).write_bytes((rd / name).read_bytes()[:100])
    with pytest.raises(CorruptFileError, match=f"Delete the run directory {rd} and rerun"):
        load_torch(rd / "resume.pt")
    with caplog.at_level("WARNING", logger="iclnoise.run.train"):
        again = train_run(spec, rd, progress=False)
    pd.testing.assert_frame_equal(again, full)   # same code path, same machine: bitwise
    warned = [r.getMessage() for r in caplog.records]
    assert [m for m in warned if "truncated or corrupt" in m] == [
        f"{RUNS[0]}: {rd / n} is truncated or corrupt; not resuming from it" for n in ("resume.pt", "resume.prev.pt")]
    assert not any(f"{rd.parent} " in m or m.endswith(str(rd.parent)) for m in warned), warned


@pytest.mark.unit
@pytest.mark.numerics
def test_an_ensemble_of_mixed_shapes_or_too_big_is_refused_before_training(tiny, tmp_path):
    a, b = run_spec(tiny, RUNS[0]), run_spec(tiny, RUNS[1])
    b["model"]["d_model"] = 32
    with pytest.raises(ValueError, match=RUNS[1]):
        train_ensemble([a, b], [tmp_path / "a", tmp_path / "b"], progress=False)
    huge = copy.deepcopy(a)
    huge["model"].update(d_model=16384, d_mlp=65536)
    with pytest.raises(MemoryError, match="ensemble_runs"):
        train_ensemble([huge], [tmp_path / "h"], progress=False)
    assert not (tmp_path / "h" / "checkpoints").exists()


@pytest.mark.integration
@pytest.mark.numerics
def test_killed_process_resumes_to_the_same_numbers(tiny, tmp_path):
    """SIGKILL a real `iclnoise train` process (an ensemble of two runs) mid-run, start it again, compare
    with a clean run."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from iclnoise.config.grid import shared_spec

    p = copy.deepcopy(tiny)
    p["train"]["budget"]["steps"] = 240
    p["train"]["checkpoints"] = {"linear": 8, "log": 0}
    p["exposure"]["enabled"] = False  # resume of the hooks' state is covered in test_noise
    runs = ["M4-B16-none-s0", "M1-B16-none-s0"]
    spec = json.dumps(shared_spec(p, runs))
    cmd = [str(Path(sys.executable).parent / "iclnoise"), "train", "--spec", spec, "--runs", ",".join(runs),
           "--results", str(tmp_path / "killed"), "--no-progress"]
    ck = tmp_path / "killed/runs" / runs[0] / "checkpoints"
    proc = subprocess.Popen(cmd)
    deadline = time.time() + 120
    while len(list(ck.glob("step_*.pt"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (ck.parent / "metrics.parquet").exists(), "the run finished before it could be killed"
    resumed = subprocess.Popen(cmd)   # the clean run trains here meanwhile, on the other core
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what `iclnoise train` uses: the same reduction order
    try:
        clean = train_ensemble([run_spec(p, r) for r in runs], [tmp_path / "clean" / r for r in runs], progress=False)
    except BaseException:
        resumed.kill()
        raise
    finally:
        torch.set_num_threads(threads)
    assert resumed.wait() == 0
    for r, c in zip(runs, clean):
        # to round-off: this reference ran in the test process after other tests (one CI run differed from the
        # subprocess in the last bits of train_loss); bitwise equality of resumes is tested in-process above
        pd.testing.assert_frame_equal(c, read_parquet(tmp_path / "killed/runs" / r / "metrics.parquet"),
                                      rtol=1e-5, atol=1e-6)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_changed_spec_removes_only_the_pipelines_files_and_a_linked_run_dir_is_refused(tiny, tmp_path, caplog):
    """Issue 48 (3): a spec change clears the files the pipeline writes and keeps the user's, naming them in the log;
    a run directory that is a symbolic link is refused before anything is written through it."""
    p = copy.deepcopy(tiny)
    rd = tmp_path / "run"
    train_ensemble([run_spec(p, RUNS[0])], [rd], progress=False, stop_after=5)
    mine = {rd / "notes.txt": b"mine", rd / "mine" / "data.csv": b"x", rd / "checkpoints" / "keep.txt": b"k"}
    for f, b in mine.items():
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b)
    (rd / "checkpoints" / "step_0000099.pt").write_bytes(b"a stale checkpoint of the old spec")
    p["train"]["optimizer"]["lr"] = 0.02
    with caplog.at_level("WARNING", logger="iclnoise.run.runs"):
        train_ensemble([run_spec(p, RUNS[0])], [rd], progress=False, stop_after=5)
    assert {f: f.read_bytes() for f in mine} == mine
    kept = {f"{f}: not written by the pipeline, kept" for f in (rd / "notes.txt", rd / "mine", rd / "checkpoints"
                                                                 / "keep.txt")}
    assert kept <= {r.getMessage() for r in caplog.records}
    assert not (rd / "checkpoints" / "step_0000099.pt").exists()   # the old spec's checkpoints are gone

    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("p")
    link = tmp_path / "linked"
    link.symlink_to(other)
    with pytest.raises(RunDirError, match=f"{link} is a symbolic link"):
        train_ensemble([run_spec(p, RUNS[0])], [link], progress=False, stop_after=5)
    assert [f.name for f in other.iterdir()] == ["precious.txt"]


class Planted:
    """An object whose unpickling runs a shell command (creates a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_planted_resume_state_or_checkpoint_runs_nothing_and_is_refused_by_name(tiny, tmp_path, caplog):
    """Issue 48 (4): every .pt file is read with weights_only=True. A planted resume.pt whose unpickling would run a
    command is refused naming it (the command never runs); a planted checkpoint likewise; a well-formed state of
    another spec is skipped with a warning naming it, not silently."""
    spec = run_spec(tiny, RUNS[0])
    rd = tmp_path / "run"
    train_ensemble([spec], [rd], progress=False, stop_after=5)
    marker = tmp_path / "ran"
    good = (rd / "resume.pt").read_bytes()
    torch.save({"spec_hash": spec_hash(spec), "step": Planted(marker)}, rd / "resume.pt")
    with pytest.raises(ForeignFile, match=f"{rd / 'resume.pt'} holds objects the pipeline never writes"):
        train_ensemble([spec], [rd], progress=False, stop_after=5)
    ck = checkpoint_path(rd, 0)
    torch.save({"model": Planted(marker)}, ck)
    with pytest.raises(ForeignFile, match=f"{ck} holds objects"):
        load_torch(ck)
    assert not marker.exists(), "unpickling ran the planted command"
    (rd / "resume.pt").write_bytes(good)
    torch.save({"spec_hash": "0" * 64, "step": 5}, rd / "resume.prev.pt")
    with caplog.at_level("WARNING", logger="iclnoise.run.train"):
        states = _resume_states(Member(RunSpec.of(spec), rd, spec_hash(spec), torch.device("cpu")))
    assert [p for p, _ in states] == [rd / "resume.pt"]
    assert f"{RUNS[0]}: {rd / 'resume.prev.pt'} is not a resume state of this run's spec; not resuming from it" in [
        r.getMessage() for r in caplog.records]


class Killed(Exception):
    """Stands in for SIGKILL: the files are all a killed trainer leaves behind."""


def final_states(dirs) -> list[dict]:
    return [load_torch(d / "resume.pt") for d in dirs]


def assert_same_states(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b):
        assert x["step"] == y["step"] and x["opt"]["step"] == y["opt"]["step"]
        for k in ("params",):
            assert all(torch.equal(x[k][n], y[k][n]) for n in x[k]), k
        for k in ("exp_avg", "exp_avg_sq"):
            assert all(torch.equal(x["opt"][k][n], y["opt"][k][n]) for n in x["opt"][k]), k


@pytest.mark.unit
@pytest.mark.numerics
def test_any_sequence_of_kills_resumes_the_ensemble_as_one_bitwise(tiny, reference, tmp_path, monkeypatch):
    """Issue 48 (8): the trainer is killed four times in a row while it writes the members' resume states (after 2,
    4, 5 and 7 more states: inside commit 0, then 1, then 1 again, then 8), then runs to the end: every run's weights
    and Adam moments are torch.equal to an uninterrupted ensemble's, its tables equal, and every resume trained the
    three runs as one ensemble (a split one rounds differently)."""
    import iclnoise.run.ensemble as ens

    specs = [run_spec(tiny, r) for r in RUNS]
    full, full_dirs = reference
    dirs = [tmp_path / "killed" / r for r in RUNS]
    save, sizes, init = ens.save_resume, [], ens.Ensemble.__init__

    def spy(self, members, *a):
        sizes.append(len(members))
        init(self, members, *a)

    monkeypatch.setattr(ens.Ensemble, "__init__", spy)
    for n in (2, 4, 5, 7):
        left = [n]

        def dying(*a):
            if left[0] == 0:
                raise Killed
            left[0] -= 1
            save(*a)

        monkeypatch.setattr(ens, "save_resume", dying)
        with pytest.raises(Killed):
            train_ensemble(specs, dirs, progress=False)
    monkeypatch.setattr(ens, "save_resume", save)
    out = train_ensemble(specs, dirs, progress=False)
    assert sizes == [3] * 5, sizes
    assert_same_states(final_states(full_dirs), final_states(dirs))
    for a, b in zip(full, out):
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.unit
@pytest.mark.numerics
def test_a_rolled_back_member_resumes_with_its_ensemble_or_is_refused(tiny, reference, tmp_path):
    """Issue 48 (8): one member's resume state rolled back one commit (its resume.pt replaced by its resume.prev.pt):
    the whole ensemble steps back with it and ends torch.equal to an uninterrupted one. Rolled back further than
    the others keep: refused, naming the member and the files, and nothing changes."""
    specs = [run_spec(tiny, r) for r in RUNS]   # commits at steps 0, 1, 8, 20, 40, 60
    full_dirs = reference[1]
    dirs = [tmp_path / "part" / r for r in RUNS]
    train_ensemble(specs, dirs, progress=False, stop_after=25)
    (dirs[1] / "resume.prev.pt").replace(dirs[1] / "resume.pt")   # run 1 back at 8, the others at 20 (and 8)
    train_ensemble(specs, dirs, progress=False)
    assert_same_states(final_states(full_dirs), final_states(dirs))

    dirs = [tmp_path / "again" / r for r in RUNS]
    train_ensemble(specs, dirs, progress=False, stop_after=5)
    old = (dirs[1] / "resume.pt").read_bytes()   # step 1
    train_ensemble(specs, dirs, progress=False, stop_after=25)
    (dirs[1] / "resume.pt").write_bytes(old)
    (dirs[1] / "resume.prev.pt").unlink()
    before = files(tmp_path / "again")
    with pytest.raises(CorruptFileError, match=f"{RUNS[1]}: resume state at step 1, behind the rest of its ensemble "
                                          f"\\({RUNS[0]}, {RUNS[2]} keep no state .*rolled back or replaced"):
        train_ensemble(specs, dirs, progress=False)
    assert files(tmp_path / "again") == before


@pytest.mark.integration
@pytest.mark.numerics
def test_a_second_trainer_is_refused_naming_the_first_and_a_killed_one_frees_the_run(tiny, tmp_path):
    """Issue 48 (13): while an `iclnoise train` process trains a run (e.g. left running by a killed snakemake), a
    second trainer of it is refused, naming the first's pid, and writes nothing; once the first is killed the run
    trains (the kernel drops a dead process's lock)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    p = copy.deepcopy(tiny)
    p["train"]["budget"]["steps"] = 2000
    p["train"]["checkpoints"] = {"linear": 400, "log": 0}
    spec = run_spec(p, RUNS[0])
    rd = tmp_path / "run"
    first = subprocess.Popen([str(Path(sys.executable).parent / "iclnoise"), "train", "--spec", json.dumps(spec),
                              "--run-dir", str(rd), "--no-progress"], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (rd / "resume.pt").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first trainer ended before the test"
        with pytest.raises(RunDirError, match=f"{rd} is being trained by another process \\(pid {first.pid},"):
            train_ensemble([spec], [rd], progress=False, stop_after=5)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert train_ensemble([spec], [rd], progress=False, stop_after=5) == [None]


@pytest.mark.unit
@pytest.mark.numerics
def test_a_deleted_checkpoint_is_named_and_its_run_trained_again_to_the_same_bytes(tiny, tmp_path, capsys, caplog):
    """Issue 48 (15): `iclnoise verify` names a checkpoint that checkpoints.json lists and the disk lacks (exit 1);
    training the run again (what its job does once the DAG plans it) writes it back, byte for byte."""
    from iclnoise.commands.runs import verify

    rd = tmp_path / "results/runs" / RUNS[0]
    train_run(run_spec(tiny, RUNS[0]), rd, progress=False)
    man = manifest(rd)
    gone = checkpoint_path(rd, sorted(man)[2])
    gone.unlink()
    with pytest.raises(SystemExit) as e:
        verify([str(tmp_path / "results")])
    assert e.value.code == 1 and f"{gone}: listed in {rd / 'checkpoints.json'}, missing" in capsys.readouterr().out
    with caplog.at_level("WARNING", logger="iclnoise.run.train"):
        train_run(run_spec(tiny, RUNS[0]), rd, progress=False)
    assert f"checkpoints {gone} are missing" in caplog.text
    assert manifest(rd) == man and sha256(gone) == man[sorted(man)[2]]
    # no checkpoints directory at all is a clone that pulled its results (DVC keeps no checkpoints), not a loss
    shutil.rmtree(rd / "checkpoints")
    verify([str(tmp_path / "results")])
    assert missing_checkpoints(rd) == []


@pytest.mark.unit
@pytest.mark.numerics
def test_a_resume_after_a_divergence_keeps_the_frozen_run_in_the_ensemble(tiny, tmp_path, monkeypatch):
    """A run that diverged stays in the stack (frozen), as in the ensemble that froze it: stopped after step 45 (run 1
    diverged at 30) and resumed, every run ends torch.equal to the uninterrupted diverging ensemble, and the resume
    trains all three runs as one ensemble."""
    import iclnoise.run.ensemble as ens
    import iclnoise.run.train as tr

    setup = _diverging_at_30(tr.Member.setup)
    monkeypatch.setattr(tr.Member, "setup", setup)
    specs = [run_spec(tiny, r) for r in RUNS]
    full_dirs, dirs = [tmp_path / "full" / r for r in RUNS], [tmp_path / "part" / r for r in RUNS]
    full = train_ensemble(specs, full_dirs, progress=False)
    train_ensemble(specs, dirs, progress=False, stop_after=45)
    sizes, init = [], ens.Ensemble.__init__

    def spy(self, members, *a):
        sizes.append(len(members))
        init(self, members, *a)

    monkeypatch.setattr(ens.Ensemble, "__init__", spy)
    out = train_ensemble(specs, dirs, progress=False)
    assert sizes == [3] and out[1].diverged.iloc[-1] and out[1].step.iloc[-1] == 30
    for a, b in zip(full, out):
        pd.testing.assert_frame_equal(a, b)
    for x, y in zip(final_states(full_dirs), final_states(dirs)):
        assert all(torch.equal(x["params"][n], y["params"][n]) for n in x["params"])
