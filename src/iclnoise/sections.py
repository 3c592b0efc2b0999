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
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, ClassVar

import pyarrow as pa
import yaml

from .schedules import checkpoints_until, lr_lambda

METHODS = ("sgld", "rmsprop_sgld")  # LLC samplers (iclnoise.llc)


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
class Geometry(Section):
    """geometry (SPEC §9): Hutchinson probes, Lanczos, SAM sharpness on held-out batches."""
    SECTION: ClassVar[str] = "geometry"
    probes: int
    lanczos_iters: int
    lanczos_tol: float
    sam_rho: float
    sam_batches: int
    n_heldout: int
    seed: int


@dataclass(frozen=True)
class Mech(Section):
    """mech (SPEC §10): linear probes, LayerNorm collapse."""
    SECTION: ClassVar[str] = "mech"
    n_probe: int
    ln_threshold: float
    seed: int


@dataclass(frozen=True)
class Exposure(Section):
    """exposure (SPEC §6). `kappa`: a number, None (κ = 1 for AdamW, iclnoise.exposure.kappa) or "calibrated".
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
class Stats(Section):
    """stats: test level, H3's equivalence margin (equivalence_margin None: equivalence_fraction × the noise
    manipulation's measured effect, iclnoise.verdicts.h3_rows), transient tolerance (the gates:
    iclnoise.verdicts.GATES)."""
    SECTION: ClassVar[str] = "stats"
    alpha: float
    equivalence_fraction: float
    equivalence_margin: float | None
    transient_tol: float


@dataclass(frozen=True)
class ED(Section):
    """ed (SPEC §8): widths in units of log(step + 1); see iclnoise.ed."""
    SECTION: ClassVar[str] = "ed"
    n_pcs: int
    n_form_pcs: int
    bandwidth: float
    tolerance: float
    margin: float
    vertex_prominence: float
    cusp_speed: float
    moving: float
    n_boot: int
    z_min: float
    seed: int

    @classmethod
    def from_dict(cls, d: dict | None) -> ED:
        if isinstance(d, dict) and "sigma" in d:   # the retired key, named
            raise ParamsError("ed.sigma (checkpoint units) was replaced by ed.bandwidth (units of log(step + 1))")
        return super().from_dict(d)


@dataclass(frozen=True)
class LLCConfig(Section):
    """llc.sampler (SPEC §7). `nbeta` None: n / log n (`resolved_nbeta`); the keys after it: the schema's defaults."""
    SECTION: ClassVar[str] = "llc.sampler"
    epsilon: float              # SGLD step size ε
    gamma: float                # localization γ
    chains: int
    burn_in: int
    draws: int
    batch: int                  # SGLD mini-batch (sequences); ≥ n: full batch (the whole set every step)
    n: int                      # size of the sampling dataset
    seed: int
    nbeta: float | None = None  # n·β; None = n / log n
    method: str = schema_default("llc.sampler", "method")                 # sgld | rmsprop_sgld
    micro_batches: int = schema_default("llc.sampler", "micro_batches")   # memory only, same numbers
    trace_points: int = schema_default("llc.sampler", "trace_points")     # kept in llc_traces.parquet
    rmsprop_alpha: float = schema_default("llc.sampler", "rmsprop_alpha")  # RMSProp decay α
    rmsprop_eps: float = schema_default("llc.sampler", "rmsprop_eps")      # RMSProp δ in G = 1 / (√V + δ)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParamsError(f"llc.sampler.method = {self.method!r}; allowed: {', '.join(METHODS)}")

    def resolved_nbeta(self) -> float:
        return self.nbeta if self.nbeta is not None else self.n / math.log(self.n)


@dataclass(frozen=True)
class Stages(Section):
    """llc.stages: log-time smoothing width (decades of steps) and plateau tolerance (iclnoise.stages)."""
    SECTION: ClassVar[str] = "llc.stages"
    sigma: float
    plateau_tol: float


@dataclass(frozen=True)
class Refined(Section):
    """llc.refined (iclnoise.refined): `chains`, `burn_in`, `draws` None: llc.sampler's; `positions` None: every y_k;
    `M` None: every probed run."""
    SECTION: ClassVar[str] = "llc.refined"
    checkpoints: int            # of the LLC's checkpoints past step 0 (iclnoise.schedules.refined_steps)
    n_obs: int                  # sequences per susceptibility observable set
    chains: int | None = None
    burn_in: int | None = None
    draws: int | None = None
    positions: list | None = None
    M: list | None = None       # grid.M values whose probed runs get it; None: every probed run

    def sampler(self, base: LLCConfig) -> LLCConfig:
        """llc.sampler with this section's chains, burn_in and draws where they are set."""
        keep = {k: v for k in ("chains", "burn_in", "draws") if (v := getattr(self, k)) is not None}
        return dataclasses.replace(base, **keep)


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
    initial_scale: float | None = None  # None: the open-loop estimate (iclnoise.injection); not read otherwise


@dataclass(frozen=True)
class NoiseCondition(Section):
    """One noise condition (SPEC §5; a run spec's `noise`). Every key but `source` may be absent (None):

    shape, schedule  None only for source none (the validator requires them otherwise);
    rank             None unless shape is lowrank or a NAP shape (required there);
    nap_tasks, nap_per_task, nap_memory  None unless shape is a NAP shape (iclnoise.nap; required there);
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
        """[start, stop) of the steps of a `total`-step schedule that receive noise (SPEC §5): the first or last
        max(1, round(fraction · total)) steps for schedules early and late, every step otherwise."""
        w = max(1, int(round(self.window_fraction * total)))
        return {"early": (0, w), "late": (total - w, total)}.get(self.schedule, (0, total))


@dataclass(frozen=True)
class TaskPrior(Section):
    """data.task_prior (SPEC §13): the spectrum of Σβ and the seed of its basis (iclnoise.tasks.prior_factor).
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
    """data (SPEC §2): task dimension D, context length K, label noise variance, task-pool seed; `task_prior` None
    (absent): t ~ N(0, I_D), else the TaskPrior (SPEC §13)."""
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
    """model (SPEC §4): the transformer's shape (iclnoise.model.ModelConfig adds D and K)."""
    SECTION: ClassVar[str] = "model"
    d_model: int
    n_layers: int
    n_heads: int
    d_mlp: int
    layer_norm: bool
    attn_init: str
    arch: str


OPTIMIZERS = ("adamw", "sgd_momentum")   # grid.optimizer (iclnoise.grid); adamw's run ids carry no label


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
    """train, as a run spec holds it: `steps`, the schedule's length, resolved by iclnoise.grid.run_spec."""
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
        o = t.optimizer   # a run spec's: AdamW's settings, or another optimizer's with its `kind` (iclnoise.grid)
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
        """η_t of update `step`: optimizer.lr × the lr_schedule's factor (iclnoise.schedules.lr_lambda); the one
        schedule the optimizer steps with, the hooks read (StepContext.lr) and metrics.parquet records."""
        return self.optimizer.lr * self._lr_factor(step)

    def lr_sum(self) -> float:
        """Σ_t η_t over the updates trained (to last_step)."""
        return self.optimizer.lr * sum(self._lr_factor(i) for i in range(self.last_step))


@dataclass(frozen=True)
class Eval(Section):
    """eval (SPEC §3): evaluation set sizes and seed, the (early, late) tokens of the ICL score."""
    SECTION: ClassVar[str] = "eval"
    n_sequences: int
    n_root: int
    eval_seed: int
    icl_tokens: tuple


M_INF = -1  # the documented encoding of M = ∞ in every table


def m_label(M: int) -> str:
    """'inf' for M_INF, else the decimal number."""
    return "inf" if M == M_INF else str(M)


def parse_m(value: int | str | float) -> int:
    """Accept 'inf', '∞', float('inf') or -1 as M_INF; positive integers as themselves."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "∞", "infinity", "-1"):
        return M_INF
    if isinstance(value, float) and math.isinf(value):
        return M_INF
    m = int(value)
    if m != M_INF and m < 1:
        raise ValueError(f"M must be a positive integer or 'inf', got {value!r}")
    return m


# A run's keys as every table's leading columns (RunKeys.to_dict, a spec's `keys`), in this order.
KEY_FIELDS = [
    pa.field("run_id", pa.string()),
    pa.field("M", pa.int64()),       # M_INF = -1 encodes M = ∞
    pa.field("seed", pa.int64()),
    pa.field("batch", pa.int64()),
    pa.field("noise", pa.string()),
]


@dataclass(frozen=True, order=True)
class RunKeys:
    """A run's place in the grid (iclnoise.grid.expand_grid). The optimizer (grid.optimizer) is in the run id only
    where it is not AdamW, so AdamW's run ids, specs and tables are those of grids without the axis; the run id
    alone carries it (a spec's `keys` and the tables hold the KEY_FIELDS)."""
    M: int
    batch: int
    noise: str
    seed: int
    optimizer: str = OPTIMIZERS[0]

    @property
    def label(self) -> str:
        """`-{optimizer}` for a run that does not train with AdamW, else empty."""
        return "" if self.optimizer == OPTIMIZERS[0] else f"-{self.optimizer}"

    @property
    def run_id(self) -> str:
        return f"M{m_label(self.M)}-B{self.batch}-{self.noise}{self.label}-s{self.seed}"

    def to_dict(self) -> dict:
        """The KEY_FIELDS: a spec's `keys`, a table row's leading columns."""
        return {f.name: getattr(self, f.name) for f in KEY_FIELDS}


_RUN_RE = re.compile(r"^M(?P<M>inf|\d+)-B(?P<batch>\d+)-(?P<noise>[a-z0-9_]+)"
                     rf"(?:-(?P<opt>{'|'.join(OPTIMIZERS[1:])}))?-s(?P<seed>\d+)$")


def parse_run_id(run_id: str) -> RunKeys:
    m = _RUN_RE.match(run_id)
    if not m:
        raise ValueError(f"not a run id: {run_id!r} (expected e.g. M64-B128-none-s0 or M64-B128-none-sgd_momentum-s0)")
    return RunKeys(parse_m(m["M"]), int(m["batch"]), m["noise"], int(m["seed"]), m["opt"] or OPTIMIZERS[0])


# What a run's training job writes (iclnoise.train): these files, then one table per step hook (RunSpec.hooks).
RUN_FILES = ("metrics.parquet", "token_losses.parquet", "root_preds.parquet", "checkpoints.json")


@dataclass(frozen=True)
class RunSpec:
    """A run spec (iclnoise.grid.run_spec, run.json) typed once where a run or a probe starts; `raw`: the dict it
    came from (what run.json holds and the spec hash covers). `exposure` None: the spec has no exposure section.
    The one place a run's derived facts are decided: its step hooks, injection window, checkpoints, learning
    rate (`train.lr`) and output files; the trainer, the injector, the cost model and the workflow read them here."""

    keys: RunKeys
    data: Data
    model: Model
    train: Train
    eval: Eval
    noise: NoiseCondition
    exposure: Exposure | None
    raw: dict

    @classmethod
    def of(cls, spec: dict) -> RunSpec:
        exp, train, k = spec.get("exposure"), Train.from_dict(spec["train"]), spec["keys"]
        keys = RunKeys(k["M"], k["batch"], k["noise"], k["seed"], train.optimizer.KIND)
        if k["run_id"] != keys.run_id:
            raise ParamsError(f"a run spec's keys.run_id is {k['run_id']!r} but its keys (M {k['M']}, batch "
                              f"{k['batch']}, noise {k['noise']}, seed {k['seed']}, optimizer "
                              f"{train.optimizer.KIND}) name run {keys.run_id!r}; make them agree "
                              f"(iclnoise.grid.run_spec writes both)")
        return cls(keys, Data.from_dict(spec["data"]), Model.from_dict(spec["model"]), train,
                   Eval.from_dict(spec["eval"]), NoiseCondition.of_spec(spec),
                   Exposure.from_dict(exp) if exp and "groups" in exp else None, spec)

    @property
    def key_dict(self) -> dict:   # a table row's leading columns: run_id, M, seed, batch, noise
        return self.keys.to_dict()

    @property
    def injects(self) -> bool:
        """Noise is injected (noise.source not none)."""
        return self.noise.source != "none"

    @property
    def hooks(self) -> tuple[str, ...]:
        """The run's step hooks, in order (iclnoise.ensemble.build_hooks): `exposure`, the exposure logger, where
        the exposure section is enabled or noise is injected (the injector's Curv and covariance are the
        logger's measurements); `injection` where noise is injected. Each writes <name>.parquet."""
        logs = self.injects or (self.exposure is not None and self.exposure.enabled)
        return ("exposure",) * logs + ("injection",) * self.injects

    @property
    def window(self) -> tuple[int, int] | None:
        """[start, stop) of the updates that inject noise (NoiseCondition.window over train.steps); None: none do."""
        return self.noise.window(self.train.steps) if self.injects else None

    @property
    def outputs(self) -> list[str]:
        """The files a finished training job leaves in the run directory (the workflow's train outputs)."""
        return [*RUN_FILES, *(f"{h}.parquet" for h in self.hooks)]


def enabled(d: dict | None) -> bool:
    """A switchable section is on: `enabled: true` (absent or `{enabled: false}`: off)."""
    return bool(d) and d["enabled"] is True

