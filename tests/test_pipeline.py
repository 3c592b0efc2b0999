"""Real Snakemake runs of a minimal grid in temporary directories (DVC: test_dvc.py, SLURM: test_slurm.py)."""
import os
import subprocess
import sys
from pathlib import Path

import yaml

from iclnoise.io import read_parquet

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
    p["mech"].update(every=3, n_sequences=16, n_probe=32)
    p["stats"]["n_boot"] = 10
    return p


def run(cmd, cwd, check=True):
    r = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def snakemake(workdir, *args, check=True):
    return run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                str(workdir), "--cores", "2", *args], cwd=workdir, check=check)


def test_snakemake_minimal_grid_produces_parquet_and_figure(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(Ms=(1, 4, "inf"))))
    snakemake(tmp_path)
    m = read_parquet(tmp_path / "results/runs/M1-B16-none-s0/metrics.parquet")
    assert m.step.iloc[-1] == 30 and {"ood_loss", "r", "delta_ridge"} <= set(m.columns)
    assert (tmp_path / "results/figures/fig01_ood_loss.png").stat().st_size > 10_000
    for f in ("llc", "stages", "geometry", "mech"):
        assert (tmp_path / f"results/runs/M1-B16-none-s0/{f}.parquet").exists()
    assert (tmp_path / "results/ed/bym-none-B16-s0/forms.parquet").exists()
    tests = read_parquet(tmp_path / "results/aggregate/tests.parquet")
    assert set(tests.hypothesis) == {"H1", "H2", "H3", "H4"}
    # the noise axis: batch 8 against batch 16 + injection emulating 8, with exposure logged in every run
    assert not (tmp_path / "results/runs/M1-B8-inj-s0").exists()  # inj runs only at batch 16
    inj = read_parquet(tmp_path / "results/runs/M1-B16-inj-s0/injection.parquet")
    assert len(inj) == 30 and (inj.trace_injected > 0).all()
    exp = read_parquet(tmp_path / "results/runs/M1-B8-none-s0/exposure.parquet")
    assert list(exp.step) == [9, 19, 29] and (exp.curv > 0).all()
    out = read_parquet(tmp_path / "results/aggregate/outcomes.parquet")
    assert out.integrated_pne.notna().all() and len(out) == 9
    h3 = tests[tests.hypothesis == "H3"]
    assert h3.status.tolist() == ["run"] and h3.term.iloc[0] == "batch 8 − inj"
    assert (tmp_path / "results/figures/fig10_exposure_series.png").exists()
    assert "Hypothesis verdicts" in (tmp_path / "results/report.md").read_text()
    assert (tmp_path / "logs/train/Minf-B16-none-s0.log").exists()
    # a second invocation has nothing to do
    assert "Nothing to be done" in snakemake(tmp_path, "-n").stdout


def test_invalid_params_stop_before_any_job(tmp_path):
    p = tiny_params()
    p["train"]["lr_schedule"]["kind"] = "cyclic"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    r = snakemake(tmp_path, check=False)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "train.lr_schedule.kind" in out and "warmup_cosine" in out
    assert not (tmp_path / "results").exists()
