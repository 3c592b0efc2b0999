"""experiments/ladder.sh: a design trained job by job over sessions and grown into its committed set (issues 43, 70).
A real run of the script on a tiny design (two ensemble jobs, one probe section): each job's runs end with the
tables the set takes; `iclnoise export --add` makes the set; a second invocation, as on a new machine, trains
nothing the set holds nor LADDER_SKIP names, and a run the set does not hold is trained again."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from iclnoise.config import load_params
from iclnoise.output.export import set_tables

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
TINY = {"grid": {"M": [1, "inf"], "seeds": [0], "batch_sizes": [8], "noise": ["none", "inj"]},
        "noise": {"conditions": {"inj": {"source": "param", "shape": "diagonal", "schedule": "early",
                                         "fraction": 0.5, "budget": 0.01, "batch_sizes": [8]}}},
        "exposure": {"every": 10, "groups": 4, "curvature_probes": 2, "heldout": 8},
        "train": {"budget": {"mode": "steps", "steps": 30}, "checkpoints": {"linear": 2, "log": 3}},
        "eval": {"n_sequences": 64, "n_root": 16}, "model": {"d_model": 16, "d_mlp": 16},
        "llc": {"enabled": False, "refined": {"enabled": False}}, "ed": {"enabled": False},
        "geometry": {"enabled": False}, "mech": {"enabled": True, "every": 3, "n_probe": 32}}


def ladder(d: Path, *env: str) -> str:
    r = subprocess.run([str(ROOT / "experiments" / "ladder.sh"), "tiny", "1", "tiny.yaml"], cwd=d,
                       env={**ENV, **dict(e.split("=", 1) for e in env)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_a_design_is_trained_job_by_job_and_a_new_machine_trains_only_what_its_set_lacks(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    params = load_params(tmp_path / "params.yaml", [tmp_path / "tiny.yaml"])
    none, inj = ["M1-B8-none-s0", "Minf-B8-none-s0"], ["M1-B8-inj-s0", "Minf-B8-inj-s0"]
    (tmp_path / "skip").write_text("\n".join(none) + "\n")   # LADDER_SKIP: as if a set held B8-none's runs
    out = ladder(tmp_path, f"LADDER_SKIP={tmp_path / 'skip'}")
    assert "== 2 jobs, 1 lane(s), 2 runs held by reference/tiny or named by LADDER_SKIP" in out, out
    assert "failed" not in out, out
    assert "== lane 1: B8-inj" in out and "B8-none" not in out, out
    assert sorted(p.name for p in (tmp_path / "results" / "runs").iterdir()) == sorted(inj)
    for r in inj:   # training's tables and the mech probe's: what the set takes
        trained, probes = set_tables(params, r)
        assert probes == ["mech.parquet"] and "exposure.parquet" in trained
        assert all((tmp_path / "results" / "runs" / r / f).exists() for f in trained + probes), r
    subprocess.run(["iclnoise", "export", "--add", "--results", "results", "--configfile", "tiny.yaml", "--out",
                    "reference/tiny"], cwd=tmp_path, env=ENV, check=True, capture_output=True)
    held = json.loads((tmp_path / "reference" / "tiny" / "provenance.json").read_text())["spec_hash"]
    assert sorted(held) == sorted(inj)
    shutil.rmtree(tmp_path / "results")   # a new machine: only the committed set is left
    out = ladder(tmp_path, f"LADDER_SKIP={tmp_path / 'skip'}")   # the set's runs and LADDER_SKIP's: nothing to do
    assert "4 runs held by reference/tiny or named by LADDER_SKIP" in out and "== lane" not in out, out
    out = ladder(tmp_path)
    assert "2 runs held by reference/tiny" in out and "== lane 1: B8-none" in out and "B8-inj" not in out, out
    assert sorted(p.name for p in (tmp_path / "results" / "runs").iterdir()) == sorted(none)
