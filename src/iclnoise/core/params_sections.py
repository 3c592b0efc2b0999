"""params.yaml as a whole: `Params` holds every section, as params.yaml holds it, and is what
iclnoise.config.schema walks to write params.schema.yaml. The sections only the workflow and the grid read (grid,
noise, llc's switches, cnr) are declared here; the others live beside the code that reads them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .keys import M_ITEM, NAME, SEED_MAX, Section, key, seeds
from .probe_sections import EDParams, GeometryParams, LLCConfig, MechParams, RefinedParams, Stages, Stats
from .sections import Data, Eval, Exposure, Model, NoiseCondition
from .train_sections import OPTIMIZERS, TrainParams


@dataclass(frozen=True, kw_only=True)
class Grid(Section):
    """grid: the axes of the runs (iclnoise.config.grid.expand_grid)."""
    SECTION: ClassVar[str] = "grid"
    M: list = key(minItems=1, uniqueItems=True, items=M_ITEM, doc=(
        'Task-pool sizes; integers 1 ≤ M ≤ 2^20 or "inf" (a fresh task per sequence).'))
    seeds: list = key(minItems=1, uniqueItems=True, items={"type": "integer", "minimum": 0, "maximum": SEED_MAX},
                      doc="Seeds: every run of the grid is trained once per seed.")
    batch_sizes: list = key(minItems=1, uniqueItems=True, items={"type": "integer", "minimum": 1}, doc=(
        "Batch sizes (sequences per update); runs of every batch size train on the same train.budget."))
    noise: list = key(minItems=1, uniqueItems=True, items={"type": "string", "pattern": NAME}, doc=(
        "Names of noise conditions defined under noise.conditions."))
    optimizer: list | None = key(optional=True, minItems=1, uniqueItems=True,
                                 items={"type": "string", "enum": OPTIMIZERS}, doc=(
        "Optimizers every run of the grid trains with (issue 45; absent: [adamw]). adamw: train.optimizer; "
        "sgd_momentum: SGD with undampened heavy-ball momentum, train.sgd_momentum (required then), κ = 1/(1 − β)² "
        "(method §6). AdamW's run ids carry no label (M16-B64-none-s0), the others' do (M16-B64-none-sgd_momentum-s0). "
        "NAP is a noise shape (noise.conditions.*.shape), not an optimizer: it shapes the injected noise and composes "
        "with either optimizer under the closed loop."))


@dataclass(frozen=True, kw_only=True)
class Noise(Section):
    """noise: the named noise conditions."""
    SECTION: ClassVar[str] = "noise"
    conditions: dict[str, NoiseCondition] = key(propertyNames={"pattern": NAME}, doc=(
        "Named noise conditions; grid.noise picks among them (method §5, iclnoise.noise)."))
    batch_exposure: dict | None = key(optional=True, propertyNames={"pattern": "^[1-9][0-9]*$"},
                                      additionalProperties={"type": "number", "exclusiveMinimum": 0}, doc=(
        "The batch noise's own integrated P-NE* per batch size, measured on runs without injection (keys are batch "
        "sizes written as strings, e.g. \"64\": 0.055): what a condition's relative_dose multiplies. Required "
        "where a condition of the grid has a relative_dose; absent otherwise."))


LLC_AT = {"oneOf": [
    {"type": "null"},
    {"type": "object", "additionalProperties": False, "required": ["linear", "log"], "properties": {
        "linear": {"type": "integer", "minimum": 0, "description": "Evenly spaced target steps."},
        "log": {"type": "integer", "minimum": 0, "description": "Log-spaced target steps."}}},
    {"type": "object", "additionalProperties": False, "required": ["steps"], "properties": {
        "steps": {"type": "array", "minItems": 1, "maxItems": 10000, "items": {"type": "integer", "minimum": 0},
                  "description": "Target steps."}}}]}


@dataclass(frozen=True, kw_only=True)
class LLC(Section):
    """llc: the LLC probe's switches and checkpoints (iclnoise.config.every_at), its sampler, stages and refined LLC."""
    SECTION: ClassVar[str] = "llc"
    enabled: bool = key(doc="Run the LLC probe and stage detection.")
    every: int = key(ge=1, doc="LLC at every k-th checkpoint plus the last.")
    at: dict | None = key(optional=True, schema=LLC_AT, doc=(
        "null, or {linear, log}: the LLC at the checkpoints nearest to `linear` evenly spaced and `log` log-spaced "
        "steps of [0, last checkpoint], or {steps}: nearest to each listed step up to the last checkpoint (a "
        "published schedule, e.g. Hoogland et al.'s released steps); overrides every."))
    seeds: list | None = seeds("Probe only the runs of these seeds (default: all).")
    sampler: LLCConfig = key(doc="Localized SGLD (method §7); calibrate it with `iclnoise llc-calibrate`.")
    stages: Stages = key(doc="Developmental stages from each probed run's LLC curve (iclnoise.probes.stages).")
    refined: RefinedParams | None = key(optional=True, doc=(
        "Refined (weight-restricted) LLC of every component (each attention head, MLP, embed, unembed, all) and its "
        "susceptibility χ to new tasks (q_M → q_∞), iclnoise.probes.refined: rllc.parquet and susceptibility.parquet "
        "per probed run (the runs of llc.seeds), in the run's probe job. The sampler is llc.sampler's, with chains, "
        "burn_in and draws overridable here. Absent: no refined estimates."))


CNR_NAME = (r"^[A-Za-z0-9_]+(\*[0-9.]+([eE][-+]?[0-9]+)?)?"   # NAME or NAME*k, then +field=value
            r"(\+[A-Za-z_]+=[A-Za-z0-9_.,-]+)*$")


@dataclass(frozen=True, kw_only=True)
class CNR(Section):
    """cnr: a run's response to counterfactual noise, by common random numbers (iclnoise.run.crn, `snakemake crn`)
    and by the first-order pathwise estimator (iclnoise.run.pathwise, `snakemake cnr`)."""
    SECTION: ClassVar[str] = "cnr"
    enabled: bool = key(doc=(
        "For every run that injects noise: CNR by common random numbers for `snakemake crn`, the pathwise estimator "
        "for `snakemake cnr` (false: the section may be written `{enabled: false}` alone)."))
    seeds: list | None = seeds("Only the runs of these seeds (default: all).")
    counterfactuals: list = key(minItems=1, items={"type": "string", "pattern": CNR_NAME}, doc=(
        "crn: NAME[*k][+field=value...]: none, self (the run's own noise), or a noise condition of noise.conditions; "
        "k multiplies the level (a budget or target), +field=value replaces a field of the section (e.g. "
        "self+shape=isotropic, self+layers=blocks.0)."))
    realisations: int = key(ge=1, doc=(
        "Noise streams (noise_seed 0..N-1): crn's per counterfactual (ΔE f's SE shrinks as 1/sqrt), the pathwise "
        "estimator's replays."))
    k: list = key(minItems=1, items={"type": "number", "exclusiveMinimum": 0}, doc=(
        "The pathwise estimator's levels: the run's own noise level × k, predicted to first order in ln k (keep "
        "|ln k| / 2 ≤ 0.5, method §13)."))
    jac_batch: int = key(ge=1, doc="The pathwise estimator: sequences of each step's batch its Jacobian is taken on.")


@dataclass(frozen=True, kw_only=True)
class Params(Section):
    """params.yaml: every section is required (a section with `enabled` may be written `{enabled: false}` alone,
    iclnoise.config.validate)."""
    grid: Grid = key(doc=(
        "The runs: every M, batch size, noise condition, optimizer and seed (a noise condition only at its own "
        "batch_sizes and M), iclnoise.config.grid.expand_grid."))
    data: Data = key(doc="Nested multi-task in-context linear regression (method §2).")
    model: Model = key(doc="The transformer (method §4).")
    train: TrainParams = key(doc=(
        "Training (method §4): budget, optimizer, schedule, checkpoints, and how runs are grouped into ensembles."))
    eval: Eval = key(doc="Evaluation sets and the ICL score (method §3).")
    noise: Noise = key(doc="Injected-noise conditions (method §5).")
    exposure: Exposure = key(doc=(
        "Noise exposure P-NE* (method §6), exposure.parquet per run; injected noise measures its covariance here."))
    llc: LLC = key(doc="Local learning coefficient per checkpoint (method §7), its stages and the refined LLC.")
    stats: Stats = key(doc="The statistics of the hypothesis tests (method §11).")
    ed: EDParams = key(doc=(
        "Essential dynamics (method §8). Curves are functions of τ = log(step + 1); bandwidth, tolerance and margin "
        "are in units of τ, so the same run sampled at 20 or 200 checkpoints has the same forms."))
    geometry: GeometryParams = key(doc=(
        "Loss-landscape geometry on held-out batches (method §9), geometry.parquet per run."))
    mech: MechParams = key(doc=(
        "Mechanistic probes (method §10), mech.parquet per run. Attention and ablation use the OOD evaluation set of "
        "metrics (eval.n_sequences sequences), so the ablation ICL score is the metrics one."))
    cnr: CNR = key(doc=(
        "Counterfactual noise response (method §13): crn.parquet by common random numbers (`snakemake crn`) and "
        "cnr_pathwise.parquet by the pathwise estimator (`snakemake cnr`) per run that injects noise; neither is part "
        "of `all`."))
