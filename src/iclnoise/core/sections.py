"""Typed params sections: one frozen dataclass per params.yaml section the code reads, built once where the
dict enters the package (a command's --cfg or the resolved params, `iclnoise.config.typed`; a run spec,
`RunSpec.of`) and passed down.

params.yaml, validated by params.schema.yaml, is the single source of truth. A field has a Python default only
where (a) the schema gives the key a `default:`, read from the schema here and never retyped, or (b) the schema
lets the key be absent and absence has a meaning: the default is None, and the class docstring says what None
means. `from_dict(d)` raises a ParamsError naming the section and the key for a missing or an unknown key; keys the
schema allows but the code reads elsewhere (the workflow's `enabled`, `every`, `seeds`) are accepted and ignored.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, ClassVar

import yaml

from .schedules import checkpoints_until, lr_lambda


class ParamsError(ValueError):
    """An invalid parameter; the message names the key and the allowed values."""


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    return yaml.safe_load(resources.files("iclnoise").joinpath("params.schema.yaml").read_text(encoding="utf-8"))


def schema() -> dict:
    """params.schema.yaml, parsed (a fresh copy)."""
    return copy.deepcopy(_schema())


def _node(path: str) -> dict:
    """The schema of section `path` ("llc.sampler"; "*" steps into additionalProperties)."""
    node = _schema()
    for part in path.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    return node


def schema_default(path: str, key: str) -> Any:
    """The `default:` params.schema.yaml gives `key` of section `path`; KeyError if it gives none."""
    return _node(path)["properties"][key]["default"]


@dataclass(frozen=True)
class Section:
    """Base of the typed sections: `from_dict` checks the keys against the fields and the schema."""
    SECTION: ClassVar[str] = ""   # dotted path of the section in params.yaml
    SCHEMA: ClassVar[str] = ""    # its path in the schema, when it differs (noise conditions)

    @classmethod
    def from_dict(cls, d: dict | None):
        name = cls.SECTION
        if not isinstance(d, dict):
            raise ParamsError(f"{name}: expected a mapping of keys, got {d!r}")
        node = _node(cls.SCHEMA or name)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        allowed = set(fields) | set(node.get("properties", {}))
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ParamsError(f"{name}: unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                             f"{', '.join(sorted(allowed))}")
        required = [k for k, f in fields.items()
                    if f.default is dataclasses.MISSING or (f.default is None and k in node.get("required", ()))]
        missing = [k for k in required if k not in d]
        if missing:
            raise ParamsError(f"{name}.{missing[0]} is missing; {name} needs the keys {', '.join(required)} "
                             f"(params.yaml is the single source of truth: no value is filled in)")
        return cls(**{k: v for k, v in d.items() if k in fields})


@dataclass(frozen=True)
class Exposure(Section):
    """exposure (method §6). `kappa`: a number, None (κ = 1 for AdamW, iclnoise.noise.exposure.kappa) or "calibrated".
    `curvature_tol` None: diag Ĥ is refreshed every `curvature_every` steps in an injection window (else adaptive).
    A section written `{enabled: false}` alone has no typed form: check `enabled(d)` first."""
    SECTION: ClassVar[str] = "exposure"
    enabled: bool
    every: int
    groups: int
    per_example: bool
    kappa: float | str | None
    curvature: str
    curvature_probes: int
    curvature_every: int
    heldout: int
    floor: float
    eig_rank: int
    curvature_tol: float | None = None


@dataclass(frozen=True)
class LRSchedule(Section):
    """train.lr_schedule; `warmup_frac` and `min_lr_frac` default to the schema's `default:` values."""
    SECTION: ClassVar[str] = "train.lr_schedule"
    kind: str
    warmup_frac: float = schema_default("train.lr_schedule", "warmup_frac")
    min_lr_frac: float = schema_default("train.lr_schedule", "min_lr_frac")


@dataclass(frozen=True)
class Controller(Section):
    """noise.conditions.<name>.controller: PI gains on log P-NE* (iclnoise.noise.PIController)."""
    SECTION: ClassVar[str] = "noise.conditions.<name>.controller"
    SCHEMA: ClassVar[str] = "noise.conditions.*.controller"
    kp: float
    ki: float
    initial_scale: float | None = None  # None: the open-loop estimate (iclnoise.noise.injection); not read otherwise


@dataclass(frozen=True)
class NoiseCondition(Section):
    """One noise condition (method §5; a run spec's `noise`). Every key but `source` may be absent (None):

    shape, schedule  None only for source none (the validator requires them otherwise);
    rank             None unless shape is lowrank or a NAP shape (required there);
    nap_tasks, nap_per_task, nap_memory  None unless shape is a NAP shape (iclnoise.noise.nap; required there);
    fraction         None unless schedule is early or late: the window is then the whole run;
    emulate_batch    None: no emulated batch (the level is `budget` or `target`);
    budget           None: no integrated-exposure budget;
    steps_as_batch   None: the run's steps are its own batch's on the budget; B_t: the steps batch B_t takes;
    target           None unless schedule is controlled: a P-NE* or [[fraction, P-NE*], ...];
    controller       None unless schedule is controlled (required there);
    batch_sizes      None: the condition runs at every grid batch size;
    M                None: the condition runs at every grid M."""
    SECTION: ClassVar[str] = "noise.conditions.<name>"
    SCHEMA: ClassVar[str] = "noise.conditions.*"
    source: str
    shape: str | None = None
    rank: int | None = None
    nap_tasks: int | None = None
    nap_per_task: int | None = None
    nap_memory: int | None = None
    schedule: str | None = None
    fraction: float | None = None
    emulate_batch: int | None = None
    budget: float | None = None
    steps_as_batch: int | None = None
    target: float | list | None = None
    controller: Controller | None = None
    batch_sizes: list | None = None
    M: list | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> NoiseCondition:
        c = super().from_dict(d)
        return dataclasses.replace(c, controller=Controller.from_dict(c.controller)) if c.controller is not None else c

    @classmethod
    def of_spec(cls, spec: dict) -> NoiseCondition:
        """A run spec's noise condition; a spec without `noise` (older run.json) is batch noise only."""
        return cls.from_dict(spec.get("noise") or {"source": "none"})

    @property
    def window_fraction(self) -> float:
        """The share of training the injection window spans (`window`): `fraction` for
        schedules early and late, the whole run (1) for constant and controlled."""
        return self.fraction if self.schedule in ("early", "late") else 1.0

    def window(self, total: int) -> tuple[int, int]:
        """[start, stop) of the steps of a `total`-step schedule that receive noise (method §5): the first or last
        max(1, round(fraction · total)) steps for schedules early and late, every step otherwise."""
        w = max(1, int(round(self.window_fraction * total)))
        return {"early": (0, w), "late": (total - w, total)}.get(self.schedule, (0, total))


@dataclass(frozen=True)
class TaskPrior(Section):
    """data.task_prior (method §13): the spectrum of Σβ and the seed of its basis (iclnoise.core.tasks.prior_factor).
    `exponent` is read for spectrum power_law, `eigenvalues` (a tuple, so the section hashes) for eigenvalues."""
    SECTION: ClassVar[str] = "data.task_prior"
    spectrum: str
    basis_seed: int
    exponent: float | None = None
    eigenvalues: tuple | None = None

    def __post_init__(self) -> None:
        need = {"power_law": "exponent", "eigenvalues": "eigenvalues"}
        if self.spectrum not in need:
            raise ParamsError(f"data.task_prior.spectrum = {self.spectrum!r}; allowed: {', '.join(need)}")
        if getattr(self, need[self.spectrum]) is None:
            raise ParamsError(f"data.task_prior.{need[self.spectrum]} is missing; spectrum {self.spectrum} needs it")
        if self.eigenvalues is not None:
            ev = tuple(float(v) for v in self.eigenvalues)
            if min(ev) <= 0:
                raise ParamsError(f"data.task_prior.eigenvalues must all be > 0 (Σβ positive definite), got {ev}")
            object.__setattr__(self, "eigenvalues", ev)


@dataclass(frozen=True)
class Data(Section):
    """data (method §2): task dimension D, context length K, label noise variance, task-pool seed; `task_prior` None
    (absent): t ~ N(0, I_D), else the TaskPrior (method §13)."""
    SECTION: ClassVar[str] = "data"
    D: int
    K: int
    noise_var: float
    pool_seed: int
    task_prior: TaskPrior | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> Data:
        c = super().from_dict(d)
        p = c.task_prior
        return c if p is None else dataclasses.replace(c, task_prior=TaskPrior.from_dict(p))


@dataclass(frozen=True)
class Model(Section):
    """model (method §4): the transformer's shape (iclnoise.core.model.ModelConfig adds D and K)."""
    SECTION: ClassVar[str] = "model"
    d_model: int
    n_layers: int
    n_heads: int
    d_mlp: int
    layer_norm: bool
    attn_init: str
    arch: str


OPTIMIZERS = ("adamw", "sgd_momentum")   # grid.optimizer (iclnoise.config.grid); adamw's run ids carry no label


@dataclass(frozen=True)
class Optimizer(Section):
    """train.optimizer: AdamW's learning rate, (β1, β2), weight decay and δ."""
    SECTION: ClassVar[str] = "train.optimizer"
    KIND: ClassVar[str] = "adamw"
    lr: float
    betas: tuple
    weight_decay: float
    eps: float

    @property
    def momentum(self) -> float:
        return self.betas[0]


@dataclass(frozen=True)
class SGDMomentum(Section):
    """train.sgd_momentum: SGD with undampened heavy-ball momentum (v ← β v + g + λ w, w ← w − η v), the settings
    of grid.optimizer's sgd_momentum runs (a run spec holds them as train.optimizer with `kind: sgd_momentum`)."""
    SECTION: ClassVar[str] = "train.sgd_momentum"
    KIND: ClassVar[str] = "sgd_momentum"
    lr: float
    momentum: float
    weight_decay: float


@dataclass(frozen=True)
class Budget(Section):
    """train.budget: `mode` steps or sequences and its value; `stop_at` None: train the whole schedule."""
    SECTION: ClassVar[str] = "train.budget"
    mode: str
    steps: int | None = None
    sequences: int | None = None
    stop_at: int | None = None


@dataclass(frozen=True)
class Train(Section):
    """train, as a run spec holds it: `steps`, the schedule's length, resolved by iclnoise.config.grid.run_spec."""
    SECTION: ClassVar[str] = "train"
    budget: Budget
    micro_batch: int
    optimizer: Optimizer | SGDMomentum
    lr_schedule: LRSchedule
    grad_clip: float | None
    checkpoints: dict
    diverge_loss: float
    device: str
    steps: int
    cuda_graphs: bool = False
    tf32: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> Train:
        t = super().from_dict(d)
        # a run spec's: AdamW's settings, or another optimizer's with its `kind` (iclnoise.config.grid)
        o = t.optimizer
        opt = (SGDMomentum.from_dict({k: v for k, v in o.items() if k != "kind"}) if o.get("kind") == "sgd_momentum"
               else Optimizer.from_dict(o))
        return dataclasses.replace(t, budget=Budget.from_dict(t.budget), optimizer=opt,
                                   lr_schedule=LRSchedule.from_dict(t.lr_schedule))

    @property
    def last_step(self) -> int:
        """The step a run trains to: its schedule's steps, or `budget.stop_at` where that comes first."""
        return min(self.steps, self.budget.stop_at or self.steps)

    @property
    def checkpoints_planned(self) -> list[int]:
        """The steps a run writes analysis checkpoints at: the schedule's, up to last_step, and last_step."""
        c = self.checkpoints
        return checkpoints_until(self.steps, c["linear"], c["log"], self.last_step)

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


@dataclass(frozen=True)
class Eval(Section):
    """eval (method §3): evaluation set sizes and seed, the (early, late) tokens of the ICL score."""
    SECTION: ClassVar[str] = "eval"
    n_sequences: int
    n_root: int
    eval_seed: int
    icl_tokens: tuple


def enabled(d: dict | None) -> bool:
    """A switchable section is on: `enabled: true` (absent or `{enabled: false}`: off)."""
    return bool(d) and d["enabled"] is True

