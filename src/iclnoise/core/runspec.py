"""A run's identity and spec: M's encoding (M_INF), the run keys and run ids, and RunSpec, a run.json typed once,
where a run's derived facts (hooks, injection window, outputs) are decided."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pyarrow as pa

from .sections import OPTIMIZERS, Data, Eval, Exposure, Model, NoiseCondition, ParamsError, Train

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
    """A run's place in the grid (iclnoise.config.grid.expand_grid). The optimizer (grid.optimizer) is in the run id
    only where it is not AdamW, so AdamW's run ids, specs and tables are those of grids without the axis; the run id
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


# What a run's training job writes (iclnoise.run.train): these files, then one table per step hook (RunSpec.hooks).
RUN_FILES = ("metrics.parquet", "token_losses.parquet", "root_preds.parquet", "checkpoints.json")


@dataclass(frozen=True)
class RunSpec:
    """A run spec (iclnoise.config.grid.run_spec, run.json) typed once where a run or a probe starts; `raw`: the dict it
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
                              f"(iclnoise.config.grid.run_spec writes both)")
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
        """The run's step hooks, in order (iclnoise.run.member.build_hooks): `exposure`, the exposure logger, where
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
