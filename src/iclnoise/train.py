"""The training loop: AdamW, lr schedules, clipping, micro-batches, checkpoints, exact resume (SPEC §4).

A run directory holds `run.json`, `checkpoints/step_XXXXXXX.pt` (model, optimizer, scheduler,
hook states and the metric rows so far) and, once finished, `metrics.parquet`,
`token_losses.parquet`, `root_preds.parquet` and one table per step hook. Killing a run and
starting it again resumes from the last checkpoint and ends with the same numbers: the data
stream is counter-based (batch = f(seed, step)) and every other state is in the checkpoint.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch import nn
from tqdm import tqdm

from .evaluate import METRICS_SCHEMA, TOKEN_SCHEMA, Evaluator, root_preds_schema
from .io import atomic_path, write_json, write_parquet
from .model import ModelConfig, build_model, mse_loss
from .schedules import checkpoint_steps, lr_lambda
from .tasks import M_INF, Batch, BatchSampler, task_pool

CKPT_DIR = "checkpoints"


@dataclass
class StepContext:
    step: int                      # 0-based index of the update being made
    total_steps: int
    model: nn.Module
    optimizer: torch.optim.AdamW
    batch: Batch                   # the full effective batch of this step
    micro_batch: int
    lr: float                      # η_t used by this update
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    heldout: Callable[[int, int], Batch]   # heldout(step, size): q_M batch never used for training
    grad_norm: float | None = None # pre-clip global gradient norm
    clip_coef: float = 1.0         # factor clipping applied to the gradient


class StepHook(Protocol):
    """Noise injection and exposure logging plug in here (see iclnoise.noise.build_hooks)."""

    name: str
    schema: pa.Schema

    def on_grads(self, ctx: StepContext) -> None: ...
    def on_update(self, ctx: StepContext) -> None: ...
    def rows(self) -> list[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / CKPT_DIR).glob("step_*.pt"))
    return ckpts[-1] if ckpts else None


def _save(obj: dict, path: Path) -> None:
    final, tmp = atomic_path(path)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _build_hooks(spec: dict, device: torch.device) -> list[StepHook]:
    noise = spec.get("noise") or {"source": "none"}
    if noise.get("source", "none") == "none" and not spec.get("exposure"):
        return []
    from .noise import build_hooks  # the noise module owns every hook
    return build_hooks(spec, device)


def train_run(spec: dict, run_dir: str | Path, progress: bool | None = None) -> pd.DataFrame:
    """Train one run to completion (resuming if checkpoints exist); return its metrics table."""
    run_dir = Path(run_dir)
    keys, data, tcfg = spec["keys"], spec["data"], spec["train"]
    device = resolve_device(tcfg.get("device", "auto"))
    seed, total, B, mb = keys["seed"], tcfg["steps"], keys["batch"], tcfg["micro_batch"]
    n_micro = B // mb
    write_json(spec, run_dir / "run.json")

    mcfg = ModelConfig(D=data["D"], K=data["K"], **spec["model"])
    model = build_model(mcfg, seed, device)
    o = tcfg["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]),
                            weight_decay=o["weight_decay"], eps=o["eps"], fused=True)
    s = tcfg["lr_schedule"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(s["kind"], total, s.get("warmup_frac", 0.0), s.get("min_lr_frac", 0.0)))
    pool = None if keys["M"] == M_INF else task_pool(data["pool_seed"], keys["M"], data["D"])
    sampler = BatchSampler(pool, data["K"], data["D"], data["noise_var"], seed, device, stream=0)
    heldout = BatchSampler(pool, data["K"], data["D"], data["noise_var"], seed, device, stream=1)
    hooks = _build_hooks(spec, device)
    evaluator = Evaluator(spec, device)
    ckpt_at = set(checkpoint_steps(total, tcfg["checkpoints"]["linear"], tcfg["checkpoints"]["log"]))

    rows: list[dict] = []
    tokens: list[dict] = []
    root: list[dict] = []
    start, diverged, loss_sum, loss_n = 0, False, 0.0, 0
    last = latest_checkpoint(run_dir)
    if last is not None:
        state = torch.load(last, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        for h, hs in zip(hooks, state["hooks"]):
            h.load_state_dict(hs)
        rows, tokens, root = state["rows"], state["tokens"], state["root"]
        start, diverged = state["step"], state["diverged"]

    def checkpoint(step: int, lr: float) -> None:
        metrics, tok, preds = evaluator(model)
        train_loss = loss_sum / loss_n if loss_n else math.nan
        rows.append({**keys, "step": step, "sequences": step * B, "lr": lr, "train_loss": train_loss,
                     **metrics, "diverged": diverged})
        tokens.extend({"run_id": keys["run_id"], "step": step, "split": split, "k": k + 1, "loss": float(v)}
                      for split, arr in tok.items() for k, v in enumerate(arr))
        root.append({"run_id": keys["run_id"], "step": step, "preds": preds.astype(np.float32)})
        _save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
               "hooks": [h.state_dict() for h in hooks], "rows": rows, "tokens": tokens, "root": root,
               "step": step, "diverged": diverged, "model_config": mcfg.to_dict()},
              run_dir / CKPT_DIR / f"step_{step:07d}.pt")

    if start == 0 and not rows:
        checkpoint(0, sched.get_last_lr()[0])
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(range(start, total), initial=start, total=total, desc=keys["run_id"], disable=not show,
               mininterval=1.0 if show else 30.0, dynamic_ncols=True)
    step = start
    for step in bar:
        if diverged:
            break
        lr = sched.get_last_lr()[0]
        batch = sampler.batch(step, B)
        opt.zero_grad(set_to_none=True)
        loss_val = 0.0
        for micro in (batch.split(n_micro) if n_micro > 1 else [batch]):
            loss = mse_loss(model, micro.xs, micro.ys) / n_micro
            loss.backward()
            loss_val += loss.item()
        if not math.isfinite(loss_val) or loss_val > tcfg["diverge_loss"]:
            diverged = True
            print(f"[{keys['run_id']}] diverged at step {step}: loss {loss_val:.4g}", file=sys.stderr)
            break
        loss_sum, loss_n = loss_sum + loss_val, loss_n + 1
        ctx = StepContext(step, total, model, opt, batch, mb, lr, mse_loss, heldout.batch)
        for h in hooks:
            h.on_grads(ctx)
        if tcfg["grad_clip"] is not None:
            norm = float(nn.utils.clip_grad_norm_(model.parameters(), tcfg["grad_clip"]))
            ctx.grad_norm, ctx.clip_coef = norm, min(1.0, tcfg["grad_clip"] / (norm + 1e-6))
        opt.step()
        sched.step()
        for h in hooks:
            h.on_update(ctx)
        if step + 1 in ckpt_at:
            checkpoint(step + 1, sched.get_last_lr()[0])
            loss_sum, loss_n = 0.0, 0
            bar.set_postfix(loss=f"{rows[-1]['train_loss']:.3f}", ood=f"{rows[-1]['ood_loss']:.3f}")
    bar.close()
    if diverged and not rows[-1]["diverged"]:  # record the state at divergence, flagged; drop nothing
        if rows[-1]["step"] == step:
            rows.pop(), root.pop()
            tokens[:] = [t for t in tokens if t["step"] != step]
        checkpoint(step, sched.get_last_lr()[0])

    metrics = pd.DataFrame(rows)[METRICS_SCHEMA.names]
    write_parquet(pd.DataFrame(tokens), run_dir / "token_losses.parquet", TOKEN_SCHEMA)
    write_parquet(pd.DataFrame(root), run_dir / "root_preds.parquet",
                  root_preds_schema(spec["eval"]["n_root"] * data["K"]))
    for h in hooks:
        write_parquet(pd.DataFrame(h.rows(), columns=h.schema.names), run_dir / f"{h.name}.parquet", h.schema)
    write_parquet(metrics, run_dir / "metrics.parquet", METRICS_SCHEMA)  # last: it marks the run complete
    return metrics


def cli(argv: list[str]) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="iclnoise train", description="Train one run (resumes from checkpoints).")
    ap.add_argument("--spec", required=True, help="the run spec as JSON (iclnoise.config.run_spec), or @file.json")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    a = ap.parse_args(argv)
    spec = json.loads(Path(a.spec[1:]).read_text() if a.spec.startswith("@") else a.spec)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    m = train_run(spec, a.run_dir, a.progress)
    last = m.iloc[-1]
    print(f"{spec['keys']['run_id']}: {int(last.step)} steps in {time.time() - t0:.1f}s; "
          f"ood_loss {last.ood_loss:.4f} (dMMSE {last.ood_loss_dmmse:.4f}, ridge {last.ood_loss_ridge:.4f}); "
          f"r {last.r:.3f}{'; DIVERGED' if last.diverged else ''}")
