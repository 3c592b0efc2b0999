"""The typed params sections of the per-checkpoint probes and the statistics: geometry, mech, stats, ed and the
LLC's (sampler, stages, refined), each key declared once (iclnoise.core.keys). A probe's section as params.yaml holds
it adds the workflow's keys (which runs, which checkpoints): GeometryParams, MechParams, EDParams, RefinedParams."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from .keys import SEED_MAX, ParamsError, Section, key, seeds

METHODS = ("sgld", "rmsprop_sgld")  # LLC samplers (iclnoise.probes.llc)


@dataclass(frozen=True, kw_only=True)
class Probed(Section):
    """The workflow's keys of a per-checkpoint probe's section: whether it runs, on which runs and checkpoints."""
    enabled: bool = key(doc=(
        "Run the probe on the probed runs (false: the section may be written `{enabled: false}` alone)."))
    every: int = key(ge=1, doc="Probe every k-th analysis checkpoint (and always the last).")
    seeds: list | None = seeds("Probe only the runs of these seeds (default: all).")


@dataclass(frozen=True, kw_only=True)
class Geometry(Section):
    """geometry (method §9): Hutchinson probes, Lanczos, SAM sharpness on held-out batches."""
    SECTION: ClassVar[str] = "geometry"
    probes: int = key(ge=2, doc=(
        "Hutchinson Rademacher probes for Tr(H) and Tr(A·H·A); se and t-based 95 % half-width reported."))
    lanczos_iters: int = key(ge=2, doc=(
        "Maximum Lanczos iterations for the largest and smallest Hessian eigenvalue."))
    lanczos_tol: float = key(gt=0, doc="Lanczos stops when both Ritz residuals are below tol × |eigenvalue|.")
    sam_rho: float = key(gt=0, doc="SAM radius ρ in L(w + ρ g/‖g‖) − L(w).")
    sam_batches: int = key(ge=2, doc="Held-out batches for SAM sharpness (mean and standard error).")
    n_heldout: int = key(ge=2, doc="Sequences per held-out batch.")
    seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the probes (plus the checkpoint step).")


@dataclass(frozen=True, kw_only=True)
class GeometryParams(Geometry, Probed):
    """geometry as params.yaml holds it."""


@dataclass(frozen=True, kw_only=True)
class Mech(Section):
    """mech (method §10): linear probes, LayerNorm collapse."""
    SECTION: ClassVar[str] = "mech"
    n_probe: int = key(ge=10, doc=(
        "q_M sequences (named stream mech) for the cross-fitted ridge probes; a planted R² 0.5 at d_model 256 reads "
        "0.39 at 1024, 0.46 at 4096."))
    ln_threshold: float = key(gt=0, doc="A LayerNorm weight with |w| below this counts as collapsed.")
    seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the probes' fold assignment.")


@dataclass(frozen=True, kw_only=True)
class MechParams(Mech, Probed):
    """mech as params.yaml holds it."""


@dataclass(frozen=True, kw_only=True)
class Stats(Section):
    """stats: test level, H3's equivalence margin (equivalence_margin None: equivalence_fraction × the noise
    manipulation's measured effect, iclnoise.analysis.verdicts.h3_rows), transient tolerance (the gates:
    iclnoise.analysis.verdicts.GATES)."""
    SECTION: ClassVar[str] = "stats"
    alpha: float = key(gt=0, lt=1, doc=(
        "Level α of every hypothesis test (iclnoise.analysis.verdicts); H3's TOST reads the (1 − 2α) interval."))
    equivalence_fraction: float = key(gt=0, lt=1, doc=(
        "H3's TOST margin as a fraction of the noise manipulation's measured effect on r (plain batch b − plain "
        "batch B, the arms the injection emulates and runs at); used when equivalence_margin is null."))
    equivalence_margin: float | None = key(schema={"anyOf": [{"type": "number", "exclusiveMinimum": 0},
                                                             {"type": "null"}]}, doc=(
        "A stated H3 TOST margin (units of r: a smallest effect of interest), used instead of the derived one; "
        "null: equivalence_fraction × the manipulation's effect."))
    transient_tol: float = key(gt=0, doc=(
        "The OOD loss's dip ends at the first later checkpoint whose loss exceeds the minimum by more than this "
        "fraction of the dip's depth (initial − minimal OOD loss; iclnoise.analysis.thresholds)."))


@dataclass(frozen=True, kw_only=True)
class ED(Section):
    """ed (method §8): widths in units of log(step + 1); see iclnoise.probes.ed."""
    SECTION: ClassVar[str] = "ed"
    n_pcs: int = key(ge=2, doc="Principal components of the joint PCA kept.")
    n_form_pcs: int = key(ge=2, doc="A form needs an event in every pair of this many leading PCs.")
    bandwidth: float = key(gt=0, doc=(
        "Gaussian kernel width of the local-quadratic smoother, in log-step; events closer than 2 bandwidths in one "
        "PC pair are one."))
    tolerance: float = key(gt=0, doc="Events of all pairs within ± tolerance (log-step) of a time make a form.")
    margin: float = key(ge=0, doc=(
        "No events within this many log-step of either end of the curve (one-sided derivatives)."))
    vertex_prominence: float = key(gt=0, doc=(
        "Minimum prominence of a curvature extremum in arcsinh(κ / median|κ|) units (0.5 ≈ κ changes by a factor "
        "1.6)."))
    cusp_speed: float = key(gt=0, le=1, doc=(
        "A cusp is a speed minimum below this fraction of the median speed where the tangent turns back."))
    moving: float = key(ge=0, le=1, doc=(
        "No vertices where the speed is below this fraction of its maximum and no speed minimum is within a "
        "bandwidth (a stalled curve)."))
    n_boot: int = key(ge=0, doc="Resamples of the root sequences for event significance (0: every event is kept).")
    z_min: float = key(ge=0, doc=(
        "Keep an event whose statistic is at least this many resampling standard deviations beyond where it would "
        "vanish."))
    seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the resampling.")

    @classmethod
    def from_dict(cls, d: dict | None) -> ED:
        if isinstance(d, dict) and "sigma" in d:   # the retired key, named
            raise ParamsError("ed.sigma (checkpoint units) was replaced by ed.bandwidth (units of log(step + 1))")
        return super().from_dict(d)


@dataclass(frozen=True, kw_only=True)
class EDParams(ED):
    """ed as params.yaml holds it: which families of runs (iclnoise.config.grid.ed_families)."""
    enabled: bool = key(doc=(
        "Essential dynamics of the families below (false: the section may be written `{enabled: false}` alone)."))
    families: list = key(minItems=1, uniqueItems=True, items={"type": "string", "enum": ["by_m", "by_noise"]}, doc=(
        "by_m: the runs of every M at one (noise condition, batch, seed); by_noise: the runs of every noise "
        "condition at one (M, batch, seed), where grid.noise has two or more. A family needs two runs."))
    seeds: list = seeds("Families are built for these seeds.", optional=False)


@dataclass(frozen=True, kw_only=True)
class LLCConfig(Section):
    """llc.sampler (method §7). `nbeta` None: n / log n (`resolved_nbeta`)."""
    SECTION: ClassVar[str] = "llc.sampler"
    method: str = key(default="sgld", enum=METHODS, doc=(
        "sgld (plain localized SGLD) or rmsprop_sgld (step and noise preconditioned by G = 1/(sqrt(V) + "
        "rmsprop_eps), V the running mean of squared loss gradients, as devinterp 2.0.1)."))
    epsilon: float = key(gt=0, doc="SGLD step size ε (noise variance per step).")
    gamma: float = key(ge=0, doc="Localization strength γ (pull towards the checkpoint).")
    nbeta: float | None = key(null=True, gt=0, doc="n·β, inverse temperature times n; null = n / log n.")
    chains: int = key(ge=2, doc="Independent chains (vmapped together).")
    burn_in: int = key(ge=0, doc="SGLD steps discarded before the draws.")
    draws: int = key(ge=8, doc="SGLD steps averaged into E_w[L].")
    batch: int = key(ge=1, doc="SGLD mini-batch (sequences, drawn with replacement); ≥ n: full batch.")
    n: int = key(ge=2, doc="Size of the sampling dataset drawn from q_M (the llc stream).")
    seed: int = key(ge=0, le=SEED_MAX, doc="Seed of the chains' noise and batch draws.")
    micro_batches: int = key(default=1, ge=1, doc="Split each mini-batch for the gradient (memory only; same numbers).")
    trace_points: int = key(default=50, ge=2, doc="Loss-trace points per chain kept in llc_traces.parquet.")
    rmsprop_alpha: float = key(default=0.99, gt=0, lt=1, doc="RMSProp decay α of V (rmsprop_sgld).")
    rmsprop_eps: float = key(default=0.1, gt=0, doc="RMSProp δ in G = 1/(sqrt(V) + δ) (rmsprop_sgld).")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParamsError(f"llc.sampler.method = {self.method!r}; allowed: {', '.join(METHODS)}")

    def resolved_nbeta(self) -> float:
        return self.nbeta if self.nbeta is not None else self.n / math.log(self.n)


@dataclass(frozen=True, kw_only=True)
class Stages(Section):
    """llc.stages: log-time smoothing width (decades of steps) and plateau tolerance (iclnoise.probes.stages)."""
    SECTION: ClassVar[str] = "llc.stages"
    sigma: float = key(ge=0, doc=(
        "Width of the Gaussian local-linear smoothing of the LLC curve, in decades of training steps "
        "(log10(step + 1))."))
    plateau_tol: float = key(gt=0, le=1, doc="A checkpoint is flat where |slope| < plateau_tol × max |slope|.")


@dataclass(frozen=True, kw_only=True)
class Refined(Section):
    """llc.refined (iclnoise.probes.refined): `chains`, `burn_in`, `draws` None: llc.sampler's; `positions` None: every
    y_k; `M` None: every probed run."""
    SECTION: ClassVar[str] = "llc.refined"
    M: list | None = key(optional=True, schema={"oneOf": [{"type": "null"}, {
        "type": "array", "minItems": 1, "uniqueItems": True,
        "items": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "enum": ["inf"]}]}}]}, doc=(
        "null (every probed run), or the task-pool sizes whose probed runs get it (a value grid.M lacks covers "
        "nothing: a warning)."))
    checkpoints: int = key(ge=1, doc=(
        "How many of the LLC's checkpoints (llc.every or llc.at) past step 0: the first, the last and evenly spaced "
        "ones between (by index)."))
    chains: int | None = key(null=True, ge=2, doc="SGLD chains per component; null = llc.sampler.chains.")
    burn_in: int | None = key(null=True, ge=0, doc="SGLD steps discarded before the draws; null = llc.sampler.burn_in.")
    draws: int | None = key(null=True, ge=8, doc=(
        "Post-burn-in SGLD steps (λ̂ and χ read at each); null = llc.sampler.draws."))
    n_obs: int = key(ge=2, doc=(
        "Sequences in each of the susceptibility observable's two sets (q_M and q_∞, the llc stream's next batch), "
        "read at every draw of every chain."))
    positions: list | None = key(schema={"oneOf": [{"type": "null"}, {
        "type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": "integer", "minimum": 0}}]}, doc=(
        "null (the loss over every y_k), or the 0-based token positions k whose predictions the loss (λ̂ and χ) "
        "keeps."))

    def sampler(self, base: LLCConfig) -> LLCConfig:
        """llc.sampler with this section's chains, burn_in and draws where they are set."""
        keep = {k: v for k in ("chains", "burn_in", "draws") if (v := getattr(self, k)) is not None}
        return dataclasses.replace(base, **keep)


@dataclass(frozen=True, kw_only=True)
class RefinedParams(Refined):
    """llc.refined as params.yaml holds it."""
    enabled: bool = key(doc="Estimate the refined LLC and susceptibilities (only where llc.enabled).")
