"""Their own modules on our checkpoints (issue 29): is our `arch: dtransformer` their network, and does their
sampler read what ours reads?

Loads a checkpoint of ours into their `InContextRegressionTransformer` (timaeus-research/icl, src/icl/regression/
model.py and dtransformer.py; the weights rearranged, not changed), prints the largest difference between the
two forward passes on 512 fresh sequences, and with --chains runs their `SGLD` optimizer (src/icl/analysis/sgld.py)
as their sample loop does (fresh batches from q_∞, the loss read before each step), from that checkpoint or from
their own initialisation (--their-init SEED), printing L(w*), the chains' mean sampled loss and λ̂, per D.
Their code is imported from a clone, never copied here:

  git clone https://github.com/timaeus-research/icl /tmp/icl
  python experiments/reproductions/hoogland_theircode.py --icl /tmp/icl/src \\
      --run-dir results/hoogland/runs/Minf-B256-none-s0 --step 984 --chains 2
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
import torch.nn.functional as F


def their_weights(ours: dict, n_layers: int, n_heads: int) -> dict:
    """Our dtransformer state dict in their module names and layouts (Q, K, V interleaved per head)."""
    p = "token_sequence_transformer."
    t = {p + "token_embedding.weight": ours["embed.weight"], p + "postn_embedding.weight": ours["pos_embed"].T,
         p + "unembedding.0.weight": ours["ln_final.weight"], p + "unembedding.0.bias": ours["ln_final.bias"],
         p + "unembedding.1.weight": ours["unembed.weight"], p + "unembedding.1.bias": ours["unembed.bias"]}
    for i in range(n_layers):
        b, q = f"{p}blocks.{i}.", f"blocks.{i}."
        qkv = [ours[q + f"attn.W_{n}"] for n in "QKV"]          # (heads, d, d_head) each
        t[b + "attention.attention.weight"] = torch.cat([w[h].T for h in range(n_heads) for w in qkv], 0)
        t[b + "attention.output.weight"] = ours[q + "attn.W_O"].flatten(0, 1).T
        for j, n in enumerate(["ln1", "ln2"]):
            for w in ("weight", "bias"):
                t[b + f"layer_norms.{j}.{w}"] = ours[q + f"{n}.{w}"]
        for j, n in [(0, "fc_in"), (2, "fc_out")]:
            for w in ("weight", "bias"):
                t[b + f"compute.{j}.{w}"] = ours[q + f"mlp.{n}.{w}"]
    return t


def regression_batch(B: int, K: int, D: int, noise_var: float, g: torch.Generator):
    ws, xs = torch.randn(B, D, 1, generator=g, device=g.device), torch.randn(B, K, D, generator=g, device=g.device)
    return xs, xs @ ws + math.sqrt(noise_var) * torch.randn(B, K, 1, generator=g, device=g.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--icl", required=True, help="the src/ folder of a timaeus-research/icl clone")
    ap.add_argument("--run-dir", required=True, help="one of our configs/hoogland.yaml runs")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--their-init", type=int, help="sample from their initialisation (torch.manual_seed) instead")
    ap.add_argument("--chains", type=int, default=0, help="SGLD chains to run (0: forward check only)")
    ap.add_argument("--burn-in", type=int, default=0)
    ap.add_argument("--draws", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--epsilon", type=float, default=3e-4)
    ap.add_argument("--nbeta", type=float, default=66.67, help="in their loss units (ours / D)")
    ap.add_argument("--gamma", type=float, default=6.6667)
    ap.add_argument("--seed", type=int, default=0, help="chain c draws its noise from torch.manual_seed(seed + c)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where their chains run (the forward check runs on the CPU)")
    a = ap.parse_args()
    sys.path.insert(0, a.icl)
    sys.path.insert(0, "src")
    from icl.analysis.sgld import SGLD
    from icl.regression.model import InContextRegressionTransformer

    from iclnoise.run import runs

    torch.set_num_threads(a.threads)
    spec = runs.read_spec(a.run_dir)
    d, m = spec["data"], spec["model"]
    D, K = d["D"], d["K"]
    ours = runs.load_model(a.run_dir, a.step, "cpu")

    def theirs(seed: int = 0):
        torch.manual_seed(seed)
        return InContextRegressionTransformer(D, K, m["d_model"], m["d_mlp"], m["n_heads"], m["n_layers"],
                                              layer_norm=m["layer_norm"], include_output=True)

    model = theirs()
    missing, unexpected = model.load_state_dict(their_weights(ours.state_dict(), m["n_layers"], m["n_heads"]),
                                                strict=False)
    assert not unexpected and all("causal_mask" in k for k in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(a.seed)
    xs, ys = regression_batch(512, K, D, d["noise_var"], g)
    with torch.no_grad():
        diff = (ours(xs, ys[..., 0]) - model(xs, ys)[..., 0]).abs().max().item()
    print(f"step {a.step}: max |ours − theirs| over 512 sequences = {diff:.3g}", flush=True)
    if not a.chains:
        return
    if a.their_init is not None:
        model = theirs(a.their_init)
    model.to(a.device)
    g = torch.Generator(a.device).manual_seed(a.seed)
    with torch.no_grad():   # L(w*) over 2^16 fresh sequences (their init loss: over their 2^20-sequence set)
        init = sum(F.mse_loss(model(*b), b[1]).item() for b in
                   (regression_batch(8192, K, D, d["noise_var"], g) for _ in range(8))) / 8
    means = []
    for c in range(a.chains):
        t0 = time.perf_counter()
        torch.manual_seed(a.seed + c)
        chain = copy.deepcopy(model).train()   # their sample loop: a deep copy of w* per chain
        n = 2 ** 20   # their temperature is n / nβ, and their step multiplies the gradient by n / temperature = nβ
        opt = SGLD(chain.parameters(), lr=a.epsilon, elasticity=a.gamma, temperature=n / a.nbeta, num_samples=n)
        losses = []
        for i in range(a.burn_in + a.draws):
            xb, yb = regression_batch(a.batch, K, D, d["noise_var"], g)
            opt.zero_grad()
            loss = F.mse_loss(chain(xb, yb), yb)
            loss.backward()
            opt.step()
            if i >= a.burn_in:
                losses.append(loss.item())
        means.append(sum(losses) / len(losses))
        print(f"  chain {c}: mean sampled loss {means[-1] / D:.4f} per D ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    level = sum(means) / len(means)
    print(f"{'their init ' + str(a.their_init) if a.their_init is not None else 'step ' + str(a.step)}: "
          f"L(w*) {init / D:.4f}, sampled {level / D:.4f} per D, λ̂ = {a.nbeta * (level - init):.1f}")


if __name__ == "__main__":
    main()
