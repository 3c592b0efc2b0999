"""The typed train sections: params.yaml's `train` (TrainParams) and a run spec's (Train), which share their keys
through TrainBase; the optimizers, the budget, the learning-rate schedule and the checkpoint grid."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar

from .keys import Section, key
from .schedules import checkpoints_until, lr_lambda

RNGS = ("generator", "counter")   # train.rng; the first: a run spec without the key
OPTIMIZERS = ("adamw", "sgd_momentum")   # grid.optimizer (iclnoise.config.grid); adamw's run ids carry no label


@dataclass(frozen=True, kw_only=True)
class LRSchedule(Section):
    """train.lr_schedule; `warmup_frac` and `min_lr_frac` have declared defaults."""
    SECTION: ClassVar[str] = "train.lr_schedule"
    kind: str = key(enum=("constant", "warmup_cosine", "triangle"), doc=(
        "constant; warmup_cosine: linear warmup to lr over warmup_frac of training, then a cosine down to min_lr_frac "
        "× lr; triangle (Raventós et al.): linear up to lr at warmup_frac, then linear down to 0."))
    warmup_frac: float = key(default=0.0, ge=0, le=1, doc=(
        "Warmup (warmup_cosine) or peak (triangle) at this fraction of training; absent: 0."))
    min_lr_frac: float = key(default=0.0, ge=0, le=1, doc=(
        "Floor of the cosine as a fraction of lr (warmup_cosine); absent: 0."))


@dataclass(frozen=True, kw_only=True)
class Optimizer(Section):
    """train.optimizer: AdamW's learning rate, (β1, β2), weight decay and δ."""
    SECTION: ClassVar[str] = "train.optimizer"
    KIND: ClassVar[str] = "adamw"
    lr: float = key(gt=0, doc="Learning rate η (times the lr_schedule's factor).")
    betas: tuple = key(minItems=2, maxItems=2, items={"type": "number", "minimum": 0, "exclusiveMaximum": 1}, doc=(
        "(β1, β2): decay of the running means of the gradient and of its square."))
    weight_decay: float = key(ge=0, doc="Decoupled weight decay λ (w ← w − η λ w each update).")
    eps: float = key(gt=0, doc="δ in the preconditioner A = 1/(√v̂ + δ) (iclnoise.core.adam).")

    @property
    def momentum(self) -> float:
        return self.betas[0]


@dataclass(frozen=True, kw_only=True)
class SGDMomentum(Section):
    """train.sgd_momentum: SGD with undampened heavy-ball momentum (v ← β v + g + λ w, w ← w − η v), the settings
    of grid.optimizer's sgd_momentum runs (a run spec holds them as train.optimizer with `kind: sgd_momentum`)."""
    SECTION: ClassVar[str] = "train.sgd_momentum"
    KIND: ClassVar[str] = "sgd_momentum"
    lr: float = key(gt=0, doc="Learning rate η (times the lr_schedule's factor).")
    momentum: float = key(ge=0, lt=1, doc="β; κ = 1/(1 − β)².")
    weight_decay: float = key(ge=0, doc="λ in v ← β v + g + λ w (added to the gradient).")


@dataclass(frozen=True, kw_only=True)
class Budget(Section):
    """train.budget: `mode` steps or sequences and its value; `stop_at` None: train the whole schedule."""
    SECTION: ClassVar[str] = "train.budget"
    mode: str = key(enum=("steps", "sequences"), doc=(
        "steps: every run makes `steps` updates; sequences: every run sees `sequences` training sequences (equal "
        "data for every batch size)."))
    steps: int | None = key(optional=True, ge=1, doc="Updates per run (mode: steps).")
    sequences: int | None = key(optional=True, ge=1, doc=(
        "Training sequences per run (mode: sequences); steps = sequences / batch."))
    stop_at: int | None = key(optional=True, ge=1, doc=(
        "Stop at this step and write the run's outputs as a finished run does; the learning-rate schedule and the "
        "checkpoint grid stay those of the whole budget (e.g. 40 000 of a 500 000-step triangle). Not part of a run's "
        "identity: raising or dropping it later resumes the run where it stopped."))


@dataclass(frozen=True, kw_only=True)
class Checkpoints(Section):
    """train.checkpoints: the analysis checkpoint grid (iclnoise.core.schedules.checkpoints_until)."""
    SECTION: ClassVar[str] = "train.checkpoints"
    linear: int = key(ge=0, le=1_000_000, doc="Evenly spaced checkpoints.")
    log: int = key(ge=0, le=1_000_000, doc="Log-spaced checkpoints (dense early).")


@dataclass(frozen=True, kw_only=True)
class TrainBase(Section):
    """The keys of `train` that params.yaml and a run spec share."""
    SECTION: ClassVar[str] = "train"
    budget: Budget = key(doc="How long every run trains: in updates or in training sequences.")
    micro_batch: int = key(ge=1, doc=(
        "Sequences per forward/backward; effective batch = micro_batch × accumulation. Runs with a smaller batch "
        "use the batch itself."))
    lr_schedule: LRSchedule = key(doc=(
        "The learning rate over a run's steps (iclnoise.core.schedules.lr_lambda)."))
    grad_clip: float | None = key(null=True, gt=0, doc="Max global grad norm; null disables clipping.")
    checkpoints: Checkpoints = key(doc=(
        "The analysis checkpoints every run writes: evenly and log-spaced steps, step 0 and the last."))
    diverge_loss: float = key(gt=0, doc="A training loss above this (or NaN) marks the run diverged and stops it.")
    device: str = key(enum=("auto", "cpu", "cuda"), doc=(
        "auto: CUDA where a device is visible, else the CPU; cuda: an error where none is visible."))
    rng: str = key(default="generator", enum=RNGS, doc=(
        "The random stream of a run's training batches and injected noise (method §4, \"Random streams\"). "
        "generator: a torch.Generator per run, seeded per step (every run trained before the key existed; a run spec "
        "holds the key only when it is not this); counter: one counter-based stream for all of an ensemble's runs "
        "(iclnoise.core.rng), a fixed number of tensor ops per step whatever the number of runs. The two give "
        "different draws of the same distributions."))
    cuda_graphs: bool = key(default=False, doc=(
        "On CUDA, capture the ensemble's step (forward, backward, divergence, clipping, AdamW) as CUDA graphs and "
        "replay them (issue 41); where capture is impossible the log says why and the step runs eagerly. No effect "
        "on the CPU (logged). The numbers equal eager's to float32 round-off (the learning rate is a float32 "
        "tensor); a run's identity holds it only when true."))
    tf32: bool = key(default=False, doc=(
        "On CUDA, TF32 matmuls (torch.backends.cuda.matmul.allow_tf32). Changes the numbers (part of a run's "
        "identity when true): off until its effect on final OOD loss and r is measured inside the seed spread. No "
        "effect on the CPU (logged)."))


@dataclass(frozen=True, kw_only=True)
class TrainParams(TrainBase):
    """train, as params.yaml holds it: AdamW's settings, sgd_momentum's, and how runs are grouped into ensembles."""
    optimizer: Optimizer = key(doc="AdamW, the optimizer of grid.optimizer adamw (the default).")
    sgd_momentum: SGDMomentum | None = key(optional=True, doc=(
        "SGD with undampened heavy-ball momentum (v ← β v + g + λ w, w ← w − η v), the runs of grid.optimizer "
        "sgd_momentum; required there, not read otherwise. Shares train.lr_schedule, grad_clip and the rest of "
        "train."))
    ensemble_runs: int | str = key(schema={"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]}, doc=(
        "Most runs trained together in one process (one Snakemake job; one GPU job on SLURM). Runs of one (batch, "
        "noise condition) form an ensemble, split into chunks of this size. auto: on a CUDA device (train.device "
        "cuda, or auto with one visible where the grid is planned) as many runs as the memory model "
        "(iclnoise.config.memory.job_memory) fits in 0.8 of the GPU's memory (at most 32 GiB per job); on the CPU "
        "18 (the default's two jobs, one per core on 2 cores). Noise conditions share one only with "
        "share_conditions. Grouping "
        "does not change any run's numbers beyond float32 round-off, nor any run's id or spec."))
    gpu_memory_gib: float | None = key(optional=True, gt=0, doc=(
        "GPU memory (GiB) that ensemble_runs auto sizes for with train.device cuda, for planning on a host without "
        "the GPU (a SLURM login node); unset: the visible CUDA device's. Not part of a run's spec."))
    share_conditions: bool = key(default=False, doc=(
        "Runs of different noise conditions at one batch size, optimizer and step count train in one ensemble (fewer, "
        "larger ensembles: fewer kernel launches per run-step on a GPU); each run keeps its own noise, hooks and "
        "numbers. false: one noise condition per ensemble, as every grid before the key. Not part of a run's spec."))


@dataclass(frozen=True, kw_only=True)
class Train(TrainBase):
    """train, as a run spec holds it (iclnoise.config.grid.run_spec): the optimizer the run trains with (AdamW's
    settings, or another's with its `kind`) and `steps`, the schedule's length."""
    optimizer: Optimizer | SGDMomentum = key(doc="The run's optimizer: train.optimizer, or another with its `kind`.")
    steps: int = key(ge=1, doc="Updates of the run's schedule, resolved from train.budget.")

    @classmethod
    def from_dict(cls, d: dict | None) -> Train:
        t = super().from_dict(d)
        o = t.optimizer
        opt = (SGDMomentum.from_dict({k: v for k, v in o.items() if k != "kind"}) if o.get("kind") == "sgd_momentum"
               else Optimizer.from_dict(o))
        return dataclasses.replace(t, optimizer=opt)

    @property
    def last_step(self) -> int:
        """The step a run trains to: its schedule's steps, or `budget.stop_at` where that comes first."""
        return min(self.steps, self.budget.stop_at or self.steps)

    @property
    def checkpoints_planned(self) -> list[int]:
        """The steps a run writes analysis checkpoints at: the schedule's, up to last_step, and last_step."""
        c = self.checkpoints
        return checkpoints_until(self.steps, c.linear, c.log, self.last_step)

    @functools.cached_property
    def _lr_factor(self) -> Callable[[int], float]:
        s = self.lr_schedule
        return lr_lambda(s.kind, self.steps, s.warmup_frac, s.min_lr_frac)

    def lr(self, step: int) -> float:
        """η_t of update `step`: optimizer.lr × the lr_schedule's factor (iclnoise.core.schedules.lr_lambda); the one
        schedule the optimizer steps with, the hooks read (StepContext.lr) and metrics.parquet records."""
        return self.optimizer.lr * self._lr_factor(step)

    def lr_sum(self) -> float:
        """Σ_t η_t over the updates trained (to last_step)."""
        return self.optimizer.lr * sum(self._lr_factor(i) for i in range(self.last_step))
