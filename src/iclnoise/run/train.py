"""The training loop: many runs trained together as one batched computation (method §4).

An *ensemble* is a set of runs that share model shape, step count and training configuration (they
differ in M, seed and so in task pool, data stream and initialisation). Their parameters are stacked
along a leading run axis and one step is one call of the hooked `ICLTransformer` on the stacked
parameters (`functional_call`: its layers run the R runs as batched matmuls; 1.5× a vmap over runs,
bench/bench_step.py), so the per-step overhead is paid once for all runs. Everything per run stays
per run: its task pool and counter-based data stream, its initialisation, its AdamW state (AdamW is
elementwise, so one AdamW over stacked tensors is R AdamWs), its gradient-norm clipping, its noise
injection and exposure hooks, its evaluation, checkpoints and divergence (a diverged run is frozen,
recorded with `diverged = true` and kept; the others go on). `train_run` is an ensemble of one.

Run directory (iclnoise.run.runs): `run.json` (spec + `spec_hash`), weights-only analysis checkpoints
with a sha256 manifest, one rolling full resume state `resume.pt` (the previous commit's kept as
`resume.prev.pt`), and the Parquet tables. The trainer holds every member's run-directory lock while it
runs (a second trainer is refused, naming the first's pid) and refuses a run directory that is a symbolic
link. A run resumes from its resume state only if the state's spec hash equals the spec's; a run whose spec
changed starts fresh (the pipeline's files are removed, any other file kept, and the log says so). A corrupt
newest resume state falls back to the previous one; a state holding objects the pipeline never writes is
refused (ForeignFile). The runs of one cohort (an ensemble that trained together) resume from one commit step,
the newest that every one of them has, so any sequence of kills resumes the ensemble as it was; a member
without that step (a resume state rolled back or replaced) is refused, naming the files.
"""
from __future__ import annotations

import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch

from ..config.grid import spec_hash
from ..core.io import CorruptFileError, repair_advice, write_json, write_parquet
from ..core.runspec import RunSpec
from .ensemble import Ensemble
from .evaluate import METRICS_SCHEMA, TOKEN_SCHEMA, root_preds_schema
from .member import RESUME, RESUME_PREV, Member
from .runs import (
    CKPT_DIR,
    MANIFEST,
    ForeignFile,
    clear_run_dir,
    load_torch,
    lock_run_dir,
    missing_checkpoints,
    read_spec,
)

log = logging.getLogger(__name__)
SHARED = ("data", "model", "train", "eval", "exposure")  # sections identical across an ensemble; each run's noise is
# its own (hooks, injector and stream per run: train.share_conditions, noise_seed's common random numbers)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def _check_shared(specs: list[RunSpec]) -> None:
    """An ensemble needs one model shape, step count and training configuration; name the runs that differ."""
    def shared(s: RunSpec) -> tuple:
        return tuple(getattr(s, k) for k in SHARED) + (s.keys.batch,)

    bad = [s.keys.run_id for s in specs if shared(s) != shared(specs[0])]
    if bad:
        raise ValueError(f"runs {bad} cannot train in one ensemble with {specs[0].keys.run_id}: an ensemble "
                         f"needs the same batch and the same {', '.join(SHARED)} sections (they differ)")
    ids = [s.keys.run_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"an ensemble lists a run twice: {sorted(i for i in ids if ids.count(i) > 1)}")


def _memory_check(specs: list[RunSpec], device: torch.device) -> None:
    """Refuse, before training, an ensemble whose planned memory (iclnoise.config.memory.job_memory) does not fit."""
    from ..config.memory import MEMORY_HEADROOM, job_memory

    s = specs[0]
    need = job_memory(s.data, s.model, s.eval, s.train.micro_batch, [x.keys.M for x in specs])["total"]
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > MEMORY_HEADROOM * free:
        R = len(specs)
        raise MemoryError(f"the ensemble of {R} runs ({', '.join(x.keys.run_id for x in specs[:4])}"
                          f"{', ...' if R > 4 else ''}) needs ≈ {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB "
                          f"are free on {device}; lower train.ensemble_runs (runs per ensemble) or train.micro_batch")


def _resume_states(m: Member) -> list[tuple[Path, dict]]:
    """The run's readable resume states whose spec hash matches, newest first. A changed spec, or an analysis
    checkpoint gone from disk (only training writes it again), clears the run directory (clear_run_dir). A corrupt
    run.json stops here (CorruptFileError, naming it and what to do) and deletes nothing: it is not a changed spec.
    A state holding foreign objects stops here too (ForeignFile)."""
    rd = m.run_dir
    old = rd / "run.json"
    if old.exists():
        prev = read_spec(rd)
        if not isinstance(prev, dict) or not isinstance(prev.get("spec_hash"), str):
            raise CorruptFileError(f"{old}: not a run spec (no spec_hash), corrupt; {repair_advice(old)}")
        prev_hash = prev["spec_hash"]
        if prev_hash != m.hash:
            log.warning("%s: spec changed (hash %s → %s): removing the stale run state and training from scratch",
                        m.run_id, prev_hash, m.hash)
            clear_run_dir(rd)
    out = []
    for name in (RESUME, RESUME_PREV):
        path = rd / name
        if not path.exists():
            continue
        try:
            state = load_torch(path, "cpu")
        except ForeignFile:
            raise
        except CorruptFileError:  # the previous state, or training from step 0, replaces it
            log.warning("%s: %s is truncated or corrupt; not resuming from it", m.run_id, path)
            continue
        if not isinstance(state, dict) or state.get("spec_hash") != m.hash:
            log.warning("%s: %s is not a resume state of this run's spec; not resuming from it", m.run_id, path)
            continue
        out.append((path, {"commit": state["step"], "cohort": None, **state}))  # states before commits: their step
    gone = missing_checkpoints(rd, {s for _, st in out for s in st["manifest"]})
    if gone:
        log.warning("%s: checkpoints %s are missing: removing the run's files and training it again from step 0",
                    m.run_id, ", ".join(map(str, gone)))
        clear_run_dir(rd)
        return []
    return out


def _choose_resume(members: list[Member]) -> None:
    """Set each member's resume state (None: it starts at step 0). The members of one cohort resume from one
    commit, the newest that all of them have: a kill while the ensemble wrote its states leaves some a commit
    ahead, and they step back to their previous state (resume.pt, newer, is removed). A member without that commit
    (its state rolled back or replaced) would split the ensemble: refused (CorruptFileError), naming the files."""
    cohorts = defaultdict(list)
    for m in members:
        states = _resume_states(m)
        if states:
            cohorts[states[0][1]["cohort"]].append((m, states))
    ats = {c: min(states[0][1]["commit"] for _, states in group) for c, group in cohorts.items()}
    for c, group in cohorts.items():  # all checked before any file is touched
        at = ats[c]
        lacking = [m.run_id for m, states in group if all(st["commit"] != at for _, st in states)]
        if lacking:
            behind = [m.run_id for m, states in group if states[0][1]["commit"] == at]
            have = "; ".join(f"{p} at step {st['commit']}" for _, ss in group for p, st in ss)
            files = " ".join(str(m.run_dir / n) for m, _ in group for n in (RESUME, RESUME_PREV))
            raise CorruptFileError(
                f"{', '.join(behind)}: resume state at step {at}, behind the rest of its ensemble "
                f"({', '.join(lacking)} keep no state at that step; {have}): a resume state was rolled "
                f"back or replaced, and resuming would split the ensemble. Restore the file, or delete "
                f"the ensemble's resume states (rm -f {files}) and rerun to train these runs again from "
                f"step 0.")
    for c, group in cohorts.items():
        for m, states in group:
            path, m.resume = next((p, st) for p, st in states if st["commit"] == ats[c])
            m.saved = ats[c]
            if path.name == RESUME_PREV:
                (m.run_dir / RESUME).unlink(missing_ok=True)  # newer than the ensemble's commit, or unreadable


def _write_outputs(m: Member) -> pd.DataFrame:
    metrics = pd.DataFrame(m.rows)[METRICS_SCHEMA.names]
    write_parquet(pd.DataFrame(m.tokens), m.run_dir / "token_losses.parquet", TOKEN_SCHEMA)
    write_parquet(pd.DataFrame(m.root), m.run_dir / "root_preds.parquet",
                  root_preds_schema(m.spec.eval.n_root * m.spec.data.K))
    for h in m.hooks:
        write_parquet(pd.DataFrame(h.rows(), columns=h.schema.names), m.run_dir / f"{h.name}.parquet", h.schema)
    write_json({str(k): v for k, v in sorted(m.manifest.items())}, m.run_dir / MANIFEST)
    write_parquet(metrics, m.run_dir / "metrics.parquet", METRICS_SCHEMA)  # last: it marks the run complete
    return metrics


def train_ensemble(specs: list[dict], run_dirs: list[str | Path], progress: bool | None = None,
                   device: torch.device | None = None, stop_after: int | None = None) -> list[pd.DataFrame | None]:
    """Train every run of `specs` (one per run directory) to completion, together; resume each from its own
    resume state where its spec hash matches. Returns the metrics table of every run, in order.

    `stop_after`: stop once this many steps are done (e.g. under a cluster time limit); the runs keep their
    last resume state, a later call goes on from there, and unfinished runs return None."""
    if len(specs) != len(run_dirs):
        raise ValueError("one run directory per spec")
    typed = [RunSpec.of(s) for s in specs]
    _check_shared(typed)
    device = device or resolve_device(typed[0].train.device)
    _memory_check(typed, device)
    locks = []
    try:
        for rd in run_dirs:
            locks.append(lock_run_dir(rd))
        return _train_locked(typed, [Path(rd) for rd in run_dirs], device, progress, stop_after)
    finally:
        for fd in locks:
            os.close(fd)


def _train_locked(typed: list[RunSpec], run_dirs: list[Path], device: torch.device, progress: bool | None,
                  stop_after: int | None) -> list[pd.DataFrame | None]:
    members = [Member(spec, rd, spec_hash(spec.raw), device) for spec, rd in zip(typed, run_dirs)]
    _choose_resume(members)
    for m in members:
        write_json({**m.spec.raw, "spec_hash": m.hash}, m.run_dir / "run.json")
        (m.run_dir / CKPT_DIR).mkdir(exist_ok=True)
    show = sys.stderr.isatty() if progress is None else progress
    starts = defaultdict(list)  # (commit, cohort) → members; every run starting at step 0 trains in one ensemble
    for m in members:
        m.setup()
        st = m.resume
        if st is not None:
            m.resume_from(st)
            log.info("%s: resuming at step %d", m.run_id, st["commit"])
        starts[(st["commit"], st["cohort"]) if st is not None and st["commit"] > 0 else (0, None)].append(m)
    for (start, cohort), group in sorted(starts.items(), key=lambda kv: kv[0][0]):
        if any(not m.diverged and m.step < m.spec.train.last_step for m in group):
            Ensemble(group, start, cohort or ",".join(sorted(m.run_id for m in group))).run(show, stop_after)
            continue
        for m in group:  # finished earlier: restore its final weights so outputs match the state
            m.model.load_state_dict({**m.model.state_dict(), **m.resume["params"]})
    return [_write_outputs(m) if m.diverged or m.step >= m.spec.train.last_step else None for m in members]


def train_run(spec: dict, run_dir: str | Path, progress: bool | None = None) -> pd.DataFrame:
    """Train one run to completion (an ensemble of one); return its metrics table."""
    return train_ensemble([spec], [run_dir], progress)[0]

