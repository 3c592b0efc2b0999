"""Typed params sections: one frozen dataclass per params.yaml section the code reads, built once where the
dict enters the package (a command's --cfg or the resolved params, `iclnoise.config.typed`; a run spec,
`RunSpec.of`) and passed down.

params.yaml is the single source of truth, and each of its keys is declared once, here and in the sibling modules
(train_sections, probe_sections, params_sections), with `key(...)` (iclnoise.core.keys): its type, allowed values,
default and description. params.schema.yaml is generated from these declarations (`iclnoise schema`). A field has a
Python default only where (a) its key declares a `default=`, or (b) the key may be absent or null and that has a
meaning: the default is None, and the key's description (or the class docstring) says what None means.
`from_dict(d)` raises a ParamsError naming the section and the key for a missing or an unknown key; keys the
params section holds but the code reads elsewhere (the workflow's `enabled`, `every`, `seeds`) are accepted and
ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .keys import M_ITEM, SEED_MAX, ParamsError, Section, key, schema_default
from .train_sections import (
    OPTIMIZERS,
    RNGS,
    Budget,
    Checkpoints,
    LRSchedule,
    Optimizer,
    SGDMomentum,
    Train,
    TrainParams,
)

__all__ = ["NOISE_SHAPES", "OPTIMIZERS", "RNGS", "Budget", "Checkpoints", "Controller", "Data", "Eval", "Exposure",
           "LRSchedule", "Model", "NoiseCondition", "Optimizer", "ParamsError", "SGDMomentum", "Section", "TaskPrior",
           "Train", "TrainParams", "enabled", "key", "schema_default"]


@dataclass(frozen=True, kw_only=True)
class Exposure(Section):
    """exposure (method §6). `kappa`: a number, None (κ = 1 for AdamW, iclnoise.noise.exposure.kappa) or "calibrated".
    `curvature_tol` None: diag Ĥ is refreshed every `curvature_every` steps in an injection window (else adaptive).
    A section written `{enabled: false}` alone has no typed form: check `enabled(d)` first."""
    SECTION: ClassVar[str] = "exposure"
    enabled: bool = key(doc="Log P-NE exposure (exposure.parquet) in every run.")
    every: int = key(ge=1, doc="Log (and refresh the injected covariance) every N steps.")
    groups: int = key(ge=2, doc="K micro-batch gradients for diag(C) = m·Var_k; must divide every batch size.")
    per_example: bool = key(doc="Per-example gradients (torch.func) instead of K groups.")
    kappa: float | str | None = key(schema={"anyOf": [
        {"type": "number", "exclusiveMinimum": 0}, {"type": "null"}, {"type": "string", "enum": ["calibrated"]}]},
        doc="Momentum factor κ: a number, null = the optimizer's (1 for AdamW), or calibrated (measured online from "
            "the update variance).")
    curvature: str = key(enum=("ggn", "ggn_exact", "hessian"), doc=(
        "Ĥ in Curv = Tr(A Ĥ A): Gauss–Newton from Hutchinson probes (PSD, low variance), the Gauss–Newton diagonal "
        "exactly (ggn_exact: per-sequence Jacobians, about the cost of as many probes as the model has outputs per "
        "sequence; no probe error, its standard error the held-out batch's spread over sequences), or Hessian "
        "probes."))
    curvature_probes: int = key(ge=2, doc="Hutchinson probes of diag Ĥ (Curv = Σ a² diag Ĥ).")
    curvature_every: int = key(ge=1, doc=(
        "Inside an injection window, diag Ĥ is measured again every N steps (as well as on logged steps): the "
        "closed loop divides each step's injected NE by Σ a_t² diag Ĥ, with this step's A and the latest Ĥ."))
    curvature_tol: float | None = key(optional=True, schema={"anyOf": [
        {"type": "number", "exclusiveMinimum": 0}, {"type": "null"}]}, doc=(
        "Adaptive refresh of diag Ĥ inside an injection window (null: every curvature_every steps). The refresh "
        "interval starts at 1 step when the window opens; at each refresh the change of Curv = Σ a² diag Ĥ at this "
        "step's A between the previous and the new Ĥ, beyond twice its Hutchinson standard error, is the drift: the "
        "interval halves when the drift exceeds this relative tolerance and doubles when it is below half of it, "
        "between 1 and curvature_every (issue 43: a diag Ĥ held for 25 steps while the curvature grows "
        "under-realises an early window's dose)."))
    heldout: int = key(ge=1, doc="Held-out sequences for the curvature (never trained on).")
    floor: float = key(gt=0, doc="ε in P-NE* = NE / max(ε, Curv).")
    eig_rank: int = key(ge=1, doc="Leading eigenvalues of A·C·A logged.")


@dataclass(frozen=True, kw_only=True)
class Controller(Section):
    """noise.conditions.<name>.controller: PI gains on log P-NE* (iclnoise.noise.PIController)."""
    SECTION: ClassVar[str] = "noise.conditions.<name>.controller"
    SCHEMA: ClassVar[str] = "noise.conditions.*.controller"
    kp: float = key(ge=0, doc="Proportional gain: log s = u + kp·e, e = log(target) − log(measured P-NE*).")
    ki: float = key(ge=0, doc="Integral gain: u ← u + ki·e at each measurement (bounded: no wind-up).")
    initial_scale: float | None = key(optional=True, gt=0, doc=(
        "Not read: the controller starts at the open-loop scale that meets the target by itself "
        "(iclnoise.noise.injection)."))


LAYER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$"   # a dotted parameter-name prefix (noise.layers)
# noise.conditions.*.shape: iclnoise.noise.covariance.SHAPES and iclnoise.noise.nap.NAP_SHAPES (tests/test_schema.py)
NOISE_SHAPES = ("isotropic", "diagonal", "lowrank", "nap", "nap_misaligned", "nap_within_task", "nap_isotropic")
TARGET = {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "array", "minItems": 1, "items": {
    "type": "array", "minItems": 2, "maxItems": 2,
    "prefixItems": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "number", "exclusiveMinimum": 0}]}}]}


@dataclass(frozen=True, kw_only=True)
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
    layers           None: the noise is on every parameter;
    noise_seed       None: the injected noise's stream is keyed by the run's seed alone (every run before the key);
    batch_sizes      None: the condition runs at every grid batch size;
    M                None: the condition runs at every grid M."""
    SECTION: ClassVar[str] = "noise.conditions.<name>"
    SCHEMA: ClassVar[str] = "noise.conditions.*"
    source: str = key(enum=("none", "grad", "param"), doc=(
        "none: batch noise only; grad: injected before the preconditioner; param: after it."))
    batch_sizes: list | None = key(optional=True, minItems=1, items={"type": "integer", "minimum": 1}, doc=(
        "Run this condition only at these grid batch sizes (default: all)."))
    M: list | None = key(optional=True, minItems=1, items=M_ITEM, doc=(
        "Run this condition only at these grid M values (default: all)."))
    shape: str | None = key(optional=True, enum=NOISE_SHAPES, doc=(
        "Shape of the injected covariance (iclnoise.noise). nap (issue 45, iclnoise.noise.nap): R' = U Σ_r Uᵀ + λ I, "
        "the rank-r sketch of the between-task gradient covariance Cov_τ(E[∇ℓ | τ]) plus the trace it misses spread "
        "isotropically (through AdamW's A the weights get P R' P); its controls, with the same spectrum: "
        "nap_misaligned (a random orthonormal basis seeded by the run's seed), nap_within_task (the within-task "
        "covariance's top directions), nap_isotropic (the same trace). Levels budget or target only."))
    rank: int | None = key(optional=True, ge=1, doc=(
        "Low-rank part of shape lowrank (required there; < exposure.groups) or of a nap shape (required there; "
        "< nap_tasks)."))
    nap_tasks: int | None = key(optional=True, ge=2, doc=(
        "nap shapes (required there): J, the distinct tasks of the step's batch whose per-task gradients are "
        "measured at each refresh (exposure.every)."))
    nap_per_task: int | None = key(optional=True, ge=2, doc=(
        "nap shapes (required there): m, fresh sequences per task (never trained on); J·m per-sequence gradients "
        "per refresh."))
    nap_memory: int | None = key(optional=True, ge=1, doc=(
        "nap shapes (required there): refreshes the sketch averages over (running mean over the last n; 1: the "
        "latest only)."))
    schedule: str | None = key(optional=True, enum=("constant", "early", "late", "controlled"), doc=(
        "When noise is injected: constant, every step (emulate_batch or budget); early or late, the first or last "
        "`fraction` of training (budget); controlled, every step, P-NE* held at `target` by the controller."))
    fraction: float | None = key(optional=True, gt=0, le=1, doc=(
        "Window of early / late: the first / last fraction of training."))
    emulate_batch: int | None = key(optional=True, ge=1, doc=(
        "Emulate this batch size: R = C/B_target − C/B (schedule constant)."))
    budget: float | None = key(optional=True, gt=0, doc=(
        "Integrated injected exposure Σ NE_t over the window (constant, early, late)."))
    relative_dose: float | None = key(optional=True, gt=0, doc=(
        "The budget as a multiple of the batch noise's own integrated P-NE* at the run's batch size "
        "(noise.batch_exposure), instead of `budget` (constant, early, late): the run spec holds the budget it "
        "resolves to, relative_dose × batch_exposure[B] to 12 significant digits (iclnoise.config.grid.run_spec)."))
    steps_as_batch: int | None = key(optional=True, ge=1, doc=(
        "Train the steps batch B_t takes on the sequence budget (budget mode sequences): with emulate_batch B_t the "
        "injected arm matches B_t's steps and exposure, seeing B/B_t times the sequences (H3 at equal steps); with "
        "source none, batch noise alone at B_t's steps (the batch axis at equal steps)."))
    target: float | list | None = key(optional=True, schema=TARGET, doc=(
        "P-NE* the controller tracks (schedule controlled): a number, or [[fraction of training, P-NE*], ...]."))
    controller: Controller | None = key(optional=True, doc="PI controller of schedule controlled (required there).")
    layers: list | None = key(optional=True, minItems=1, items={"type": "string", "pattern": LAYER_PATTERN}, doc=(
        "Inject into these parameters only: dotted prefixes of the model's parameter names (blocks.0, blocks.1.attn, "
        "embed, pos_embed, unembed, ...). R' becomes M R' M with M the 0/1 mask of the named parameters, so the "
        "noise, its exposure and a budget's closed loop all count those coordinates alone (method §5, 'Noise on "
        "some layers'). Absent: every parameter."))
    noise_seed: int | None = key(optional=True, ge=0, le=SEED_MAX, doc=(
        "Key the injected noise's stream by (seed, noise_seed), not by the run's seed alone: runs of one seed and "
        "different noise_seed share data and initialisation and draw independent noise (common random numbers for "
        "counterfactual noise, method §13). Absent: the stream of every run before the key."))

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


@dataclass(frozen=True, kw_only=True)
class TaskPrior(Section):
    """data.task_prior (method §13): the spectrum of Σβ and the seed of its basis (iclnoise.core.tasks.prior_factor).
    `exponent` is read for spectrum power_law, `eigenvalues` (a tuple, so the section hashes) for eigenvalues."""
    SECTION: ClassVar[str] = "data.task_prior"
    spectrum: str = key(enum=("power_law", "eigenvalues"), doc=(
        "power_law: λ_i ∝ i^(−exponent); eigenvalues: λ = `eigenvalues`."))
    exponent: float | None = key(optional=True, ge=0, doc="Power-law exponent (spectrum power_law).")
    eigenvalues: tuple | None = key(optional=True, minItems=1, items={"type": "number", "exclusiveMinimum": 0},
                                    doc="The D eigenvalues of Σβ (spectrum eigenvalues).")
    basis_seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the orthonormal basis U.")

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


@dataclass(frozen=True, kw_only=True)
class Data(Section):
    """data (method §2): task dimension D, context length K, label noise variance, task-pool seed; `task_prior` None
    (absent or null): t ~ N(0, I_D), else the TaskPrior (method §13)."""
    SECTION: ClassVar[str] = "data"
    D: int = key(ge=1, doc="Task dimension.")
    K: int = key(ge=2, doc="Context length (x, y pairs per sequence).")
    noise_var: float = key(gt=0, doc="σ², label noise variance.")
    pool_seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the nested task stream.")
    task_prior: TaskPrior | None = key(optional=True, null=True, doc=(
        "method §13: tasks t ~ N(0, Σβ), Σβ = U diag(λ) Uᵀ with U a random orthonormal basis drawn from `basis_seed` "
        "(iclnoise.core.tasks.prior_factor). spectrum power_law: λ_i ∝ i^(−exponent), i = 1..D, scaled to trace D; "
        "spectrum eigenvalues: λ = `eigenvalues` as given (D positive numbers). Absent or null: t ~ N(0, I_D), the "
        "isotropic prior of method §2."))


@dataclass(frozen=True, kw_only=True)
class Model(Section):
    """model (method §4): the transformer's shape (iclnoise.core.model.ModelConfig adds D and K)."""
    SECTION: ClassVar[str] = "model"
    d_model: int = key(ge=1, doc="Width of the residual stream (a multiple of n_heads).")
    n_layers: int = key(ge=1, doc="Transformer blocks (attention, then the MLP).")
    n_heads: int = key(ge=1, doc="Attention heads per block, each of d_model / n_heads dimensions.")
    d_mlp: int = key(ge=1, doc="Hidden width of each block's MLP.")
    layer_norm: bool = key(doc="LayerNorm before attention, before the MLP and before the readout (false: none).")
    attn_init: str = key(enum=("fan_in", "gpt2"), doc=(
        "Initial attention weights W_Q, W_K, W_V, W_O ~ N(0, s²): fan_in s = 1/√d_model (the scale of the linear "
        "layers; the small default model leaves the initial loss plateau 2-4× sooner, experiments/tuning/tuning.md), "
        "gpt2 s = 0.02 (GPT-2 and the Raventós release)."))
    arch: str = key(enum=("default", "dtransformer"), doc=(
        "default: this project's network (iclnoise.core.model). dtransformer: the network of Raventós et al. and "
        "Hoogland et al. (their DTransformer: tokens (0, x) and (y, 0), no biases in the embedding and Q, K, V, O, "
        "ReLU MLP, a stream that adds each block's output to its input, readout Linear(d → D+1) read at component 0; "
        "their PyTorch-default initialisation, so attn_init does not apply)."))


@dataclass(frozen=True, kw_only=True)
class Eval(Section):
    """eval (method §3): evaluation set sizes and seed, the (early, late) tokens of the ICL score."""
    SECTION: ClassVar[str] = "eval"
    n_sequences: int = key(ge=1, doc="Size of the in-distribution and OOD evaluation sets.")
    n_root: int = key(ge=1, doc="Root-task sequences (essential dynamics).")
    eval_seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the evaluation sets.")
    icl_tokens: tuple = key(minItems=2, maxItems=2, items={"type": "integer", "minimum": 1}, doc=(
        "ICL score = loss at token k_early minus loss at token k_late (1-based)."))


def enabled(d: dict | None) -> bool:
    """A switchable section is on: `enabled: true` (absent or `{enabled: false}`: off)."""
    return bool(d) and d["enabled"] is True
