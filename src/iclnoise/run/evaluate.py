"""Per-checkpoint behavioural metrics against dMMSE_M and ridge on fixed evaluation sets (method §3).

Δ to both predictors is logged on the in-distribution set (q_M: ridge-likeness r) and on the OOD set (new tasks,
q_∞, with dMMSE_M of the run's pool: the anchor's crossover threshold, thresholds.crossover_threshold)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..core.predictors import delta, dmmse, icl_score, ridge, ridge_likeness, token_losses
from ..core.runspec import KEY_FIELDS, RunSpec
from ..core.sections import TaskPrior
from ..core.tasks import M_INF, Batch, eval_set, pool_for, prior_cov

METRICS_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()),
    pa.field("sequences", pa.int64()),
    pa.field("lr", pa.float64()),
    pa.field("train_loss", pa.float64()),    # mean training loss / D over the updates since the last checkpoint
    pa.field("id_loss", pa.float64()),       # losses are mean squared error / D
    pa.field("ood_loss", pa.float64()),
    pa.field("id_loss_dmmse", pa.float64()),
    pa.field("id_loss_ridge", pa.float64()),
    pa.field("ood_loss_dmmse", pa.float64()),
    pa.field("ood_loss_ridge", pa.float64()),
    pa.field("delta_dmmse", pa.float64()),   # Δ(f, dMMSE_M) on the in-distribution set
    pa.field("delta_ridge", pa.float64()),   # Δ(f, ridge) on the in-distribution set
    pa.field("ood_delta_dmmse", pa.float64()),   # Δ(f, dMMSE_M) on the OOD set (new tasks, q_∞); NaN for M = ∞
    pa.field("ood_delta_ridge", pa.float64()),   # Δ(f, ridge) on the OOD set
    pa.field("r", pa.float64()),             # ridge-likeness; NaN for M = ∞ (dMMSE_∞ is ridge)
    pa.field("icl_score", pa.float64()),     # OOD ℓ_{k_early} − ℓ_{k_late}
    pa.field("diverged", pa.bool_()),
])

TOKEN_SCHEMA = pa.schema([pa.field("run_id", pa.string()), pa.field("step", pa.int64()),
                          pa.field("split", pa.string()), pa.field("k", pa.int64()),
                          pa.field("loss", pa.float64())])


def root_preds_schema(length: int) -> pa.Schema:
    return pa.schema([pa.field("run_id", pa.string()), pa.field("step", pa.int64()),
                      pa.field("preds", pa.list_(pa.float32(), length))])


@dataclass
class _Split:
    batch: Batch
    dmmse: torch.Tensor | None
    ridge: torch.Tensor


@functools.lru_cache(maxsize=64)
def _split(kind: str, M: int, n: int, K: int, D: int, noise_var: float, pool_seed: int,
           eval_seed: int, prior: TaskPrior | None = None) -> tuple[Batch, torch.Tensor | None, torch.Tensor]:
    """An evaluation set with dMMSE_M of the run's pool (None for M = ∞) and ridge on it, on the CPU; cached,
    because the OOD and root sets (and their ridge predictions) are the same for every run of an ensemble, and
    dMMSE_M on them the same for every seed of one M. `ridge` is the Bayes predictor of the prior in force
    (the generalised ridge under a shaped prior, method §13), so r and the Δ's are measured against it."""
    b = eval_set(kind, M, n, K, D, noise_var, pool_seed, eval_seed, prior)
    pool = pool_for(M, pool_seed, D, prior)
    dm = None if pool is None else dmmse(b.xs, b.ys, pool, noise_var)
    return b, dm, ridge(b.xs, b.ys, noise_var, None if prior is None else prior_cov(prior, D))


class Evaluator:
    """Holds the fixed evaluation sets and the predictors' outputs on them (computed once)."""

    def __init__(self, spec: RunSpec, device: torch.device | str = "cpu"):
        d, e = spec.data, spec.eval
        self.M, self.D, self.K = spec.keys.M, d.D, d.K
        self.icl_tokens = e.icl_tokens
        self.device = device
        self.splits: dict[str, _Split] = {}
        for kind, n in (("id", e.n_sequences), ("ood", e.n_sequences), ("root", e.n_root)):
            b, dm, rd = _split(kind, self.M, n, d.K, d.D, d.noise_var, d.pool_seed, e.eval_seed, d.task_prior)
            self.splits[kind] = _Split(b.to(device), None if dm is None else dm.to(device), rd.to(device))
        self.reference = self._reference_losses()

    def _reference_losses(self) -> dict[str, float]:
        out = {}
        for split in ("id", "ood"):
            s = self.splits[split]
            out[f"{split}_loss_ridge"] = float(token_losses(s.ridge, s.batch.ys, self.D).mean())
            out[f"{split}_loss_dmmse"] = (math.nan if s.dmmse is None
                                          else float(token_losses(s.dmmse, s.batch.ys, self.D).mean()))
        return out

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> tuple[dict[str, float], dict[str, np.ndarray], np.ndarray]:
        """(scalar metrics, per-token losses by split, root-task predictions flattened (n_root·K,))."""
        was_training = model.training
        model.eval()
        preds = {k: model(s.batch.xs, s.batch.ys) for k, s in self.splits.items()}
        model.train(was_training)
        return self.score(preds)

    def score(self, preds: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict[str, np.ndarray], np.ndarray]:
        """__call__'s outputs from the run's predictions on each split (its own pass, or its slice of an ensemble's
        stacked pass: iclnoise.run.ensemble.Ensemble.evaluate)."""
        tok = {k: token_losses(preds[k], self.splits[k].batch.ys, self.D) for k in ("id", "ood")}
        d = {}
        for split, pre in (("id", ""), ("ood", "ood_")):   # Δ on the q_M set (r reads it) and on new tasks
            s = self.splits[split]
            d[f"{pre}delta_ridge"] = delta(preds[split], s.ridge, self.D)
            d[f"{pre}delta_dmmse"] = math.nan if s.dmmse is None else delta(preds[split], s.dmmse, self.D)
        metrics = {
            "id_loss": float(tok["id"].mean()), "ood_loss": float(tok["ood"].mean()), **d,
            "r": math.nan if self.M == M_INF else ridge_likeness(d["delta_dmmse"], d["delta_ridge"]),
            "icl_score": icl_score(tok["ood"], *self.icl_tokens),
            **self.reference,
        }
        return metrics, {k: v.cpu().numpy() for k, v in tok.items()}, preds["root"].float().cpu().numpy().ravel()
