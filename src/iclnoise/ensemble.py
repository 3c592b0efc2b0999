"""One ensemble's stacked training step (SPEC §4; iclnoise.train starts, resumes and finishes the runs).

The runs' parameters are stacked along a leading run axis and one step is one call of the hooked
`ICLTransformer` on the stacked parameters (`functional_call`: its layers run the R runs as batched matmuls).
AdamW is elementwise, so one AdamW over the stacked tensors is R AdamWs; each run's hooked model aliases its
slice of the stack, and its hooks read its slice of the optimizer state through `RunAdam`. A step
(`Ensemble.run`): sample every run's batch, backward, freeze runs that diverged, the hooks' `on_grads`, clip
per run, the optimizer step (frozen runs restored), the hooks' `on_update` and the due checkpoints.

Resume states are written per commit, not per run: at each checkpoint step the ensemble first writes every live
run's analysis checkpoint, then every member's resume state (frozen runs too), each tagged with the commit step and
the ensemble's cohort. A member keeps the state of the previous commit beside it (resume.prev.pt), so a kill while
the members' states are being written leaves every member a state at the earlier commit, and the ensemble resumes
from there as one (iclnoise.train).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

from .evaluate import Evaluator
from .exposure import AdamState
from .hooks import ExposureLogger, ExposureState, NoiseMeter, StepContext, StepHook
from .injection import NoiseInjector
from .model import ModelConfig, build_model, mse_loss
from .noise import window
from .runs import checkpoint_path, sampler, save_torch
from .schedules import checkpoints_until, lr_lambda
from .sections import RunSpec
from .tasks import Batch

log = logging.getLogger(__name__)
RESUME, RESUME_PREV = "resume.pt", "resume.prev.pt"


def build_hooks(spec: RunSpec, device: torch.device) -> list[StepHook]:
    """The step hooks of one run, [exposure logger, injector] (either may be absent); injected noise
    needs the exposure section, which measures the covariance it is shaped from (validated)."""
    noise = spec.noise
    log_exposure = spec.exposure is not None and spec.exposure.enabled
    if noise.source == "none" and not log_exposure:
        return []
    total = spec.train.steps
    bounds = window(noise.schedule, total, noise.window_fraction) if noise.source != "none" else ()
    meter, state = NoiseMeter(spec.exposure, total, tuple(bounds)), ExposureState()
    injector = NoiseInjector(spec, meter, state, device) if noise.source != "none" else None
    hooks: list[StepHook] = []
    if log_exposure or injector is not None:  # injection needs Curv and the covariance: the logger measures
        hooks.append(ExposureLogger(spec, meter, state, tuple(bounds) or None, device))
    if injector is not None:
        hooks.append(injector)
    return hooks


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
    loss_sum: float = 0.0
    loss_n: int = 0
    resume: dict | None = None
    saved: int | None = None   # the commit step of the run's resume.pt, None before it has one
    adam: RunAdam | None = None

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
        self.evaluator = Evaluator(s, self.device)


def save_resume(m: Member, params: dict[str, torch.Tensor], opt_state: dict | None, commit: int, cohort: str) -> None:
    """The run's full training state at the ensemble's commit step `commit` (resume.pt); resume.pt of an earlier
    commit becomes resume.prev.pt first, so the run keeps its state at the ensemble's previous commit."""
    cur, prev = m.run_dir / RESUME, m.run_dir / RESUME_PREV
    state = {"spec_hash": m.hash, "step": m.step, "commit": commit, "cohort": cohort, "diverged": m.diverged,
             "params": params, "opt": opt_state, "hooks": [h.state_dict() for h in m.hooks], "rows": m.rows,
             "tokens": m.tokens, "root": m.root, "manifest": m.manifest}
    if m.saved is not None and m.saved != commit and cur.exists():
        cur.replace(prev)
    save_torch(state, cur)
    m.saved = commit


class RunAdam:
    """Run r's view of the ensemble's AdamW as an AdamState (iclnoise.exposure): views of its slices, rebuilt only
    when the optimizer's per-tensor state objects change (its first step, a resume); AdamW updates them in
    place, so the views stay current between steps."""

    def __init__(self, opt: torch.optim.AdamW, stacked: list[torch.Tensor], r: int):
        self.opt, self.stacked, self.r = opt, stacked, r
        self.grads = [P.grad[r] for P in stacked]
        self._key: tuple = ()
        self._slices: tuple = (None, None, None)

    def state(self) -> AdamState:
        g = self.opt.param_groups[0]
        if "momentum" in g:   # SGD with momentum: no preconditioner (A = I), β its momentum
            return AdamState(g["lr"], g["momentum"], 0.0, 0.0, self.grads, identity=True)
        sts = [self.opt.state.get(P) for P in self.stacked]
        key = tuple(id(st) if st else 0 for st in sts)  # an empty state (not yet filled) is 0
        if key != self._key:
            self._key = key
            full = all(sts)
            self._slices = ((sts[0]["step"], [st["exp_avg"][self.r] for st in sts],
                             [st["exp_avg_sq"][self.r] for st in sts]) if full else (None, None, None))
        step, m, v = self._slices
        return AdamState(g["lr"], g["betas"][0], g["betas"][1], g["eps"], self.grads,
                         None if step is None else int(step), m, v)


class Ensemble:
    """The stacked parameters and AdamW of runs that all start at the same step (frozen runs included: they stay in
    the stack, as in the ensemble that froze them). `cohort` names the ensemble in its resume states."""

    def __init__(self, members: list[Member], start: int, cohort: str):
        self.members, self.start, self.cohort = members, start, cohort
        spec = members[0].spec
        self.t = t = spec.train
        self.total, self.B, self.mb = t.steps, spec.keys.batch, t.micro_batch
        self.stop = t.last_step  # the schedule runs over `total`; training may stop before (budget.stop_at)
        self.n_micro = self.B // self.mb
        self.device = members[0].device
        base = members[0].model
        self.names = [n for n, _ in base.named_parameters()]
        self.buffers = {k: v for k, v in base.named_buffers()}
        for m in members:
            if m.resume is not None:
                m.model.load_state_dict({**m.model.state_dict(), **m.resume["params"]})
        self.P = [torch.stack([dict(m.model.named_parameters())[n].detach() for m in members]).requires_grad_()
                  for n in self.names]
        o = t.optimizer
        fused = self.device.type in ("cpu", "cuda")
        if o.KIND == "sgd_momentum":   # undampened heavy ball: v ← β v + g + λ w, w ← w − η v (κ = 1/(1 − β)²)
            self.opt = torch.optim.SGD(self.P, lr=o.lr, momentum=o.momentum, dampening=0.0,
                                       weight_decay=o.weight_decay, nesterov=False)
        else:
            self.opt = torch.optim.AdamW(self.P, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                         eps=o.eps, fused=fused)
        if start > 0 and members[0].resume["opt"] is not None:
            saved = members[0].resume["opt"]
            for i, P in enumerate(self.P):
                n = self.names[i]
                self.opt.state[P] = {k: torch.stack([m.resume["opt"][k][n] for m in members]).to(self.device)
                                     for k in saved if k != "step"}
                if "step" in saved:
                    self.opt.state[P]["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32,
                                                             device=self.device if fused else "cpu")
        for g in self.P:
            g.grad = torch.zeros_like(g)
        for r, m in enumerate(members):  # each run's hooked model now aliases its slice of the stack
            for (n, P) in zip(self.names, self.P):
                mod, _, leaf = n.rpartition(".")
                owner = m.model.get_submodule(mod) if mod else m.model
                p = nn.Parameter(P.detach()[r])
                p.grad = P.grad[r]
                owner._parameters[leaf] = p
            m.adam = RunAdam(self.opt, self.P, r)
        s = t.lr_schedule
        self.lr_at = lr_lambda(s.kind, self.total, s.warmup_frac, s.min_lr_frac)
        self.ckpt_at = set(checkpoints_until(self.total, t.checkpoints["linear"], t.checkpoints["log"], self.stop))
        self.frozen = torch.tensor([m.diverged for m in members])

    def loss(self, params: list[torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """Every run's training loss (R,) on its own batch, from the stacked parameters (R, ...)."""
        p = dict(zip(self.names, params))
        return mse_loss(lambda a, b: functional_call(self.members[0].model, (p, self.buffers), (a, b)), xs, ys)

    def lr(self, step: int) -> float:
        return self.t.optimizer.lr * self.lr_at(step)

    # ---------------------------------------------------------------- per-run state
    def params_of(self, r: int) -> dict[str, torch.Tensor]:
        return {n: P.detach()[r].clone().cpu() for n, P in zip(self.names, self.P)}

    def opt_of(self, r: int) -> dict | None:
        st = [self.opt.state.get(P) for P in self.P]
        if not st[0]:
            return None
        out = {k: {n: s[k][r].clone().cpu() for n, s in zip(self.names, st)} for k in st[0] if k != "step"}
        return {"step": int(st[0]["step"]), **out} if "step" in st[0] else out   # AdamW's step; SGD has none

    def checkpoint(self, r: int, step: int) -> None:
        """Evaluate run r and write its weights-only analysis checkpoint (its resume state: `commit`)."""
        m = self.members[r]
        metrics, tok, preds = m.evaluator(m.model)
        train_loss = m.loss_sum / m.loss_n if m.loss_n else math.nan
        rid = m.run_id
        m.rows.append({**m.spec.key_dict, "step": step, "sequences": step * self.B, "lr": self.lr(step),
                       "train_loss": train_loss, **metrics, "diverged": m.diverged})
        m.tokens.extend({"run_id": rid, "step": step, "split": split, "k": k + 1, "loss": float(v)}
                        for split, arr in tok.items() for k, v in enumerate(arr))
        m.root.append({"run_id": rid, "step": step, "preds": preds.astype(np.float32)})
        params, opt = self.params_of(r), self.opt_of(r)
        o = self.t.optimizer
        adam = None if opt is None or "exp_avg_sq" not in opt else {   # SGD: no preconditioner to keep
            "exp_avg_sq": torch.cat([v.reshape(-1) for v in opt["exp_avg_sq"].values()]),
            "step": opt["step"], "beta2": o.betas[1], "eps": o.eps}
        m.manifest[step] = save_torch({"model": params, "model_config": m.model.cfg.to_dict(), "adam": adam,
                                       "spec_hash": m.hash}, checkpoint_path(m.run_dir, step))
        m.loss_sum, m.loss_n, m.step = 0.0, 0, step

    def commit(self, step: int) -> None:
        """Every member's resume state at `step` (after the step's analysis checkpoints)."""
        for r, m in enumerate(self.members):
            save_resume(m, self.params_of(r), self.opt_of(r), step, self.cohort)

    # ---------------------------------------------------------------- one step, in named parts
    def _backward(self, batches: list[Batch]) -> list[float]:
        """Every run's gradient of its mean loss over the micro-batches into the stacked .grad; the losses."""
        xs, ys = torch.stack([b.xs for b in batches]), torch.stack([b.ys for b in batches])
        for g in self.P:
            g.grad.zero_()
        loss = torch.zeros(len(batches), device=self.device)
        for i in range(self.n_micro):
            sl = slice(i * self.mb, (i + 1) * self.mb)
            part = self.loss(self.P, xs[:, sl], ys[:, sl]) / self.n_micro
            part.sum().backward()
            loss += part.detach()
        return loss.tolist()

    def _record_losses(self, step: int, losses: list[float]) -> None:
        """Add each live run's loss to its interval mean; freeze a run whose loss is not finite or above
        train.diverge_loss, recording its state at divergence (flagged, nothing dropped)."""
        for r, (m, v) in enumerate(zip(self.members, losses)):
            if self.frozen[r]:
                continue
            if not math.isfinite(v) or v > self.t.diverge_loss:
                log.warning("[%s] diverged at step %d: loss %.4g", m.run_id, step, v)
                m.diverged, self.frozen[r] = True, True
                if m.rows and m.rows[-1]["step"] == step:
                    m.rows.pop(), m.root.pop()
                    m.tokens[:] = [t for t in m.tokens if t["step"] != step]
                self.checkpoint(r, step)
                continue
            m.loss_sum, m.loss_n = m.loss_sum + v, m.loss_n + 1

    def _clip(self) -> tuple[list[float], list[float]]:
        """Per-run gradient-norm clipping to train.grad_clip (frozen runs get a zero gradient); the pre-clip norms
        and the factors applied."""
        R, clip = len(self.members), self.t.grad_clip
        norms = torch.stack([g.grad.reshape(R, -1).square().sum(1) for g in self.P]).sum(0).sqrt()
        coef = torch.ones(R, device=self.device) if clip is None else (clip / (norms + 1e-6)).clamp(max=1.0)
        coef = torch.where(self.frozen.to(self.device), torch.zeros_like(coef), coef)
        for g in self.P:
            g.grad.mul_(coef.view(R, *[1] * (g.dim() - 1)))
        return norms.tolist(), coef.tolist()

    def _optimizer_step(self) -> None:
        """One AdamW step of every run; a frozen run's parameters and state are put back afterwards."""
        keep = self._freeze()
        self.opt.step()
        self._restore(keep)

    def _freeze(self) -> list | None:
        """Parameters and optimizer state of frozen (diverged) runs, to restore after the shared step."""
        if not self.frozen.any():
            return None
        idx = self.frozen.nonzero().flatten().to(self.device)
        return [(P.detach()[idx].clone(), {k: v[idx].clone() for k, v in self.opt.state.get(P, {}).items()
                                           if k != "step"}) for P in self.P]

    def _restore(self, keep: list | None) -> None:
        if keep is None:
            return
        idx = self.frozen.nonzero().flatten().to(self.device)
        with torch.no_grad():
            for P, (w, st) in zip(self.P, keep):
                P[idx] = w
                for k, v in st.items():
                    self.opt.state[P][k][idx] = v

    def run(self, progress: bool, stop_after: int | None = None) -> None:
        members = self.members
        if self.start == 0:  # a run resumed at step 0 already has its step-0 checkpoint: keep it untouched
            for r, m in enumerate(members):
                if m.resume is None:
                    self.checkpoint(r, 0)
            self.commit(0)
        desc = members[0].run_id if len(members) == 1 else f"{len(members)} runs B{self.B} {members[0].spec.keys.noise}"
        bar = tqdm(range(self.start, self.stop), initial=self.start, total=self.stop, desc=desc,
                   disable=not progress, mininterval=1.0, dynamic_ncols=True)
        for step in bar:
            if self.frozen.all():  # every run diverged: their final states
                self.commit(step)
                break
            if stop_after is not None and step >= stop_after:
                break
            lr = self.lr(step)
            self.opt.param_groups[0]["lr"] = lr
            batches = [m.sampler.batch(step, self.B) for m in members]
            self._record_losses(step, self._backward(batches))
            live = [(r, m) for r, m in enumerate(members) if not self.frozen[r]]
            ctxs = {r: StepContext(step, self.total, m.model, m.adam.state(), batches[r], self.mb, lr, mse_loss,
                                   m.heldout.batch) for r, m in live}
            for r, m in live:
                for h in m.hooks:
                    h.on_grads(ctxs[r])
            norms, coefs = self._clip()
            self._optimizer_step()
            for r, m in live:
                ctxs[r].grad_norm, ctxs[r].clip_coef = norms[r], coefs[r]
                for h in reversed(m.hooks):
                    h.on_update(ctxs[r])
                if step + 1 in self.ckpt_at:
                    self.checkpoint(r, step + 1)
            if step + 1 in self.ckpt_at:
                self.commit(step + 1)
                self._log_progress(bar, desc, step + 1)
        bar.close()

    def _log_progress(self, bar: tqdm, desc: str, step: int) -> None:
        live = [m.rows[-1]["ood_loss"] for m, f in zip(self.members, self.frozen) if not f]
        if live:
            bar.set_postfix(ood=f"{np.mean(live):.3f}")
            log.info("%s: step %d/%d, mean OOD loss %.4f over %d live runs", desc, step, self.stop, np.mean(live),
                     len(live))
