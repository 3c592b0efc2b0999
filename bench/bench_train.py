"""Training-step throughput, measured side by side in one process (ratios, not absolute times).

  ours    : on-device vectorised BatchSampler + the hooked ICLTransformer + AdamW (the train loop)
  plain   : the same weights through a plain-PyTorch forward that calls no HookPoint modules
  naive   : a per-sample IterableDataset + DataLoader feeding the same model (the seed-004 pattern)

Usage: python bench/bench_train.py [--steps 300] [--batch 64] [--threads 1] [--device cpu]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from iclnoise.core.model import ICLTransformer, ModelConfig, build_model, encode
from iclnoise.core.tasks import BatchSampler, task_pool


def plain_forward(m: ICLTransformer, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """ICLTransformer's computation written out with its parameters, without hook modules."""
    h = m.embed(encode(xs, ys)) + m.pos_embed[: 2 * xs.shape[1]]
    for b in m.blocks:
        a, x = b.attn, b.ln1(h)
        q = torch.einsum("bpd,hde->bphe", x, a.W_Q) + a.b_Q
        k = torch.einsum("bpd,hde->bphe", x, a.W_K) + a.b_K
        v = torch.einsum("bpd,hde->bphe", x, a.W_V) + a.b_V
        n = x.shape[1]
        s = (torch.einsum("bqhe,bkhe->bhqk", q, k) * a.scale).masked_fill(a.mask[:n, :n], float("-inf"))
        z = torch.einsum("bhqk,bkhe->bqhe", F.softmax(s, -1), v)
        h = h + torch.einsum("bqhe,hed->bqd", z, a.W_O) + a.b_O
        h = h + b.mlp.fc_out(F.gelu(b.mlp.fc_in(b.ln2(h))))
    return m.unembed(m.ln_final(h)[:, 0::2]).squeeze(-1)


class PerSampleDataset(IterableDataset):
    """One sequence per __next__, as in the seed conversation's data loader."""

    def __init__(self, pool: torch.Tensor, K: int, noise_var: float):
        self.pool, self.K, self.s = pool, K, math.sqrt(noise_var)

    def __iter__(self):
        while True:
            t = self.pool[torch.randint(0, len(self.pool), (1,)).item()]
            x = torch.randn(self.K, self.pool.shape[1])
            yield x, x @ t + self.s * torch.randn(self.K)


def timed(fn, steps: int, warmup: int = 20) -> float:
    for i in range(warmup):
        fn(i)
    t0 = time.perf_counter()
    for i in range(steps):
        fn(i)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--D", type=int, default=4)
    ap.add_argument("--K", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cfg = ModelConfig(D=a.D, K=a.K, d_model=a.d_model, n_layers=2, n_heads=2, d_mlp=2 * a.d_model)
    pool = task_pool(0, 64, a.D)
    sampler = BatchSampler(pool, a.K, a.D, 0.125, data_seed=0, device=dev)
    loader = iter(DataLoader(PerSampleDataset(pool, a.K, 0.125), batch_size=a.batch))

    def make_step(forward, batch_fn):
        model = build_model(cfg, 0, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            xs, ys = batch_fn(i)
            opt.zero_grad(set_to_none=True)
            loss = (forward(model, xs, ys) - ys).square().mean()
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return step

    def ours_batch(i):
        b = sampler.batch(i, a.batch)
        return b.xs, b.ys

    def naive_batch(i):
        xs, ys = next(loader)
        return xs.to(dev), ys.to(dev)

    variants = {
        "ours": make_step(lambda m, x, y: m(x, y), ours_batch),
        "plain": make_step(plain_forward, ours_batch),
        "naive": make_step(lambda m, x, y: m(x, y), naive_batch),
    }
    # interleave rounds so that machine noise hits every variant alike
    times = {k: [] for k in variants}
    for _ in range(3):
        for k, fn in variants.items():
            times[k].append(timed(fn, a.steps // 3))
    best = {k: min(v) for k, v in times.items()}
    print(f"device={dev} threads={a.threads} batch={a.batch} D={a.D} K={a.K} d_model={a.d_model} "
          f"params={sum(p.numel() for p in build_model(cfg, 0).parameters())}")
    for k, t in best.items():
        print(f"  {k:6s} {1e3 * t:8.3f} ms/step   ratio to ours: {t / best['ours']:.2f}x")
    print(f"hook overhead (ours / plain): {best['ours'] / best['plain']:.3f}x; "
          f"naive loader / ours: {best['naive'] / best['ours']:.2f}x")


if __name__ == "__main__":
    main()
