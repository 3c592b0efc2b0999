"""The command layer (iclnoise.cli, iclnoise.commands): one entry-point convention, one way to take params."""
import ast
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from iclnoise.cli import COMMANDS, split_each
from iclnoise.commands import sections
from iclnoise.config import ParamsError, every_at, typed
from iclnoise.config.schema import schema
from iclnoise.core.probe_sections import LLCConfig, Refined

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_every_command_is_a_function_of_the_commands_package():
    """COMMANDS: `iclnoise.commands.<topic>:<the command with - as _>`, every one importable."""
    for command, (target, _) in COMMANDS.items():
        module, name = target.split(":")
        assert module.startswith("iclnoise.commands.") and name == command.replace("-", "_"), target
        assert callable(getattr(importlib.import_module(module), name)), target


@pytest.mark.unit
def test_cfg_holds_exactly_the_sections_a_command_reads(tmp_path):
    geometry = {"enabled": True, "every": 6, "probes": 8}
    assert sections(json.dumps({"geometry": geometry}), "geometry") == {"geometry": geometry}
    (tmp_path / "cfg.json").write_text(json.dumps({"geometry": geometry}))
    assert sections(f"@{tmp_path / 'cfg.json'}", "geometry") == {"geometry": geometry}
    assert sections('{"grid": {}, "stats": {}}') == {"grid": {}, "stats": {}}   # no names: every section
    with pytest.raises(SystemExit, match="holds the section"):
        sections(json.dumps({"geometry": geometry, "mech": {}}), "geometry")
    with pytest.raises(SystemExit, match="must be a mapping"):
        sections(json.dumps(geometry), "geometry")   # the section itself, not {name: section}
    with pytest.raises(SystemExit, match="not JSON"):
        sections("{grid: {M: [1]}}")
    with pytest.raises(SystemExit, match="must be a mapping"):
        sections("[1]")


@pytest.mark.unit
def test_a_command_gets_typed_sections_and_a_misspelled_key_is_an_error():
    llc = yaml.safe_load((ROOT / "params.yaml").read_text())["llc"]
    cfg = sections(json.dumps({"llc": llc}), "llc")
    assert typed(cfg, "llc.sampler") == LLCConfig.from_dict(llc["sampler"])
    assert typed(cfg, "llc.refined") == Refined.from_dict(llc["refined"])
    assert every_at(cfg, "llc") == (llc["every"], llc.get("at"))
    with pytest.raises(ParamsError, match="llc.sampler: unknown key.*epsilonn"):
        typed({"llc": {**llc, "sampler": {**llc["sampler"], "epsilonn": 1e-4}}}, "llc.sampler")
    with pytest.raises(ParamsError, match="llc.stages is missing"):
        typed({"llc": {k: v for k, v in llc.items() if k != "stages"}}, "llc.stages")
    with pytest.raises(ParamsError, match="no typed section 'llc.sampelr'"):
        typed(cfg, "llc.sampelr")
    with pytest.raises(ParamsError, match="geometry.every is missing"):
        every_at({"geometry": {"probes": 8}}, "geometry")


@pytest.mark.unit
def test_commands_and_paper_read_no_params_section_raw():
    """`cfg["llc"]["sampler"]` outside the config layer would bypass the typed sections' key checks: the commands
    and iclnoise.output.paper read params through iclnoise.config.typed and every_at only."""
    names = set(schema()["properties"]) | {"sampler", "stages", "refined", "budget", "conditions"}
    pkg = ROOT / "src" / "iclnoise"
    raw = [(p.name, n.lineno) for p in [*sorted((pkg / "commands").glob("*.py")), pkg / "output" / "paper.py"]
           for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
           if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in names]
    assert raw == []


@pytest.mark.integration
def test_rules_pass_each_command_its_sections_as_in_params(tmp_path):
    """Every `--cfg` of the planned DAG (a dry run) holds exactly the sections its command reads, each equal to
    params.yaml's less the keys that only select jobs (seeds, families), so Snakemake's params trigger reruns a rule
    when, and only when, what it computes changes."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llc"]["refined"].update(enabled=True, M=None)   # every probed run, so every command is planned here
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                        str(tmp_path), "-n", "-p", "--cores", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    reads = {"llc": ["llc"], "refined": ["llc"], "stages": ["llc"], "geometry": ["geometry"], "mech": ["mech"],
             "ed": ["ed"], "ed-figures": ["ed"], "aggregate": ["stats"], "report": sorted(params)}
    seen = set()
    for line in re.findall(r"^Shell command: (iclnoise .*)$", r.stdout, re.M):
        args = shlex.split(line.rsplit(" > ", 1)[0])[1:]
        for cmd in split_each(args[1:]) if args[0] == "each" else [args]:
            if "--cfg" not in cmd:
                continue
            cfg = json.loads(cmd[cmd.index("--cfg") + 1])
            want = {s: {k: v for k, v in params[s].items() if k not in ("seeds", "families")} for s in cfg}
            if "llc" in want:   # llc.refined.M selects jobs too
                want["llc"]["refined"] = {k: v for k, v in want["llc"]["refined"].items() if k != "M"}
            assert sorted(cfg) == reads[cmd[0]] and cfg == want, cmd[0]
            seen.add(cmd[0])
    assert seen == set(reads), seen


@pytest.mark.integration
def test_refined_covers_the_probed_runs_of_its_m_only(tmp_path):
    """llc.refined.M selects jobs: with M = [16] a dry run plans `iclnoise refined` in the probe jobs of the M = 16
    runs llc probes and in no other; a value grid.M lacks warns and covers nothing."""
    from iclnoise.config import validate_params
    from iclnoise.config.grid import parse_run_id, refined_covers

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["llc"]["refined"].update(enabled=True, M=[16])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory",
                        str(tmp_path), "-n", "-p", "--cores", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    refined = sorted(re.findall(r"refined --run-dir results/runs/(\S+) ", r.stdout))
    seeds = params["llc"]["seeds"]
    assert refined and all(parse_run_id(run).M == 16 and parse_run_id(run).seed in seeds for run in refined)
    assert len(refined) == len(params["grid"]["batch_sizes"]) * len(seeds)
    params["llc"]["refined"]["M"] = [16, 3]
    with pytest.warns(UserWarning, match="llc.refined.M"):
        p = validate_params(params)
    assert refined_covers(p, parse_run_id("M16-B64-none-s0")) and not refined_covers(p, parse_run_id("M8-B64-none-s0"))
    p["llc"]["refined"]["M"] = None
    assert refined_covers(p, parse_run_id("M8-B64-none-s0"))


@pytest.mark.unit
def test_check_names_the_jobs_a_change_reruns_with_their_cost(tmp_path, capsys):
    """Issue 48 (16): against the params the results were made with (<results>/params.last.json, which the Snakefile
    writes after a successful run), `iclnoise check` prints the changed keys and the jobs they rerun before any
    runs: a geometry-only key reruns the default grid's 12 probe jobs and both ED families and trains nothing; a
    stats key reruns aggregate, its figures and the report only; the learning rate reruns everything."""
    import copy

    from iclnoise.commands.runs import check
    from iclnoise.config import validate_params
    from iclnoise.config.cost import PARAMS_RECORD, rerun_plan
    from iclnoise.config.grid import ed_families, ensemble_groups
    from iclnoise.core.io import write_json

    old = validate_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    write_json(old, tmp_path / "results" / PARAMS_RECORD)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["geometry"]["probes"] += 1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    check([str(tmp_path / "params.yaml"), "--results", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert ("changed since the results were made: geometry.probes; this reruns 0 training job(s); 12 probe job(s) "
            "(every probe of a run reruns together") in out and "; 2 ED families (analysis and figures)" in out, out
    stats = copy.deepcopy(old)
    stats["stats"]["alpha"] = 0.01
    assert rerun_plan(old, stats) == {"train": [], "probe": [], "ed": [], "other": ["aggregate", "aggregate_figures",
                                                                                      "report"]}
    lr = copy.deepcopy(old)
    lr["train"]["optimizer"]["lr"] *= 2
    plan = rerun_plan(old, lr)
    assert plan["train"] == list(ensemble_groups(lr)) and len(plan["probe"]) == 12
    assert plan["ed"] == list(ed_families(lr)) and "training_figures" in plan["other"]
    assert rerun_plan(old, old) == {"train": [], "probe": [], "ed": [], "other": []}
