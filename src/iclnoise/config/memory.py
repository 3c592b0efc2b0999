"""The memory a training job plans to allocate (a floor, iclnoise.config.cost checks grids against it) and the ensembles
`train.ensemble_runs: auto` packs into a GPU's memory by it (iclnoise.config.grid.ensemble_groups)."""
from __future__ import annotations

from ..core.runspec import M_INF
from ..core.sections import Data, Eval, Model, ParamsError

MAX_JOB_MEMORY = 32 * 2**30  # bytes one job may plan to allocate (iclnoise.config.cost.memory_estimate)
MEMORY_HEADROOM = 0.8  # share of a device's memory a training job may plan to fill (allocator and CUDA context)


def job_memory(data: Data, model: Model, eval_: Eval, micro_batch: int, Ms: list[int]) -> dict[str, int]:
    """Bytes a training job of len(Ms) runs (an ensemble, run i at task-pool size Ms[i]) plans to allocate (a
    floor, not a measurement), summed over its runs:

    pool   = M·(16D + 196): the training pool M·D·4 plus the evaluator's peak, max(M·D·12 (float64 draw and
             float32 copy), M·D·4 + M·(2D+1)·4 + 3·16·M·4 (dMMSE: pool, its two copies, three buffers)); 0 at M = ∞
    eval   = (2·n_sequences + n_root)·K·(D+1)·4·2 per run (its sets, predictions) + n_sequences·2K·(4d + d_mlp
             + 2K·h)·4·2 once (one run is evaluated at a time; on CUDA a chunk of runs of at most R·micro_batch
             sequences in all, whose activations fit in the train term's, freed while it evaluates)
    train  = micro_batch·2K·L·(10d + 2·d_mlp + 3·2K·h)·4 (activations kept for backward; the runs step together)
    params = 16·P, P = L·(4d² + 2d·d_mlp) (weights, gradients, two Adam moments)
    """
    D, K, T = data.D, data.K, 2 * data.K
    dm, dmlp, L, h = model.d_model, model.d_mlp, model.n_layers, model.n_heads
    R = len(Ms)
    est = {
        "pool": sum(M * (16 * D + 196) for M in Ms if M != M_INF),
        "eval": R * (2 * eval_.n_sequences + eval_.n_root) * K * (D + 1) * 8
        + eval_.n_sequences * T * (4 * dm + dmlp + T * h) * 8,
        "train": R * micro_batch * T * L * (10 * dm + 2 * dmlp + 3 * T * h) * 4,
        "params": R * 16 * L * (4 * dm * dm + 2 * dm * dmlp),
    }
    est["total"] = sum(est.values())
    return est


def ensemble_memory(params: dict, batch: int, Ms: list[int]) -> dict[str, int]:
    """job_memory of an ensemble at `batch` whose runs train task pools of sizes Ms, under params."""
    mb = min(params["train"]["micro_batch"], batch)
    return job_memory(Data.from_dict(params["data"]), Model.from_dict(params["model"]),
                      Eval.from_dict(params["eval"]), mb, Ms)


def gpu_limit(params: dict) -> float | None:
    """Bytes one ensemble may plan to fill under `train.ensemble_runs: auto`: min(MEMORY_HEADROOM · G,
    MAX_JOB_MEMORY) for a GPU of G bytes; None to size for the CPU. G: with train.device cuda, train.gpu_memory_gib
    where set (a grid planned on a host without the GPU, e.g. a SLURM login node), else the visible CUDA device's
    total memory; with auto, the visible CUDA device's (None where none is)."""
    t = params["train"]
    if t["device"] == "cpu":
        return None
    import torch

    if t["device"] == "cuda" and t.get("gpu_memory_gib"):
        gpu = t["gpu_memory_gib"] * 2**30
    elif torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory
    elif t["device"] == "auto":
        return None
    else:
        raise ParamsError("train.ensemble_runs = 'auto' with train.device = 'cuda' sizes ensembles for the GPU's "
                          "memory, but no CUDA device is visible here; set train.gpu_memory_gib (the GPU's memory "
                          "in GiB) or train.ensemble_runs to a number")
    return min(MEMORY_HEADROOM * gpu, MAX_JOB_MEMORY)
