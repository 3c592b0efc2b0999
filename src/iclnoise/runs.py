"""Run-directory plumbing, used by training and by every probe (llc, geometry, mech, ed).

A run directory `results/runs/{run}/` holds:

- `run.json`: the resolved spec (`iclnoise.grid.run_spec`) and its hash (`iclnoise.grid.spec_hash`);
- `checkpoints/step_XXXXXXX.pt`: analysis checkpoints, one per scheduled step, each holding only
  `model` (state_dict), `model_config`, `adam` ({"exp_avg_sq": flat float tensor, "step", "beta2",
  "eps"}; None before the first update) and `spec_hash`: linear storage, no metric rows;
- `checkpoints.json`: the manifest {step: sha256} of every analysis checkpoint, written with the
  metrics: probes verify a checkpoint against it before they use it;
- `resume.pt` (+ `resume.prev.pt`): the rolling full training state of the run (see iclnoise.train).

Named data streams: every consumer draws its sequences from the run's own q_M on its own stream,
so no probe ever sees a training batch.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from .io import read_json, write_bytes
from .sections import RunSpec
from .tasks import BatchSampler, pool_for

CKPT_DIR = "checkpoints"
MANIFEST = "checkpoints.json"
STREAMS = {"train": 0, "heldout": 1, "llc": 2, "geometry": 3, "mech": 4}


class CorruptFile(RuntimeError):
    """A file the pipeline needs is unreadable or does not match its manifest; the message says what to do."""


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
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_bytes(buf.getvalue(), path)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def load_torch(path: str | Path, device: str | torch.device = "cpu", expect_sha: str | None = None) -> dict:
    """torch.load with a clear error naming the file and what to do: delete its run directory (checkpoints are
    not Snakemake outputs, so deleting one alone retrains nothing); checks the sha256 when one is expected."""
    path = Path(path)
    run_dir = path.parent.parent if path.parent.name == CKPT_DIR else path.parent  # a checkpoint, or resume.pt
    retrain = f"Delete the run directory {run_dir} and rerun snakemake to retrain the run."
    if expect_sha is not None and path.exists() and sha256(path) != expect_sha:
        raise CorruptFile(f"{path} does not match its manifest (sha256 differs): the file is corrupt. {retrain}")
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except FileNotFoundError:
        raise CorruptFile(f"{path} is missing. {retrain}")
    except Exception as err:  # noqa: BLE001 - any unpickling error means the same thing to the user
        raise CorruptFile(f"{path} cannot be read ({type(err).__name__}: {err}): the file is truncated or "
                          f"corrupt. {retrain}") from None


def manifest(run_dir: str | Path) -> dict[int, str]:
    """{step: sha256} of the run's analysis checkpoints ({} when there is no manifest yet; CorruptFileError,
    naming the file and what to do, when it is truncated or corrupt)."""
    p = Path(run_dir) / MANIFEST
    return {int(k): v for k, v in read_json(p).items()} if p.exists() else {}


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the run's analysis checkpoints, from the manifest (or the files, before it exists)."""
    m = manifest(run_dir)
    if m:
        return sorted(m)
    return sorted(int(p.stem.split("_")[1]) for p in (Path(run_dir) / CKPT_DIR).glob("step_*.pt"))


def load_checkpoint(run_dir: str | Path, step: int, device: str | torch.device = "cpu") -> dict:
    """An analysis checkpoint, verified against the manifest."""
    return load_torch(checkpoint_path(run_dir, step), device, manifest(run_dir).get(step))


def model_from_checkpoint(state: dict, device: str | torch.device = "cpu") -> torch.nn.Module:
    from .model import ModelConfig, build_model

    model = build_model(ModelConfig(**state["model_config"]), 0, device)
    model.load_state_dict(state["model"])
    return model


def load_model(run_dir: str | Path, step: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The hooked ICLTransformer of a run at an analysis checkpoint."""
    return model_from_checkpoint(load_checkpoint(run_dir, step, device), device)


def checkpoint_precond(state: dict) -> torch.Tensor | None:
    """Flat Adam preconditioner a of a checkpoint (dead coordinates 0), None before the first update."""
    from .adam import adam_a

    adam = state.get("adam")
    if adam is None:
        return None
    return adam_a(adam["exp_avg_sq"], adam["step"], adam["beta2"], adam["eps"])


def read_spec(run_dir: str | Path) -> dict:
    """The run's run.json (CorruptFileError, naming it and what to do, when it is truncated or corrupt)."""
    return read_json(Path(run_dir) / "run.json")


def sampler(spec: RunSpec, stream: str, device: str | torch.device = "cpu") -> BatchSampler:
    """The run's q_M sampler on a named stream (train, heldout, llc, geometry, mech)."""
    d, k = spec.data, spec.keys
    return BatchSampler(pool_for(k.M, d.pool_seed, d.D), d.K, d.D, d.noise_var, k.seed, device,
                        stream=STREAMS[stream])


def select_steps(steps: list[int], every: int) -> list[int]:
    """Every `every`-th checkpoint (from the first) plus always the last."""
    steps = sorted(steps)
    chosen = steps[::max(1, every)]
    return chosen if chosen[-1] == steps[-1] else chosen + [steps[-1]]
