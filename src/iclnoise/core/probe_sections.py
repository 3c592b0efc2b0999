"""The typed params sections of the per-checkpoint probes and the statistics: geometry, mech, stats, ed and the
LLC's (sampler, stages, refined), each read from params.yaml through its schema (iclnoise.core.sections)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from .sections import ParamsError, Section, schema_default

METHODS = ("sgld", "rmsprop_sgld")  # LLC samplers (iclnoise.probes.llc)


@dataclass(frozen=True)
class Geometry(Section):
    """geometry (method §9): Hutchinson probes, Lanczos, SAM sharpness on held-out batches."""
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
    """mech (method §10): linear probes, LayerNorm collapse."""
    SECTION: ClassVar[str] = "mech"
    n_probe: int
    ln_threshold: float
    seed: int


@dataclass(frozen=True)
class Stats(Section):
    """stats: test level, H3's equivalence margin (equivalence_margin None: equivalence_fraction × the noise
    manipulation's measured effect, iclnoise.analysis.verdicts.h3_rows), transient tolerance (the gates:
    iclnoise.analysis.verdicts.GATES)."""
    SECTION: ClassVar[str] = "stats"
    alpha: float
    equivalence_fraction: float
    equivalence_margin: float | None
    transient_tol: float


@dataclass(frozen=True)
class ED(Section):
    """ed (method §8): widths in units of log(step + 1); see iclnoise.probes.ed."""
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
    """llc.sampler (method §7). `nbeta` None: n / log n (`resolved_nbeta`); the keys after it: the schema's defaults."""
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
    """llc.stages: log-time smoothing width (decades of steps) and plateau tolerance (iclnoise.probes.stages)."""
    SECTION: ClassVar[str] = "llc.stages"
    sigma: float
    plateau_tol: float


@dataclass(frozen=True)
class Refined(Section):
    """llc.refined (iclnoise.probes.refined): `chains`, `burn_in`, `draws` None: llc.sampler's; `positions` None: every
    y_k; `M` None: every probed run."""
    SECTION: ClassVar[str] = "llc.refined"
    checkpoints: int            # of the LLC's checkpoints past step 0 (iclnoise.core.schedules.refined_steps)
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
