"""One ensemble's stacked training step (method §4; iclnoise.run.train starts, resumes and finishes the runs).

The runs' parameters are stacked along a leading run axis and one step is one call of the hooked
`ICLTransformer` on the stacked parameters (`functional_call`: its layers run the R runs as batched matmuls).
AdamW is elementwise, so one AdamW over the stacked tensors is R AdamWs; each run's hooked model aliases its
slice of the stack, and its hooks read its slice of the optimizer state through `RunAdam`. A step
(`Ensemble._step`): one stacked draw of every run's batch, backward, freeze runs that diverged, the hooks' `on_grads`
(the group gradients and diag Ĥ of the runs whose loggers measure at this step first, stacked: measure.measure),
the injectors of all their runs at once (batched.BatchedInjection; sgd_momentum's and those beside another hook per
run), clip per run, the optimizer step (frozen runs restored), the hooks' `on_update` and the due checkpoints.

The step reads nothing from the device on the host (no sync): losses, their interval sums, divergence and freezing,
clipping and the restoring of frozen runs are tensors over the run axis. The host looks at the frozen runs only at
the steps `Ensemble._looks` names (checkpoints, steps where a hook acts, every LOOK_EVERY steps) and then records a
run frozen at step s as at s: its parameters and moments were kept as they were at s, its loss sums stopped there.

Resume states are written per commit, not per run: at each checkpoint step the ensemble first writes every live
run's analysis checkpoint, then every member's resume state (frozen runs too), each tagged with the commit step and
the ensemble's cohort. A member keeps the state of the previous commit beside it (resume.prev.pt), so a kill while
the members' states are being written leaves every member a state at the earlier commit, and the ensemble resumes
from there as one (iclnoise.run.train).
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

from ..core.model import mse_loss
from ..core.tasks import Batch, CounterSampler, stacked_batch
from ..noise.batched import BatchedInjection
from ..noise.hooks import ExposureLogger, HostReads, StepContext
from ..noise.injection import NoiseInjector
from .measure import measure
from .member import Member, resume_state, save_resume
from .optim import RunAdam, build_optimizer, load_opt_state, opt_state_of

log = logging.getLogger(__name__)
LOOK_EVERY = 64  # steps between the host's reads of the frozen runs when nothing else makes it look
LOOK_ALWAYS = ("cpu",)  # devices where the host reads them every step (free there), sparing the restore when none is
INJECT_BATCHED = True  # the injectors of all runs at once (batched.BatchedInjection); False: per run


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
        self.P = self._stack()
        self.graphed = self._engine()
        self.opt, self.graphed = build_optimizer(self.P, self.t, self.start, self.device, self.graphed)
        if start > 0 and members[0].resume["opt"] is not None:
            load_opt_state(self.opt, self.names, self.P, [m.resume["opt"] for m in members], self.device)
        for g in self.P:
            g.grad = torch.zeros_like(g)
        self._alias()
        self.adam = RunAdam(self.opt, self.P, None)   # every run's AdamW state, stacked (the batched injection's)
        self.ckpt_at = set(t.checkpoints_planned)
        R = len(members)
        self.injection = self._batch_injection()
        batched = set(self.injection.runs) if self.injection else set()
        self.hooks = [m.hooks[:1] if r in batched else m.hooks for r, m in enumerate(members)]   # called per run
        self.samplers = [m.sampler for m in members]
        self.counter = CounterSampler(self.samplers) if t.rng == "counter" else None   # else a generator per run
        # the exposure loggers' clipped and live steps since their last row, counted here for all runs at once
        self.clipped_n = torch.zeros(R, dtype=torch.long, device=self.device)
        self.steps_n = torch.zeros(R, dtype=torch.long, device=self.device)
        loggers = {r: h for r, m in enumerate(members) for h in m.hooks if isinstance(h, ExposureLogger)}
        for r, h in loggers.items():
            h.count_in(self.clipped_n[r], self.steps_n[r])
        self.counting = bool(loggers)
        # the host values of the loggers alone among their run's hooks, read once after on_grads and once after
        # on_update on a logging step (HostReads); a logger beside a per-run hook reads at once (that hook reads
        # the state it sets within the step)
        self.reads = HostReads(eager=False)
        for r, h in loggers.items():
            if self.hooks[r] == [h]:
                h.reads = self.reads
        # divergence on the device (self.frozen, the step and loss it happened at); the host's view, self.known,
        # is brought up to date at the steps _looks names (iclnoise.run.ensemble module docstring)
        self.frozen = torch.tensor([m.diverged for m in members], device=self.device)
        self.known = [m.diverged for m in members]
        self.div_step = torch.full((R,), -1, dtype=torch.long, device=self.device)
        self.div_loss = torch.zeros(R, device=self.device)
        self.loss_sum = torch.zeros(R, dtype=torch.float64, device=self.device)   # since each run's last checkpoint
        self.loss_n = torch.zeros(R, dtype=torch.long, device=self.device)
        self.step_t = torch.zeros((), dtype=torch.long, device=self.device)    # the step, for _record_losses
        self.graphs: tuple | None = None   # (backward graph, its xs, ys; update graph, its norms, coefs)
        # runs per stacked evaluation pass: on CUDA as many as a training micro-batch holds (config.memory's floor
        # holds); on the CPU 1 (stacked measured no faster: 18 runs, chunk 2, 4.4 s against 3.3-4.2 s one at a time)
        e = spec.eval
        self.eval_chunk = R * self.mb // max(e.n_sequences, e.n_root) if self.device.type == "cuda" else 1

    def _stack(self) -> list[torch.Tensor]:
        """The members' parameters (their resume states' where they resume) stacked along the run axis."""
        for m in self.members:
            if m.resume is not None:
                m.model.load_state_dict({**m.model.state_dict(), **m.resume["params"]})
        return [torch.stack([dict(m.model.named_parameters())[n].detach() for m in self.members]).requires_grad_()
                for n in self.names]

    def _alias(self) -> None:
        """Each run's hooked model now aliases its slice of the stack (and of its .grad); its RunAdam views."""
        for r, m in enumerate(self.members):
            for (n, P) in zip(self.names, self.P):
                mod, _, leaf = n.rpartition(".")
                owner = m.model.get_submodule(mod) if mod else m.model
                p = nn.Parameter(P.detach()[r])
                p.grad = P.grad[r]
                owner._parameters[leaf] = p
            m.adam = RunAdam(self.opt, self.P, r)

    def _batch_injection(self) -> BatchedInjection | None:
        """The runs whose injector's closed loop runs batched (NoiseInjector.batched, AdamW, hooks as build_hooks
        makes them: a run with another hook, e.g. a DoseReference, stays per run); the log names each path's
        conditions."""
        hooks = {r: m.hooks for r, m in enumerate(self.members) if any(isinstance(h, NoiseInjector) for h in m.hooks)}
        ok = INJECT_BATCHED and self.t.optimizer.KIND == "adamw"
        batched = [r for r, hs in hooks.items() if ok and len(hs) == 2 and isinstance(hs[0], ExposureLogger)
                   and isinstance(hs[1], NoiseInjector) and hs[1].batched]
        rest = [r for r in hooks if r not in batched]
        names = lambda rs: ", ".join(sorted({self.members[r].spec.keys.noise for r in rs}))  # noqa: E731
        if batched:
            log.info("noise injection: %d runs (%s) in one batched closed loop", len(batched), names(batched))
        if rest:
            log.info("noise injection: %d runs (%s) per run (sgd_momentum, another hook or INJECT_BATCHED off)",
                     len(rest), names(rest))
        return BatchedInjection(batched, [hooks[r][1] for r in batched], [hooks[r][0] for r in batched],
                                len(self.members), self.device) if batched else None

    def _engine(self) -> bool:
        """Apply train.tf32 and say whether train.cuda_graphs is to be tried; on another device, log that they do
        nothing there."""
        t, cuda = self.t, self.device.type == "cuda"
        for key, on in (("tf32", t.tf32), ("cuda_graphs", t.cuda_graphs)):
            if on and not cuda:
                log.info("train.%s: no effect on %s (CUDA only); the step runs as without it", key, self.device)
        if t.tf32 and cuda:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            log.info("train.tf32: TF32 matmuls on %s", self.device)
        return t.cuda_graphs and cuda

    def loss(self, params: list[torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """Every run's training loss (R,) on its own batch, from the stacked parameters (R, ...)."""
        return mse_loss(lambda a, b: self.predict(params, a, b), xs, ys)

    def predict(self, params: list[torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """The predictions of the runs whose stacked parameters (r, ...) are `params`, each on its own xs, ys."""
        return functional_call(self.members[0].model, (dict(zip(self.names, params)), self.buffers), (xs, ys))

    # ---------------------------------------------------------------- per-run state
    def params_of(self, r: int) -> dict[str, torch.Tensor]:
        return {n: P.detach()[r].clone().cpu() for n, P in zip(self.names, self.P)}

    @torch.no_grad()
    def evaluate(self, rs: list[int]) -> dict[int, tuple]:
        """Runs rs evaluated (Evaluator.score): every split predicted from the stacked parameters for
        self.eval_chunk runs at once, in fixed chunks [i·chunk, (i+1)·chunk) whatever is live, so a run's numbers
        never depend on another run's fate. At a chunk of one run, each run takes its own evaluator's pass."""
        chunk = self.eval_chunk
        if chunk <= 1:
            return {r: self.members[r].evaluator(self.members[r].model) for r in rs}
        out = {}
        for lo in sorted({r // chunk * chunk for r in rs}):
            idx = range(lo, min(lo + chunk, len(self.members)))
            ev = [self.members[i].evaluator for i in idx]
            preds = {k: self.predict([P.detach()[lo:idx.stop] for P in self.P],
                                        torch.stack([v.splits[k].batch.xs for v in ev]),
                                        torch.stack([v.splits[k].batch.ys for v in ev])) for k in ev[0].splits}
            out.update({r: ev[r - lo].score({k: v[r - lo] for k, v in preds.items()}) for r in rs if r in idx})
        return out

    def checkpoints(self, rs: list[int], step: int) -> None:
        """Evaluate runs rs (evaluate) and write each one's analysis checkpoint (checkpoint)."""
        for r, evaluated in self.evaluate(rs).items():
            self.checkpoint(r, step, evaluated)

    def checkpoint(self, r: int, step: int, evaluated: tuple) -> None:
        """Record run r's evaluation (Evaluator.score's outputs) and write its weights-only analysis checkpoint
        (its resume state: `commit`)."""
        m = self.members[r]
        n = int(self.loss_n[r])
        m.record(step, step * self.B, self.t.lr(step), float(self.loss_sum[r]) / n if n else math.nan, evaluated)
        opt = opt_state_of(self.opt, self.names, self.P, r, step)
        m.save_checkpoint(step, self.params_of(r), opt, self.t.optimizer)
        self.loss_sum[r], self.loss_n[r], m.step = 0.0, 0, step

    def commit(self, step: int) -> None:
        """Every member's resume state at `step` (after the step's analysis checkpoints) into its resume.pt."""
        for m, state in zip(self.members, self.states(step)):
            save_resume(m, state)

    def states(self, step: int) -> list[dict]:
        """Every member's resume state at `step` in memory: what commit saves, and a fork's start (iclnoise.run.crn)."""
        if self.injection:
            self.injection.flush()
        return [{**resume_state(m, self.params_of(r), opt_state_of(self.opt, self.names, self.P, r, step), step,
                                self.cohort), "step": m.step if m.diverged else step}
                for r, m in enumerate(self.members)]

    # ---------------------------------------------------------------- one step, in named parts
    def _backward(self, batch: Batch) -> torch.Tensor:
        """Every run's gradient of its mean loss over the micro-batches into the stacked .grad; the losses (R,)."""
        for g in self.P:
            g.grad.zero_()
        loss = torch.zeros(len(self.members), device=self.device)
        for i in range(self.n_micro):
            sl = slice(i * self.mb, (i + 1) * self.mb)
            part = self.loss(self.P, batch.xs[:, sl], batch.ys[:, sl]) / self.n_micro
            part.sum().backward()
            loss += part.detach()
        return loss

    def _record_losses(self, loss: torch.Tensor) -> None:
        """On the device: freeze a live run whose loss is not finite or above train.diverge_loss (noting the step and
        the loss), and add each live run's loss to its interval sum. The host records the frozen runs in _look."""
        new = ~self.frozen & (~torch.isfinite(loss) | (loss > self.t.diverge_loss))
        self.div_step.copy_(torch.where(new, self.step_t, self.div_step))   # in place: a CUDA graph replays it
        self.div_loss.copy_(torch.where(new, loss, self.div_loss))
        self.frozen |= new
        self.loss_sum += torch.where(self.frozen, 0.0, loss.double())
        self.loss_n += ~self.frozen

    def _acting(self, step: int) -> list[int]:
        """The runs with a hook that acts at this step (StepHook.acts): only they get a StepContext and hook calls."""
        return [r for r, hs in enumerate(self.hooks) if any(h.acts(step) for h in hs)]

    def _looks(self, step: int, stop_after: int | None, acts: list[int]) -> bool:
        """The host reads the frozen runs at this step: every LOOK_EVERY steps, before a checkpoint or the last step,
        whenever a live run's hook acts (`acts`; a hook never sees a frozen run), and every step on LOOK_ALWAYS
        devices."""
        return (self.device.type in LOOK_ALWAYS or step % LOOK_EVERY == 0 or step + 1 in self.ckpt_at
                or step + 1 in (self.stop, stop_after) or any(not self.known[r] for r in acts))

    def _look(self) -> bool:
        """Record the runs frozen since the host last looked, each at its divergence step s, as they were then (a
        frozen run's parameters and moments stay as at s): flagged, nothing dropped. False once every run is
        frozen (after their final states are committed, at the step after the last divergence)."""
        frozen = self.frozen.tolist()
        new = [r for r, (f, k) in enumerate(zip(frozen, self.known)) if f and not k]
        at, loss = (self.div_step.tolist(), self.div_loss.tolist()) if new or all(frozen) else ([], [])
        for r in new:
            m, s = self.members[r], at[r]
            log.warning("[%s] diverged at step %d: loss %.4g", m.run_id, s, loss[r])
            m.diverged = self.known[r] = True
            if m.rows and m.rows[-1]["step"] == s:
                m.rows.pop(), m.root.pop()
                m.tokens[:] = [t for t in m.tokens if t["step"] != s]
            self.checkpoints([r], s)
        if all(frozen):
            self.commit(max(at) + 1)
            return False
        return True

    def _clip(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-run gradient-norm clipping to train.grad_clip (frozen runs get a zero gradient); the pre-clip norms
        and the factors applied (R,), on the device."""
        R, clip = len(self.members), self.t.grad_clip
        # every sum runs along a run's own row, so on one CPU thread a run's norm has the same bits in an ensemble of
        # any size (a sum over the first axis of a stacked (tensors, R) does not: its order depends on R)
        norms = torch.stack([g.grad.reshape(R, -1).square().sum(1) for g in self.P], 1).sum(1).sqrt()
        coef = torch.ones(R, device=self.device) if clip is None else (clip / (norms + 1e-6)).clamp(max=1.0)
        coef = torch.where(self.frozen, torch.zeros_like(coef), coef)
        for g in self.P:
            g.grad.mul_(coef.view(R, *[1] * (g.dim() - 1)))
        return norms, coef

    def _optimizer_step(self, known: bool = False) -> None:
        """One AdamW step of every run; a frozen run's parameters and moments are put back afterwards (on the device:
        the host need not know which runs are frozen). `known`: the host looked this step, so with no run frozen
        there is nothing to put back."""
        if known and not any(self.known):
            self.opt.step()
            return
        keep = [(P.detach(), P.detach().clone()) for P in self.P]
        keep += [(v, v.clone()) for P in self.P for k, v in self.opt.state.get(P, {}).items() if k != "step"]
        self.opt.step()
        with torch.no_grad():
            for x, old in keep:
                torch.where(self.frozen.view(-1, *[1] * (x.dim() - 1)), old, x, out=x)

    def _capture(self, batch: Batch) -> None:
        """Capture the step's two device parts as CUDA graphs (train.cuda_graphs): backward with the divergence
        bookkeeping, on copies of the batch; clipping with the optimizer step. The hooks run between their replays.
        Where capture fails, the log says why and the step stays eager (self.graphed off)."""
        try:
            xs, ys = batch.xs.clone(), batch.ys.clone()
            torch.cuda.synchronize(self.device)
            g_back, g_update = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_back):
                self._record_losses(self._backward(Batch(xs, ys, batch.tasks)))
            with torch.cuda.graph(g_update, pool=g_back.pool()):
                norms, coefs = self._clip()
                self._optimizer_step()
            self.graphs = (g_back, xs, ys, g_update, norms, coefs)
            log.info("train.cuda_graphs: the step is captured (%d runs)", len(self.members))
        except Exception as e:   # noqa: BLE001 - any capture failure falls back, named
            self.graphed, self.graphs = False, None
            self.opt.param_groups[0]["lr"] = float(self.opt.param_groups[0]["lr"])
            log.warning("train.cuda_graphs: capture failed (%s: %s); the step runs eagerly", type(e).__name__, e)

    def _params(self, rs: list[int]) -> dict[str, torch.Tensor]:
        """The stacked parameters of runs `rs` (detached copies)."""
        idx = torch.tensor(rs, device=self.device)
        return {name: P.detach()[idx] for name, P in zip(self.names, self.P)}

    def _step(self, step: int, stop_after: int | None) -> bool:
        """Update `step` of every run; False when every run has diverged (nothing left to train)."""
        members, lr = self.members, self.t.lr(step)
        batch = self.counter.batch(step, self.B) if self.counter else stacked_batch(self.samplers, step, self.B)
        self.step_t.fill_(step)
        if self.graphed:
            self.opt.param_groups[0]["lr"].fill_(lr)
        else:
            self.opt.param_groups[0]["lr"] = lr
        if self.graphs is None and self.graphed and step > self.start:   # AdamW has its state: capture
            self._capture(batch)
        if self.graphs:
            g_back, xs, ys, *_ = self.graphs
            xs.copy_(batch.xs), ys.copy_(batch.ys)
            g_back.replay()
        else:
            self._record_losses(self._backward(batch))
        acts = self._acting(step)
        looked = self._looks(step, stop_after, acts)
        if looked and not self._look():
            return False
        live = [r for r, f in enumerate(self.known) if not f]
        ctxs = {r: StepContext(step, self.total, members[r].model, members[r].adam.state(step),   # the runs whose
                               Batch(batch.xs[r], batch.ys[r], batch.tasks[r]), self.mb, lr, mse_loss,   # hooks act
                               members[r].heldout.batch) for r in acts if not self.known[r]}
        measure(step, batch, ctxs, self.members, self._params, self.B, self.device)
        inj = self.injection
        acting = inj is not None and inj.acting(step, ctxs)   # a batched run's logger acts: book its rows first
        if acting:
            inj.flush()
        for r, ctx in ctxs.items():
            for h in self.hooks[r]:
                h.on_grads(ctx)
        self.reads.read()
        if inj:
            inj.on_grads(step, lr, set(live), ctxs, self.adam.state(step), self.frozen, acting)
        if self.graphs:
            *_, g_update, norms, coefs = self.graphs
            g_update.replay()
        else:
            norms, coefs = self._clip()
            self._optimizer_step(looked)
        if inj:
            inj.on_update(coefs, self.P, acting)
        if self.counting:   # the loggers' counts (ExposureLogger.count_in), before their rows read them
            self.steps_n += ~self.frozen
            self.clipped_n += ~self.frozen & (coefs < 1.0)
        for r, ctx in ctxs.items():
            ctx.grad_norm, ctx.clip_coef, ctx.live = norms[r], coefs[r], ~self.frozen[r]
            for h in reversed(self.hooks[r]):
                h.on_update(ctx)
        self.reads.read()
        if step + 1 in self.ckpt_at:
            self.checkpoints(live, step + 1)
            self.commit(step + 1)
        return True

    def run(self, progress: bool, stop_after: int | None = None) -> None:
        members = self.members
        if self.start == 0:  # a run resumed at step 0 already has its step-0 checkpoint: keep it untouched
            self.checkpoints([r for r, m in enumerate(members) if m.resume is None], 0)
            self.commit(0)
        noise = "+".join(sorted({m.spec.keys.noise for m in members}))
        desc = members[0].run_id if len(members) == 1 else f"{len(members)} runs B{self.B} {noise}"
        bar = tqdm(range(self.start, self.stop), initial=self.start, total=self.stop, desc=desc,
                   disable=not progress, mininterval=1.0, dynamic_ncols=True)
        for step in bar:
            if stop_after is not None and step >= stop_after or not self._step(step, stop_after):
                break
            if step + 1 in self.ckpt_at:
                self._log_progress(bar, desc, step + 1)
        bar.close()

    def _log_progress(self, bar: tqdm, desc: str, step: int) -> None:
        live = [m.rows[-1]["ood_loss"] for m, f in zip(self.members, self.known) if not f]
        if live:
            bar.set_postfix(ood=f"{np.mean(live):.3f}")
            log.info("%s: step %d/%d, mean OOD loss %.4f over %d live runs", desc, step, self.stop, np.mean(live),
                     len(live))
