"""Invalid parameters are rejected with a message that names the key and what is allowed."""
import copy
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jsonschema
import pytest
import yaml

from iclnoise import cli as iclnoise_cli
from iclnoise.config import ParamsError, check_yaml_files, load_params, merge_params, read_yaml, validate_params
from iclnoise.config.cost import COST_CONFIRM_CORE_HOURS, check_cost, cost_estimate
from iclnoise.config.grid import ed_families, expand_grid, parse_run_id, run_spec
from iclnoise.config.memory import job_memory
from iclnoise.config.schema import schema
from iclnoise.core.sections import Data, Eval, Model


@pytest.fixture(scope="module")
def params():
    """params.yaml with an injected-noise condition in the grid (the checks of used conditions need one)."""
    with open("params.yaml") as f:
        p = yaml.safe_load(f)
    p["grid"]["noise"] = ["none", "grad_b16"]
    return validate_params(p)


def bad(params, path, value):
    p = copy.deepcopy(params)
    node = p
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    return str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("path,value,expect", [
    (("train", "lr_schedule", "kind"), "cyclic", ["train.lr_schedule.kind", "constant", "warmup_cosine", "triangle"]),
    (("grid", "M"), [0, 4], ["grid.M.0", "inf"]),
    (("grid", "M"), [4, "many"], ["grid.M.1", "inf"]),
    (("grid", "noise"), ["loud"], ["grid.noise", "noise.conditions", "none"]),
    (("grid", "batch_sizes"), [96], ["grid.batch_sizes", "micro_batch"]),
    (("train", "optimizer", "lr"), -1.0, ["train.optimizer.lr", "> 0"]),
    (("train", "device"), "tpu", ["train.device", "auto", "cpu", "cuda"]),
    (("eval", "icl_tokens"), [8, 2], ["eval.icl_tokens", "k_early < k_late"]),
    (("model", "n_heads"), 3, ["model.d_model", "model.n_heads"]),
    (("data", "typo_key"), 1, ["data", "typo_key", "allowed keys"]),
])
def test_rejections_name_the_key_and_the_allowed_values(params, path, value, expect):
    msg = bad(params, path, value)
    for fragment in expect:
        assert fragment in msg, msg


@pytest.mark.unit
def test_budget_modes(params):
    p = copy.deepcopy(params)
    p["train"]["budget"] = {"mode": "sequences", "sequences": 64 * 100}
    validate_params(p)
    assert run_spec(p, "M4-B16-none-s0")["train"]["steps"] == 400
    assert run_spec(p, "M4-B64-none-s0")["train"]["steps"] == 100
    p["train"]["budget"] = {"mode": "sequences"}
    with pytest.raises(ParamsError, match="train.budget.sequences"):
        validate_params(p)


@pytest.mark.unit
def test_grid_and_run_ids(params):
    runs = expand_grid(params)
    g = params["grid"]
    conds = params["noise"]["conditions"]
    pairs = [(B, n) for B in g["batch_sizes"] for n in g["noise"] if B in conds[n].get("batch_sizes", [B])]
    assert len(runs) == len(g["M"]) * len(g["seeds"]) * len(pairs)
    assert {(k.batch, k.noise) for k in runs} == set(pairs) and (16, "grad_b16") not in pairs  # restricted to B=64
    for k in runs:
        assert parse_run_id(k.run_id) == k
    assert parse_run_id("Minf-B32-none-s1").M == -1
    spec = run_spec(params, "M16-B16-none-s1")
    assert spec["keys"] == {"run_id": "M16-B16-none-s1", "M": 16, "seed": 1, "batch": 16, "noise": "none"}
    assert spec["train"]["micro_batch"] == 16


@pytest.mark.unit
def test_condition_restricted_to_some_m(params):
    """A condition with `M` runs only at those grid M (configs/science.yaml's early/late pair at M = 16); the
    run's spec does not carry the restriction, and an M outside the grid is refused."""
    p = copy.deepcopy(params)
    p["grid"].update(M=[1, 16, "inf"], noise=["none", "early"])
    p["noise"]["conditions"]["early"]["M"] = [16, "inf"]
    early = [k for k in expand_grid(p) if k.noise == "early"]
    assert {k.M for k in early} == {16, -1} and {k.batch for k in early} == {64}
    assert len(early) == 2 * len(p["grid"]["seeds"])
    assert "M" not in run_spec(p, "M16-B64-early-s0")["noise"]
    p["noise"]["conditions"]["early"]["M"] = [16]   # one run per seed: no ED family, and the workflow says so
    assert "bym-early-B64-s0" not in ed_families(p) and list(ed_families(p, single=True)) == ["bym-early-B64-s0"]
    p["noise"]["conditions"]["early"]["M"] = [3]
    with pytest.raises(ParamsError, match=r"noise.conditions.early.M = \[3\] shares no value with grid.M"):
        validate_params(p)


@pytest.mark.unit
def test_a_dose_series_switches_the_noise_at_one_fraction():
    """configs/exposure.yaml's noise-off arm (fraction 0.8 at 0.3-10×) and the pilot's windows (0.7, 0.5 at 10×) in
    one grid would be read as one series, 10×'s three windows as one level: refused, naming them. Each config alone
    passes (the pilot's windows share one dose: no series), and so does a window at another batch size."""
    base = load_params("params.yaml", ["configs/science.yaml", "configs/exposure.yaml"])
    pilot = load_params("params.yaml", ["configs/science.yaml", "configs/exposure_pilot.yaml"])
    both = copy.deepcopy(base)
    both["noise"]["conditions"].update(pilot["noise"]["conditions"])
    both["grid"]["noise"] += ["param_x10_on70", "param_x10_on50"]
    with pytest.raises(ParamsError, match=r"form one dose series \(param, diagonal, early, batch 64\) but switch "
                       r"the noise at fractions 0.5, 0.7, 0.8"):
        validate_params(both)
    both["grid"]["batch_sizes"] = [64, 128]
    for n in ("param_x10_on70", "param_x10_on50"):
        both["noise"]["conditions"][n]["batch_sizes"] = [128]
    both["noise"]["batch_exposure"]["128"] = 0.014
    validate_params(both)


@pytest.mark.unit
def test_steps_as_batch_trains_another_batch_s_steps(params):
    """configs/noise.yaml's grad_b16_steps: at batch 64 it trains the steps batch 16 takes on the sequence budget
    (4× the sequences), and the cost estimate counts them; with a budget in steps the key is refused."""
    p = copy.deepcopy(params)
    p["grid"].update(M=[16], batch_sizes=[16, 64], noise=["none", "grad_b16"])
    before = cost_estimate(p)["run_steps"]
    p["noise"]["conditions"]["grad_b16"]["steps_as_batch"] = 16
    validate_params(p)
    n16 = p["train"]["budget"]["sequences"] // 16
    assert run_spec(p, "M16-B64-grad_b16-s0")["train"]["steps"] == n16
    assert run_spec(p, "M16-B64-none-s0")["train"]["steps"] == n16 // 4
    assert cost_estimate(p)["run_steps"] - before == len(p["grid"]["seeds"]) * (n16 - n16 // 4)
    p["train"]["budget"].update(mode="steps", steps=100)
    with pytest.raises(ParamsError, match="steps_as_batch needs train.budget.mode: sequences"):
        validate_params(p)


@pytest.mark.unit
@pytest.mark.parametrize("edit, key, allowed", [
    (lambda p: p["noise"]["conditions"]["early"].pop("budget"), "noise.conditions.early", "budget"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(shape="spiky"), "noise.conditions.grad_b16.shape",
     "lowrank"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(source="both"), "noise.conditions.grad_b16.source", "param"),
    (lambda p: p["noise"]["conditions"]["late"].update(schedule="middle"), "noise.conditions.late.schedule",
     "controlled"),
    (lambda p: p["exposure"].update(groups=6), "exposure.groups", "divisor"),
    (lambda p: p["noise"]["conditions"]["grad_b16"].update(rank=8), "noise.conditions.grad_b16.rank", "rank ≤ 7"),
    (lambda p: p["noise"]["conditions"]["none"].update(shape="diagonal"), "noise.conditions.none", "no other keys"),
])
def test_noise_and_exposure_errors_name_the_key(params, edit, key, allowed):
    p = copy.deepcopy(params)
    edit(p)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    assert key in str(e.value) and allowed in str(e.value), str(e.value)


# ---- bad parameter files, written as YAML text and read with load_params (issue 20) ----

def canonical(text: str) -> str:
    """params.yaml with the lines the bad-file table edits set to fixed values, so the table does not depend on
    the shipped defaults (D, lr, budget, M grid, seeds)."""
    for pattern, line in ((r"(?m)^  D: .*$", "  D: 4"), (r"(?m)^  M: \[.*$", "  M: [1, 4, 16, 64, 256, inf]"),
                          (r"(?m)^  seeds: \[0, 1, 2\].*$", "  seeds: [0, 1]"),
                          (r"(?m)^  noise: \[.*$", "  noise: [none, grad_b16]"),
                          (r"(?m)^  budget: .*$", "  budget: {mode: steps, steps: 2500}"),
                          (r"\{lr: [0-9.e+-]+,", "{lr: 0.002,"),
                          (r"early, fraction: 0.3, budget: [0-9.e+-]+", "early, fraction: 0.3, budget: 4.0e+6"),
                          (r"(?m)^  n_sequences: \d+", "  n_sequences: 1024"),
                          (r"(?m)^(llc:\n(?:  .*\n)*?)  every: \d+ ", r"\1  every: 8 ")):
        text, n = re.subn(pattern, line, text, count=1)
        assert n == 1, pattern
    return text


TEXT = canonical(Path("params.yaml").read_text())


def line_of(text: str, fragment: str) -> int:
    """1-based line where `fragment` starts in `text`."""
    return text[:text.index(fragment)].count("\n") + 1


def sub(old: str, new: str):
    def f(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)
    return f


def section_block(text: str, name: str) -> re.Match:
    m = re.search(rf"(?ms)^{name}:.*?(?=^\S|\Z)", text)
    assert m, name
    return m


def in_section(name: str, old: str, new: str):
    def f(text: str) -> str:
        m = section_block(text, name)
        assert m.group().count(old) == 1, (name, old)
        return text[:m.start()] + m.group().replace(old, new) + text[m.end():]
    return f


def drop_section(name: str):
    def f(text: str) -> str:
        m = section_block(text, name)
        return text[:m.start()] + text[m.end():]
    return f


def replace_section(name: str, new: str):
    def f(text: str) -> str:
        m = section_block(text, name)
        return text[:m.start()] + new + "\n" + text[m.end():]
    return f


def both(*fs):
    def f(text: str) -> str:
        for g in fs:
            text = g(text)
        return text
    return f


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


D_LINE, K_LINE, OPT_LINE = line_of(TEXT, "  D: 4\n"), line_of(TEXT, "  K: 8\n"), line_of(TEXT, "  optimizer:")
SEEDS = "grid.seeds = [0, 1]"

# (id, edit of params.yaml, fragments the message must contain: the key and the allowed values)
BAD_FILES = [
    # finite numbers only
    ("lr-nan", sub("lr: 0.002", "lr: .nan"), ["train.optimizer.lr = nan", "a finite number"]),
    ("lr-inf", sub("lr: 0.002", "lr: .inf"), ["train.optimizer.lr = inf", "a finite number"]),
    ("diverge-nan", sub("diverge_loss: 1000.0", "diverge_loss: .NaN"), ["train.diverge_loss = nan", "a finite number"]),
    ("budget-minus-inf", sub("early, fraction: 0.3, budget: 4.0e+6", "early, fraction: 0.3, budget: -.inf"),
     ["noise.conditions.early.budget = -inf", "a finite number"]),
    ("M-float-inf", sub("M: [1, 4, 16, 64, 256, inf]", "M: [1, 4, 16, 64, 256, .inf]"),
     ["grid.M.5 = inf", "a finite number", "written inf, a string"]),
    # integers are integers
    ("D-float", sub("  D: 4\n", "  D: 4.0\n"), ["data.D = 4.0", "it must be an integer", "write 4"]),
    ("D-bool", sub("  D: 4\n", "  D: true\n"), ["data.D = True", "it must be an integer"]),
    ("seed-float", sub("seeds: [0, 1]", "seeds: [0, 1.0]"), ["grid.seeds.1 = 1.0", "an integer", "write 1"]),
    ("steps-float", sub("steps: 2500}", "steps: 2.5e+3}"), ["train.budget.steps = 2500.0", "an integer", "write 2500"]),
    ("M-float", sub("M: [1, 4, 16, 64, 256, inf]", "M: [1, 4.0, 16, 64, 256, inf]"),
     ["grid.M.1 = 4.0", "integer 1 <= M <= 1048576", "'inf'"]),
    ("eps-yaml-string", sub("eps: 1.0e-8", "eps: 1e-8"),
     ["train.optimizer.eps = '1e-8'", "it must be a number", "write it with a dot"]),
    # absurd sizes
    ("M-2^40", sub("M: [1, 4, 16, 64, 256, inf]", "M: [1, 4, 16, 1099511627776, inf]"),
     ["grid.M.3 = 1099511627776", "1 <= M <= 1048576 (2^20)", "'inf'"]),
    ("pool-memory", both(sub("M: [1, 4, 16, 64, 256, inf]", "M: [1, 4, 16, 64, 1048576, inf]"),
                         sub("  D: 4\n", "  D: 4096\n")),
     ["estimated memory of one job", "pool 128.4 GiB", "allowed: <= 32.0 GiB", "grid.M × data.D"]),  # 2 seeds' pools
    ("eval-memory", sub("n_sequences: 1024", "n_sequences: 100000000"),
     ["estimated memory of one job", "allowed: <= 32.0 GiB", "eval.n_sequences"]),
    # duplicate keys, with file and line
    ("dup-flow-key", sub("{lr: 0.002, ", "{lr: 0.002, lr: 0.02, "),
     ["train.optimizer.lr is given twice", f"line {OPT_LINE}", "allowed: each key once"]),
    ("dup-block-key", sub("  D: 4\n", "  D: 4\n  D: 8\n"),
     [f"line {D_LINE + 1}: key data.D is given twice (first at line {D_LINE})", "allowed: each key once"]),
    ("dup-section", lambda t: t + "stats:\n  alpha: 0.1\n", ["key stats is given twice", "allowed: each key once"]),
    # YAML syntax errors, with file, line and column
    ("tab-indent", sub("  K: 8\n", "\tK: 8\n"), [f"line {K_LINE}, column 1: YAML syntax error", "no tabs"]),
    ("unclosed-list", sub("seeds: [0, 1]", "seeds: [0, 1"), ["YAML syntax error", "column", "expected ',' or ']'"]),
    ("bad-indent", sub("  K: 8\n", "   K: 8\n"), [f"line {K_LINE}, column", "YAML syntax error"]),
    # seeds mix 32 bits into the streams: larger ones would share a stream with a smaller one
    ("seed-2^32", sub("seeds: [0, 1]", "seeds: [0, 4294967296]"),
     ["grid.seeds.1 = 4294967296 is not allowed", "<= 4294967295"]),
    ("long-condition-name", sub("noise: [none, grad_b16]", "noise: [none, " + "n" * 40 + "]"),
     ["grid.noise.1", "1-32 lowercase letters"]),
    # every job kind has a memory model: probes and the exposure step too
    ("llc-set-memory", sub("    n: 1024", "    n: 1000000000"),
     ["estimated memory of one llc job", "allowed: <= 32.0 GiB", "llc.sampler.n"]),
    ("exposure-memory", sub("  heldout: 32", "  heldout: 1000000000"),
     ["estimated memory of one exposure step of a training job", "exposure.heldout"]),
    # checkpoint counts the probes can use; ED's own rules
    ("checkpoints-huge", sub("checkpoints: {linear: 12, log: 16}", "checkpoints: {linear: 1000000000, log: 16}"),
     ["train.checkpoints.linear = 1000000000 is not allowed", "<= 1000000"]),
    ("checkpoints-too-many", sub("checkpoints: {linear: 12, log: 16}", "checkpoints: {linear: 5000, log: 16}"),
     ["checkpoints per run; allowed: at most 2000"]),
    ("checkpoints-none", sub("checkpoints: {linear: 12, log: 16}", "checkpoints: {linear: 0, log: 0}"),
     ["gives 2 checkpoints per run; essential dynamics needs at least ed.n_pcs + 2 = 5"]),
    ("ed-form-pcs", sub("n_form_pcs: 3", "n_form_pcs: 4"), ["ed.n_form_pcs = 4 > ed.n_pcs = 3", "n_form_pcs <= n_pcs"]),
    # keys that are not strings, nesting, alias expansion and size: refused before anything is built
    ("int-key", lambda t: t + "1: 2\n", ["key '1' under <top level> is not a string", "reads it as int",
                                         "allowed: string keys"]),
    ("yaml11-on-key", lambda t: t + "on: true\n", ["key 'on'", "reads it as bool", "allowed: string keys"]),
    ("deep-nesting", lambda t: t + "deep: " + "[" * 3000 + "]" * 3000 + "\n", ["nested too deeply"]),
    ("alias-bomb", lambda t: t + "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
     + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 7)),
     ["expands to more than 100,000 values", "aliases"]),
    ("huge-file", lambda t: t + "big: [" + ", ".join(["1"] * 400_000) + "]\n",
     ["allowed: a params file up to 1,048,576 bytes"]),
    # every section required, unless switched off with enabled: false
    *[(f"no-{s}", drop_section(s), [f"{s}: section missing", "every section is required",
                                    f"`{s}: {{enabled: false}}`"])
      for s in ("exposure", "llc", "ed", "geometry", "mech")],
    ("no-stats", drop_section("stats"), ["stats: section missing", "every section is required"]),
    ("no-grid", drop_section("grid"), ["grid: section missing", "every section is required"]),
    ("llc-key-missing", in_section("llc", "  every: 8 ", "  # every: 8 "),
     ["llc.every is required", "allowed: the keys enabled, every, sampler, stages", "llc.enabled: false"]),
    ("unknown-section", lambda t: t + "typo_section: {enabled: false}\n",
     ["unknown key(s) typo_section", "allowed keys: cnr, data, ed, eval, exposure"]),
    ("exposure-off-but-injected", replace_section("exposure", "exposure: {enabled: false}"),
     ["noise.conditions.grad_b16", "needs the full exposure section", "groups"]),
    # probe seeds must be grid seeds
    *[(f"{s}-seed-not-in-grid", in_section(s, "  seeds: [0]", "  seeds: [0, 3]"),
       [f"{s}.seeds = [0, 3]", "seed(s) [3] not in grid.seeds", SEEDS, "a subset of grid.seeds"])
      for s in ("llc", "geometry", "mech", "ed")],
]


@pytest.mark.unit
def test_a_file_that_is_not_utf8_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(TEXT.encode() + "# réglages\n".encode("latin-1"))
    with pytest.raises(ParamsError, match=rf"line {TEXT.count(chr(10)) + 1}: byte 0xe9 is not UTF-8"):
        load_params(path)


@pytest.mark.unit
@pytest.mark.parametrize("edit, expect", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_files_are_rejected_naming_key_and_allowed_values(tmp_path, edit, expect):
    path = write(tmp_path, edit(TEXT))
    with pytest.raises(ParamsError) as e:
        load_params(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    for fragment in expect:
        assert fragment in msg, f"{fragment!r} not in:\n{msg}"


@pytest.mark.unit
@pytest.mark.parametrize("name", ["exposure", "llc", "ed", "geometry", "mech"])
def test_a_section_switched_off_needs_no_other_keys(tmp_path, name):
    text = replace_section(name, f"{name}: {{enabled: false}}")(TEXT)
    if name == "exposure":  # injected noise needs the exposure keys: run batch noise only
        text = sub("noise: [none, grad_b16]", "noise: [none]")(text)
    p = load_params(write(tmp_path, text))
    assert p[name] == {"enabled": False}


@pytest.mark.unit
def test_the_shipped_configs_are_valid_with_their_overrides():
    for override in ("configs/noise.yaml", "configs/carroll.yaml"):
        p = load_params("params.yaml", [override])
        assert p["data"] == yaml.safe_load(Path(override).read_text()).get("data", p["data"])
    # configs/noise.yaml goes on top of configs/science.yaml: the first science setting (640 000 sequences) plus
    # H3 at equal data and at batch 16's steps (reference/noise)
    p = load_params("params.yaml", ["configs/science.yaml", "configs/noise.yaml"])
    science = load_params("params.yaml", ["configs/science.yaml"])
    extra = set(expand_grid(p)) - set(expand_grid(science))
    assert {k.noise for k in extra} == {"grad_b16", "grad_b16_steps"}
    assert set(expand_grid(science)) <= set(expand_grid(p))
    assert {run_spec(p, k.run_id)["train"]["steps"] for k in extra if k.noise == "grad_b16_steps"} == {640_000 // 16}
    assert run_spec(science, "M16-B16-none-s0")["train"]["steps"] == 1_280_000 // 16


@pytest.mark.unit
def test_schema_is_draft_2020_12_and_validated_once():
    s = schema()
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(s)

    def tuples(node):  # draft-07 tuple `items: [...]` is `prefixItems` in 2020-12
        if isinstance(node, dict):
            return [k for k, v in node.items() if k == "items" and isinstance(v, list)] + \
                [x for v in node.values() for x in tuples(v)]
        return [x for v in node for x in tuples(v)] if isinstance(node, list) else []
    assert tuples(s) == []
    assert set(s["required"]) == set(s["properties"])  # every section required


def snakemake_jobs(*configfiles: str) -> int:
    """The job count of Snakemake's own dry run of the workflow."""
    import subprocess
    import sys
    args = [a for c in configfiles for a in ("--configfile", c)]
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--config", "confirm_cost=true",
                          *args, "--directory", str(Path(__file__).parent / "_dryrun")], capture_output=True,
                         text=True, check=True).stdout
    return int(re.findall(r"(?m)^total\s+(\d+)", out)[-1])


@pytest.mark.integration
def test_cost_estimate_counts_the_dag():
    """Job counts equal Snakemake's own dry-run DAG for params.yaml, configs/noise.yaml and configs/carroll.yaml."""
    import shutil
    d = Path(__file__).parent / "_dryrun"
    d.mkdir(exist_ok=True)
    try:
        shutil.copy("params.yaml", d / "params.yaml")
        default = cost_estimate(load_params("params.yaml"))
        assert default["jobs"] == snakemake_jobs()
        assert cost_estimate(load_params("params.yaml", ["configs/noise.yaml"]))["jobs"] == snakemake_jobs(
            str(Path("configs/noise.yaml").resolve()))
        carroll = cost_estimate(load_params("params.yaml", ["configs/carroll.yaml"]))
        assert carroll["jobs"] == snakemake_jobs(str(Path("configs/carroll.yaml").resolve()))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert carroll["runs"] == 595
    # 17 M x 5 seeds x (B64: none; B256, B1024: none + 2 injected) with 76.8M sequences / B steps each
    assert carroll["run_steps"] == 17 * 5 * (76_800_000 // 64 + 3 * 76_800_000 // 256 + 3 * 76_800_000 // 1024)
    assert default["train_core_hours"] < default["core_hours"] < COST_CONFIRM_CORE_HOURS < carroll["core_hours"]


@pytest.mark.unit
def test_cost_prices_only_the_injection_windows_steps_at_the_injected_rate():
    """An early or late arm injects on `fraction` of its steps: its training costs plain · (1 + (f − 1) · fraction),
    f = injected_factor(params, source) (measured, bench/bench_noise.py); a constant schedule pays f on every step."""
    from iclnoise.config.cost import injected_factor, step_ms

    def train_hours(noise, **cond):
        p = load_params("params.yaml")
        p["grid"].update(noise=[noise], batch_sizes=[64], M=[16], seeds=[0])
        p["noise"]["conditions"][noise].update(cond)
        return cost_estimate(p)["train_core_hours"]

    p = load_params("params.yaml")
    plain = train_hours("none")
    early, const = train_hours("early"), train_hours("early", schedule="constant", fraction=None)
    f, steps = injected_factor(p, "grad"), 2500
    extra = steps * (step_ms(p, 64) * (f - 1)) / 1000 / 3600
    assert early == pytest.approx(plain + 0.3 * extra, rel=1e-9) and const == pytest.approx(plain + extra, rel=1e-9)


@pytest.mark.unit
def test_cost_counts_the_closed_loops_curvature_probes():
    """Issue 43: the estimate priced an injecting step alike at any exposure.curvature_probes / curvature_every,
    so configs/dose.yaml's 16 probes every 10 steps (5x the default's 8 every 25) read as the default's cost. Each
    probe per step costs CURVATURE_PROBE_COST plain steps (measured, cost.py)."""
    from iclnoise.config.cost import CURVATURE_PROBE_COST, injected_factor, step_ms

    def hours(probes, every, noise="param_x1"):
        p = load_params("params.yaml", ["configs/science.yaml", "configs/dose.yaml"])
        p["grid"].update(noise=[noise], M=[16], seeds=[0])
        p["exposure"].update(curvature_probes=probes, curvature_every=every)
        return p, cost_estimate(p)["train_core_hours"]

    (p, dose), (_, default) = hours(16, 10), hours(8, 25)
    plain = hours(16, 10, "none")[1]
    assert injected_factor(p, "none") == 1.0 and plain < default < dose
    extra = 20_000 * step_ms(p, 64) * CURVATURE_PROBE_COST * (16 / 10 - 8 / 25) / 1000 / 3600
    assert dose - default == pytest.approx(extra, rel=1e-9)


@pytest.mark.unit
def test_probed_checkpoints_match_a_real_run():
    """The default's probed checkpoints per batch-64 run equal what the probes select from the training
    schedule (runs.select_steps on schedules.checkpoint_steps, as iclnoise.run.probing does): 7 LLC, 5 geometry
    and 2 mech checkpoints of 24 (checked against llc.parquet, geometry.parquet and mech.parquet of
    M16-B64-none-s0 in a default DAG run of 9baea51)."""
    from iclnoise.config.cost import probed_checkpoints
    from iclnoise.config.grid import typed_spec
    p = load_params("params.yaml")
    spec = typed_spec(p, "M16-B64-none-s0")
    assert len(spec.train.checkpoints_planned) == 25   # step 0 and 24 after it
    assert [probed_checkpoints(p, spec, s) for s in ("llc", "geometry", "mech")] == [7, 5, 2]


@pytest.mark.integration
def test_confirm_cost_takes_only_true_or_false():
    """Issue 30: `--config confirm_cost=false` (or no, off) confirmed a 330 core-hour grid. A real dry run of the
    Carroll grid: the words for no refuse with the cost message, other words are refused naming the key."""
    import subprocess
    import sys

    def dry(value):
        return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile",
                               "configs/carroll.yaml", "--config", f"confirm_cost={value}"], capture_output=True,
                              text=True)
    # real dry runs for a word for no, a number and a refused word; the other words through the same switch()
    for value in ("false", "0"):
        out = dry(value)
        assert out.returncode != 0 and "threshold" in out.stderr + out.stdout, (value, out.stderr[-500:])
    out = dry("no")
    assert out.returncode != 0 and "use confirm_cost=true or confirm_cost=false" in out.stderr + out.stdout
    from iclnoise.config import switch
    assert switch("TRUE", "k") is True and switch(1, "k") is True and switch(False, "k") is False
    assert switch("False", "k") is False and switch(" 0 ", "k") is False
    for word in ("no", "off", "yes", 0.5):
        with pytest.raises(ParamsError, match="use k=true or k=false"):
            switch(word, "k")


@pytest.mark.unit
def test_check_cost_refuses_a_large_grid_without_confirmation():
    check_cost(load_params("params.yaml"), confirmed=False)
    carroll = load_params("params.yaml", ["configs/carroll.yaml"])
    with pytest.raises(ParamsError) as e:
        check_cost(carroll, confirmed=False)
    msg = str(e.value)
    for fragment in ("595 runs", "core-hours", "--config confirm_cost=true", "threshold"):
        assert fragment in msg, msg
    assert check_cost(carroll, confirmed=True)["runs"] == 595


@pytest.mark.unit
def test_check_command_prints_the_estimate(capsys):
    from iclnoise.commands.runs import check as cli
    cli(["params.yaml"])
    out = capsys.readouterr().out
    est = cost_estimate(load_params("params.yaml"))
    assert f"valid; {est['runs']} runs" in out and f"cost estimate: {est['runs']} runs, {est['jobs']} jobs" in out
    cli(["params.yaml", "--configfile", "configs/carroll.yaml"])
    assert "above the 2 core-hour threshold" in capsys.readouterr().out


@pytest.mark.unit
def test_log_level_option_env_and_format(monkeypatch, capsys):
    monkeypatch.delenv("ICLNOISE_LOG_LEVEL", raising=False)
    assert iclnoise_cli.pop_log_level(["train", "--spec", "x"]) == ("INFO", ["train", "--spec", "x"])
    assert iclnoise_cli.pop_log_level(["--log-level", "debug", "train"]) == ("DEBUG", ["train"])
    assert iclnoise_cli.pop_log_level(["train", "--log-level=warning"]) == ("WARNING", ["train"])
    monkeypatch.setenv("ICLNOISE_LOG_LEVEL", "error")
    assert iclnoise_cli.pop_log_level(["train"]) == ("ERROR", ["train"])
    with pytest.raises(SystemExit, match="ICLNOISE_LOG_LEVEL = 'loud' is not allowed; allowed: DEBUG, INFO"):
        monkeypatch.setenv("ICLNOISE_LOG_LEVEL", "loud")
        iclnoise_cli.pop_log_level(["train"])
    root, pkg = logging.getLogger(), logging.getLogger("iclnoise")
    saved = (root.handlers[:], root.level, pkg.level)
    try:
        iclnoise_cli.setup_logging("WARNING", "llc")
        logging.getLogger("iclnoise.probes.llc").info("hidden")
        logging.getLogger("iclnoise.probes.llc").warning("shown")
        err = capsys.readouterr().err
        assert "hidden" not in err and "WARNING iclnoise llc iclnoise.probes.llc: shown" in err
        iclnoise_cli.setup_logging("DEBUG", "train")
        logging.getLogger("iclnoise.run.train").debug("step detail")
        logging.getLogger("pydot").debug("third-party chatter")
        warnings.warn("a warning becomes a log record")
        err = capsys.readouterr().err
        assert "DEBUG iclnoise train iclnoise.run.train: step detail" in err and "chatter" not in err
        assert "a warning becomes a log record" in err
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        pkg.setLevel(saved[2])
        logging.captureWarnings(False)


@pytest.mark.integration
@pytest.mark.numerics
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak RSS")
def test_pool_memory_estimate_matches_a_measured_peak():
    """The pool term against the peak RSS (VmHWM, reset first) of drawing a pool and running dMMSE on it (one
    evaluator pool: the estimate minus the training pool's M·D·4). Measured 143.7 MB vs 126.4 MB estimated
    for M = 2^17, D = 64 (ratio 1.14, three runs)."""
    M, D = 2**17, 64
    code = ("import torch; torch.set_num_threads(1)\n"
            "from iclnoise.core.tasks import task_pool, eval_set\nfrom iclnoise.core.predictors import dmmse\n"
            "def kb(k): return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(k))\n"
            "open('/proc/self/clear_refs', 'w').write('5')\nr0 = kb('VmRSS:')\n"
            f"pool = task_pool(0, {M}, {D}); b = eval_set('id', {M}, 32, 8, {D}, 0.125, 0, 1)\n"
            "dmmse(b.xs, b.ys, pool, 0.125)\nprint((kb('VmHWM:') - r0) * 1024)\n")
    measured = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    p = yaml.safe_load(Path("params.yaml").read_text())
    p["data"]["D"] = D
    evaluator_part = job_memory(Data.from_dict(p["data"]), Model.from_dict(p["model"]), Eval.from_dict(p["eval"]), 64,
                                [M])["pool"] - M * D * 4
    assert 0.7 * evaluator_part < measured < 1.3 * evaluator_part, (measured, evaluator_part)


@pytest.mark.integration
def test_overrides_merge_as_snakemake_does_and_are_read_strictly(tmp_path):
    """merge_params against Snakemake's own update_config (the reference: what --configfile does)."""
    update_config = pytest.importorskip("snakemake.utils").update_config
    base = read_yaml("params.yaml")
    for override in ("configs/carroll.yaml", "configs/noise.yaml"):
        ref = copy.deepcopy(base)
        update_config(ref, read_yaml(override))
        assert merge_params(base, read_yaml(override)) == ref
    assert base == read_yaml("params.yaml")  # not mutated
    dup = tmp_path / "override.yaml"
    dup.write_text("grid:\n  seeds: [0]\n  seeds: [0, 1]\n")
    for call in (lambda: load_params("params.yaml", [dup]), lambda: check_yaml_files(["params.yaml", dup])):
        with pytest.raises(ParamsError, match=rf"{dup}, line 3: key grid.seeds is given twice \(first at line 2\)"):
            call()


@pytest.mark.unit
def test_each_runs_several_commands_in_one_process(monkeypatch, capsys):
    """`iclnoise each -- A -- B` (one probe job per run): both commands run, in order, under their own
    log prefix; a list without a leading -- or with an unknown command is refused before anything runs."""
    monkeypatch.delenv("ICLNOISE_LOG_LEVEL", raising=False)
    assert iclnoise_cli.split_each(["--", "llc", "--every", "2", "--", "stages", "--run-dir", "d"]) == [
        ["llc", "--every", "2"], ["stages", "--run-dir", "d"]]
    with pytest.raises(SystemExit, match="start every command with --"):
        iclnoise_cli.split_each(["llc", "--every", "2"])
    root, pkg = logging.getLogger(), logging.getLogger("iclnoise")
    saved = (root.handlers[:], root.level, pkg.level)
    try:
        iclnoise_cli.main(["each", "--", "check", "params.yaml", "--", "check", "params.yaml", "--configfile",
                           "configs/noise.yaml"])
        out = capsys.readouterr().out
        assert out.index("params.yaml: valid") < out.index("params.yaml + configs/noise.yaml: valid")
        with pytest.raises(SystemExit, match="'lcc'] is not a command; allowed: train"):
            iclnoise_cli.main(["each", "--", "check", "params.yaml", "--", "lcc", "--run-dir", "x"])
        assert "valid" not in capsys.readouterr().out
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        pkg.setLevel(saved[2])
        logging.captureWarnings(False)


@pytest.mark.unit
def test_params_sources_are_read_bounded_devices_and_pipes_included(tmp_path):
    """Issue 48, case 11: the size cap used stat, which is 0 for a pipe or a device, so `iclnoise check /dev/zero`
    read without bound (7 GB in 12 s). At most MAX_YAML_BYTES + 1 bytes are read from any source: a pipe that
    carries 2 MiB is refused naming the cap (and its writer is left unread), /dev/zero too, and a `--cfg @file`."""
    import threading

    from iclnoise.commands import sections as cfg_sections
    from iclnoise.commands.runs import check
    from iclnoise.config import MAX_YAML_BYTES

    r, w = os.pipe()
    chunk = b"# a comment line of a params file\n" * 1024

    def write():
        try:
            with open(w, "wb") as f:
                for _ in range(2 * MAX_YAML_BYTES // len(chunk) + 1):
                    f.write(chunk)
        except BrokenPipeError:
            pass
    t = threading.Thread(target=write)
    t.start()
    try:
        with pytest.raises(ParamsError, match=r"/dev/fd/\d+: more than 1,048,576 bytes; allowed: a params file up"):
            load_params(f"/dev/fd/{r}")
    finally:
        os.close(r)
        t.join()
    with pytest.raises(SystemExit, match="/dev/zero: more than 1,048,576 bytes"):
        check(["/dev/zero"])
    with pytest.raises(SystemExit, match="/dev/zero: more than 1,048,576 bytes"):
        cfg_sections("@/dev/zero")
    with pytest.raises(SystemExit, match=f"{tmp_path}: cannot be read"):
        check([str(tmp_path)])   # a directory: named, no traceback


@pytest.mark.unit
def test_config_values_are_read_as_yaml_scalars_and_errors_name_key_and_value():
    """Issue 48, case 14: Snakemake reads `--config stats={alpha: 0.05}` with YAML's BaseLoader, so 0.05 arrived as
    the string '0.05' and was refused as not a number. parse_overrides reads each string as a YAML scalar (safe
    loader), as in a params file. `data=nan` (a number where a section belongs) is named as such, not as "a finite
    number"; a source is named once."""
    from iclnoise.config import parse_overrides, source_names

    got = parse_overrides({"stats": {"alpha": "0.05", "equivalence_margin": "0.1", "transient_tol": "1e-2"},
                           "grid": {"M": ["1", "16", "inf"], "seeds": ["0"]}, "data": float("nan"),
                           "model": {"layer_norm": "true", "attn_init": "a: b", "arch": "!!python/name:os.system"}})
    assert got["stats"] == {"alpha": 0.05, "equivalence_margin": 0.1, "transient_tol": "1e-2"}  # as YAML 1.1 reads
    assert got["grid"] == {"M": [1, 16, "inf"], "seeds": [0]} and got["data"] != got["data"]
    assert got["model"] == {"layer_norm": True, "attn_init": "a: b", "arch": "!!python/name:os.system"}
    p = load_params("params.yaml")
    with pytest.raises(ParamsError) as e:
        validate_params(merge_params(p, {"data": float("nan"), "stats": {"transient_tol": float("nan")}}))
    msg = str(e.value)
    assert "data = nan is not allowed; it must be a mapping" in msg, msg
    assert "stats.transient_tol = nan is not allowed; allowed: a finite number" in msg, msg
    assert "data = nan is not allowed; allowed: a finite number" not in msg, msg
    here = str(Path("params.yaml").resolve())
    assert source_names(["params.yaml", here, "configs/noise.yaml"], {"data": 1, "confirm_cost": True}) == \
        "params.yaml + configs/noise.yaml + --config data, confirm_cost"


@pytest.mark.integration
def test_snakemake_config_values_arrive_as_numbers(tmp_path):
    """Issue 48, case 14, through Snakemake's own --config parsing (a dry run stopped at parse time): the numbers of
    a mapping are numbers (stats.alpha is not named), a wrong value names its key and what it got, and the message
    starts with each source once (it read "params.yaml + params.yaml")."""
    (tmp_path / "params.yaml").write_text(Path("params.yaml").read_text())
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile",
                          str(Path("Snakefile").resolve()), "--directory", str(tmp_path), "--config",
                          "stats={alpha: 0.05, equivalence_margin: 0.1, transient_tol: x}", "data=nan"],
                         capture_output=True, text=True, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "params.yaml + --config stats, data: invalid params" in text, text[-2000:]
    assert "stats.transient_tol = 'x' is not allowed; it must be a number" in text, text[-2000:]
    assert "data = nan is not allowed; it must be a mapping" in text and "stats.alpha" not in text, text[-2000:]
    assert "params.yaml + params.yaml" not in text


@pytest.mark.unit
def test_ensemble_runs_auto_on_the_cpu_is_the_default_grouping(monkeypatch):
    """`train.ensemble_runs: auto` on the CPU (train.device cpu, or auto with no CUDA device visible) gives the
    default's groups (18 runs per ensemble: CPU_ENSEMBLE_RUNS), and no run's spec hash moves with the key."""
    import torch

    from iclnoise.config.grid import CPU_ENSEMBLE_RUNS, ensemble_groups, spec_hash

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = load_params("params.yaml")
    assert p["train"]["ensemble_runs"] == CPU_ENSEMBLE_RUNS == 18
    p["grid"]["seeds"] = list(range(7))   # 42 runs per (batch, noise): the auto chunks are visible
    default = ensemble_groups(p)
    assert [len(r) for r in default.values()] == [18, 18, 6] * 2
    for device in ("cpu", "auto"):
        q = copy.deepcopy(p)
        q["train"].update(ensemble_runs="auto", device=device, gpu_memory_gib=80)
        assert ensemble_groups(validate_params(q)) == default
    assert p["train"]["device"] == q["train"]["device"] == "auto"   # q differs from p in the two sizing keys alone
    assert [spec_hash(run_spec(q, r)) for r in sum(default.values(), [])] == [
        spec_hash(run_spec(p, r)) for r in sum(default.values(), [])]


@pytest.mark.unit
def test_ensemble_runs_auto_fills_a_planted_gpu_memory():
    """On a GPU of planted memory G, `auto` packs runs (grid order) while the ensemble's job_memory stays within
    0.8 G: at one M job_memory = c + R·u, so a GPU of (c + 5u + u/2)/0.8 bytes takes ensembles of 5 runs across
    seeds; with several M every ensemble fits and would not fit with the next run; the limit is 32 GiB per job."""
    from iclnoise.config.grid import ensemble_groups
    from iclnoise.config.memory import MAX_JOB_MEMORY, ensemble_memory

    def need(runs):
        return ensemble_memory(p, 16, [parse_run_id(r).M for r in runs])["total"]

    p = load_params("params.yaml")
    p["grid"].update(M=[64], seeds=list(range(12)), batch_sizes=[16])
    p["train"].update(ensemble_runs="auto", device="cuda")
    ids = [k.run_id for k in expand_grid(p)]
    one, two = need(ids[:1]), need(ids[:2])
    u, c = two - one, 2 * one - two
    p["train"]["gpu_memory_gib"] = (c + 5.5 * u) / 0.8 / 2**30
    groups = ensemble_groups(validate_params(p))
    assert [len(r) for r in groups.values()] == [5, 5, 2] and sum(groups.values(), []) == ids
    p["grid"]["M"] = [1, 1024, 2**20, "inf"]   # pools of very different sizes
    p["grid"]["seeds"] = [0, 1, 2]
    sizes = []
    for gib, limit in ((0.5, 0.8 * 0.5 * 2**30), (1000, MAX_JOB_MEMORY)):
        p["train"]["gpu_memory_gib"] = gib
        groups = ensemble_groups(validate_params(p))
        runs = sum(groups.values(), [])
        assert runs == [k.run_id for k in expand_grid(p)]
        for g, members in groups.items():
            assert need(members) <= limit
            nxt = runs.index(members[-1]) + 1
            if nxt < len(runs):
                assert need(members + [runs[nxt]]) > limit, g
        sizes.append([len(r) for r in groups.values()])
    assert sizes == [[7, 1, 4], [12]]
    p["grid"].update(M=[2**20], seeds=list(range(150)))   # ≈ 250 MiB per run: 150 runs plan more than 32 GiB
    ids = [k.run_id for k in expand_grid(p)]
    one, two = need(ids[:1]), need(ids[:2])
    fit = int((MAX_JOB_MEMORY - (2 * one - two)) // (two - one))
    assert [len(r) for r in ensemble_groups(validate_params(p)).values()] == [fit, 150 - fit] and 64 < fit < 150


@pytest.mark.unit
def test_ensemble_runs_auto_on_cuda_without_a_gpu_names_the_key(monkeypatch):
    """Planning `auto` for cuda where no CUDA device is visible and gpu_memory_gib is unset: a ParamsError that
    names train.gpu_memory_gib; a run too large for the GPU alone is named."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = load_params("params.yaml")
    p["train"].update(ensemble_runs="auto", device="cuda")
    with pytest.raises(ParamsError, match="train.gpu_memory_gib"):
        validate_params(p)
    p["train"]["gpu_memory_gib"] = 1e-6
    with pytest.raises(ParamsError, match=r"run M1-B16-none-s0 alone plans .* lower grid.M"):
        validate_params(p)


@pytest.mark.unit
def test_the_slurm_profile_asks_for_a_gpu_only_for_cuda():
    """slurm/config.yaml's train_gpu_resources join a training job's resources only where train.device is cuda;
    the CPU profile has none."""
    from iclnoise.config import run_options

    def profile(name):
        cfg = yaml.safe_load(Path(name, "config.yaml").read_text())["config"]
        return {k: yaml.safe_load(v) for k, v in (e.split("=", 1) for e in cfg)}

    gpu = profile("slurm")
    for device in ("cpu", "auto", "cuda"):
        assert ("gpu" in run_options(gpu, device)[1]) == (device == "cuda")
        assert "gpu" not in run_options(profile("slurm-cpu"), device)[1]
    assert run_options(gpu, "cuda")[1] == {"gpu": 1, "cpus_per_task": 4, "mem_mb": 16000, "runtime": 720,
                                          "slurm_partition": "gpu"}
    with pytest.raises(ParamsError, match="train_gpu_resources.gpu=-1"):
        run_options({"train_gpu_resources": {"gpu": -1}}, "cuda")
