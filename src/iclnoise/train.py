"""The training loop: many runs trained together as one batched computation (SPEC §4).

An *ensemble* is a set of runs that share model shape, step count and training configuration (they
differ in M, seed and so in task pool, data stream and initialisation). Their parameters are stacked
along a leading run axis and one step is one call of the hooked `ICLTransformer` on the stacked
parameters (`functional_call`: its layers run the R runs as batched matmuls; 1.5× a vmap over runs,
bench/bench_step.py), so the per-step overhead is paid once for all runs. Everything per run stays
per run: its task pool and counter-based data stream, its initialisation, its AdamW state (AdamW is
elementwise, so one AdamW over stacked tensors is R AdamWs), its gradient-norm clipping, its noise
injection and exposure hooks, its evaluation, checkpoints and divergence (a diverged run is frozen,
recorded with `diverged = true` and kept; the others go on). `train_run` is an ensemble of one.

Run directory (iclnoise.runs): `run.json` (spec + `spec_hash`), weights-only analysis checkpoints
with a sha256 manifest, one rolling full resume state `resume.pt` (the previous one kept as
`resume.prev.pt`), and the Parquet tables. A run resumes from its resume state only if the state's
spec hash equals the spec's; a run whose spec changed starts fresh (the stale state is removed and
the log says so). A corrupt newest resume state falls back to the previous one.
"""
from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pandas as pd
import torch

from .ensemble import RESUME, RESUME_PREV, Ensemble, Member
from .evaluate import METRICS_SCHEMA, TOKEN_SCHEMA, root_preds_schema
from .grid import spec_hash
from .io import CorruptFileError, repair_advice, write_json, write_parquet
from .runs import CKPT_DIR, MANIFEST, CorruptFile, load_torch, read_spec
from .sections import RunSpec

log = logging.getLogger(__name__)
SHARED = ("data", "model", "train", "eval", "noise", "exposure")  # sections identical across an ensemble


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
    """Refuse, before training, an ensemble whose planned memory (iclnoise.cost.job_memory) does not fit."""
    from .cost import job_memory

    s = specs[0]
    need = job_memory(s.data, s.model, s.eval, s.train.micro_batch, [x.keys.M for x in specs])["total"]
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        R = len(specs)
        raise MemoryError(f"the ensemble of {R} runs ({', '.join(x.keys.run_id for x in specs[:4])}"
                          f"{', ...' if R > 4 else ''}) needs ≈ {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB "
                          f"are free on {device}; lower train.ensemble_runs (runs per ensemble) or train.micro_batch")


def _load_resume(m: Member) -> dict | None:
    """The newest readable resume state of the run whose spec hash matches; stale state is removed. A corrupt
    run.json stops here (CorruptFileError, naming it and what to do) and deletes nothing: it is not a changed spec."""
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
            for p in rd.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in (RESUME, RESUME_PREV):
        path = rd / name
        if not path.exists():
            continue
        try:
            state = load_torch(path, "cpu")
        except CorruptFile:  # the previous state, or training from step 0, replaces it
            log.warning("%s: %s is truncated or corrupt; not resuming from it", m.run_id, path)
            continue
        if state.get("spec_hash") == m.hash:
            return state
    return None


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
    members = []
    for spec, rd in zip(typed, run_dirs):
        m = Member(spec, Path(rd), spec_hash(spec.raw), device)
        m.run_dir.mkdir(parents=True, exist_ok=True)
        m.resume = _load_resume(m)
        write_json({**spec.raw, "spec_hash": m.hash}, m.run_dir / "run.json")
        (m.run_dir / CKPT_DIR).mkdir(exist_ok=True)
        members.append(m)
    show = sys.stderr.isatty() if progress is None else progress
    todo = []
    for m in members:
        m.setup()
        if m.resume is not None:
            st = m.resume
            m.step, m.diverged = st["step"], st["diverged"]
            m.rows, m.tokens, m.root, m.manifest = st["rows"], st["tokens"], st["root"], st["manifest"]
            for h, hs in zip(m.hooks, st["hooks"]):
                h.load_state_dict(hs)
            log.info("%s: resuming at step %d", m.run_id, m.step)
        if not (m.diverged or m.step >= m.spec.train.last_step):
            todo.append(m)
        else:  # finished earlier: restore its final weights so outputs match the state
            m.model.load_state_dict({**m.model.state_dict(), **m.resume["params"]})
    for start in sorted({m.step for m in todo}):
        group = [m for m in todo if m.step == start]
        Ensemble(group, start).run(show, stop_after)
    return [_write_outputs(m) if m.diverged or m.step >= m.spec.train.last_step else None for m in members]


def train_run(spec: dict, run_dir: str | Path, progress: bool | None = None) -> pd.DataFrame:
    """Train one run to completion (an ensemble of one); return its metrics table."""
    return train_ensemble([spec], [run_dir], progress)[0]

