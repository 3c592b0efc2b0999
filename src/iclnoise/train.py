"""The training loop: many runs trained together as one batched computation (SPEC §4).

An *ensemble* is a set of runs that share model shape, step count and training configuration (they
differ in M, seed and so in task pool, data stream and initialisation). Their parameters are stacked
along a leading run axis and one step is one call of the hooked `ICLTransformer` on the stacked
parameters (`functional_call`: its layers run the R runs as batched matmuls; 1.5× a vmap over runs,
bench/bench_step.py), so the per-step overhead is paid once for all runs. Everything per run stays
per run: its task pool and counter-based data stream, its initialisation, its AdamW state (AdamW is
elementwise, so one AdamW over stacked tensors is R AdamWs), its gradient-norm clipping, its noise
injection and exposure hooks, its evaluation, checkpoints and divergence (a diverged run is frozen,
recorded with `diverged = true` and kept; the others go on). `train_run` is an ensemble of one.

Run directory (iclnoise.runs): `run.json` (spec + `spec_hash`), weights-only analysis checkpoints
with a sha256 manifest, one rolling full resume state `resume.pt` (the previous one kept as
`resume.prev.pt`), and the Parquet tables. A run resumes from its resume state only if the state's
spec hash equals the spec's; a run whose spec changed starts fresh (the stale state is removed and
the log says so). A corrupt newest resume state falls back to the previous one.
"""
from __future__ import annotations

import logging
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

from .evaluate import METRICS_SCHEMA, TOKEN_SCHEMA, Evaluator, root_preds_schema
from .hooks import StepContext, StepHook, build_hooks
from .io import CorruptFileError, repair_advice, write_json, write_parquet
from .model import ModelConfig, build_model, mse_loss
from .runs import (
    CKPT_DIR,
    MANIFEST,
    CorruptFile,
    checkpoint_path,
    last_step,
    load_torch,
    read_spec,
    sampler,
    save_torch,
    spec_hash,
)
from .schedules import checkpoints_until, lr_lambda
from .sections import LRSchedule

log = logging.getLogger(__name__)
RESUME, RESUME_PREV = "resume.pt", "resume.prev.pt"
SHARED_KEYS = ("data", "model", "train", "eval", "noise", "exposure")  # identical across an ensemble


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


class RunOptimizer:
    """One run's view of the ensemble's AdamW: the param group's settings and per-parameter state slices, as
    the hooks read them from a torch optimizer (`param_groups`, `state[p]`)."""

    def __init__(self, opt: torch.optim.AdamW, stacked: list[torch.Tensor], params: list[nn.Parameter], r: int):
        self.opt, self.stacked, self.params, self.r = opt, stacked, params, r
        self._key: tuple = ()
        self._state: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        g = self.opt.param_groups[0]
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": self.params}]

    @property
    def state(self) -> dict:
        """Views of run r's slices, rebuilt only when the optimizer's per-tensor state objects change (its first
        step, a resume): AdamW updates them in place, so the views stay current between steps."""
        sts = [self.opt.state.get(P) for P in self.stacked]
        key = tuple(id(st) if st else 0 for st in sts)  # an empty state (not yet filled) is 0
        if key != self._key:
            self._key = key
            self._state = {p: {"step": st["step"], "exp_avg": st["exp_avg"][self.r],
                               "exp_avg_sq": st["exp_avg_sq"][self.r]}
                           for p, st in zip(self.params, sts) if st}
        return self._state


@dataclass
class Member:
    """One run inside an ensemble: its spec, data, evaluator, hooks and everything it records."""

    spec: dict
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

    @property
    def run_id(self) -> str:
        return self.spec["keys"]["run_id"]

    def setup(self) -> None:
        d = self.spec["data"]
        self.model = build_model(ModelConfig(D=d["D"], K=d["K"], **self.spec["model"]),
                                 self.spec["keys"]["seed"], self.device)
        self.sampler = sampler(self.spec, "train", self.device)
        self.heldout = sampler(self.spec, "heldout", self.device)
        self.hooks = build_hooks(self.spec, self.device)
        self.evaluator = Evaluator(self.spec, self.device)


def _check_shared(specs: list[dict]) -> None:
    """An ensemble needs one model shape, step count and training configuration; name the runs that differ."""
    ref = {k: specs[0].get(k) for k in SHARED_KEYS}
    ref_batch = specs[0]["keys"]["batch"]
    bad = [s["keys"]["run_id"] for s in specs
           if {k: s.get(k) for k in SHARED_KEYS} != ref or s["keys"]["batch"] != ref_batch]
    if bad:
        raise ValueError(f"runs {bad} cannot train in one ensemble with {specs[0]['keys']['run_id']}: an ensemble "
                         f"needs the same batch and the same {', '.join(SHARED_KEYS)} sections (they differ)")
    ids = [s["keys"]["run_id"] for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"an ensemble lists a run twice: {sorted(i for i in ids if ids.count(i) > 1)}")


def _memory_check(specs: list[dict], device: torch.device) -> None:
    """Refuse, before training, an ensemble whose parameters, optimizer state and activations do not fit."""
    from .model import ICLTransformer

    s = specs[0]
    m, d, t = s["model"], s["data"], s["train"]
    with torch.device("meta"):  # count parameters without allocating them
        P = sum(p.numel() for p in ICLTransformer(ModelConfig(D=d["D"], K=d["K"], **m)).parameters())
    R, n = len(specs), 2 * d["K"]
    act = t["micro_batch"] * n * (m["d_model"] * 16 + m["d_mlp"] * 4 + m["n_heads"] * n * 3) * m["n_layers"]
    need = 4 * R * (4 * P + 3 * act)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        raise MemoryError(f"the ensemble of {R} runs ({', '.join(x['keys']['run_id'] for x in specs[:4])}"
                          f"{', ...' if R > 4 else ''}) needs ≈ {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB "
                          f"are free on {device}; lower train.ensemble_runs (runs per ensemble) or train.micro_batch")


def _load_resume(m: Member) -> dict | None:
    """The newest readable resume state of the run whose spec hash matches; stale state is removed. A corrupt
    run.json stops here (CorruptFileError, naming it and what to do) and deletes nothing: it is not a changed spec."""
    rd = m.run_dir
    old = rd / "run.json"
    if old.exists():
        prev = read_spec(rd)
        if not isinstance(prev, dict) or not isinstance(prev.get("spec_hash"), str):
            raise CorruptFileError(f"{old}: not a run spec (no spec_hash), corrupt; {repair_advice(old)}")
        prev_hash = prev["spec_hash"]
        if prev_hash != m.hash:
            log.warning("%s: spec changed (hash %s → %s): removing the stale run state and training from scratch",
                        m.run_id, prev_hash, m.hash)
            for p in rd.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name in (RESUME, RESUME_PREV):
        path = rd / name
        if not path.exists():
            continue
        try:
            state = load_torch(path, "cpu")
        except CorruptFile:  # the previous state, or training from step 0, replaces it
            log.warning("%s: %s is truncated or corrupt; not resuming from it", m.run_id, path)
            continue
        if state.get("spec_hash") == m.hash:
            return state
    return None


def _save_resume(m: Member, params: dict[str, torch.Tensor], opt_state: dict | None, step: int) -> None:
    cur, prev = m.run_dir / RESUME, m.run_dir / RESUME_PREV
    state = {"spec_hash": m.hash, "step": step, "diverged": m.diverged, "params": params, "opt": opt_state,
             "hooks": [h.state_dict() for h in m.hooks], "rows": m.rows, "tokens": m.tokens, "root": m.root,
             "manifest": m.manifest}
    if cur.exists():
        cur.replace(prev)
    save_torch(state, cur)


def _write_outputs(m: Member) -> pd.DataFrame:
    spec, data = m.spec, m.spec["data"]
    metrics = pd.DataFrame(m.rows)[METRICS_SCHEMA.names]
    write_parquet(pd.DataFrame(m.tokens), m.run_dir / "token_losses.parquet", TOKEN_SCHEMA)
    write_parquet(pd.DataFrame(m.root), m.run_dir / "root_preds.parquet",
                  root_preds_schema(spec["eval"]["n_root"] * data["K"]))
    for h in m.hooks:
        write_parquet(pd.DataFrame(h.rows(), columns=h.schema.names), m.run_dir / f"{h.name}.parquet", h.schema)
    write_json({str(k): v for k, v in sorted(m.manifest.items())}, m.run_dir / MANIFEST)
    write_parquet(metrics, m.run_dir / "metrics.parquet", METRICS_SCHEMA)  # last: it marks the run complete
    return metrics


class Ensemble:
    """The stacked parameters and AdamW of runs that all start at the same step."""

    def __init__(self, members: list[Member], start: int):
        self.members, self.start = members, start
        spec = members[0].spec
        self.t = t = spec["train"]
        self.total, self.B, self.mb = t["steps"], spec["keys"]["batch"], t["micro_batch"]
        self.stop = last_step(spec)  # the schedule runs over `total`; training may stop before (budget.stop_at)
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
        o = t["optimizer"]
        fused = self.device.type in ("cpu", "cuda")
        self.opt = torch.optim.AdamW(self.P, lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"],
                                     eps=o["eps"], fused=fused)
        if start > 0:
            for i, P in enumerate(self.P):
                n = self.names[i]
                self.opt.state[P] = {
                    "step": torch.tensor(float(members[0].resume["opt"]["step"]), dtype=torch.float32,
                                         device=self.device if fused else "cpu"),
                    "exp_avg": torch.stack([m.resume["opt"]["exp_avg"][n] for m in members]).to(self.device),
                    "exp_avg_sq": torch.stack([m.resume["opt"]["exp_avg_sq"][n] for m in members]).to(self.device)}
        for g in self.P:
            g.grad = torch.zeros_like(g)
        for r, m in enumerate(members):  # each run's hooked model now aliases its slice of the stack
            for (n, P) in zip(self.names, self.P):
                mod, _, leaf = n.rpartition(".")
                owner = m.model.get_submodule(mod) if mod else m.model
                p = nn.Parameter(P.detach()[r])
                p.grad = P.grad[r]
                owner._parameters[leaf] = p
            m.optimizer = RunOptimizer(self.opt, self.P, list(m.model.parameters()), r)
        s = LRSchedule.from_dict(t["lr_schedule"])
        self.lr_at = lr_lambda(s.kind, self.total, s.warmup_frac, s.min_lr_frac)
        self.ckpt_at = set(checkpoints_until(self.total, t["checkpoints"]["linear"], t["checkpoints"]["log"],
                                             self.stop))

    def loss(self, params: list[torch.Tensor], xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """Every run's training loss (R,) on its own batch, from the stacked parameters (R, ...)."""
        p = dict(zip(self.names, params))
        return mse_loss(lambda a, b: functional_call(self.members[0].model, (p, self.buffers), (a, b)), xs, ys)

    def lr(self, step: int) -> float:
        return self.t["optimizer"]["lr"] * self.lr_at(step)

    # ---------------------------------------------------------------- per-run state
    def params_of(self, r: int) -> dict[str, torch.Tensor]:
        return {n: P.detach()[r].clone().cpu() for n, P in zip(self.names, self.P)}

    def opt_of(self, r: int) -> dict | None:
        st = [self.opt.state.get(P) for P in self.P]
        if not st[0]:
            return None
        return {"step": int(st[0]["step"]), "exp_avg": {n: s["exp_avg"][r].clone().cpu() for n,
                                                        s in zip(self.names, st)},
                "exp_avg_sq": {n: s["exp_avg_sq"][r].clone().cpu() for n, s in zip(self.names, st)}}

    def checkpoint(self, r: int, step: int) -> None:
        """Evaluate run r, write its weights-only analysis checkpoint and its rolling resume state."""
        m = self.members[r]
        metrics, tok, preds = m.evaluator(m.model)
        train_loss = m.loss_sum / m.loss_n if m.loss_n else math.nan
        keys, rid = m.spec["keys"], m.run_id
        m.rows.append({**keys, "step": step, "sequences": step * self.B, "lr": self.lr(step), "train_loss": train_loss,
                       **metrics, "diverged": m.diverged})
        m.tokens.extend({"run_id": rid, "step": step, "split": split, "k": k + 1, "loss": float(v)}
                        for split, arr in tok.items() for k, v in enumerate(arr))
        m.root.append({"run_id": rid, "step": step, "preds": preds.astype(np.float32)})
        params, opt = self.params_of(r), self.opt_of(r)
        o = self.t["optimizer"]
        adam = None if opt is None else {"exp_avg_sq": torch.cat([v.reshape(-1) for v in opt["exp_avg_sq"].values()]),
                                         "step": opt["step"], "beta2": o["betas"][1], "eps": o["eps"]}
        m.manifest[step] = save_torch({"model": params, "model_config": m.model.cfg.to_dict(), "adam": adam,
                                       "spec_hash": m.hash}, checkpoint_path(m.run_dir, step))
        m.loss_sum, m.loss_n, m.step = 0.0, 0, step
        _save_resume(m, params, opt, step)

    # ---------------------------------------------------------------- the loop
    def run(self, progress: bool, stop_after: int | None = None) -> None:
        R, members = len(self.members), self.members
        frozen = torch.tensor([m.diverged for m in members])
        if self.start == 0:  # a run resumed at step 0 already has its step-0 checkpoint: keep it untouched
            for r, m in enumerate(members):
                if m.resume is None:
                    self.checkpoint(r, 0)
        desc = members[0].run_id if R == 1 else f"{R} runs B{self.B} {members[0].spec['keys']['noise']}"
        bar = tqdm(range(self.start, self.stop), initial=self.start, total=self.stop, desc=desc,
                   disable=not progress, mininterval=1.0, dynamic_ncols=True)
        clip, thr = self.t["grad_clip"], self.t["diverge_loss"]
        for step in bar:
            if frozen.all() or (stop_after is not None and step >= stop_after):
                break
            lr = self.lr(step)
            self.opt.param_groups[0]["lr"] = lr
            batches = [m.sampler.batch(step, self.B) for m in members]
            xs, ys = torch.stack([b.xs for b in batches]), torch.stack([b.ys for b in batches])
            for g in self.P:
                g.grad.zero_()
            loss = torch.zeros(R, device=self.device)
            for i in range(self.n_micro):
                sl = slice(i * self.mb, (i + 1) * self.mb)
                part = self.loss(self.P, xs[:, sl], ys[:, sl]) / self.n_micro
                part.sum().backward()
                loss += part.detach()
            values = loss.tolist()
            for r, (m, v) in enumerate(zip(members, values)):
                if frozen[r]:
                    continue
                if not math.isfinite(v) or v > thr:  # record the state at divergence, flagged; drop nothing
                    log.warning("[%s] diverged at step %d: loss %.4g", m.run_id, step, v)
                    m.diverged, frozen[r] = True, True
                    if m.rows and m.rows[-1]["step"] == step:
                        m.rows.pop(), m.root.pop()
                        m.tokens[:] = [t for t in m.tokens if t["step"] != step]
                    self.checkpoint(r, step)
                    continue
                m.loss_sum, m.loss_n = m.loss_sum + v, m.loss_n + 1
            ctxs = [StepContext(step, self.total, m.model, m.optimizer, b, self.mb, lr, mse_loss, m.heldout.batch)
                    for m, b in zip(members, batches)]
            for r, m in enumerate(members):
                if not frozen[r]:
                    for h in m.hooks:
                        h.on_grads(ctxs[r])
            norms = torch.stack([g.grad.reshape(R, -1).square().sum(1) for g in self.P]).sum(0).sqrt()
            coef = torch.ones(R, device=self.device) if clip is None else (clip / (norms + 1e-6)).clamp(max=1.0)
            coef = torch.where(frozen.to(self.device), torch.zeros_like(coef), coef)
            for g in self.P:
                g.grad.mul_(coef.view(R, *[1] * (g.dim() - 1)))
            norm_l, coef_l = norms.tolist(), coef.tolist()
            keep = self._freeze(frozen)
            self.opt.step()
            self._restore(frozen, keep)
            for r, m in enumerate(members):
                if frozen[r]:
                    continue
                ctxs[r].grad_norm, ctxs[r].clip_coef = norm_l[r], coef_l[r]
                for h in reversed(m.hooks):
                    h.on_update(ctxs[r])
                if step + 1 in self.ckpt_at:
                    self.checkpoint(r, step + 1)
            if step + 1 in self.ckpt_at:
                live = [m.rows[-1]["ood_loss"] for m, f in zip(members, frozen) if not f]
                if live:
                    bar.set_postfix(ood=f"{np.mean(live):.3f}")
                    log.info("%s: step %d/%d, mean OOD loss %.4f over %d live runs", desc, step + 1, self.stop,
                             np.mean(live), len(live))
        bar.close()

    def _freeze(self, frozen: torch.Tensor) -> list | None:
        """Parameters and optimizer state of frozen (diverged) runs, to restore after the shared step."""
        if not frozen.any():
            return None
        idx = frozen.nonzero().flatten().to(self.device)
        return [(P.detach()[idx].clone(), {k: v[idx].clone() for k, v in self.opt.state.get(P, {}).items()
                                           if k != "step"}) for P in self.P]

    def _restore(self, frozen: torch.Tensor, keep: list | None) -> None:
        if keep is None:
            return
        idx = frozen.nonzero().flatten().to(self.device)
        with torch.no_grad():
            for P, (w, st) in zip(self.P, keep):
                P[idx] = w
                for k, v in st.items():
                    self.opt.state[P][k][idx] = v


def train_ensemble(specs: list[dict], run_dirs: list[str | Path], progress: bool | None = None,
                   device: torch.device | None = None, stop_after: int | None = None) -> list[pd.DataFrame | None]:
    """Train every run of `specs` (one per run directory) to completion, together; resume each from its own
    resume state where its spec hash matches. Returns the metrics table of every run, in order.

    `stop_after`: stop once this many steps are done (e.g. under a cluster time limit); the runs keep their
    last resume state, a later call goes on from there, and unfinished runs return None."""
    if len(specs) != len(run_dirs):
        raise ValueError("one run directory per spec")
    _check_shared(specs)
    device = device or resolve_device(specs[0]["train"]["device"])
    _memory_check(specs, device)
    members = []
    for spec, rd in zip(specs, run_dirs):
        m = Member(spec, Path(rd), spec_hash(spec), device)
        m.run_dir.mkdir(parents=True, exist_ok=True)
        m.resume = _load_resume(m)
        write_json({**spec, "spec_hash": m.hash}, m.run_dir / "run.json")
        (m.run_dir / CKPT_DIR).mkdir(exist_ok=True)
        members.append(m)
    show = sys.stderr.isatty() if progress is None else progress
    todo = []
    for m in members:
        m.setup()
        if m.resume is not None:
            st = m.resume
            m.step, m.diverged = st["step"], st["diverged"]
            m.rows, m.tokens, m.root, m.manifest = st["rows"], st["tokens"], st["root"], st["manifest"]
            for h, hs in zip(m.hooks, st["hooks"]):
                h.load_state_dict(hs)
            log.info("%s: resuming at step %d", m.run_id, m.step)
        if not (m.diverged or m.step >= last_step(m.spec)):
            todo.append(m)
        else:  # finished earlier: restore its final weights so outputs match the state
            m.model.load_state_dict({**m.model.state_dict(), **m.resume["params"]})
    for start in sorted({m.step for m in todo}):
        group = [m for m in todo if m.step == start]
        Ensemble(group, start).run(show, stop_after)
    return [_write_outputs(m) if m.diverged or m.step >= last_step(m.spec) else None for m in members]


def train_run(spec: dict, run_dir: str | Path, progress: bool | None = None) -> pd.DataFrame:
    """Train one run to completion (an ensemble of one); return its metrics table."""
    return train_ensemble([spec], [run_dir], progress)[0]


def cli(argv: list[str]) -> None:
    import argparse
    import json
    import time

    from .config import member_specs

    ap = argparse.ArgumentParser(prog="iclnoise train",
                                 description="Train runs as one ensemble (resumes from their resume states).")
    ap.add_argument("--spec", required=True, help="a run spec as JSON (iclnoise.config.run_spec), or @file.json; "
                    "with --runs, the spec shared by the ensemble (its keys are replaced per run)")
    ap.add_argument("--runs", default=None, help="comma-separated run ids of the ensemble (default: the spec's run)")
    ap.add_argument("--results", default="results", help="run directories are <results>/runs/<run>")
    ap.add_argument("--run-dir", default=None, help="the run directory of a single run (no --runs)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    a = ap.parse_args(argv)
    spec = json.loads(Path(a.spec[1:]).read_text() if a.spec.startswith("@") else a.spec)
    torch.set_num_threads(a.threads)
    if a.runs:
        specs = member_specs(spec, a.runs.split(","))
        dirs = [Path(a.results) / "runs" / s["keys"]["run_id"] for s in specs]
    else:
        specs, dirs = [spec], [Path(a.run_dir or Path(a.results) / "runs" / spec["keys"]["run_id"])]
    t0 = time.time()
    out = train_ensemble(specs, dirs, a.progress)
    steps = sum(int(m.step.iloc[-1]) for m in out)
    for s, m in zip(specs, out):
        last = m.iloc[-1]
        print(f"{s['keys']['run_id']}: {int(last.step)} steps; ood_loss {last.ood_loss:.4f} (dMMSE "
              f"{last.ood_loss_dmmse:.4f}, ridge {last.ood_loss_ridge:.4f}); r {last.r:.3f}"
              f"{'; DIVERGED' if last.diverged else ''}")
    print(f"{len(specs)} runs, {steps} run-steps in {time.time() - t0:.1f}s")
