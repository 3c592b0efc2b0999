"""Refined (weight-restricted) LLC per component: ours against devinterp 2.0.1 on one checkpoint of a default run.

Ours: iclnoise.probes.refined.refined_llcs, every component of the checkpoint in ONE batched SGLD pass (rows
component-major).
Theirs: devinterp.slt.llc.llc with `param_masks`, one run per component (its chains one after the other): head
masks from devinterp's own `create_param_masks(model, "l{i}h{h}")` (the model is TransformerLens-shaped, so devinterp
reads its heads itself; they equal ours, tests/test_refined.py), the other components' masks from
iclnoise.probes.refined.components (devinterp's MLP / embed names are TransformerLens', not ours), "all" unrestricted.

Same checkpoint, sampling set (the run's `llc` stream, n sequences), loss (per-D MSE; devinterp sees it per token),
ε, γ, nβ, chains, draws, mini-batch; burn-in 0 for both because devinterp 2.0.1's `compute_llc` averages every step.
Default hyperparameters are params.yaml's llc.sampler (ε 3e-4, γ 100, nβ = n / log n, batch 32, n 1024) with
8 chains x 200 draws (no burn-in) instead of its 4 x (50 burn-in + 100 draws), to resolve a few per cent between
the two; about 6 minutes on one core. The settings used are in the CSV's header.

The checkpoint: --run-dir/--step, or (default) the last checkpoint of run M16-B64-none-s0 of the shipped
params.yaml (default arch: D 3, K 8, d_model 32, 3 layers, 2 heads), trained once into --cache (P-NE logging off).

Mini-batch control variate: each estimator is run once more at ε = 1e-12 (w stays at w*), which leaves only the
λ̂ its mini-batch sequence alone gives, nβ (mean L_batch(w*) − L_n(w*)). Every component sees the same sequence
(ours: chain c draws its batches from its own generator whatever the mask; devinterp: one loader order for every
chain of every run), so this offset is common to all components and, for devinterp, to all chains (which its
chain-spread s.e. cannot see). The *_cv columns subtract it chain by chain.

Writes reference/reproductions/rllc_devinterp.csv: '#' header lines (settings, offsets, times), then component,
n_params, ours, ours_se, theirs, theirs_se, rel_diff (ours / theirs − 1), z ((ours − theirs) / combined s.e.) and
the same six after the control variate (*_cv).
Usage: PYTHONPATH=src python experiments/reproductions/rllc_devinterp.py [--chains 8] [--draws 200] [--threads 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
from pathlib import Path

import pandas as pd
import torch
import yaml

from iclnoise.core.model import ICLTransformer, mse_loss
from iclnoise.core.runspec import RunSpec
from iclnoise.probes.llc import LLCConfig, estimate_llc
from iclnoise.probes.refined import components, n_moving, refined_llcs
from iclnoise.run import runs
from iclnoise.run.probing import sampling_data

HERE = Path(__file__).parent
DATA = HERE.parents[1] / "reference" / "reproductions"  # the tables and figures these scripts write
RUN_ID = "M16-B64-none-s0"


def se(per_chain) -> float:
    return float(per_chain.std(ddof=1) / math.sqrt(len(per_chain)))


class DevinterpModel(ICLTransformer):
    """Our model under its own parameter names; devinterp 2.0.1 calls model.to(device, print_details=False) on models
    with a `cfg.n_heads` (it takes them for TransformerLens models, and so reads their heads)."""

    def to(self, *a, print_details: bool = False, **k):
        return super().to(*a, **k)


def default_run(cache: Path) -> Path:
    """The shipped params.yaml's run M16-B64-none-s0, trained once (about a minute on one core)."""
    run_dir = cache / RUN_ID
    if runs.saved_steps(run_dir) if run_dir.exists() else []:
        return run_dir
    from iclnoise.config.grid import run_spec
    from iclnoise.config.validate import validate_params
    from iclnoise.run.train import train_run

    with open("params.yaml") as f:
        params = validate_params(yaml.safe_load(f))
    params["exposure"]["enabled"] = False
    t0 = time.perf_counter()
    train_run(run_spec(params, RUN_ID), run_dir, progress=False)
    print(f"trained {RUN_ID} into {run_dir} in {time.perf_counter() - t0:.0f} s")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--step", type=int, help="default: the run's last checkpoint")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/iclnoise_rllc_bench"))
    ap.add_argument("--chains", type=int, default=8)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--epsilon", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=100.0)
    ap.add_argument("--components", nargs="*", help="default: all of iclnoise.probes.refined.components")
    ap.add_argument("--seed", type=int, default=0, help="ours: chain seed; devinterp: init_seed 100 + seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DATA / "rllc_devinterp.csv")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from datasets import Dataset
    from devinterp.slt.llc import llc as devinterp_llc
    from devinterp.slt.weight_restrictions import create_param_masks

    run_dir = a.run_dir or default_run(a.cache)
    step = a.step if a.step is not None else runs.saved_steps(run_dir)[-1]
    model = runs.load_model(run_dir, step)
    spec = RunSpec.of(runs.read_spec(run_dir))
    K, D = spec.data.K, spec.data.D
    xs, ys = sampling_data(spec, a.n)
    cfg = LLCConfig(seed=a.seed, epsilon=a.epsilon, gamma=a.gamma, chains=a.chains, burn_in=0, draws=a.draws,
                    batch=a.batch, n=a.n)
    comps = components(model)
    comps = {k: comps[k] for k in a.components} if a.components else comps
    print(f"{run_dir} step {step}: {sum(p.numel() for p in model.parameters())} parameters, loss "
          f"{float(mse_loss(model, xs, ys).detach()):.4f} per D; {len(comps)} components, ε={cfg.epsilon:g} "
          f"γ={cfg.gamma:g} nβ={cfg.resolved_nbeta():.1f}, {a.chains} chains x {a.draws} draws, batch {a.batch}, "
          f"n={a.n}, {a.threads} thread(s)")

    t0 = time.perf_counter()
    ours = refined_llcs(model, mse_loss, xs, ys, cfg, comps=comps)
    t_ours = time.perf_counter() - t0
    print(f"ours: {len(comps)} components x {a.chains} chains in one pass, {t_ours:.1f} s")

    dm = DevinterpModel(model.cfg)
    dm.load_state_dict(model.state_dict())

    def per_token_loss(m, input_ids):  # regression data as float input_ids, as bench/bench_llc.py
        x = input_ids[:, :K * D].reshape(-1, K, D).float()
        y = input_ids[:, K * D:].float()
        return ((m(x, y) - y).square().mean(1) / D)[:, None].expand(-1, input_ids.shape[1] - 1)

    ds = Dataset.from_dict({"input_ids": torch.cat([xs.reshape(a.n, -1), ys], 1).tolist()}).with_format("torch")

    def theirs(masks, lr):  # per-chain λ̂ and init loss of one devinterp run
        ref = devinterp_llc(dm, ds, {}, lr=lr, n_beta=cfg.resolved_nbeta(), localization=cfg.gamma,
                            num_chains=a.chains, num_draws=a.draws, batch_size=a.batch, num_burnin_steps=0,
                            num_init_loss_batches=a.n // a.batch, loss_fn=per_token_loss, device="cpu",
                            param_masks=masks, init_seed=100 + a.seed)
        return ref.llc_per_chain.values.astype(float), float(ref.init_loss)

    # Mini-batch control variate: the same estimators at ε = 1e-12 (w stays at w*) see only their mini-batch
    # sequence, which every component shares (ours: chain c's generator; devinterp: one loader order for every
    # chain and run), so nβ (mean L_batch(w*) − L_n(w*)) is a common offset; subtracted per chain below.
    off_ours = estimate_llc(model, mse_loss, xs, ys, dataclasses.replace(cfg, epsilon=1e-12)).llc_per_chain
    off_theirs = theirs(None, 1e-12)[0]
    print(f"mini-batch offsets at ε = 1e-12: ours {off_ours.mean():+.3f} ± {se(off_ours):.3f}, devinterp "
          f"{off_theirs.mean():+.3f} ± {se(off_theirs):.3f} (one loader order for every chain)")

    rows, t_theirs = [], 0.0
    for name, masks in comps.items():
        if name == "all":
            theirs_masks = None
        elif re.fullmatch(r"l\d+h\d+", name):
            theirs_masks = create_param_masks(dm, name)
        else:
            theirs_masks = masks
        t0 = time.perf_counter()
        t_chains, t_init = theirs(theirs_masks, cfg.epsilon)
        dt = time.perf_counter() - t0
        t_theirs += dt
        o_chains = ours.llc[name].llc_per_chain
        row = {"component": name, "n_params": n_moving(model, masks)}
        for tag, oc, tc in (("", o_chains, t_chains), ("_cv", o_chains - off_ours, t_chains - off_theirs)):
            o, t, o_se, t_se = oc.mean(), tc.mean(), se(oc), se(tc)
            row |= {f"ours{tag}": o, f"ours{tag}_se": o_se, f"theirs{tag}": t, f"theirs{tag}_se": t_se,
                    f"rel_diff{tag}": o / t - 1, f"z{tag}": (o - t) / math.hypot(o_se, t_se)}
        rows.append(row)
        print(f"  {name:8s} {row['n_params']:6d} params  ours {row['ours']:7.3f} ± {row['ours_se']:.3f}   devinterp "
              f"{row['theirs']:7.3f} ± {row['theirs_se']:.3f}   rel {row['rel_diff']:+.1%} z {row['z']:+.2f}   "
              f"offsets subtracted: rel {row['rel_diff_cv']:+.1%} z {row['z_cv']:+.2f}   (devinterp {dt:.1f} s; init "
              f"loss {t_init:.5f} vs ours {ours.llc[name].init_loss:.5f})", flush=True)
    df = pd.DataFrame(rows)
    header = ["# refined LLC per component, ours (one batched pass) vs devinterp 2.0.1 (one run per component)",
              f"# checkpoint {run_dir.name} step {step}; seed {a.seed}; eps={cfg.epsilon:g} gamma={cfg.gamma:g} "
              f"nbeta={cfg.resolved_nbeta():.2f} chains={a.chains} draws={a.draws} burn_in=0 batch={a.batch} n={a.n} "
              f"(params.yaml llc.sampler has chains 4, draws 100 + 50 burn-in)",
              "# se = chain s.d. / sqrt(chains); z = (ours - theirs) / hypot(se); rel_diff = ours / theirs - 1",
              f"# *_cv: each chain minus the same estimator's value at eps = 1e-12 (its mini-batch sequence alone, "
              f"common to all components): ours {off_ours.mean():+.3f} +- {se(off_ours):.3f}, devinterp "
              f"{off_theirs.mean():+.3f} +- {se(off_theirs):.3f}",
              f"# |z| < 2 in {int((df.z.abs() < 2).sum())}/{len(df)} components, |z_cv| < 2 in "
              f"{int((df.z_cv.abs() < 2).sum())}/{len(df)}; mean rel_diff {df.rel_diff.mean():+.1%}, "
              f"mean rel_diff_cv {df.rel_diff_cv.mean():+.1%}",
              f"# wall time, {a.threads} thread(s): ours {t_ours:.1f} s (all components, one pass), devinterp "
              f"{t_theirs:.1f} s (one run per component), ratio ours/devinterp {t_ours / t_theirs:.3f}"]
    with open(a.out, "w") as f:
        f.write("\n".join(header) + "\n")
        df.to_csv(f, index=False, float_format="%.5g")
    print("\n".join(header[2:]))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
