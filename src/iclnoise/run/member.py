"""One run inside an ensemble (iclnoise.run.ensemble): its spec, model, data, evaluator and step hooks, the rows
it records and its resume state (save_resume: resume.pt, with the
previous commit's kept as resume.prev.pt)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..core.model import ModelConfig, build_model
from ..core.runspec import RunSpec
from ..core.sections import Optimizer, SGDMomentum
from ..noise.hooks import ExposureLogger, ExposureState, NoiseMeter, StepHook
from ..noise.injection import NoiseInjector
from .evaluate import Evaluator
from .optim import RunAdam
from .runs import checkpoint_path, sampler, save_torch

RESUME, RESUME_PREV = "resume.pt", "resume.prev.pt"


def build_hooks(spec: RunSpec, device: torch.device) -> list[StepHook]:
    """The step hooks RunSpec.hooks names, in its order: the exposure logger and the injector, sharing one noise
    meter and exposure state (injected noise is shaped from the covariance the logger measures)."""
    if not spec.hooks:
        return []
    meter, state = NoiseMeter(spec.exposure, spec.train.steps, spec.window or ()), ExposureState()
    injector = NoiseInjector(spec, meter, state, device) if "injection" in spec.hooks else None
    logger = ExposureLogger(spec, meter, state, device)   # RunSpec.hooks: a run with hooks logs exposure
    return [logger] + ([injector] if injector is not None else [])


@dataclass
class Member:
    """One run inside an ensemble: its spec, data, evaluator, hooks and everything it records."""

    spec: RunSpec
    run_dir: Path
    hash: str
    device: torch.device
    model: nn.Module = None
    hooks: list[StepHook] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    tokens: list[dict] = field(default_factory=list)
    root: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    step: int = 0
    diverged: bool = False
    resume: dict | None = None
    saved: int | None = None   # the commit step of the run's resume.pt, None before it has one
    adam: RunAdam | None = None   # its view of the ensemble's optimizer (iclnoise.run.optim)

    @property
    def run_id(self) -> str:
        return self.spec.keys.run_id

    def setup(self) -> None:
        s = self.spec
        self.model = build_model(ModelConfig(D=s.data.D, K=s.data.K, **dataclasses.asdict(s.model)), s.keys.seed,
                                 self.device)
        self.sampler = sampler(s, "train", self.device)
        self.heldout = sampler(s, "heldout", self.device)
        self.hooks = build_hooks(s, self.device)
        for h in self.hooks:
            if isinstance(h, NoiseInjector):
                h.restrict(self.model)   # noise.layers' mask, checked against the model before any step
        self.evaluator = Evaluator(s, self.device)

    def resume_from(self, state: dict, hooks: bool = True) -> int:
        """Resume from a resume state (resume_state) as training does, the hooks' states too unless `hooks` is False
        (another run's state: its hooks start afresh); the commit step it resumes at."""
        self.resume, self.step, self.diverged = state, state["step"], state["diverged"]
        if hooks:
            self.rows, self.tokens, self.root, self.manifest = state["rows"], state["tokens"], state["root"], \
                state["manifest"]
            for h, hs in zip(self.hooks, state["hooks"]):
                h.load_state_dict(hs)
        return state.get("commit", state["step"])

    def record(self, step: int, sequences: int, lr: float, train_loss: float, evaluated: tuple) -> None:
        """The run's rows at analysis checkpoint `step` from Evaluator.score's outputs (metrics, per-token losses,
        root predictions): its metrics row, its token losses, its root predictions."""
        metrics, tok, preds = evaluated
        rid = self.run_id
        self.rows.append({**self.spec.key_dict, "step": step, "sequences": sequences, "lr": lr,
                          "train_loss": train_loss, **metrics, "diverged": self.diverged})
        self.tokens.extend({"run_id": rid, "step": step, "split": split, "k": k + 1, "loss": float(v)}
                           for split, arr in tok.items() for k, v in enumerate(arr))
        self.root.append({"run_id": rid, "step": step, "preds": preds.astype(np.float32)})

    def save_checkpoint(self, step: int, params: dict, opt: dict | None, optimizer: Optimizer | SGDMomentum) -> None:
        """The run's weights-only analysis checkpoint at `step` (its resume state is save_resume's), with AdamW's
        second moments for the preconditioner the probes read (SGD keeps none); listed in its manifest."""
        adam = None if opt is None or "exp_avg_sq" not in opt else {   # SGD: no preconditioner to keep
            "exp_avg_sq": torch.cat([v.reshape(-1) for v in opt["exp_avg_sq"].values()]),
            "step": opt["step"], "beta2": optimizer.betas[1], "eps": optimizer.eps}
        self.manifest[step] = save_torch({"model": params, "model_config": self.model.cfg.to_dict(), "adam": adam,
                                          "spec_hash": self.hash}, checkpoint_path(self.run_dir, step))


def resume_state(m: Member, params: dict[str, torch.Tensor], opt_state: dict | None, commit: int, cohort: str) -> dict:
    """The run's full training state at the ensemble's commit step `commit`: what resume.pt holds (save_resume) and
    what a fork starts from (iclnoise.run.crn)."""
    return {"spec_hash": m.hash, "step": m.step, "commit": commit, "cohort": cohort, "diverged": m.diverged,
            "params": params, "opt": opt_state, "hooks": [h.state_dict() for h in m.hooks], "rows": m.rows,
            "tokens": m.tokens, "root": m.root, "manifest": m.manifest}


def save_resume(m: Member, state: dict) -> None:
    """The run's resume state (resume_state) into resume.pt; resume.pt of an earlier commit becomes resume.prev.pt
    first, so the run keeps its state at the ensemble's previous commit."""
    cur, prev = m.run_dir / RESUME, m.run_dir / RESUME_PREV
    if m.saved is not None and m.saved != state["commit"] and cur.exists():
        cur.replace(prev)
    save_torch(state, cur)
    m.saved = state["commit"]
