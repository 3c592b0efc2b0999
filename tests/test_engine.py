"""The stacked step (issue 41): one draw of every run's batch, bit-identical to each run's own stream; the ensemble
equal to each run trained alone through its own hooks; no device-to-host read on the steps that log nothing."""
import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch

import iclnoise.noise.hooks as hooks
import iclnoise.run.ensemble as ens
import iclnoise.run.measure as meas
from iclnoise.config.grid import run_spec, spec_hash
from iclnoise.core.io import read_parquet
from iclnoise.core.model import mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.core.schedules import lr_lambda
from iclnoise.core.sections import TaskPrior
from iclnoise.core.tasks import BatchSampler, stacked_batch, task_pool
from iclnoise.noise.exposure import AdamState
from iclnoise.noise.hooks import StepContext
from iclnoise.run.evaluate import Evaluator
from iclnoise.run.member import Member
from iclnoise.run.runs import manifest
from iclnoise.run.train import train_ensemble

pytestmark = [pytest.mark.unit, pytest.mark.numerics]

RUNS = ["M4-B16-early-s0", "M1-B16-early-s1", "Minf-B16-early-s2"]


def test_the_stacked_draw_is_every_runs_own_batch_bit_for_bit():
    """Pooled runs of different M, fresh tasks, a shaped prior's fresh tasks: every run's slice of the stacked batch
    is torch.equal to its sampler's own batch at that step."""
    prior = TaskPrior.from_dict({"spectrum": "power_law", "exponent": 1.0, "basis_seed": 3})
    samplers = [BatchSampler(task_pool(7, 4, 5), 8, 5, 0.25, 0), BatchSampler(task_pool(7, 1, 5), 8, 5, 0.25, 1),
                BatchSampler(None, 8, 5, 0.25, 2), BatchSampler(None, 8, 5, 0.25, 3, prior=prior)]
    for step in (0, 7, 1234):
        b = stacked_batch(samplers, step, 16)
        assert b.xs.shape == (4, 16, 8, 5) and b.ys.shape == (4, 16, 8)
        for r, s in enumerate(samplers):
            own = s.batch(step, 16)
            assert all(torch.equal(getattr(b, f)[r], getattr(own, f)) for f in ("xs", "ys", "tasks")), (step, r)


@pytest.fixture(params=["generator", "counter"])
def injecting(tiny, request):
    """Three runs of a closed-loop injecting arm (budget, early window of 0.4), exposure every 10 steps, clipping
    active (0.3), 60 steps; under either random stream (train.rng)."""
    p = copy.deepcopy(tiny)
    p["train"]["rng"] = request.param
    p["grid"]["noise"] = ["early"]
    p["train"]["grad_clip"] = 0.3
    p["noise"]["conditions"]["early"].update(fraction=0.4, budget=0.002)
    return p


def alone(spec: dict, tmp) -> tuple[dict, list, list, dict]:
    """One run trained the per-run way, independently of the ensemble: its own hooked model and hooks, torch's
    AdamW, its own sampler's batches, torch's clip_grad_norm_; the final parameters, the hooks' rows and the
    final evaluation."""
    s = RunSpec.of(spec)
    m = Member(s, tmp, spec_hash(spec), torch.device("cpu"))
    m.setup()
    t, o = s.train, s.train.optimizer
    opt = torch.optim.AdamW(m.model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                            eps=o.eps)
    f = lr_lambda(t.lr_schedule.kind, t.steps, t.lr_schedule.warmup_frac, t.lr_schedule.min_lr_frac)
    params, n_micro = list(m.model.parameters()), s.keys.batch // t.micro_batch
    for step in range(t.steps):
        lr = o.lr * f(step)
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        batch = m.sampler.batch(step, s.keys.batch)
        for mb in batch.split(n_micro):
            (mse_loss(m.model, mb.xs, mb.ys) / n_micro).backward()
        ctx = StepContext(step, t.steps, m.model, AdamState.of_torch(opt), batch, t.micro_batch, lr, mse_loss,
                          m.heldout.batch)
        for h in m.hooks:
            h.on_grads(ctx)
        norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
        coef = min(1.0, t.grad_clip / (norm + 1e-6))
        for p in params:
            p.grad.mul_(coef)
        opt.step()
        ctx.grad_norm, ctx.clip_coef = norm, coef
        for h in reversed(m.hooks):
            h.on_update(ctx)
    metrics = Evaluator(s, torch.device("cpu"))(m.model)[0]
    return ({n: p.detach().clone() for n, p in m.model.named_parameters()}, m.hooks[0].rows(), m.hooks[1].rows(),
            metrics)


# NE and Curv at steps 0 and 1 have A ≈ 1/(|g| + ε): v̂ holds one or two of b_K's round-off gradients (test_train),
# which enter them as 1/ε (measured, run 0: Curv 1.2e-3 and NE 1.5e-3 apart at step 0; on an AMD EPYC, M1-B16-early-s1's
# Curv and injected NE 2.1e-3 apart at step 1, and so its exposure row at step 9, whose interval means hold step 1;
# every run within 3.3e-5 from step 2): those columns are compared from the third row of each table
A_ROUNDOFF = ("ne_postclip", "curv", "ne_injected", "pne")


@pytest.mark.parametrize("curvature", ["ggn", "ggn_exact"])
def test_the_stacked_ensemble_equals_each_run_trained_alone_through_its_hooks(injecting, curvature, tmp_path,
                                                                             monkeypatch):
    """60 steps, clipping in most steps, exposure rows every 10 steps and an injecting closed loop: each run's
    parameters, exposure rows, injection rows and final metrics equal the run trained alone the per-run way, to
    float32 round-off (the two differ in summation order: bmm against F.linear, fused AdamW against foreach).
    The ensemble measured every group gradient and diag Ĥ of its runs in stacked calls (exposure.stacked_group_grads,
    curvature.stacked_ggn_curvature: 4 probes every 25 steps; stacked_exact_ggn_curvature: exact every 2 steps, the
    default), none per run."""
    if curvature == "ggn_exact":   # stacked on CUDA only (measure.EXACT_STACKED): here too, to test it
        injecting["exposure"].update(curvature="ggn_exact", curvature_every=2)
        monkeypatch.setattr(meas, "EXACT_STACKED", ("cpu",))
    stacked_fn = "stacked_exact_ggn_curvature" if curvature == "ggn_exact" else "stacked_ggn_curvature"
    calls = {"stacked": 0, "own": 0, "stacked_grads": 0, "own_grads": 0}

    def counted(key, f):
        def call(*a, **k):
            calls[key] += 1
            return f(*a, **k)
        return call
    monkeypatch.setattr(meas, stacked_fn, counted("stacked", getattr(meas, stacked_fn)))
    monkeypatch.setattr(ens.ExposureLogger, "_curvature", counted("own", ens.ExposureLogger._curvature))
    monkeypatch.setattr(meas, "stacked_group_grads", counted("stacked_grads", meas.stacked_group_grads))
    monkeypatch.setattr(hooks, "group_grads", counted("own_grads", hooks.group_grads))
    specs = [run_spec(injecting, r) for r in RUNS]
    out = train_ensemble(specs, [tmp_path / r for r in RUNS], progress=False)
    assert calls["stacked"] >= 6 and calls["stacked_grads"] >= 6 and calls["own"] == calls["own_grads"] == 0, calls
    monkeypatch.undo()   # the runs trained alone measure their own
    for spec, r, metrics in zip(specs, RUNS, out):
        params, exp_rows, inj_rows, final = alone(spec, tmp_path / f"alone-{r}")
        state = torch.load(tmp_path / r / "resume.pt", weights_only=False)
        for n, w in params.items():
            tol = 2 * spec["train"]["optimizer"]["lr"] * 60 if n.endswith("b_K") else 1e-5   # b_K: test_train
            torch.testing.assert_close(state["params"][n], w, rtol=1e-4, atol=tol, msg=f"{r} {n}")
        exp, inj = read_parquet(tmp_path / r / "exposure.parquet"), read_parquet(tmp_path / r / "injection.parquet")
        assert len(exp) == len(exp_rows) >= 6 and len(inj) == len(inj_rows) == 60
        assert inj.active.sum() >= 20 and (inj.scale > 0).sum() >= 20 and (inj.clip_coef < 1).mean() > 0.5
        for col in ("pne", "ne_postclip", "pne_injected_postclip", "trace_c", "curv", "clip_coef", "clip_frac",
                    "grad_norm"):
            first = 2 if col in A_ROUNDOFF else 0
            np.testing.assert_allclose(exp[col][first:], [x[col] for x in exp_rows][first:], rtol=1e-3, atol=1e-9,
                                       err_msg=f"{r} exposure {col}")
        for col in ("scale", "ne_injected", "pne_injected", "curv", "clip_coef"):
            first = 2 if col in A_ROUNDOFF else 0
            np.testing.assert_allclose(inj[col][first:], [x[col] for x in inj_rows][first:], rtol=1e-3, atol=1e-9,
                                       err_msg=f"{r} injection {col}")
        last = metrics.iloc[-1]
        assert last.step == 60
        for k in ("ood_loss", "id_loss"):
            assert last[k] == pytest.approx(final[k], rel=1e-4), (r, k)


@pytest.mark.usefixtures("one_thread")
def test_a_runs_numbers_are_the_same_bits_in_an_ensemble_of_any_size(injecting, tmp_path):
    """On one CPU thread, three runs trained as a 3-run ensemble, at other positions of a 5-run ensemble and one of
    them alone end with the same bits: checkpoints, metrics, exposure and injection rows, with clipping, exposure and
    the batched closed loop active, so a run's numbers do not depend on how a plan groups it into jobs. The clipping
    norm used to sum a stacked (tensors, R) over its first axis, whose order depends on R: a run's norm then moved by
    1 ulp within 3 steps, and 40 steps of grad_x0p3 parted its weights by up to 1e-3. And one run's unembedding (a
    one-column batched matmul) took the gemv kernel, which rounds otherwise, until model.Linear ran it as two."""
    five = ["M4-B16-early-s1", RUNS[2], "Minf-B16-early-s0", RUNS[0], RUNS[1]]
    for tag, runs in (("three", RUNS), ("five", five), ("one", RUNS[1:2])):
        train_ensemble([run_spec(injecting, r) for r in runs], [tmp_path / tag / r for r in runs], progress=False)
    for tag, r in [("five", r) for r in RUNS] + [("one", RUNS[1])]:
        a, b = tmp_path / "three" / r, tmp_path / tag / r
        assert manifest(a) == manifest(b), (tag, r)   # every checkpoint's bytes
        for f in ("metrics.parquet", "exposure.parquet", "injection.parquet"):
            pd.testing.assert_frame_equal(read_parquet(a / f), read_parquet(b / f), check_exact=True, obj=f"{r} {f}")


SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy")


def test_the_step_reads_nothing_from_the_device_on_steps_that_log_nothing(tiny, tmp_path, monkeypatch):
    """The default's ensemble (exposure logging on), the CPU stepping as on CUDA (the host does not look every
    step): every method that copies a tensor's value to the host is counted during each step; the steps where the
    host does not look (no checkpoint, no exposure row, not every LOOK_EVERY-th) count none, and they are most
    steps. Before issue 41 every step read the losses, the norms and the clipping factors (`tolist`)."""
    p = copy.deepcopy(tiny)
    p["train"]["budget"] = {"mode": "steps", "steps": 100}
    specs = [run_spec(p, r) for r in ("M4-B16-none-s0", "M1-B16-none-s1", "Minf-B16-none-s0")]
    counts, quiet = sync_counts(specs, tmp_path, monkeypatch)
    assert len(counts) == 100 and len(quiet) >= 60, sorted(quiet)
    assert {s: counts[s] for s in quiet} == dict.fromkeys(quiet, 0)
    assert sum(counts.values()) > 0   # the counter sees the looks (checkpoints, rows)


def test_a_closed_loop_injecting_arm_reads_nothing_from_the_device_on_steps_that_log_nothing(closed_loop, tmp_path,
                                                                                           monkeypatch):
    """The grad source's closed loop (early window over steps 0-39 of 100, clipping at 0.3) batched, the CPU stepping
    as on CUDA: inside the window, the steps where no exposure row or diag Ĥ is due read nothing from the device,
    and they inject. Before issue 41 item 3 the injector read |g|², Curv, the NE unit and c² on the host every step
    (its hook acted every step, so the host looked at every step: none was quiet)."""
    p = copy.deepcopy(closed_loop)
    p["train"]["budget"] = {"mode": "steps", "steps": 100}
    specs = [run_spec(p, r) for r in ("M4-B16-early-s0", "Minf-B16-early-s1")]
    counts, quiet = sync_counts(specs, tmp_path, monkeypatch)
    inside = sorted(quiet & set(range(40)))
    assert len(inside) >= 15 and {s: counts[s] for s in inside} == dict.fromkeys(inside, 0), sorted(quiet)
    for s in specs:
        inj = read_parquet(tmp_path / s["keys"]["run_id"] / "injection.parquet").set_index("step")
        assert (inj.scale[inside] > 0).all() and inj.active[inside].all()


def sync_counts(specs: list[dict], root, monkeypatch) -> tuple[dict[int, int], set[int]]:
    """Train `specs` under root, the CPU stepping as on CUDA (the host does not look every step), counting the calls
    that copy a tensor's value to the host during each step; the counts per step and the steps where the host did
    not look."""
    monkeypatch.setattr(ens, "LOOK_ALWAYS", ())   # the CPU stepping as on CUDA
    counts: dict[int, int] = {}
    current = [None]
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            if current[0] is not None:
                counts[current[0]] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    step_fn, looks_fn, quiet = ens.Ensemble._step, ens.Ensemble._looks, set()

    def step(self, s, stop_after):
        if not looks_fn(self, s, stop_after, self._acting(s)):
            quiet.add(s)
        counts[s], current[0] = 0, s
        try:
            return step_fn(self, s, stop_after)
        finally:
            current[0] = None
    monkeypatch.setattr(ens.Ensemble, "_step", step)
    train_ensemble(specs, [root / s["keys"]["run_id"] for s in specs], progress=False)
    monkeypatch.undo()
    return counts, quiet


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU counterparts above always run")
@pytest.mark.parametrize("noise", ["none", "early"])   # early: the batched closed loop (grad source, clipping)
def test_the_step_runs_under_cuda_sync_debug_errors_on_steps_that_log_nothing(injecting, noise, tmp_path, monkeypatch):
    p = copy.deepcopy(injecting)
    p["train"].update(budget={"mode": "steps", "steps": 100}, device="cuda")
    specs = [run_spec(p, r) for r in (f"M4-B16-{noise}-s0", f"Minf-B16-{noise}-s0")]
    step_fn, quiet = ens.Ensemble._step, []

    def step(self, s, stop_after):
        if self._looks(s, stop_after, self._acting(s)):
            return step_fn(self, s, stop_after)
        quiet.append(s)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step_fn(self, s, stop_after)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(ens.Ensemble, "_step", step)
    train_ensemble(specs, [tmp_path / s["keys"]["run_id"] for s in specs], progress=False)
    assert len(quiet) >= 60


def test_the_cuda_switches_are_logged_no_ops_off_cuda_and_leave_the_default_spec_alone(tiny, tmp_path, caplog):
    """train.cuda_graphs and train.tf32 on the CPU: each logged as having no effect there, and the run's tables
    equal those without them; off (the default), a run's spec and hash are those of the specs before the switches."""
    off = copy.deepcopy(tiny)
    off["train"]["device"] = "cpu"
    specs = [run_spec(off, "M4-B16-none-s0")]
    assert all(k not in specs[0]["train"] for k in ("cuda_graphs", "tf32"))
    on = copy.deepcopy(off)
    on["train"].update(cuda_graphs=True, tf32=True)
    with caplog.at_level("INFO", logger="iclnoise.run.ensemble"):
        a = train_ensemble([run_spec(on, "M4-B16-none-s0")], [tmp_path / "on"], progress=False, stop_after=20)
    assert a == [None]
    said = [r.getMessage() for r in caplog.records]
    assert any("train.cuda_graphs: no effect on cpu" in m for m in said), said
    assert any("train.tf32: no effect on cpu" in m for m in said), said
    train_ensemble(specs, [tmp_path / "off"], progress=False, stop_after=20)
    x, y = (torch.load(tmp_path / d / "resume.pt", weights_only=False) for d in ("on", "off"))
    assert all(torch.equal(x["params"][n], y["params"][n]) for n in x["params"])
    assert pd.DataFrame(x["rows"]).equals(pd.DataFrame(y["rows"])) and len(x["rows"]) >= 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_the_eager_step(tiny, tmp_path, caplog):
    """On CUDA, train.cuda_graphs captures the step (logged) and ends where the eager step ends, to float32
    round-off (its learning rate is a float32 tensor), exposure logging on."""
    out = {}
    for graphs in (False, True):
        p = copy.deepcopy(tiny)
        p["train"].update(device="cuda", cuda_graphs=graphs)
        specs = [run_spec(p, r) for r in ("M4-B16-none-s0", "Minf-B16-none-s0")]
        with caplog.at_level("INFO", logger="iclnoise.run.ensemble"):
            out[graphs] = train_ensemble(specs, [tmp_path / str(graphs) / s["keys"]["run_id"] for s in specs],
                                         progress=False)
    assert any("the step is captured" in r.getMessage() for r in caplog.records), caplog.text
    for a, b in zip(out[False], out[True]):
        np.testing.assert_allclose(a.ood_loss, b.ood_loss, rtol=1e-4)
        np.testing.assert_allclose(a.train_loss[1:], b.train_loss[1:], rtol=1e-4)


def test_a_run_frozen_between_the_hosts_looks_is_recorded_as_when_it_looks_every_step(tiny, tmp_path, monkeypatch):
    """Run 1 diverges at step 30 (test_train's fixture); stepping as on CUDA, the host first looks at step 39 (the
    next exposure row): the run is recorded diverged at step 30, and every table and final state (weights, Adam
    moments) is bitwise that of the host looking every step; stopped at 45 and resumed, the same again."""
    from test_train import RUNS as TRAIN_RUNS
    from test_train import _diverging_at_30, assert_same_states, final_states

    import iclnoise.run.train as tr

    monkeypatch.setattr(tr.Member, "setup", _diverging_at_30(tr.Member.setup))
    specs = [run_spec(tiny, r) for r in TRAIN_RUNS]
    dirs = {k: [tmp_path / k / r for r in TRAIN_RUNS] for k in ("every", "lazy", "resumed")}
    every = train_ensemble(specs, dirs["every"], progress=False)
    looked = []
    monkeypatch.setattr(ens, "LOOK_ALWAYS", ())
    look = ens.Ensemble._look
    monkeypatch.setattr(ens.Ensemble, "_look", lambda self: looked.append(int(self.step_t)) or look(self))
    lazy = train_ensemble(specs, dirs["lazy"], progress=False)
    assert 30 not in looked and 39 in looked
    train_ensemble(specs, dirs["resumed"], progress=False, stop_after=45)
    resumed = train_ensemble(specs, dirs["resumed"], progress=False)
    assert every[1].diverged.iloc[-1] and every[1].step.iloc[-1] == 30
    for other, k in ((lazy, "lazy"), (resumed, "resumed")):
        for a, b in zip(every, other):
            pd.testing.assert_frame_equal(a, b)
        assert_same_states(final_states(dirs["every"]), final_states(dirs[k]))


def test_evaluation_in_one_stacked_pass_equals_each_runs_own(tiny, tmp_path, monkeypatch):
    """Ensemble.evaluate with a chunk of 2 runs (CUDA's choice at R·micro_batch = 2 × the largest eval split): runs
    of different M (pools, dMMSE_∞ absent) are predicted in stacked passes; every metric, token loss and root
    prediction equals the run's own Evaluator pass to float32 round-off; a run's numbers do not depend on which
    other runs are asked for (fixed chunks); at chunk 1 each run takes its own evaluator's pass, bit for bit."""
    runs = ["M4-B16-none-s0", "M1-B16-none-s1", "Minf-B16-none-s2"]
    p = copy.deepcopy(tiny)
    p["eval"].update(n_sequences=12, n_root=8)
    members = [Member(RunSpec.of(run_spec(p, r)), tmp_path / r, spec_hash(run_spec(p, r)), torch.device("cpu"))
               for r in runs]
    for m in members:
        m.setup()
    e = ens.Ensemble(members, 0, "test")
    assert e.eval_chunk == 1   # the CPU: each run its own pass; on CUDA 3 · 8 // 12 = 2
    e.eval_chunk = 2   # passes over runs [0, 1] and [2]
    own = [m.evaluator(m.model) for m in e.members]
    with monkeypatch.context() as mp:
        mp.setattr(Evaluator, "__call__", lambda *a: pytest.fail("a run took its own pass"))
        stacked, alone2 = e.evaluate([0, 1, 2]), e.evaluate([2])
        alone1 = e.evaluate([1])
    for r, ((metrics, tok, preds), (m0, t0, p0)) in enumerate(zip([stacked[r] for r in range(3)], own)):
        assert metrics.keys() == m0.keys()
        for k, v in metrics.items():
            assert v == pytest.approx(m0[k], rel=1e-5, abs=1e-7, nan_ok=True), (runs[r], k)
        assert all(np.allclose(tok[s], t0[s], rtol=1e-5, atol=1e-7) for s in t0)
        np.testing.assert_allclose(preds, p0, rtol=1e-5, atol=1e-6)
    assert math.isnan(stacked[2][0]["r"]) and not math.isnan(stacked[0][0]["r"])
    assert same(alone2[2], stacked[2]) and same(alone1[1], stacked[1])
    e.eval_chunk = 1
    assert all(same(out, e.members[r].evaluator(e.members[r].model)) for r, out in e.evaluate([0, 1, 2]).items())


def same(a: tuple, b: tuple) -> bool:
    """Two Evaluator outputs (metrics, token losses, root predictions) bit for bit, NaN equal to NaN."""
    return (a[0].keys() == b[0].keys() and np.array_equal(list(a[0].values()), list(b[0].values()), equal_nan=True)
            and all(np.array_equal(a[1][s], b[1][s]) for s in b[1]) and np.array_equal(a[2], b[2]))


# ---------------------------------------------------------------- the injector's closed loop across runs (issue 41.3)
@pytest.fixture
def closed_loop(injecting):
    """`injecting` (grad source, diagonal, early window 0.4, clipping at 0.3 active) and the param source: diagonal over
    the whole run (constant), isotropic in the late half; the grad source emulating batch 4 with low-rank noise (scale
    1, no budget) and the param source's NAP shape at a budget, both over the whole run."""
    c = injecting["noise"]["conditions"]
    c["pdiag"] = {"source": "param", "shape": "diagonal", "schedule": "constant", "budget": 0.002}
    c["pisolate"] = {"source": "param", "shape": "isotropic", "schedule": "late", "fraction": 0.5, "budget": 0.002}
    c["glow"] = {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant", "emulate_batch": 4}
    c["pnap"] = {"source": "param", "shape": "nap", "rank": 4, "nap_tasks": 4, "nap_per_task": 4, "nap_memory": 4,
                 "schedule": "constant", "budget": 0.002}
    c["gpid"] = {"source": "grad", "shape": "diagonal", "schedule": "controlled", "target": 2e-5,
                 "controller": {"kp": 0.5, "ki": 0.3}}
    c["glayer"] = {**c["early"], "layers": ["blocks.1", "embed"]}   # noise.layers: the grad and param sources
    c["pisolayer"] = {**c["pisolate"], "layers": ["blocks.0.attn"]}
    return injecting


def trained(p: dict, runs: list[str], root, batched: bool, monkeypatch, **kw) -> list:
    """train_ensemble of `runs` under root, the injector's closed loop batched or per run."""
    monkeypatch.setattr(ens, "INJECT_BATCHED", batched)
    return train_ensemble([run_spec(p, r) for r in runs], [root / r for r in runs], progress=False, **kw)


def assert_same_table(a: pd.DataFrame, b: pd.DataFrame, what: str, rtol: float) -> None:
    """Every column: numbers to rtol (NaN where NaN), the rest equal."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b), what
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype.kind == "f":
            np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-12, equal_nan=True, err_msg=f"{what} {col}")
        elif x.dtype == object and not isinstance(x[0], str):   # lists (exposure's aca_eigs)
            assert all(np.allclose(u, v, rtol=rtol, atol=1e-12) for u, v in zip(x, y)), f"{what} {col}"
        else:
            assert (x == y).all(), f"{what} {col}"


# each condition under one random stream, alternating so each source meets both, to keep the unit tier under its
# 5 minutes (docs/development.md, "Test tiers"); the ensemble tests above compare the two streams run by run
CLOSED = [("early", "generator"), ("pdiag", "counter"), ("pisolate", "generator"), ("glow", "counter"),
          ("pnap", "generator"), ("gpid", "counter"), ("glayer", "generator"), ("pisolayer", "counter")]


@pytest.mark.parametrize("noise, injecting", CLOSED, indirect=["injecting"])
def test_the_batched_closed_loop_equals_the_per_run_path_run_by_run(closed_loop, noise, tmp_path, monkeypatch,
                                                                    caplog):
    """60 steps of a closed-loop injecting arm (grad source with clipping active in most steps, early window; param
    source diagonal over the whole run; param source isotropic, late window; grad source low-rank emulating batch 4;
    param source NAP; grad source under the PI controller; the first and the isotropic one restricted to some layers),
    exposure rows every 10 steps, each under one random stream (CLOSED): the
    batched closed loop (batched.BatchedInjection, logged; no per-run injector call) and the per-run path give each
    run the same parameters, metrics, exposure rows and injection rows (every column) and the same realised
    integrated P-NE*, to float32 round-off (measured: bitwise on the CPU at 1 thread; the two sum |g|², Σ a² Ĥ and
    Σ a² R' over the run axis of one tensor against each run's own)."""
    runs = [f"M4-B16-{noise}-s0", f"Minf-B16-{noise}-s1"]
    with caplog.at_level("INFO", logger="iclnoise.run.ensemble"):
        per_run = trained(closed_loop, runs, tmp_path / "per_run", False, monkeypatch)
        assert f"2 runs ({noise}) per run" in caplog.text
        caplog.clear()
        own = ens.NoiseInjector.on_grads
        monkeypatch.setattr(ens.NoiseInjector, "on_grads", lambda *a: pytest.fail("a per-run injector call"))
        batched = trained(closed_loop, runs, tmp_path / "batched", True, monkeypatch)
        monkeypatch.setattr(ens.NoiseInjector, "on_grads", own)
        assert f"2 runs ({noise}) in one batched closed loop" in caplog.text
    lr = closed_loop["train"]["optimizer"]["lr"]
    for r, a, b in zip(runs, per_run, batched):
        assert_same_table(a, b, f"{r} metrics", 1e-4)
        x, y = (torch.load(tmp_path / k / r / "resume.pt", weights_only=False) for k in ("per_run", "batched"))
        for n, w in x["params"].items():
            tol = 2 * lr * 60 if n.endswith("b_K") else 1e-6   # b_K: round-off of a near-zero v̂ (test_train)
            torch.testing.assert_close(y["params"][n], w, rtol=1e-4, atol=tol, msg=f"{r} {n}")
        for name in ("exposure", "injection"):
            assert_same_table(*(read_parquet(tmp_path / k / r / f"{name}.parquet") for k in ("per_run", "batched")),
                              f"{r} {name}", 1e-4)
        inj = read_parquet(tmp_path / "batched" / r / "injection.parquet")
        assert len(inj) == 60 and (inj.scale > 0).sum() >= 20
        if noise == "early":
            assert (inj.clip_coef < 1).mean() > 0.5
        realised = [st["hooks"][1]["realised"] for st in (x, y)]
        assert realised[1] == pytest.approx(realised[0], rel=1e-4) and realised[1] == pytest.approx(
            inj.pne_injected.sum(), rel=1e-12) and realised[1] > 0


def test_a_batched_closed_loop_resumed_inside_its_window_ends_where_it_would_have(closed_loop, tmp_path, monkeypatch):
    """The batched closed loop (grad source, clipping, early window over steps 0-23) stopped after step 25, so that it
    resumes from its step-20 commit, inside the window: every table and final state bitwise as uninterrupted."""
    from test_train import assert_same_states, final_states

    runs = ["M4-B16-early-s0", "Minf-B16-early-s1"]
    full = trained(closed_loop, runs, tmp_path / "full", True, monkeypatch)
    assert trained(closed_loop, runs, tmp_path / "part", True, monkeypatch, stop_after=25) == [None, None]
    assert all(torch.load(tmp_path / "part" / r / "resume.pt", weights_only=False)["commit"] == 20 for r in runs)
    resumed = trained(closed_loop, runs, tmp_path / "part", True, monkeypatch)
    for r, a, b in zip(runs, full, resumed):
        pd.testing.assert_frame_equal(a, b)
        for name in ("exposure", "injection"):
            pd.testing.assert_frame_equal(read_parquet(tmp_path / "full" / r / f"{name}.parquet"),
                                          read_parquet(tmp_path / "part" / r / f"{name}.parquet"))
    assert_same_states(final_states([tmp_path / "full" / r for r in runs]),
                       final_states([tmp_path / "part" / r for r in runs]))


def test_a_run_diverging_inside_the_batched_closed_loop_is_recorded_as_per_run(closed_loop, tmp_path, monkeypatch):
    """Param source over the whole run; run 1 diverges at step 30 (test_train's blowing-up sampler). The batched closed
    loop with the host looking lazily (as on CUDA: first at step 39) ends as the per-run path looking every step:
    the diverged run's injection rows stop at step 29 and the other run's tables and weights are the same."""
    from test_train import _BlowingUp

    runs = ["M4-B16-pdiag-s0", "M1-B16-pdiag-s1"]
    setup, draw, keys = ens.Member.setup, ens.CounterSampler.batch, []

    def blowing_up(self):
        setup(self)
        if self.run_id == runs[1] and self.sampler.counter:   # its key: the stacked draw's labels blow up below
            keys.append(int(ens.CounterSampler([self.sampler]).keys[0]))
        elif self.run_id == runs[1]:
            self.sampler.__class__, self.sampler._pool = _BlowingUp, self.sampler.__dict__.pop("pool")

    def counter_blowing_up(self, step, size):   # the counter stream draws all runs at once: its labels 1e4x from 30
        b = draw(self, step, size)
        hit = torch.isin(self.keys, torch.tensor(keys))[:, None, None] & (step >= 30)
        return ens.Batch(b.xs, torch.where(hit, b.ys * 1e4, b.ys), b.tasks)
    monkeypatch.setattr(ens.Member, "setup", blowing_up)
    monkeypatch.setattr(ens.CounterSampler, "batch", counter_blowing_up)
    per_run = trained(closed_loop, runs, tmp_path / "per_run", False, monkeypatch)
    monkeypatch.setattr(ens, "LOOK_ALWAYS", ())
    batched = trained(closed_loop, runs, tmp_path / "batched", True, monkeypatch)
    assert per_run[1].diverged.iloc[-1] and per_run[1].step.iloc[-1] == 30
    for r, a, b in zip(runs, per_run, batched):
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-4)
        for name in ("exposure", "injection"):
            assert_same_table(*(read_parquet(tmp_path / k / r / f"{name}.parquet") for k in ("per_run", "batched")),
                              f"{r} {name}", 1e-4)
    inj = read_parquet(tmp_path / "batched" / runs[1] / "injection.parquet")
    assert inj.step.tolist() == list(range(30)) and (inj.scale > 0).all()


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def quiet_step_ops(p: dict, noise: str, R: int, root) -> int:
    """The aten ops of one quiet step (no hook acts, no checkpoint, the host not looking for LOOK_EVERY) of an
    ensemble of R runs of `noise` at batch 16, M cycling through ∞, 1, 2, 4, 8, 16 (fresh and pooled tasks at any R)."""
    ms = ["inf", 1, 2, 4, 8, 16]
    members = []
    for r in range(R):
        spec = RunSpec.of(run_spec(p, f"M{ms[r % 6]}-B16-{noise}-s{r // 6}"))
        (root / spec.keys.run_id / "checkpoints").mkdir(parents=True)
        members.append(Member(spec, root / spec.keys.run_id, spec_hash(spec.raw), torch.device("cpu")))
        members[-1].setup()
    e = ens.Ensemble(members, 0, "ops")
    step = 0
    while step < 2 or e._acting(step) or step + 1 in e.ckpt_at or step % ens.LOOK_EVERY == 0:
        e._step(step, None)
        step += 1
    with _Ops() as ops:
        e._step(step, None)
    return ops.n


QUIET_NOISE = {   # the op count's injecting modes: a budget (closed loop) or emulate_batch (scale 1), each shape kind
    "grad_diagonal": {"source": "grad", "shape": "diagonal", "schedule": "constant", "budget": 0.002},
    "param_isotropic": {"source": "param", "shape": "isotropic", "schedule": "constant", "budget": 0.002},
    "grad_lowrank": {"source": "grad", "shape": "lowrank", "rank": 4, "schedule": "constant", "emulate_batch": 4},
    "param_nap": {"source": "param", "shape": "nap", "rank": 4, "nap_tasks": 4, "nap_per_task": 4, "nap_memory": 4,
                  "schedule": "constant", "budget": 0.002},
    "grad_controlled": {"source": "grad", "shape": "diagonal", "schedule": "controlled", "target": 2e-5,
                        "controller": {"kp": 0.5, "ki": 0.3}}}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["plain", "exposure", *QUIET_NOISE])
def test_a_quiet_step_costs_the_same_ops_at_2_and_8_runs(tiny, mode, tmp_path):
    """train.rng counter: a step where no hook acts dispatches as many aten ops for 8 runs as for 2, without exposure
    logging, with it, and injecting (QUIET_NOISE: diagonal, isotropic, low-rank and NAP shapes, at a budget, emulating
    a batch or under the PI controller): no per-run work on the device. Measured before (generator stream, a context
    per run per step): 9, 20 and 23 ops per run per step on the tiny model without logging, with it and injecting
    diagonal noise; the low-rank, NAP and controlled injectors acted on every step, per run."""
    p = copy.deepcopy(tiny)
    p["train"]["rng"] = "counter"
    p["exposure"]["enabled"] = mode != "plain"
    noise = {"plain": "none", "exposure": "none"}.get(mode, mode)
    if noise in QUIET_NOISE:
        p["noise"]["conditions"][noise] = QUIET_NOISE[noise]
    p["grid"]["noise"] = [noise]
    two, eight = (quiet_step_ops(p, noise, R, tmp_path / str(R)) for R in (2, 8))
    assert two == eight, (two, eight)


def logging_step_reads(p: dict, noise: str, R: int, root, row: bool) -> int:
    """The host reads (SYNCS calls) of one step where every run's logger acts: a row step (`row`), else a step
    where only diag Ĥ is refreshed; not a checkpoint. The ensemble as quiet_step_ops builds it."""
    ms = ["inf", 1, 2, 4, 8, 16]
    members = []
    for r in range(R):
        spec = RunSpec.of(run_spec(p, f"M{ms[r % 6]}-B16-{noise}-s{r // 6}"))
        (root / spec.keys.run_id / "checkpoints").mkdir(parents=True)
        members.append(Member(spec, root / spec.keys.run_id, spec_hash(spec.raw), torch.device("cpu")))
        members[-1].setup()
    e = ens.Ensemble(members, 0, "reads")
    logger = members[0].hooks[0]

    def wanted(s):   # every logger acts, for a row or (not due) for a diag Ĥ alone
        return len(e._acting(s)) == R and s + 1 not in e.ckpt_at and s > 2 and logger.meter.due(s) == row
    step = 0
    while not wanted(step):
        e._step(step, None)
        step += 1
    n, saved = [0], {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counting(orig):
        def call(self, *a, **k):
            n[0] += 1
            return orig(self, *a, **k)
        return call
    try:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, counting(orig))
        e._step(step, None)
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)
    return n[0]


@pytest.mark.parametrize("mode", ["exposure_row", "injecting_refresh"])
def test_a_logging_step_reads_the_host_as_often_at_2_and_8_runs(tiny, mode, tmp_path):
    """The host reads of a step where every run's logger acts, at 2 and 8 runs: an exposure row (measured before:
    16 per run) and, in the batched closed loop (grad source, diagonal, exact Gauss-Newton curvature every 2 steps),
    a step that only refreshes diag Ĥ. Still per run: the injected covariance's refresh on a row step (its PSD
    projection and trace)."""
    p = copy.deepcopy(tiny)
    p["train"]["rng"] = "counter"
    noise = "none" if mode == "exposure_row" else "grad_diagonal"
    if noise != "none":
        p["noise"]["conditions"][noise] = QUIET_NOISE[noise]
        p["exposure"].update(curvature="ggn_exact", curvature_every=2)
    p["grid"]["noise"] = [noise]
    two, eight = (logging_step_reads(p, noise, R, tmp_path / str(R), mode == "exposure_row") for R in (2, 8))
    assert two == eight, (two, eight)


@pytest.mark.usefixtures("one_thread")
def test_runs_of_different_conditions_share_an_ensemble_with_their_own_numbers(closed_loop, tmp_path):
    """train.share_conditions: batch noise alone, the grad source's closed loop (clipping), low-rank emulate_batch and
    the param source's closed loop, one run each, grouped into one ensemble (ensemble_groups) and trained together:
    every table and final state equals the same run's in its own condition's ensemble, bit for bit (one thread). A
    condition with other steps (steps_as_batch) keeps an ensemble of its own."""
    from test_train import assert_same_states, final_states

    from iclnoise.config.grid import ensemble_groups

    p = copy.deepcopy(closed_loop)
    conds = ["none", "early", "glow", "pdiag"]
    p["grid"].update(noise=[*conds, "grad_b16_steps"], M=[4], seeds=[0], batch_sizes=[16])
    p["noise"]["conditions"]["grad_b16_steps"] = {"source": "grad", "shape": "lowrank", "rank": 4,
                                                  "schedule": "constant", "emulate_batch": 4, "steps_as_batch": 4}
    p["train"]["budget"] = {"mode": "sequences", "sequences": 960}
    p["noise"]["conditions"]["early"].pop("batch_sizes", None)   # params.yaml's runs it at batch 64 only
    assert len(ensemble_groups(p)) == 5
    p["train"]["share_conditions"] = True
    groups = ensemble_groups(p)
    assert sorted(len(g) for g in groups.values()) == [1, 4], groups
    runs = next(g for g in groups.values() if len(g) == 4)
    assert all(run_spec(p, r) == run_spec({**p, "train": {**p["train"], "share_conditions": False}}, r) for r in runs)
    train_ensemble([run_spec(p, r) for r in runs], [tmp_path / "shared" / r for r in runs], progress=False)
    for r in runs:
        train_ensemble([run_spec(p, r)], [tmp_path / "own" / r], progress=False)
        a, b = tmp_path / "shared" / r, tmp_path / "own" / r
        for f in ("metrics.parquet", "exposure.parquet") + (("injection.parquet",) if "none" not in r else ()):
            pd.testing.assert_frame_equal(read_parquet(a / f), read_parquet(b / f), check_exact=True, obj=f"{r} {f}")
        assert_same_states(final_states([a]), final_states([b]))
