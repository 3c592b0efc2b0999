"""Our vmapped LLC estimator against devinterp 2.0.1 on one Hoogland-setting checkpoint.

The checkpoint: iclnoise.core.model with D = 4, K = 16, 2 layers, 4 heads, d_model 64, MLP 64, layer norm,
trained with Adam (lr 3e-3, batch 64) on q_∞ for --train-steps steps so it is not at initialisation.
Both estimators run in this process, one after the other, on the same sampling set with the same
hyperparameters (Hoogland et al.'s ε = 1e-3, γ = 6, nβ = 60 in their loss units = 240 in ours, see
configs/hoogland.yaml; burn-in 0 because devinterp 2.0.1 averages over every step, burn-in included).
Prints both estimates (mean ± s.e. over chains), their relative difference, and the time ratio
ours / devinterp. Defaults fit 2 CPU cores; Hoogland's full settings are
  --chains 8 --draws 1000 --batch 1024 --n 131072   (GPU).
Usage: PYTHONPATH=src python bench/bench_llc.py [--method sgld|rmsprop_sgld] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from iclnoise.core.model import ModelConfig, build_model, mse_loss
from iclnoise.core.tasks import BatchSampler
from iclnoise.probes.llc import LLCConfig, estimate_llc
from iclnoise.probes.sgld import sgld_chains


class DevinterpAdapter(nn.Module):
    """devinterp 2.0.1 calls model.to(device, print_details=False) (a HookedTransformer signature)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)

    def to(self, *a, print_details: bool = False, **k):
        return super().to(*a, **k)


def hoogland_checkpoint(train_steps: int, device: str) -> tuple[nn.Module, int, int]:
    K, D = 16, 4
    model = build_model(ModelConfig(D=D, K=K, d_model=64, n_layers=2, n_heads=4, d_mlp=64, layer_norm=True), 0, device)
    sampler = BatchSampler(None, K, D, 0.125, 0, device)          # q_∞: a fresh task per sequence
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    for i in range(train_steps):
        b = sampler.batch(i, 64)
        opt.zero_grad()
        mse_loss(model, b.xs, b.ys).backward()
        opt.step()
    return model, K, D


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--epsilon", type=float, default=1e-3)
    ap.add_argument("--gamma", type=float, default=6.0)
    ap.add_argument("--nbeta", type=float, default=240.0)
    ap.add_argument("--method", default="sgld", choices=["sgld", "rmsprop_sgld"])
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--run-dir", help="a trained configs/hoogland.yaml run (e.g. results/hoogland/runs/"
                    "Minf-B256-none-s0): its checkpoint at --step instead of the --train-steps model")
    ap.add_argument("--step", type=int, default=985)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loop", action="store_true", help="also time our chains in a Python loop (no vmap)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from devinterp.slt.llc import llc as devinterp_llc

    t0 = time.perf_counter()
    if a.run_dir:
        from iclnoise.run import runs
        model, K, D = runs.load_model(a.run_dir, a.step, a.device), 16, 4
        a.train_steps = a.step
    else:
        model, K, D = hoogland_checkpoint(a.train_steps, a.device)
    data = BatchSampler(None, K, D, 0.125, 0, a.device, stream=2).batch(0, a.n)
    with torch.no_grad():
        loss = float(mse_loss(model, data.xs, data.ys))
    print(f"checkpoint: {sum(p.numel() for p in model.parameters())} parameters, {a.train_steps} Adam steps "
          f"({time.perf_counter() - t0:.0f} s); loss {loss:.4f} per D")
    cfg = LLCConfig(seed=0, epsilon=a.epsilon, gamma=a.gamma, nbeta=a.nbeta, chains=a.chains, burn_in=0, draws=a.draws,
                    batch=a.batch, n=a.n, method=a.method)

    def per_token_loss(m, input_ids):
        x = input_ids[:, :K * D].reshape(-1, K, D).float()
        y = input_ids[:, K * D:].float()
        return ((m(x, y) - y).square().mean(1) / D)[:, None].expand(-1, input_ids.shape[1] - 1)

    rows = torch.cat([data.xs.reshape(a.n, -1), data.ys], 1).cpu().tolist()
    ds = Dataset.from_dict({"input_ids": rows}).with_format("torch")
    t0 = time.perf_counter()
    ref = devinterp_llc(DevinterpAdapter(model), ds, {}, lr=cfg.epsilon, n_beta=cfg.nbeta, localization=cfg.gamma,
                        num_chains=a.chains, num_draws=a.draws, batch_size=a.batch, num_burnin_steps=0,
                        num_init_loss_batches=a.n // a.batch, loss_fn=per_token_loss, device=a.device,
                        sampling_method="rmsprop_sgld" if a.method == "rmsprop_sgld" else "sgmcmc_sgld")
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = estimate_llc(model, mse_loss, data.xs, data.ys, cfg)
    t_ours = time.perf_counter() - t0
    se_ref, se_ours = float(ref.llc_std) / math.sqrt(a.chains), ours.llc_std / math.sqrt(a.chains)
    rel = (ours.llc_mean - float(ref.llc_mean)) / float(ref.llc_mean)
    print(f"{a.method}: ε={cfg.epsilon:g} γ={cfg.gamma:g} nβ={cfg.nbeta:g}, {a.chains} chains x {a.draws} draws, "
          f"batch {a.batch}, n={a.n}, threads={a.threads}, device={a.device}")
    print(f"  devinterp 2.0.1   λ̂ = {float(ref.llc_mean):8.3f} ± {se_ref:.3f} (s.e.)  init loss "
          f"{float(ref.init_loss):.5f}  mean sampled loss {float(ref.init_loss) + float(ref.llc_mean) / cfg.nbeta:.4f}"
          f"   {t_ref:7.1f} s")
    print(f"  iclnoise (vmap)   λ̂ = {ours.llc_mean:8.3f} ± {se_ours:.3f} (s.e.)  init loss "
          f"{ours.init_loss:.5f}  mean sampled loss {ours.traces.mean():.4f}   {t_ours:7.1f} s   "
          f"MALA acceptance {ours.mala_accept:.3f}")
    print(f"relative difference ours/devinterp − 1 = {rel:+.1%} (combined s.e. "
          f"{math.hypot(se_ref, se_ours) / float(ref.llc_mean):.1%})")
    print(f"time ratio ours/devinterp = {t_ours / t_ref:.2f}")
    if a.loop:
        t0 = time.perf_counter()
        sgld_chains(model, mse_loss, data.xs, data.ys, cfg, vectorize=False)
        t_loop = time.perf_counter() - t0
        print(f"  iclnoise (Python loop over chains, same numbers) {t_loop:7.1f} s; vmap/loop = {t_ours / t_loop:.2f}")


if __name__ == "__main__":
    main()
