"""Run-directory plumbing, used by training and by every probe (llc, geometry, mech, ed).

A run directory `results/runs/{run}/` holds:

- `run.json`: the resolved spec (`iclnoise.config.grid.run_spec`) and its hash (`iclnoise.config.grid.spec_hash`);
- `checkpoints/step_XXXXXXX.pt`: analysis checkpoints, one per scheduled step, each holding only
  `model` (state_dict), `model_config`, `adam` ({"exp_avg_sq": flat float tensor, "step", "beta2",
  "eps"}; None before the first update) and `spec_hash`: linear storage, no metric rows;
- `checkpoints.json`: the manifest {step: sha256} of every analysis checkpoint, written with the
  metrics: probes verify a checkpoint against it before they use it;
- `resume.pt` (+ `resume.prev.pt`): the rolling full training state of the run (see iclnoise.run.train);
- `.train.lock`: held (flock) by the one trainer writing the directory.

Every `.pt` file is read with `torch.load(weights_only=True)` (tensors, plain containers and numpy arrays only), so
a planted file cannot run code: one holding anything else is refused, named (ForeignFile). A run directory is
cleared (`clear_run_dir`) by removing the files the pipeline writes (RUN_FILES, the checkpoints), nothing else.

Named data streams: every consumer draws its sequences from the run's own q_M on its own stream,
so no probe ever sees a training batch.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import logging
import os
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..core.io import CorruptFileError, file_mode, read_json, write_bytes
from ..core.runspec import RunSpec

if TYPE_CHECKING:   # torch is imported where it is used: the Snakefile imports this module to parse the DAG
    import torch

    from ..core.tasks import BatchSampler

log = logging.getLogger(__name__)
CKPT_DIR = "checkpoints"
MANIFEST = "checkpoints.json"
LOCK = ".train.lock"
# every file the pipeline writes into a run directory besides the checkpoints (training, then the probe jobs)
RUN_FILES = ("run.json", MANIFEST, "metrics.parquet", "token_losses.parquet", "root_preds.parquet", "exposure.parquet",
             "injection.parquet", "resume.pt", "resume.prev.pt", "llc.parquet", "llc_traces.parquet",
             "llc.partial.parquet", "llc_traces.partial.parquet", "llc.partial.json", "stages.parquet",
             "geometry.parquet", "mech.parquet", "rllc.parquet", "susceptibility.parquet", "cnr.parquet")
CKPT_NAME = re.compile(r"step_\d{7}\.pt")
# what torch.load(weights_only=True) may build besides tensors and plain containers: numpy arrays and scalars
# (root predictions, metric values in a resume state's rows)
SAFE_GLOBALS = [np.dtype, np.ndarray, np._core.multiarray.scalar, np._core.multiarray._reconstruct,
                *(type(np.dtype(t)) for t in ("float32", "float64", "int64", "int32", "bool"))]
STREAMS = {"train": 0, "heldout": 1, "llc": 2, "geometry": 3, "mech": 4}


class ForeignFile(CorruptFileError):
    """A .pt file holding objects the pipeline never writes (it was planted or replaced): refused, never loaded."""


class RunDirError(RuntimeError):
    """A run directory the pipeline refuses to write (a symbolic link, one another trainer holds)."""


def check_run_dir(run_dir: str | Path) -> Path:
    """`run_dir`, refused (RunDirError) when it or its checkpoints folder is a symbolic link: clearing or writing
    it would change another tree."""
    run_dir = Path(run_dir)
    for p in (run_dir, run_dir / CKPT_DIR):
        if p.is_symlink():
            raise RunDirError(f"{p} is a symbolic link (to {p.readlink()}): the pipeline writes and clears run "
                              f"directories, and would change the tree it points into. Replace it with a real "
                              f"directory (rm {p}) and rerun.")
    return run_dir


def lock_run_dir(run_dir: str | Path) -> int:
    """Take the run directory's lock (flock on its .train.lock, which records the holder's pid) and return its file
    descriptor: the lock lasts until it is closed or the process ends, however it ends. A directory another process
    holds raises RunDirError naming that process."""
    rd = check_run_dir(run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(rd / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, file_mode())
    except OSError as e:   # O_NOFOLLOW: a symbolic link is refused (ELOOP), not followed to somebody's file
        what = "a symbolic link, which a trainer never makes" if (rd / LOCK).is_symlink() else e.strerror
        raise RunDirError(f"{rd / LOCK}: cannot take the run directory's lock ({what}); remove it (rm {rd / LOCK}) "
                          f"and rerun") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"{rd} is being trained by another process (pid {holder}, holding {rd / LOCK}); two trainers "
                          f"would write the same files. Wait for it to end, or stop it (kill {holder}): a killed "
                          f"snakemake leaves its training job running.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def clear_run_dir(run_dir: str | Path) -> None:
    """Remove the files the pipeline writes into a run directory (RUN_FILES, checkpoints/step_*.pt and their
    temporary files), nothing else: any other file stays, and the log names it."""
    rd = check_run_dir(run_dir)
    ours = set(RUN_FILES)
    for folder, named in ((rd, lambda n: n in ours), (rd / CKPT_DIR, CKPT_NAME.fullmatch)):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            name = p.name
            if name.startswith(".") and name.endswith(".tmp"):  # atomic_path's temporary file: .<name>.<random>.tmp
                name = name[1:].rsplit(".", 2)[0]
            if named(name) and (p.is_file() or p.is_symlink()):  # a link is removed, never what it points to
                p.unlink()
            elif p.name != LOCK and p != rd / CKPT_DIR and not p.name.startswith("checkpoints.missing."):  # Snakemake's
                log.warning("%s: not written by the pipeline, kept", p)
    if (rd / CKPT_DIR).is_dir() and not any((rd / CKPT_DIR).iterdir()):
        (rd / CKPT_DIR).rmdir()


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step_{step:07d}.pt"


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_torch(obj: dict, path: str | Path) -> str:
    """torch.save atomically (temporary file + rename); returns the sha256 of the bytes written."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes(buf.getvalue(), path)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def load_torch(path: str | Path, device: str | torch.device = "cpu", expect_sha: str | None = None) -> dict:
    """torch.load(weights_only=True) with a clear error naming the file and what to do: delete its run directory
    (checkpoints are not Snakemake outputs, so deleting one alone retrains nothing); checks the sha256 when one is
    expected. A file holding objects the pipeline never writes raises ForeignFile and runs none of its code."""
    path = Path(path)
    run_dir = path.parent.parent if path.parent.name == CKPT_DIR else path.parent  # a checkpoint, or resume.pt
    retrain = f"Delete the run directory {run_dir} and rerun snakemake to retrain the run."
    if expect_sha is not None and path.exists() and sha256(path) != expect_sha:
        raise CorruptFileError(f"{path} does not match its manifest (sha256 differs): the file is corrupt. {retrain}")
    import torch

    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CorruptFileError(f"{path} is missing. {retrain}")
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise CorruptFileError(f"{path} cannot be read (UnpicklingError: {err}): the file is truncated or corrupt. "
                                   f"{retrain}") from None
        what = next((ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln), "objects outside the allowed set")
        raise ForeignFile(f"{path} holds objects the pipeline never writes ({what}): it was not written by iclnoise "
                          f"(planted or replaced) and was not loaded, since loading it could run code. Delete it "
                          f"(rm {path}); {retrain}") from None
    except Exception as err:  # noqa: BLE001 - any unpickling error means the same thing to the user
        raise CorruptFileError(f"{path} cannot be read ({type(err).__name__}: {err}): the file is truncated or "
                               f"corrupt. {retrain}") from None


def manifest(run_dir: str | Path) -> dict[int, str]:
    """{step: sha256} of the run's analysis checkpoints ({} when there is no manifest yet; CorruptFileError,
    naming the file and what to do, when it is truncated or corrupt)."""
    p = Path(run_dir) / MANIFEST
    return {int(k): v for k, v in read_json(p).items()} if p.exists() else {}


def missing_checkpoints(run_dir: str | Path, steps: set[int] = frozenset()) -> list[Path]:
    """The analysis checkpoints that the run's manifest (a corrupt one counts as none), or `steps`, list and that
    are not on disk: no probe can use the run until its training job trains it again. A run without a checkpoints
    directory has none here by design (a clone that pulled its results: DVC does not version checkpoints,
    .dvcignore), not lost ones: its probes' outputs came with the pull; rerunning a probe there needs
    `snakemake --forcerun train`."""
    if not (Path(run_dir) / CKPT_DIR).is_dir():
        return []
    try:
        listed = set(manifest(run_dir)) | set(steps)
    except CorruptFileError:
        listed = set(steps)
    return [checkpoint_path(run_dir, s) for s in sorted(listed) if not checkpoint_path(run_dir, s).exists()]


def changed_checkpoints(run_dir: str | Path) -> list[Path]:
    """The analysis checkpoints on disk whose bytes differ from the sha256 the run's manifest lists for them (a
    corrupt manifest: none, `missing_checkpoints` and the reader name it)."""
    try:
        listed = manifest(run_dir)
    except CorruptFileError:
        return []
    return [p for s, h in sorted(listed.items()) if (p := checkpoint_path(run_dir, s)).exists() and sha256(p) != h]


def saved_steps(run_dir: str | Path) -> list[int]:
    """The steps of the run's analysis checkpoints, from the manifest (or the files, before it exists)."""
    m = manifest(run_dir)
    if m:
        return sorted(m)
    return sorted(int(p.stem.split("_")[1]) for p in (Path(run_dir) / CKPT_DIR).glob("step_*.pt"))


def load_checkpoint(run_dir: str | Path, step: int, device: str | torch.device = "cpu") -> dict:
    """An analysis checkpoint, verified against the manifest, its weights finite: CorruptFileError naming the file
    otherwise (a diverged run's checkpoints hold the last finite weights it had, so NaN weights were not written by
    its training job)."""
    import torch

    path = checkpoint_path(run_dir, step)
    state = load_torch(path, device, manifest(run_dir).get(step))
    bad = [n for n, w in state["model"].items() if not bool(torch.isfinite(w).all())]
    if bad:
        raise CorruptFileError(f"{path} holds non-finite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}"
                               f"): no probe can read it. Delete the run directory {Path(run_dir)} and rerun "
                               f"snakemake to train the run again")
    return state


def model_from_checkpoint(state: dict, device: str | torch.device = "cpu") -> torch.nn.Module:
    from ..core.model import ModelConfig, build_model

    model = build_model(ModelConfig(**state["model_config"]), 0, device)
    model.load_state_dict(state["model"])
    return model


def load_model(run_dir: str | Path, step: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The hooked ICLTransformer of a run at an analysis checkpoint."""
    return model_from_checkpoint(load_checkpoint(run_dir, step, device), device)


def checkpoint_precond(state: dict) -> torch.Tensor | None:
    """Flat Adam preconditioner a of a checkpoint (dead coordinates 0), None before the first update."""
    from ..core.adam import adam_a

    adam = state.get("adam")
    if adam is None:
        return None
    return adam_a(adam["exp_avg_sq"], adam["step"], adam["beta2"], adam["eps"])


def read_spec(run_dir: str | Path) -> dict:
    """The run's run.json (CorruptFileError, naming it and what to do, when it is truncated or corrupt)."""
    return read_json(Path(run_dir) / "run.json")


def checked_spec(run_dir: str | Path) -> dict:
    """read_spec, checked against the run directory's name (its run id) and against the spec hash the trainer
    wrote into it (over the rest of run.json): a run.json edited by hand (another M, with the run_id to match)
    would count the run elsewhere. CorruptFileError naming the file and what differs."""
    from ..config.grid import spec_hash

    run_dir = Path(run_dir)
    raw = read_spec(run_dir)
    rid = raw.get("keys", {}).get("run_id")
    why = (f"its run_id {rid!r} is not its directory's name" if rid != run_dir.name
           else "its content does not hash to the spec_hash the trainer wrote into it"
           if "spec_hash" in raw and raw["spec_hash"] != spec_hash({k: v for k, v in raw.items() if k != "spec_hash"})
           else None)
    if why:
        raise CorruptFileError(f"{run_dir / 'run.json'}: {why}, so the file was edited after training and its run "
                               f"cannot be told apart from another; restore it (git checkout, or the set's export) "
                               f"or delete the run directory {run_dir} and rerun snakemake")
    return raw


def sampler(spec: RunSpec, stream: str, device: str | torch.device = "cpu") -> BatchSampler:
    """The run's q_M sampler on a named stream (train, heldout, llc, geometry, mech); the train stream draws as
    train.rng says, the others from a seeded generator."""
    from ..core.tasks import BatchSampler, pool_for

    d, k = spec.data, spec.keys
    return BatchSampler(pool_for(k.M, d.pool_seed, d.D, d.task_prior), d.K, d.D, d.noise_var, k.seed, device,
                        stream=STREAMS[stream], prior=d.task_prior,
                        counter=stream == "train" and spec.train.rng == "counter")

