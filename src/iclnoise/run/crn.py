"""Counterfactual noise response by common random numbers (method §13, "CNR by common random numbers"; issue 67):
what a run's final metrics become, in expectation over the noise, had its injected noise over [t0, T) been another.

A counterfactual is a noise section. Every member of the experiment is the run with one counterfactual's noise and
one realisation i of its noise stream (noise_seed i, iclnoise.core.tasks: data and initialisation unchanged), and
all of them train in one ensemble from the run's state at t0. The run's own noise (`self`; `none` for a run that
injects none) is the reference (`reference` in the tables), so the realisations pair: counterfactual c's i-th
member and the reference's i-th draw the same data and the same noise stream, and
ΔE f = mean_i (f(c, i) − f(reference, i)) has the seeds' variance taken out (iclnoise.analysis.stats.paired_effects).

The state at t0. No member injects noise before t0 (each counterfactual's window starts at or after t0; checked),
so every member's first t0 steps are the same trajectory: they are trained once per distinct injector (a
condition's noise section less its level and noise_seed, `structure`), so each fork starts from the hook states
its own condition would have had at t0, and a member is bit for bit the run a plain retraining of its spec gives
(tested). The forks are checked to share one set of parameters at t0.

Counterfactuals (`counterfactual`): NAME[*k][+field=value...], NAME one of `self` (the run's noise section),
`none`, or a noise condition of params.yaml; `*k` multiplies its level (budget or target: the injected exposure
is k times the condition's; k = 0 is none); `+field=value` replaces a field of the section (shape, rank, source,
fraction, schedule, layers, ...: NoiseCondition's, validated as params.yaml's are; `+layers=blocks.0,embed` puts
the noise on those parameters alone, at the same level: method §5, "Noise on some layers"). What cannot be a
counterfactual here: `*k` on an emulate_batch level (its covariance is a batch size's, not a multiple)."""
from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from ..config.grid import spec_hash
from ..config.validate import validate_condition
from ..core.runspec import RunSpec, parse_run_id
from ..core.sections import ParamsError
from .ensemble import Ensemble
from .member import RESUME, RESUME_PREV, Member
from .runs import CKPT_DIR, load_torch, save_torch
from .train import train_ensemble

METRICS = ("r", "id_loss", "ood_loss", "delta_ridge", "delta_dmmse", "ood_delta_ridge", "ood_delta_dmmse")
LEVELS = ("budget", "target", "emulate_batch", "relative_dose")   # a condition's level, not its injector
OWN = ("noise_seed", "batch_sizes", "M")   # grid and stream keys: never part of a member's condition as given
REFERENCE = "reference"   # the run's own noise: the members every counterfactual's pair with
NAME = re.compile(r"(?P<name>[A-Za-z0-9_]+)(?:\*(?P<k>[0-9.]+(?:[eE][-+]?[0-9]+)?))?"
                  r"(?P<set>(?:\+[A-Za-z_]+=[A-Za-z0-9_.,-]+)*)")
REALISATIONS_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("seed", pa.int64()), pa.field("counterfactual", pa.string()),
    pa.field("realisation", pa.int64()),   # the member's noise_seed
    pa.field("t0", pa.int64()), pa.field("step", pa.int64()),   # the fork, and the step f was read at
    pa.field("metric", pa.string()), pa.field("value", pa.float64()), pa.field("diverged", pa.bool_()),
])


@dataclass(frozen=True)
class Counterfactual:
    """`text` as given; `noise` the noise section its members train with (noise_seed set per realisation)."""

    text: str
    noise: dict

    @property
    def structure(self) -> tuple:
        """The injector apart from its level and stream: members of one structure share their first t0 steps."""
        return tuple(sorted((k, repr(v)) for k, v in self.noise.items() if k not in LEVELS))


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _scaled(noise: dict, k: float, text: str) -> dict:
    """The section with its level × k (budget, or target: a number or [[fraction, P-NE*], ...])."""
    if noise.get("budget") is not None:
        return {**noise, "budget": noise["budget"] * k}
    t = noise.get("target")
    if t is not None:
        return {**noise, "target": t * k if isinstance(t, (int, float)) else [[f, v * k] for f, v in t]}
    raise ValueError(f"counterfactual {text!r}: *k multiplies a budget or target level, and this condition's level "
                     f"is emulate_batch (a batch size's covariance); name an emulate_batch condition instead")


def counterfactual(text: str, conditions: dict, spec: RunSpec) -> Counterfactual:
    """Parse NAME[*k][+field=value...] against the run's spec and params.yaml's noise conditions (module
    docstring); the section is validated as params.yaml's are."""
    m = NAME.fullmatch(text)
    if m is None:
        raise ValueError(f"counterfactual {text!r}: expected NAME[*k][+field=value...] (e.g. none, self*2, "
                         f"self+shape=isotropic, late*0.5)")
    name, k = m["name"], float(m["k"] or 1.0)
    if name == "none":
        base = {"source": "none"}
    elif name == "self":
        base = {key: v for key, v in spec.raw.get("noise", {"source": "none"}).items() if key not in OWN}
    elif name in conditions:
        base = {key: v for key, v in conditions[name].items() if key not in OWN}
        if "relative_dose" in base:
            raise ValueError(f"counterfactual {text!r}: condition {name!r} gives a relative_dose, which a run spec "
                             f"holds as the budget it resolves to at the run's batch size: use self*k on a run of "
                             f"that condition, or a condition with its budget")
    else:
        raise ValueError(f"counterfactual {text!r}: {name!r} is not a noise condition of params.yaml "
                         f"(noise.conditions: {', '.join(sorted(conditions)) or 'none'}; or none, self)")
    for item in filter(None, m["set"].split("+")):
        key, _, v = item.partition("=")
        if key in OWN:
            raise ValueError(f"counterfactual {text!r}: {key} is not the noise's to set (the realisations set "
                             f"noise_seed; the grid keys are the run's)")
        base[key] = v.split(",") if key == "layers" else _value(v)
    if k == 0 or base.get("source") == "none":
        base = {"source": "none"}
    elif k != 1:
        base = _scaled(base, k, text)
    try:
        validate_condition(base, spec.raw)
    except ParamsError as e:
        raise ValueError(f"counterfactual {text!r}: {e}") from None
    return Counterfactual(text, base)


def member_spec(raw: dict, cf: Counterfactual, realisation: int | None) -> dict:
    """The run's spec with the counterfactual's noise, its stream keyed by noise_seed `realisation` (None: the
    run's own stream). A noise-free member's section is {source: none}, as any run's."""
    noise = dict(cf.noise)
    if noise.get("source", "none") != "none" and realisation is not None:
        noise["noise_seed"] = realisation
    return {**copy.deepcopy(raw), "noise": noise}


def labelled(s: dict, j: int) -> dict:
    """Member j's spec under a run id of its own (noise label crn<j>), since an ensemble lists each run once; the
    label is no input of training (tests/test_crn.py compares members with their unlabelled specs' runs)."""
    keys = dataclasses.replace(parse_run_id(s["keys"]["run_id"]), noise=f"crn{j}")
    return {**s, "keys": {**s["keys"], "noise": keys.noise, "run_id": keys.run_id}}


def _check_window(spec: RunSpec, t0: int, what: str) -> None:
    if spec.window is not None and spec.window[0] < t0:
        raise ValueError(f"{what} injects noise from step {spec.window[0]}, before the fork at t0 = {t0}: CNR "
                         f"compares noise over [t0, T) from one shared state; fork at or before step "
                         f"{spec.window[0]}, or give a counterfactual whose window starts at or after t0 (e.g. "
                         f"+schedule=late+fraction=...)")


def crn(raw: dict, names: list[str], conditions: dict, realisations: int, t0: int | None = None,
        device: str = "cpu", work: str | Path | None = None, fork: str | Path | None = None) -> pd.DataFrame:
    """REALISATIONS_SCHEMA rows: the final METRICS of every member (the reference `self`, then each counterfactual
    of `names`, × noise_seed 0..realisations−1), all forked at t0 (default: the start of the run's own injection
    window) and trained to the end in one ensemble.

    `work`: a directory for the members' run directories, so that a killed call resumes (the window from the
    ensemble's last commit, as training does; the first t0 steps, which are not committed, again); None: a
    temporary one. `fork`: a file for the reference's resume state at t0 (the state an estimator replays from,
    iclnoise.run.pathwise). Where it exists, the members of the reference's structure fork from it and only other
    structures train their first t0 steps (a second call on the same run with more counterfactuals); otherwise it
    is written when the members are planted."""
    raw = {k: v for k, v in raw.items() if k != "spec_hash"}
    spec = RunSpec.of(raw)
    if t0 is None:
        if spec.window is None:
            raise ValueError(f"run {spec.keys.run_id} injects no noise: give t0, the step to fork at")
        t0 = spec.window[0]
    if not 0 <= t0 < spec.train.last_step:
        raise ValueError(f"t0 = {t0} is outside the run's training steps [0, {spec.train.last_step})")
    if realisations < 1:
        raise ValueError("realisations must be at least 1")
    own = Counterfactual(REFERENCE, counterfactual("self", conditions, spec).noise)
    cfs = [own, *(counterfactual(n, conditions, spec) for n in names)]
    members = [(cf, i, member_spec(raw, cf, i)) for cf in cfs for i in range(realisations)]
    members = [(cf, i, labelled(s, j)) for j, (cf, i, s) in enumerate(members)]
    for cf in cfs:
        _check_window(RunSpec.of(member_spec(raw, cf, 0)), t0, f"counterfactual {cf.text!r}")
    with tempfile.TemporaryDirectory(prefix="crn-") as tmp:
        root = Path(work) if work is not None else Path(tmp)
        dirs = [root / f"{j:04d}" for j in range(len(members))]
        if t0 > 0 and not any((d / RESUME).exists() or (d / RESUME_PREV).exists() for d in dirs):
            forks = _forks(raw, cfs, t0, Path(tmp) / "pre", device, fork)
            for (cf, _, s), d in zip(members, dirs):   # each member's resume state: its structure's state at t0
                d.mkdir(parents=True, exist_ok=True)
                save_torch({**forks[cf.structure], "spec_hash": spec_hash(s), "cohort": "crn", "manifest": {}},
                           d / RESUME)
        tables = train_ensemble([s for *_, s in members], dirs, progress=False, device=torch.device(device))
    rows = []
    for (cf, i, _), metrics in zip(members, tables):
        last = metrics.iloc[-1]
        rows += [{"run_id": spec.keys.run_id, "seed": spec.keys.seed, "counterfactual": cf.text, "realisation": i,
                  "t0": t0, "step": int(last["step"]), "metric": k, "value": float(last[k]),
                  "diverged": bool(metrics.diverged.any())} for k in METRICS]
    return pd.DataFrame(rows, columns=REALISATIONS_SCHEMA.names)


def _member(spec: RunSpec, run_dir: Path, device: str) -> Member:
    m = Member(spec, run_dir, spec_hash(spec.raw), torch.device(device))
    (run_dir / CKPT_DIR).mkdir(parents=True)
    m.setup()
    return m


def _forks(raw: dict, cfs: list[Counterfactual], t0: int, tmp: Path, device: str, fork: str | Path | None) -> dict:
    """Each structure's state at t0: the reference's from `fork` where that file exists (its step checked), the
    others trained (states_at) and checked to hold its parameters; `fork` written where it did not exist."""
    own = cfs[0]
    kept = {own.structure: load_torch(Path(fork), "cpu")} if fork is not None and Path(fork).exists() else {}
    if kept and kept[own.structure]["step"] != t0:
        raise ValueError(f"{fork}: a state at step {kept[own.structure]['step']}, not the fork's t0 = {t0}; "
                         f"delete it, or fork at its step")
    need = [cf for cf in cfs if cf.structure not in kept]
    forks = {**kept, **(states_at(raw, need, t0, tmp, device) if need else {})}
    ref = forks[own.structure]["params"]
    if any(not all(torch.equal(ref[n], st["params"][n]) for n in ref) for st in forks.values()):
        raise RuntimeError(f"the state in {fork} and the trained forks differ at t0: it is not this run's fork")
    if fork is not None and not kept:
        save_torch(forks[own.structure], fork)
    return forks


def states_at(raw: dict, cfs: list[Counterfactual], t0: int, tmp: Path, device: str) -> dict[tuple, dict] | None:
    """The state at t0 of one run per distinct structure (module docstring), trained together from step 0; None
    at t0 = 0. Raises if their parameters differ at t0 (noise acted before the fork)."""
    if t0 == 0:
        return None
    first = {cf.structure: cf for cf in reversed(cfs)}
    pre = [_member(RunSpec.of(member_spec(raw, cf, None)), tmp / f"{j}", device) for j, cf in enumerate(first.values())]
    ens = Ensemble(pre, 0, "crn-pre")
    ens.run(False, stop_after=t0)
    states = [{**st, "commit": t0} for st in ens.states(t0)]
    ref = states[0]["params"]
    if any(not all(torch.equal(ref[n], s["params"][n]) for n in ref) for s in states[1:]):
        raise RuntimeError("the members' trajectories parted before t0: some noise acted before the fork")
    return dict(zip(first, states))
