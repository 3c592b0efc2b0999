"""Training: learns, checkpoints on the schedule, resumes exactly, records divergence."""
import copy

import numpy as np
import pandas as pd
import pytest
import torch

from iclnoise.config import run_spec
from iclnoise.io import read_parquet
from iclnoise.schedules import checkpoint_steps, lr_lambda
from iclnoise.train import train_run


def test_checkpoint_schedule_is_union_of_linear_and_log():
    s = checkpoint_steps(1000, 4, 4)
    assert s[0] == 0 and s[-1] == 1000
    assert {250, 500, 750, 1, 10, 100} <= set(s)


def test_lr_schedules():
    f = lr_lambda("warmup_cosine", 100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    t = lr_lambda("triangle", 100, 0.5)
    assert t(49) == pytest.approx(1.0) and t(100) == 0 and t(75) == pytest.approx(0.5)


def full_and_resumed(spec: dict, tmp_path, killed_after: int = 20):
    """Train `spec` uninterrupted and as a job killed after checkpoint `killed_after` (later checkpoints and
    outputs dropped) then rerun; return both metric tables and run directories."""
    full = train_run(spec, tmp_path / "full", progress=False)
    part = tmp_path / "part"
    train_run(spec, part, progress=False)
    for f in (part / "checkpoints").glob("step_*.pt"):
        if int(f.stem.split("_")[1]) > killed_after:
            f.unlink()
    for f in part.glob("*.parquet"):
        f.unlink()
    return full, train_run(spec, part, progress=False), tmp_path / "full", part


def test_resume_gives_identical_numbers(tiny, tmp_path):
    full, resumed, _, part = full_and_resumed(run_spec(tiny, "M4-B16-none-s0"), tmp_path)  # 2 micro-batches per step
    pd.testing.assert_frame_equal(full, resumed)
    a = torch.load(tmp_path / "full/checkpoints/step_0000060.pt", weights_only=False)["model"]
    b = torch.load(part / "checkpoints/step_0000060.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_micro_batching_does_not_change_the_data_stream(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    spec1 = run_spec(p, "M4-B16-none-s0")
    p["train"]["micro_batch"] = 16
    spec2 = run_spec(p, "M4-B16-none-s0")
    m1 = train_run(spec1, tmp_path / "a", progress=False)
    m2 = train_run(spec2, tmp_path / "b", progress=False)
    # same data and same mean gradient up to float summation order
    np.testing.assert_allclose(m1.ood_loss, m2.ood_loss, rtol=1e-4)


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


def test_divergence_is_recorded_not_dropped(tiny, tmp_path):
    p = copy.deepcopy(tiny)
    p["train"]["optimizer"]["lr"] = 50.0
    p["train"]["grad_clip"] = None
    p["train"]["diverge_loss"] = 5.0
    m = train_run(run_spec(p, "Minf-B16-none-s0"), tmp_path, progress=False)
    assert m.diverged.iloc[-1] and m.step.iloc[-1] < 60
    assert (tmp_path / "metrics.parquet").exists()


def test_killed_process_resumes_to_the_same_numbers(tiny, tmp_path):
    """SIGKILL a real `iclnoise train` process mid-run, start it again, compare with a clean run."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    p = copy.deepcopy(tiny)
    p["train"]["budget"]["steps"] = 400
    p["train"]["checkpoints"] = {"linear": 8, "log": 0}
    spec = json.dumps(run_spec(p, "M4-B16-none-s0"))
    cmd = [str(Path(sys.executable).parent / "iclnoise"), "train", "--spec", spec, "--no-progress"]
    clean = train_run(json.loads(spec), tmp_path / "clean", progress=False)
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(cmd + ["--run-dir", str(run_dir)])
    deadline = time.time() + 120
    while len(list((run_dir / "checkpoints").glob("step_*.pt"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "metrics.parquet").exists(), "the run finished before it could be killed"
    subprocess.run(cmd + ["--run-dir", str(run_dir)], check=True)
    pd.testing.assert_frame_equal(clean, read_parquet(run_dir / "metrics.parquet"))
