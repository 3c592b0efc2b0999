"""Local learning coefficient by localized SGLD (SPEC §7), all chains batched with torch.func.

    λ̂(w*) = nβ · (E_w[L_n(w)] − L_n(w*)),   w ~ exp(−nβ L_n(w) − (γ/2)‖w − w*‖²)
    w ← w − (ε/2)(nβ ∇L_batch(w) + γ (w − w*)) + N(0, ε I)

E_w is the mean mini-batch loss over the post-burn-in draws of every chain (the loss at the
current w, computed in the same pass as the gradient); L_n(w*) is the full-data loss at w*.
Each chain owns a generator seeded by (seed, chain), so results do not depend on how many
chains run together, in which order, or whether they run vmapped or in a loop.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from torch.func import functional_call, grad_and_value, vmap
from tqdm import tqdm

from .io import KEY_FIELDS, read_json, read_parquet, write_parquet

LossFn = Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LLCConfig:
    epsilon: float = 3e-4       # SGLD step size ε
    gamma: float = 100.0        # localization γ
    nbeta: float | None = None  # n·β; None = n / log n
    chains: int = 4
    burn_in: int = 100
    draws: int = 100
    batch: int = 64             # SGLD mini-batch (sequences)
    n: int = 1024               # size of the sampling dataset
    micro_batches: int = 1      # split each SGLD mini-batch for the gradient (memory only)
    seed: int = 0
    trace_points: int = 50      # trace length kept in llc_traces.parquet

    def resolved_nbeta(self) -> float:
        return self.nbeta if self.nbeta is not None else self.n / math.log(self.n)


@dataclass
class LLCResult:
    llc_mean: float
    llc_std: float
    llc_per_chain: np.ndarray
    init_loss: float
    traces: np.ndarray           # (chains, burn_in + draws) mini-batch losses
    nbeta: float
    flags: dict = field(default_factory=dict)


def _chain_generators(seed: int, chains: list[int], device) -> list[torch.Generator]:
    gens = []
    for c in chains:
        g = torch.Generator(device=device)
        g.manual_seed(int(np.random.SeedSequence([seed, c, 0x5C1D]).generate_state(1)[0]))
        gens.append(g)
    return gens


def sgld_chains(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                cfg: LLCConfig, chains: list[int] | None = None, vectorize: bool = True,
                progress: bool = False) -> np.ndarray:
    """Run localized SGLD chains from the model's parameters; return losses (chains, steps)."""
    chains = list(range(cfg.chains)) if chains is None else chains
    C, steps, n = len(chains), cfg.burn_in + cfg.draws, xs.shape[0]
    nbeta, eps, gamma = cfg.resolved_nbeta(), cfg.epsilon, cfg.gamma
    w0 = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    w = {k: v.unsqueeze(0).repeat(C, *[1] * v.dim()).clone() for k, v in w0.items()}
    gens = _chain_generators(cfg.seed, chains, xs.device)

    def loss_at(params, x, y):
        return loss_fn(lambda a, b: functional_call(model, (params, buffers), (a, b)), x, y)

    def grad_loss(params, x, y):
        if cfg.micro_batches == 1:
            return grad_and_value(loss_at)(params, x, y)
        g_tot, l_tot = None, 0.0
        for xm, ym in zip(x.chunk(cfg.micro_batches), y.chunk(cfg.micro_batches)):
            g, l_ = grad_and_value(loss_at)(params, xm, ym)
            wgt = xm.shape[0] / x.shape[0]
            g_tot = {k: v * wgt for k, v in g.items()} if g_tot is None else {k: g_tot[k] + v * wgt for k, v in g.items()}
            l_tot = l_tot + l_ * wgt
        return g_tot, l_tot

    batched = vmap(grad_loss) if vectorize else None
    losses = torch.empty(C, steps, dtype=torch.float64)
    for t in tqdm(range(steps), disable=not progress, desc="SGLD", mininterval=5):
        idx = torch.stack([torch.randint(0, n, (cfg.batch,), generator=g, device=xs.device) for g in gens])
        if vectorize:
            grads, loss = batched(w, xs[idx], ys[idx])
        else:
            outs = [grad_loss({k: v[c] for k, v in w.items()}, xs[idx[c]], ys[idx[c]]) for c in range(C)]
            grads = {k: torch.stack([o[0][k] for o in outs]) for k in w}
            loss = torch.stack([o[1] for o in outs])
        losses[:, t] = loss.detach().double().cpu()
        with torch.no_grad():
            for k, v in w.items():
                noise = torch.stack([torch.randn(v.shape[1:], generator=g, device=v.device) for g in gens])
                v.add_(grads[k] * nbeta + gamma * (v - w0[k]), alpha=-0.5 * eps).add_(noise, alpha=math.sqrt(eps))
    return losses.numpy()


@torch.no_grad()
def full_loss(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor, chunk: int = 4096) -> float:
    tot = 0.0
    for s in range(0, xs.shape[0], chunk):
        tot += float(loss_fn(model, xs[s:s + chunk], ys[s:s + chunk])) * xs[s:s + chunk].shape[0]
    return tot / xs.shape[0]


def diagnose(traces: np.ndarray, init_loss: float, nbeta: float, burn_in: int) -> dict:
    """Flags: diverged (non-finite or exploding trace), negative estimate, not levelled off.

    Not levelled: a least-squares line through the chain-mean trace over the draws rises (or
    falls) by more than 20 % of E[L] − L(w*) across the draws, with a slope t-statistic > 3.
    """
    draws = traces[:, burn_in:]
    finite = bool(np.isfinite(draws).all())
    exploded = (not finite) or draws.max() > init_loss + 100 * max(abs(init_loss), 1e-3)
    not_levelled = False
    if finite and draws.shape[1] >= 8:
        y = draws.mean(0)
        x = np.arange(len(y), dtype=float)
        slope, icpt = np.polyfit(x, y, 1)
        resid = y - (slope * x + icpt)
        se = math.sqrt(resid.var(ddof=2) / ((x - x.mean()) ** 2).sum())
        gap = abs(y.mean() - init_loss)
        not_levelled = bool(abs(slope) * len(y) > 0.2 * gap and abs(slope) > 3 * se)
    return {"diverged": bool(exploded), "negative": bool(finite and nbeta * (draws.mean() - init_loss) < 0),
            "not_levelled": not_levelled}


def estimate_llc(model: torch.nn.Module, loss_fn: LossFn, xs: torch.Tensor, ys: torch.Tensor,
                 cfg: LLCConfig, vectorize: bool = True, progress: bool = False) -> LLCResult:
    """λ̂ at the model's current parameters on the sampling dataset (xs, ys) of size n."""
    if xs.shape[0] != cfg.n:
        raise ValueError(f"sampling dataset has {xs.shape[0]} sequences, config says n = {cfg.n}")
    init = full_loss(model, loss_fn, xs, ys)
    traces = sgld_chains(model, loss_fn, xs, ys, cfg, vectorize=vectorize, progress=progress)
    nbeta = cfg.resolved_nbeta()
    per_chain = nbeta * (traces[:, cfg.burn_in:].mean(1) - init)
    return LLCResult(float(per_chain.mean()), float(per_chain.std(ddof=1)) if len(per_chain) > 1 else 0.0,
                     per_chain, init, traces, nbeta, diagnose(traces, init, nbeta, cfg.burn_in))


# ---------------------------------------------------------------- per-run pipeline step

LLC_SCHEMA = pa.schema(KEY_FIELDS + [
    pa.field("step", pa.int64()), pa.field("llc_mean", pa.float64()), pa.field("llc_std", pa.float64()),
    pa.field("llc_se", pa.float64()), pa.field("llc_per_chain", pa.list_(pa.float64())),
    pa.field("init_loss", pa.float64()), pa.field("mean_sampling_loss", pa.float64()),
    pa.field("diverged", pa.bool_()), pa.field("negative", pa.bool_()), pa.field("not_levelled", pa.bool_()),
    pa.field("epsilon", pa.float64()), pa.field("gamma", pa.float64()), pa.field("nbeta", pa.float64()),
    pa.field("chains", pa.int64()), pa.field("burn_in", pa.int64()), pa.field("draws", pa.int64()),
    pa.field("batch_size", pa.int64()), pa.field("n", pa.int64()), pa.field("seconds", pa.float64()),
])
TRACE_SCHEMA = pa.schema([pa.field("run_id", pa.string()), pa.field("step", pa.int64()),
                          pa.field("chain", pa.int64()), pa.field("sgld_step", pa.int64()),
                          pa.field("loss", pa.float64())])


def select_steps(steps: list[int], every: int) -> list[int]:
    """Every `every`-th checkpoint (from the first) plus always the last."""
    steps = sorted(steps)
    chosen = steps[::max(1, every)]
    return chosen if chosen[-1] == steps[-1] else chosen + [steps[-1]]


def sampling_data(spec: dict, n: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences from the run's own training distribution q_M, on a stream training never uses."""
    from .tasks import M_INF, BatchSampler, task_pool

    d, k = spec["data"], spec["keys"]
    pool = None if k["M"] == M_INF else task_pool(d["pool_seed"], k["M"], d["D"])
    b = BatchSampler(pool, d["K"], d["D"], d["noise_var"], k["seed"], device, stream=2).batch(0, n)
    return b.xs, b.ys


def load_checkpoint_model(run_dir: Path, step: int, device="cpu") -> torch.nn.Module:
    from .model import ModelConfig, build_model

    state = torch.load(run_dir / "checkpoints" / f"step_{step:07d}.pt", map_location=device, weights_only=False)
    model = build_model(ModelConfig(**state["model_config"]), 0, device)
    model.load_state_dict(state["model"])
    return model


def llc_for_run(run_dir: str | Path, cfg: LLCConfig, every: int = 1, progress: bool = True) -> pd.DataFrame:
    """Estimate the LLC at the selected checkpoints of a run; write llc.parquet and llc_traces.parquet."""
    from .model import mse_loss

    run_dir = Path(run_dir)
    spec = read_json(run_dir / "run.json")
    metrics = read_parquet(run_dir / "metrics.parquet")
    xs, ys = sampling_data(spec, cfg.n)
    rows, traces = [], []
    for step in tqdm(select_steps(metrics.step.tolist(), every), desc=f"LLC {spec['keys']['run_id']}",
                     disable=not progress, mininterval=5):
        model = load_checkpoint_model(run_dir, step)
        t0 = time.time()
        r = estimate_llc(model, mse_loss, xs, ys, cfg)
        rows.append({**spec["keys"], "step": step, "llc_mean": r.llc_mean, "llc_std": r.llc_std,
                     "llc_se": r.llc_std / math.sqrt(cfg.chains), "llc_per_chain": r.llc_per_chain.tolist(),
                     "init_loss": r.init_loss, "mean_sampling_loss": float(r.traces[:, cfg.burn_in:].mean()),
                     **r.flags, "epsilon": cfg.epsilon, "gamma": cfg.gamma, "nbeta": r.nbeta,
                     "chains": cfg.chains, "burn_in": cfg.burn_in, "draws": cfg.draws, "batch_size": cfg.batch,
                     "n": cfg.n, "seconds": time.time() - t0})
        keep = np.unique(np.linspace(0, r.traces.shape[1] - 1, min(cfg.trace_points, r.traces.shape[1])).astype(int))
        traces += [{"run_id": spec["keys"]["run_id"], "step": step, "chain": c, "sgld_step": int(t),
                    "loss": float(r.traces[c, t])} for c in range(cfg.chains) for t in keep]
    df = pd.DataFrame(rows)
    write_parquet(pd.DataFrame(traces), run_dir / "llc_traces.parquet", TRACE_SCHEMA)
    write_parquet(df, run_dir / "llc.parquet", LLC_SCHEMA)
    return df


def cli(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="iclnoise llc", description="LLC per checkpoint of one run.")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--sampler", default="{}", help="JSON of LLCConfig fields (params.yaml llc.sampler)")
    ap.add_argument("--every", type=int, default=1, help="every k-th checkpoint (the last always)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    df = llc_for_run(a.run_dir, LLCConfig(**json.loads(a.sampler)), a.every)
    print(df[["step", "llc_mean", "llc_std", "not_levelled", "negative", "diverged", "seconds"]].to_string(index=False))


def cli_llc_calibrate(argv: list[str]) -> None:
    """Sweep ε × γ on one checkpoint; plot the traces so a user can pick settings."""
    import matplotlib.pyplot as plt

    from .figures import style
    from .model import mse_loss

    ap = argparse.ArgumentParser(prog="iclnoise llc-calibrate", description=cli_llc_calibrate.__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the last)")
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3])
    ap.add_argument("--gammas", type=float, nargs="+", default=[10.0, 100.0, 1000.0])
    ap.add_argument("--cfg", default="{}", help="JSON of other LLCConfig fields")
    ap.add_argument("--out", default=None, help="output stem (default: <run-dir>/llc_calibration)")
    a = ap.parse_args(argv)
    run_dir = Path(a.run_dir)
    spec = read_json(run_dir / "run.json")
    steps = read_parquet(run_dir / "metrics.parquet").step.tolist()
    step = a.step if a.step is not None else max(steps)
    base = LLCConfig(**json.loads(a.cfg))
    xs, ys = sampling_data(spec, base.n)
    model = load_checkpoint_model(run_dir, step)
    style.setup()
    fig, axes = plt.subplots(len(a.gammas), len(a.epsilons), figsize=(3 * len(a.epsilons), 2.4 * len(a.gammas)),
                             squeeze=False, sharex=True)
    rows = []
    for i, g in enumerate(a.gammas):
        for j, e in enumerate(a.epsilons):
            cfg = LLCConfig(**{**asdict(base), "epsilon": e, "gamma": g})
            r = estimate_llc(model, mse_loss, xs, ys, cfg)
            ax = axes[i, j]
            for tr in r.traces:
                ax.plot(r.nbeta * (tr - r.init_loss), lw=0.7)
            ax.axvline(cfg.burn_in, color="grey", ls=":")
            ax.axhline(0, color="black", lw=0.5)
            bad = [k for k, v in r.flags.items() if v]
            ax.set_title(f"ε={e:g} γ={g:g}\nλ̂={r.llc_mean:.2f}±{r.llc_std:.2f}" + (f" [{', '.join(bad)}]" if bad else ""),
                         fontsize=8, color="firebrick" if bad else "black")
            rows.append({"epsilon": e, "gamma": g, "llc_mean": r.llc_mean, "llc_std": r.llc_std, **r.flags})
    for ax in axes[-1]:
        ax.set_xlabel("SGLD step")
    for ax in axes[:, 0]:
        ax.set_ylabel("nβ·(L − L(w*))")
    fig.suptitle(f"LLC calibration, {spec['keys']['run_id']} step {step}: pick the largest ε whose traces level "
                 f"off without divergence, and the smallest γ that keeps chains local", fontsize=9)
    fig.tight_layout()
    out = Path(a.out) if a.out else run_dir / "llc_calibration"
    table = pd.DataFrame(rows)
    style.save_figure(fig, out, table)
    print(table.to_string(index=False))
    print(f"wrote {out}.png")
