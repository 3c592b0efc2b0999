"""Reference sets, `iclnoise export` and `iclnoise paper` / `make paper` under misuse (issue 48, cases 1, 2, 7, 9,
10, 12): an output that is, holds or lies inside an input is refused; a set that changed after it was written is
refused, naming the file and its git restore; a killed command leaves nothing a later one reads; two at once and
a read-only checkout work.

The set is a small copy of reference/science (6 runs, its aggregate rerun and its provenance.json sealed again).
The figure functions are replaced by writers of one small PNG each, written as save_figure writes (a temporary
file, then a rename): these tests are about the directories, and drawing the real figures takes a minute;
tests/test_pipeline.py draws them for real.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from iclnoise.commands.results import export as export_cmd
from iclnoise.commands.results import paper as paper_cmd
from iclnoise.core.io import atomic_path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [f"M{m}-B64-none-s{s}" for m in (1, 16, "inf") for s in (0, 1)]


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    """reference/science cut to 6 runs (without its attached CNR check, whose runs are not among them), its aggregate
    rerun from them and provenance.json's sha256 rewritten."""
    from iclnoise.analysis.aggregate import aggregate
    from iclnoise.config import typed
    from iclnoise.output.paper import rehash

    ref = tmp_path_factory.mktemp("small") / "science"
    src = ROOT / "reference" / "science"
    shutil.copytree(src, ref, ignore=lambda d, names: [n for n in names if Path(d) == src / "runs" and n not in RUNS
                                                       or Path(d) == src and n == "crn"])
    prov = json.loads((ref / "provenance.json").read_text())
    aggregate(sorted((ref / "runs").iterdir()), ref / "aggregate", typed(prov["params"], "stats"))
    rehash(ref)
    return ref


@pytest.fixture
def ref(small_set, tmp_path) -> Path:
    """A fresh copy of the small set at tmp_path/reference/science."""
    return Path(shutil.copytree(small_set, tmp_path / "reference" / "science"))


class FakeFigures:
    """The five figure functions `iclnoise paper` calls, each writing one PNG as save_figure does (atomic_path,
    then os.replace); `hold(path)` runs between the two (the concurrency test waits there)."""

    def __init__(self, monkeypatch):
        import iclnoise.output.figures.aggregate
        import iclnoise.output.figures.ed
        import iclnoise.output.figures.llc
        import iclnoise.output.figures.refined
        import iclnoise.output.figures.training

        self.hold = lambda path: None
        draw = self.draw
        monkeypatch.setattr(iclnoise.output.figures.training, "training_figures",
                            lambda metrics, out: draw(Path(out) / "figures" / "fig01_ood_loss.png"))
        monkeypatch.setattr(iclnoise.output.figures.aggregate, "aggregate_figures",
                            lambda agg, exposure, figs, alignment=(): draw(Path(figs) / "fig06_threshold_vs_noise.png"))
        monkeypatch.setattr(iclnoise.output.figures.llc, "llc_figures",
                            lambda summary, llc, stages, figs: draw(Path(figs) / "fig03_loss_llc_vs_m.png"))
        monkeypatch.setattr(iclnoise.output.figures.refined, "refined_figures",
                            lambda rllc, sus, figs: draw(Path(figs) / "fig11_rllc_over_training.png"))
        monkeypatch.setattr(iclnoise.output.figures.ed, "ed_figures", lambda runs, family, ed, figs, cfg:
                            draw(Path(figs) / f"fig02_essential_subspace_{family}.png"))

    def draw(self, path: Path) -> None:
        final, tmp = atomic_path(path)
        tmp.write_bytes(b"\x89PNG\r\n")
        self.hold(final)
        os.replace(tmp, final)


@pytest.fixture
def figures(monkeypatch) -> FakeFigures:
    return FakeFigures(monkeypatch)


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()}


def params_file(ref: Path, tmp_path: Path) -> Path:
    """The parameters the set's runs were trained with (its provenance's), as a params file for `export --params`:
    export checks every run against the parameters it records."""
    import yaml

    from iclnoise.config import merge_params

    base = yaml.safe_load((ROOT / "params.yaml").read_text())   # sections the provenance predates keep defaults,
    del base["train"]["rng"]   # keys it predates their declared default (train.rng: the generator its runs used)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(merge_params(base, json.loads((ref / "provenance.json").read_text())["params"])))
    return path

def refused(cmd, argv) -> str:
    """The message of the SystemExit `cmd(argv)` raises: one line."""
    with pytest.raises(SystemExit) as e:
        cmd([str(a) for a in argv])
    msg = str(e.value.code)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.unit
def test_export_refuses_an_output_that_is_holds_or_lies_inside_its_results(ref, tmp_path):
    """Case 1: `iclnoise export --results R --out R` deleted R's checkpoints and resume states and reported
    success. Now an output that is R, lies inside it or holds it (or holds the params file) is refused before
    anything is written, and R keeps every file; an output apart from the inputs is written and its set checks."""
    results = ref   # a reference set is a results directory without checkpoints: give it some
    (results / "runs" / RUNS[0] / "checkpoints").mkdir()
    (results / "runs" / RUNS[0] / "checkpoints" / "step_000010.pt").write_bytes(b"weights")
    (results / "runs" / RUNS[0] / "resume.pt").write_bytes(b"state")
    params = params_file(ref, tmp_path)
    before = snapshot(tmp_path)
    base = ["--results", results, "--params", params, "--workdir", tmp_path]
    for out, how in ((results, "is the input"), (results / "ref", "lies inside the input"),
                     (results.parent, "contains the input"), (tmp_path, "contains the input")):
        assert how in refused(export_cmd, [*base, "--out", out])
    assert snapshot(tmp_path) == before
    from iclnoise.output.paper import verify
    out = tmp_path / "exported" / "science"
    export_cmd([str(a) for a in [*base, "--out", out]])
    assert verify(out)["spec_hash"].keys() == set(RUNS)
    assert not any(p.suffix == ".pt" for p in out.rglob("*"))
    assert [p.name for p in out.parent.iterdir()] == ["science"]   # no temporary directory left
    (tmp_path / "notaset").mkdir()
    (tmp_path / "notaset" / "notes.txt").write_text("mine")
    assert "holds no provenance.json" in refused(export_cmd, [*base, "--out", tmp_path / "notaset"])
    assert (tmp_path / "notaset" / "notes.txt").read_text() == "mine"


@pytest.mark.unit
def test_paper_refuses_an_output_that_holds_or_lies_inside_a_reference(ref, tmp_path, figures):
    """Case 2: `iclnoise paper reference/noise --out reference` deleted the set it was drawing, then crashed.
    Now the output OUT/<set> must be apart from every set given, and the sets keep every file."""
    before = snapshot(ref.parent)
    assert "is the input" in refused(paper_cmd, [ref, "--out", ref.parent])
    assert "lies inside the input" in refused(paper_cmd, [ref, "--out", ref])
    assert snapshot(ref.parent) == before
    paper_cmd([str(ref), "--out", str(tmp_path / "paper")])
    assert (tmp_path / "paper" / "science" / "report.md").exists() and snapshot(ref.parent) == before


def _edit_metric(ref: Path) -> Path:
    path = ref / "runs" / RUNS[0] / "metrics.parquet"
    t = pq.read_table(path)
    df = t.to_pandas()
    df.loc[len(df) // 2, "ood_loss"] *= 1.01
    pq.write_table(pa_table(df, t), path)
    return path


def _drop_row(ref: Path) -> Path:
    path = ref / "runs" / RUNS[1] / "metrics.parquet"
    t = pq.read_table(path)
    df = t.to_pandas()
    pq.write_table(pa_table(df.drop(index=len(df) // 2).reset_index(drop=True), t), path)
    return path


def pa_table(df: pd.DataFrame, like):
    import pyarrow as pa
    return pa.Table.from_pandas(df, schema=like.schema, preserve_index=False)


def _edit_provenance(ref: Path, edit) -> Path:
    path = ref / "provenance.json"
    prov = json.loads(path.read_text())
    edit(prov)
    path.write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    return path


def _edit_commit(ref: Path) -> Path:
    return _edit_provenance(ref, lambda p: p.update(commit="0" * 40, runs_per_commit={"0" * 40: 54}))


def _edit_d_lr(ref: Path) -> Path:
    def edit(p):
        p["params"]["data"]["D"] = 3
        p["params"]["train"]["optimizer"]["lr"] = 0.1
    return _edit_provenance(ref, edit)


@pytest.mark.unit
@pytest.mark.parametrize("edit", [_edit_metric, _drop_row, _edit_commit, _edit_d_lr],
                         ids=["metric", "dropped row", "provenance commit", "provenance D and lr"])
def test_paper_refuses_a_set_that_changed_after_it_was_written(ref, tmp_path, figures, edit):
    """Case 7: a changed mid-training metric, a dropped metrics row, an edited provenance commit or D and lr in
    the provenance's parameters changed the figures or the report without a word. Now `iclnoise paper` checks
    every file against provenance.json's sha256 (and provenance.json against its own) before drawing: refused,
    naming the file and how to restore it from git; nothing is written."""
    path = edit(ref)
    msg = refused(paper_cmd, [ref, "--out", tmp_path / "paper"])
    assert msg.startswith(str(path)) and f"git checkout -- {path}" in msg, msg
    assert not (tmp_path / "paper").exists()


@pytest.mark.unit
def test_the_report_names_the_training_commit_and_the_provenance_parameters(ref, tmp_path, figures):
    """Case 7: the report showed the checkout's commit only. Now it names the commits the runs trained at and
    the one that aggregated them (from provenance.json), and its Parameters are the provenance's."""
    import yaml

    prov = json.loads((ref / "provenance.json").read_text())
    paper_cmd([str(ref), "--out", str(tmp_path / "paper")])
    report = (tmp_path / "paper" / "science" / "report.md").read_text()
    (commit, n), = prov["runs_per_commit"].items()
    assert f"trained at git {commit[:7]} ({n} runs); aggregated at git {prov['aggregate_commit'][:7]}" in report
    params = yaml.safe_load(report.split("## Parameters")[1].split("```yaml")[1].split("```")[0])
    assert params == prov["params"] and params["data"]["D"] == 5


@pytest.mark.unit
def test_a_killed_export_leaves_nothing_make_paper_reads(ref, tmp_path, figures, monkeypatch, caplog):
    """Case 9: a killed export left reference/<set>.tmp, which `make paper` (reference/*/) then passed to
    `iclnoise paper`, and it crashed before drawing any set. Now export writes a hidden, unique temporary
    directory (removed when it fails; a SIGKILLed one is hidden from reference/*/ and named in the log of the
    next export), and `iclnoise paper` skips a `*.tmp` directory with a log line and draws the others."""
    import iclnoise.output.paper

    params = params_file(ref, tmp_path)
    out = tmp_path / "exported" / "science"
    argv = [str(a) for a in ["--results", ref, "--params", params, "--workdir", tmp_path, "--out", out]]
    export_cmd(argv)
    before = snapshot(out)

    def killed(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(iclnoise.output.paper, "write_json", killed)
        export_cmd(argv)
    assert sorted(p.name for p in out.parent.glob("*")) == ["science"] and snapshot(out) == before
    stale = out.with_name("science.tmp")   # what a SIGKILLed export of the old code left
    shutil.copytree(out / "runs", stale / "runs")
    (out.parent / ".science.abc123.tmp").mkdir()   # what a SIGKILLed export leaves now
    paper_cmd([str(stale), str(out), "--out", str(tmp_path / "paper")])
    assert (tmp_path / "paper" / "science" / "report.md").exists() and not (tmp_path / "paper" / "science.tmp").exists()
    assert f"{stale}: skipped" in caplog.text
    export_cmd(argv)
    assert f"{out.parent / '.science.abc123.tmp'}: ignored" in caplog.text


@pytest.mark.integration
def test_reference_errors_are_one_line_naming_the_reference_file(small_set, ref, tmp_path, figures):
    """Case 10: reference-set errors printed tracebacks; the repair advice named the paper/ copy or said to `rm`
    the committed provenance.json; a deleted ed/pcs.parquet gave a FileNotFoundError traceback. Now each is one
    line naming the set's own file and `git checkout -- <it>`."""
    out = tmp_path / "paper"
    pcs = next((ref / "ed").glob("*/pcs.parquet"))
    pcs.unlink()
    msg = refused(paper_cmd, [ref, "--out", out])
    assert msg.startswith(f"{pcs} is missing") and f"git checkout -- {pcs}" in msg, msg
    shutil.copy(small_set / pcs.relative_to(ref), pcs)   # restored, as git checkout would
    metrics = ref / "runs" / RUNS[0] / "metrics.parquet"
    metrics.write_bytes(metrics.read_bytes()[:100])   # truncated
    msg = refused(paper_cmd, [ref, "--out", out])
    assert msg.startswith(str(metrics)) and f"git checkout -- {metrics}" in msg and str(out) not in msg, msg
    shutil.copy(small_set / metrics.relative_to(ref), metrics)
    pj = ref / "provenance.json"
    pj.write_bytes(pj.read_bytes()[:200])
    msg = refused(paper_cmd, [ref, "--out", out])
    assert msg.startswith(str(pj)) and f"git checkout -- {pj}" in msg and "rm " not in msg, msg
    r = subprocess.run([sys.executable, "-m", "iclnoise.cli", "paper", str(ref), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1] == msg
    prov = json.loads((small_set / "provenance.json").read_text())
    del prov["self_sha256"]   # an export before issue 48: its own edits cannot be told, so it is refused
    pj.write_text(json.dumps(prov))
    assert f"export the set again: iclnoise export --out {ref}" in refused(paper_cmd, [ref, "--out", out])
    assert not out.exists()


@pytest.mark.unit
def test_two_paper_commands_at_once_do_not_collide(ref, tmp_path, figures):
    """Case 12: two `make paper` at once: one died with FileNotFoundError (the second deleted the first's output
    while it was writing). Now each draws in its own directory and renames it into place: the first holds a
    figure's temporary file until the second has started drawing, and both finish with a complete output."""
    out = tmp_path / "paper"
    first_holding, second_drawing, errors = threading.Event(), threading.Event(), []

    def hold(path):
        if threading.current_thread().name == "first":
            first_holding.set()
            assert second_drawing.wait(60)
        else:
            second_drawing.set()
    figures.hold = hold

    def draw():
        try:
            paper_cmd([str(ref), "--out", str(out)])
        except BaseException as e:   # SystemExit included
            errors.append(repr(e))
        finally:
            second_drawing.set()
    first, second = threading.Thread(target=draw, name="first"), threading.Thread(target=draw, name="second")
    first.start()
    assert first_holding.wait(60)
    second.start()
    first.join(120), second.join(120)
    assert not errors, errors
    assert sorted(p.name for p in (out / "science" / "figures").iterdir()) == sorted(
        ["fig01_ood_loss.png", "fig03_loss_llc_vs_m.png", "fig06_threshold_vs_noise.png",
         "fig11_rllc_over_training.png", "fig02_essential_subspace_bym-none-B16-s0.png",
         "fig02_essential_subspace_bym-none-B64-s0.png"])
    assert [p.name for p in out.iterdir()] == ["science"]   # no temporary directory left


@pytest.mark.integration
def test_paper_writes_where_paper_out_says_and_names_it_when_it_cannot(ref, tmp_path, figures):
    """Case 12: a read-only checkout gave an EROFS traceback and `make paper` had no way to write elsewhere. Now
    an output that cannot be written is one line naming PAPER_OUT, and `make paper PAPER_OUT=DIR` passes DIR as
    --out (reference/*/ skips the hidden temporary directories a killed export leaves)."""
    (tmp_path / "ro").write_text("a file, so nothing can be made under it (as on a read-only file system)")
    msg = refused(paper_cmd, [ref, "--out", tmp_path / "ro" / "paper"])
    assert msg.startswith(f"cannot write {tmp_path / 'ro' / 'paper' / 'science'}") and "PAPER_OUT=" in msg, msg
    (ref.parent / ".science.abc123.tmp").mkdir()
    r = subprocess.run(["make", "-s", "-n", "-f", str(ROOT / "Makefile"), "-o", ".venv/.installed", "paper",
                        "PAPER_OUT=/elsewhere/paper"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "iclnoise paper reference/science/ --out /elsewhere/paper", r.stdout


@pytest.mark.unit
def test_update_aggregate_seals_the_set_again_and_refuses_a_changed_one(ref, tmp_path, figures, capsys):
    """The legitimate way to change a set's aggregate (`iclnoise paper --update-aggregate`, after a change of the
    aggregate's code) leaves a set `make paper` accepts; it refuses a set whose files changed since it was written
    (it would seal the change into provenance.json)."""
    from iclnoise.output.paper import verify

    paper_cmd([str(ref), "--out", str(tmp_path / "paper"), "--update-aggregate"])
    assert "science: aggregate rerun; changed: nothing" in capsys.readouterr().out
    assert verify(ref) and "trained at git" in (ref / "report.md").read_text()
    path = _drop_row(ref)
    msg = refused(paper_cmd, [ref, "--out", tmp_path / "paper", "--update-aggregate"])
    assert msg.startswith(str(path)), msg


@pytest.mark.unit
def test_paper_and_export_replace_only_a_directory_of_their_own(ref, tmp_path, figures):
    """Issue 68 (1): `paper SET --out DIR` replaced any DIR/<set> holding a report.md whatever else it held (a
    pipeline's results directory with its checkpoints, a user's thesis.tex). Now paper and export replace an output
    only where every file in it is one they listed when they wrote it (paper's .written.json, a set's
    provenance.json), and refuse otherwise, naming the files; the directory keeps every byte."""
    out = tmp_path / "paper"
    paper_cmd([str(ref), "--out", str(out)])
    paper_cmd([str(ref), "--out", str(out)])                         # its own output: replaced
    (out / "science" / "thesis.tex").write_text("mine")               # a user's file beside the figures
    before = snapshot(out)
    assert "thesis.tex" in refused(paper_cmd, [ref, "--out", out])
    assert snapshot(out) == before
    results = tmp_path / "here" / "science"                          # a results directory that holds a report.md
    (results / "runs" / RUNS[0]).mkdir(parents=True)
    (results / "report.md").write_text("the pipeline's report")
    (results / "runs" / RUNS[0] / "resume.pt").write_bytes(b"state")
    before = snapshot(results)
    assert "holds no .written.json" in refused(paper_cmd, [ref, "--out", results.parent])
    assert snapshot(results) == before
    params = params_file(ref, tmp_path)
    exported = tmp_path / "sets" / "science"
    base = ["--results", ref, "--params", params, "--workdir", tmp_path, "--out", exported]
    export_cmd([str(a) for a in base])
    (exported / "notes.md").write_text("mine")
    assert "notes.md" in refused(export_cmd, base)
    assert (exported / "notes.md").read_text() == "mine"



@pytest.mark.unit
def test_export_refuses_a_set_name_make_paper_cannot_pass_on(ref, tmp_path):
    """Issue 68 (14): a set named with a space exported, then `make paper` could not read it (the Makefile splits
    reference/*/ at spaces). Now export refuses such a name before writing anything, naming it."""
    params = params_file(ref, tmp_path)
    base = ["--results", ref, "--params", params, "--workdir", tmp_path]
    for name in ("my set", "tab\tset", "star*"):
        msg = refused(export_cmd, [*base, "--out", tmp_path / "sets" / name])
        assert f"a set's name ({name!r}) may hold only" in msg
    assert not (tmp_path / "sets").exists()


@pytest.mark.integration
def test_paper_says_when_a_set_is_not_as_git_holds_it(ref, tmp_path, figures, caplog):
    """Issue 68 (8): a set edited and its provenance.json sealed again (iclnoise.output.paper.rehash) passes its
    own check, and `make paper` said nothing of it. Now paper compares the set with git's HEAD where the set lies in
    a checkout: the log and the report say it is not as git holds it, naming the files; a set as committed, or
    one outside any checkout, reads as before."""
    from iclnoise.output.paper import rehash

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "the set"], check=True)
    with caplog.at_level("WARNING", logger="iclnoise.output.paper"):
        paper_cmd([str(ref), "--out", str(tmp_path / "out1")])
    assert "not as git holds it" not in caplog.text
    assert "not as git holds it" not in (tmp_path / "out1" / "science" / "report.md").read_text()
    edited = _edit_metric(ref)
    rehash(ref)
    with caplog.at_level("WARNING", logger="iclnoise.output.paper"):
        paper_cmd([str(ref), "--out", str(tmp_path / "out2")])
    name = str(edited.relative_to(tmp_path))
    assert f"{ref}: not as git holds it at HEAD" in caplog.text and "metrics.parquet" in caplog.text
    report = (tmp_path / "out2" / "science" / "report.md").read_text()
    assert "It is not as git holds it at HEAD (2 file(s) changed" in report and name.split("/")[-1] in report


@pytest.mark.unit
def test_a_cnr_check_attached_to_a_set_is_sealed_drawn_and_reported(small_set, ref, tmp_path, figures):
    """`iclnoise paper --attach-crn TABLE` keeps the check in the set (crn/crn.csv, its origin in provenance.json,
    sealed: `make paper` accepts the set and refuses it edited), draws figure 13 from it and reports r's ρ and
    coverage (reference/reproductions/crn_pathwise.csv, the small-scale check: ρ 0.96 over 21, 1.00 over 12); a
    table without the predictions is refused, naming the columns, and the set is left as it was."""
    from iclnoise.output.paper import CRN_TABLE, verify

    table = ROOT / "reference" / "reproductions" / "crn_pathwise.csv"
    paper_cmd([str(ref), "--out", str(tmp_path / "paper"), "--attach-crn", str(table), "--note", "test"])
    prov = verify(ref)
    assert prov["crn"]["from"] == str(table) and prov["crn"]["note"] == "test" and CRN_TABLE in prov["sha256"]
    assert (tmp_path / "paper" / "science" / "figures" / "fig13_crn.png").exists()
    report = (ref / "report.md").read_text()
    assert "Spearman ρ 0.96 over 21" in report and "Spearman ρ 1.00 over 12" in report, report
    (ref / CRN_TABLE).write_text((ref / CRN_TABLE).read_text().replace("self*2,", "self*2.5,", 1))
    assert refused(paper_cmd, [ref, "--out", tmp_path / "again"]).startswith(str(ref / CRN_TABLE))
    bare, other = tmp_path / "bare.csv", Path(shutil.copytree(small_set, tmp_path / "other" / "science"))
    pd.read_csv(table).drop(columns=["predicted_lo"]).to_csv(bare, index=False)
    before = snapshot(other)
    msg = refused(paper_cmd, [other, "--out", tmp_path / "p3", "--attach-crn", bare])
    assert msg.startswith(str(bare)) and "predicted_lo" in msg, msg
    assert snapshot(other) == before
