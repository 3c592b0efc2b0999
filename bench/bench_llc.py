"""Our vmapped LLC estimator against devinterp 2.0.1 on the same checkpoint and hyperparameters.

Both run in this process, one after the other, on the same data; the script prints both
estimates (mean ± sd over chains) and the time ratio. Usage:
  python bench/bench_llc.py [--chains 8] [--draws 300] [--threads 2] [--d-model 32]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from iclnoise.llc import LLCConfig, estimate_llc, sgld_chains
from iclnoise.model import ModelConfig, build_model, mse_loss
from iclnoise.tasks import BatchSampler, task_pool


class DevinterpAdapter(nn.Module):
    """devinterp 2.0.1 calls model.to(device, print_details=False) (a HookedTransformer signature)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return self.inner(x, y)

    def to(self, *a, print_details: bool = False, **k):
        return super().to(*a, **k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chains", type=int, default=8)
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from devinterp.slt.llc import llc as devinterp_llc

    K, D = 8, 4
    model = build_model(ModelConfig(D=D, K=K, d_model=a.d_model, n_layers=2, n_heads=2, d_mlp=2 * a.d_model), 0)
    sampler = BatchSampler(task_pool(0, 16, D), K, D, 0.125, 0)
    opt = torch.optim.AdamW(model.parameters(), 2e-3)
    for i in range(500):  # a checkpoint past initialisation
        b = sampler.batch(i, 64)
        opt.zero_grad()
        mse_loss(model, b.xs, b.ys).backward()
        opt.step()
    data = BatchSampler(task_pool(0, 16, D), K, D, 0.125, 0, stream=2).batch(0, a.n)
    nbeta = a.n / math.log(a.n)
    cfg = LLCConfig(epsilon=3e-4, gamma=100.0, nbeta=nbeta, chains=a.chains, burn_in=0, draws=a.draws,
                    batch=a.batch, n=a.n)

    def per_token_loss(m, input_ids):
        x = input_ids[:, :K * D].reshape(-1, K, D).float()
        y = input_ids[:, K * D:].float()
        return ((m(x, y) - y).square().mean(1) / D)[:, None].expand(-1, input_ids.shape[1] - 1)

    ds = Dataset.from_dict({"input_ids": torch.cat([data.xs.reshape(a.n, -1), data.ys], 1).tolist()}).with_format("torch")
    t0 = time.perf_counter()
    ref = devinterp_llc(DevinterpAdapter(model), ds, {}, lr=cfg.epsilon, n_beta=nbeta, localization=cfg.gamma,
                        num_chains=a.chains, num_draws=a.draws, batch_size=a.batch, num_burnin_steps=0,
                        num_init_loss_batches=a.n // a.batch, loss_fn=per_token_loss, device="cpu")
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = estimate_llc(model, mse_loss, data.xs, data.ys, cfg)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    sgld_chains(model, mse_loss, data.xs, data.ys, cfg, vectorize=False)
    t_loop = time.perf_counter() - t0
    print(f"checkpoint: ICLTransformer d_model={a.d_model}, {sum(p.numel() for p in model.parameters())} params; "
          f"{a.chains} chains x {a.draws} draws, batch {a.batch}, n={a.n}, threads={a.threads}")
    print(f"  devinterp 2.0.1   λ̂ = {float(ref.llc_mean):7.3f} ± {float(ref.llc_std):.3f}   {t_ref:7.2f} s")
    print(f"  iclnoise (vmap)   λ̂ = {ours.llc_mean:7.3f} ± {ours.llc_std:.3f}   {t_ours:7.2f} s")
    print(f"  iclnoise (loop over chains, same numbers)            {t_loop:7.2f} s")
    print(f"speed-up vs devinterp: {t_ref / t_ours:.2f}x; vmap vs loop: {t_loop / t_ours:.2f}x")


if __name__ == "__main__":
    main()
