"""Counterfactual noise replay of a run directory (SPEC §13, CNR; issue 46): a run's final metrics had its injected
noise been another, predicted from the run without retraining it. The formulas, and the approximations they make,
are iclnoise.cnr's; this module builds their inputs from a run and adds its own:

- trajectory: the run is replayed from step 0 by the training engine in a scratch directory (its initialisation,
  data stream and injection are seeded, so the replay is the run: `replayed` beside `observed` in cnr.parquet shows
  it). A run keeps only its latest resume state, so step 0 is the nearest state of every step; forward-mode
  products go the way training goes, so the paths ride along (`Replayer`) and nothing is stored;
- update map: AdamW's step on the state (θ, m): m' = β1 m + (1 − β1) c_t ∇L_t(θ), θ' = θ(1 − η_t wd) − η_t A_t m' /
  (1 − β1ⁿ), with A_t = 1/(√v̂ + ε) frozen at the value the step used (v's own response to the perturbation, weight
  1 − β2 per step, is dropped), c_t the run's clip factor held, and ∇L_t on the first `jac_batch`
  sequences of the step's batch (a sub-sampled Jacobian: the sub-batch's curvature stands for the batch's);
- noise: grad source enters m and θ through the step above (ε ~ N(0, s_t R'_t), clipped by c_t); param source
  η_t A_t ε into θ (isotropic: τ² I, τ² P = η² s Tr(A R' A)); R'_t the injector's at that step;
- counterfactuals (`counterfactual`): `none`, `self*k` (the run's own noise, covariance × k), or a noise condition
  of params.yaml (× k) whose level is open loop (emulate_batch): its R' is shaped from the gradient covariance
  measured on the replayed trajectory every exposure.every steps; closed-loop levels (budget, controlled) are
  refused, since their scale depends on the counterfactual run itself; a counterfactual's grad-source noise is
  clipped by the run's own clip factors.

Cost: one training run (the replay) plus, per step, a JVP of a JVP of the gradient on `jac_batch` sequences for
every path: (1 + counterfactuals) × probes paths, all counterfactuals in one pass.
"""
from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch
from torch.func import functional_call, grad, vmap

from .cnr import estimate, metric_terms, propagate
from .ensemble import Ensemble, Member
from .exposure import AdamState, grad_noise, group_grads, preconditioner
from .grid import spec_hash
from .hooks import Unrecorded
from .injection import NoiseInjector
from .io import read_parquet
from .model import mse_loss
from .noise import shaped_covariance
from .predictors import token_losses
from .runs import CKPT_DIR, read_spec
from .sections import NoiseCondition, RunSpec
from .tasks import _seed_mix

METRICS = ("ood_loss", "r", "delta_dmmse", "delta_ridge", "ood_delta_dmmse", "ood_delta_ridge")
CNR_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("counterfactual", pa.string()), pa.field("metric", pa.string()),
    pa.field("observed", pa.float64()),    # the run's final value (metrics.parquet)
    pa.field("replayed", pa.float64()),    # the same metric on the replayed trajectory (equal up to rounding)
    pa.field("delta", pa.float64()),       # predicted change of E f (second order, iclnoise.cnr)
    pa.field("se", pa.float64()),          # its standard error from the probes
    pa.field("sd_draw", pa.float64()),     # the spread one realisation adds (noise draws)
    pa.field("lo", pa.float64()), pa.field("hi", pa.float64()),   # observed + delta ± 1.96 √(se² + sd_draw²)
    pa.field("predicted", pa.float64()),   # observed + delta
    pa.field("probes", pa.int64()),
    pa.field("seconds", pa.float64()),     # the replay with every counterfactual's paths (one pass for all)
])
SPEC = re.compile(r"(?P<name>[A-Za-z0-9_]+)(?:\*(?P<k>[0-9.]+(?:[eE][-+]?[0-9]+)?))?")


@dataclass(frozen=True)
class Counterfactual:
    """`text` as given; `noise` the condition injected (None: none); `own`: the run's own noise; `factor` × R'."""

    text: str
    noise: NoiseCondition | None
    own: bool
    factor: float


def counterfactual(text: str, conditions: dict, spec: RunSpec) -> Counterfactual:
    """Parse NAME or NAME*k (NAME: none, self, or a key of noise.conditions); refuse what CNR cannot replay."""
    m = SPEC.fullmatch(text)
    if m is None:
        raise ValueError(f"counterfactual {text!r}: expected NAME or NAME*k (e.g. none, self*2, grad_b16*0.5)")
    name, k = m["name"], float(m["k"] or 1.0)
    if name == "none" or k == 0:
        return Counterfactual(text, None, False, 0.0)
    if name == "self":
        if spec.noise.source == "none":
            raise ValueError(f"counterfactual {text!r}: run {spec.keys.run_id} injects no noise to scale; name a "
                             f"noise condition instead")
        return Counterfactual(text, spec.noise, True, k)
    if name not in conditions:
        raise ValueError(f"counterfactual {text!r}: {name!r} is not a noise condition of params.yaml "
                         f"(noise.conditions: {', '.join(sorted(conditions))}; or none, self)")
    cond = NoiseCondition.from_dict({k2: v for k2, v in conditions[name].items() if k2 not in ("batch_sizes", "M")})
    if cond.source == "none":
        return Counterfactual(text, None, False, 0.0)
    if cond.emulate_batch is None:
        raise ValueError(f"counterfactual {text!r}: noise condition {name!r} sets its level in closed loop (budget "
                         f"or target), which depends on the counterfactual run itself; CNR replays open-loop "
                         f"levels only: use self*k on a run of that condition, or an emulate_batch condition")
    return Counterfactual(text, cond, False, k)


class Replayer(Unrecorded):
    """A step hook (iclnoise.hooks protocol) that carries CNR's paths forward beside the replayed run: every step, the
    previous step's noise draws are added and every path goes through this step's linearised update (module
    docstring); `finish` adds the last draws and returns (first, second) per path group. Put last, so the injector
    has set this step's covariance before it reads it; it writes nothing into the run."""

    name, schema = "cnr", pa.schema([pa.field("step", pa.int64())])

    def __init__(self, spec: RunSpec, model: torch.nn.Module, cfs: list[Counterfactual], injector: NoiseInjector | None,
                 probes: int, jac_batch: int, seed: int):
        self.spec, self.model, self.injector = spec, model, injector
        self.groups = [None, *cfs]          # group 0: the run's own noise; then one per counterfactual
        self.probes, self.jac_batch, self.seed = probes, jac_batch, seed
        o = spec.train.optimizer
        self.beta1, self.wd = o.betas[0], o.weight_decay
        self.unflat, theta = _functional(model)
        self.P = theta.numel()
        cov_cf = [c for c in cfs if c.noise is not None and not c.own]
        self.every = spec.exposure.every if cov_cf else None
        self.n_groups = spec.exposure.groups if cov_cf else 0
        self.noise, self.measured, self.covs = None, None, {}
        self.delta: torch.Tensor | None = None   # (groups · probes, 2P): state (θ, m) perturbations
        self.e: torch.Tensor | None = None
        self.pending: dict | None = None
        self.windows = [None if c is None or c.noise is None or c.own else
                        c.noise.window(spec.train.steps) for c in self.groups]

    # ------------------------------------------------------------ the hook
    def on_grads(self, ctx) -> None:
        b, adam = ctx.batch, ctx.adam
        if self.every is not None and (self.measured is None or ctx.step - self.measured >= self.every):
            K = min(self.n_groups, len(b))
            self.noise = grad_noise(group_grads(ctx.model, ctx.loss_fn, b.xs, b.ys, K), len(b) // K)
            self.measured = ctx.step
        m = (torch.zeros(self.P, device=b.xs.device) if adam.exp_avg is None
             else torch.cat([v.detach().reshape(-1) for v in adam.exp_avg]))
        self.now = {"step": ctx.step, "theta": torch.cat([p.detach().reshape(-1) for p in ctx.model.parameters()]),
                    "m": m.clone(), "a": preconditioner(adam).detach().clone(), "lr": ctx.lr,
                    "bc1": 1 - self.beta1 ** ((adam.step or 0) + 1), "xs": b.xs[:self.jac_batch],
                    "ys": b.ys[:self.jac_batch], "cov": None if self.injector is None else self.injector.cov,
                    "noise": self.noise}

    def on_update(self, ctx) -> None:
        now, self.now = self.now, None
        now["clip"], now["a_step"] = ctx.clip_coef, step_preconditioner(ctx.adam)
        self._add_noise()
        if self.delta is not None:
            x, phi = torch.cat([now["theta"], now["m"]]), self._phi(now)
            if self.e is None:
                self.delta, self.e = vmap(lambda d: propagate(phi, x, d, None))(self.delta)
            else:
                self.delta, self.e = vmap(lambda d, e: propagate(phi, x, d, e))(self.delta, self.e)
        self.pending = now

    # ------------------------------------------------------------ the linearised step and its noise
    def _phi(self, now: dict):
        """AdamW's step on the state (θ, m), A frozen at the value the step used, the clip factor held."""
        P, b1, lr, wd, a, bc1, c = self.P, self.beta1, now["lr"], self.wd, now["a_step"], now["bc1"], now["clip"]
        g = grad(lambda th: mse_loss(lambda u, v: functional_call(self.model, self.unflat(th), (u, v)), now["xs"],
                                     now["ys"]))

        def phi(x: torch.Tensor) -> torch.Tensor:
            theta, m = x[:P], x[P:]
            m2 = b1 * m + (1 - b1) * c * g(theta)
            return torch.cat([theta * (1 - lr * wd) - lr * a * m2 / bc1, m2])
        return phi

    def _add_noise(self) -> None:
        """Add the pending step's draws to every path (the injector's row of that step is written by now)."""
        now = self.pending
        if now is None:
            return
        row = self.injector.rows()[-1] if self.injector is not None else None
        draws = [self._draw(g, now, row, k) for g in range(len(self.groups)) for k in range(self.probes)]
        if all(d is None for d in draws):
            return
        zero = torch.zeros(2 * self.P, device=now["a"].device, dtype=now["a"].dtype)
        w = torch.stack([zero if d is None else d for d in draws])
        self.delta = w if self.delta is None else self.delta + w

    def _draw(self, g: int, now: dict, row: dict | None, k: int) -> torch.Tensor | None:
        """Path k of group g: the step's noise in (θ, m) space, ε from the generator of (seed, step, k) (paired)."""
        cf = self.groups[g]
        if cf is None or cf.own:
            if row is None or not row["active"] or row["scale"] <= 0:
                return None
            cond, cov = self.spec.noise, now["cov"]
            var = row["scale"] * (cf.factor if cf is not None else 1.0)   # s_t (× k)
            clip = math.sqrt(row["clip_coef"])
        else:
            if cf.noise is None or not (self.windows[g][0] <= now["step"] < self.windows[g][1]):
                return None
            cond, var, clip = cf.noise, cf.factor, now["clip"] if cf.noise.source == "grad" else 1.0
            key = (id(now["noise"]), g)
            if key not in self.covs:
                coef = 1.0 / cond.emulate_batch - 1.0 / self.spec.keys.batch
                self.covs = {kk: v for kk, v in self.covs.items() if kk[0] == key[0]}
                self.covs[key] = shaped_covariance(now["noise"], coef, cond.shape, cond.rank or 0)[0]
            cov = self.covs[key]
        gen = torch.Generator(device=now["a"].device).manual_seed(_seed_mix(self.seed, now["step"], k))
        eps, a, lr, zero = cov.sample(gen) * math.sqrt(var), now["a"], now["lr"], torch.zeros_like(now["a"])
        if cond.source == "grad":   # through the step's AdamW; param noise is shaped by A before it (the injector's)
            z = (1 - self.beta1) * clip * eps
            return torch.cat([-lr * now["a_step"] * z / now["bc1"], z])
        if cond.shape == "isotropic":
            tau2 = lr ** 2 * var * float((a.square() * cov.diag()).sum()) / a.numel()
            return torch.cat([math.sqrt(tau2) * torch.randn(a.numel(), generator=gen, device=a.device,
                                                            dtype=a.dtype), zero])
        return torch.cat([lr * a * eps, zero])

    def finish(self, f, theta_T: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(first, second) per group, each (probes, metrics), after the last step's draws."""
        self._add_noise()
        self.pending = None
        x = torch.cat([theta_T, torch.zeros_like(theta_T)])
        fx = lambda y: f(y[:self.P])  # noqa: E731 - the metrics read θ only
        zero = torch.zeros(self.probes, *fx(x).shape, dtype=x.dtype)
        if self.delta is None:
            return [(zero, zero)] * len(self.groups)
        if self.e is None:
            first, second = vmap(lambda d: metric_terms(fx, x, d, None))(self.delta)
        else:
            first, second = vmap(lambda d, e: metric_terms(fx, x, d, e))(self.delta, self.e)
        n = self.probes
        return [(first[g * n:(g + 1) * n], second[g * n:(g + 1) * n]) for g in range(len(self.groups))]


def step_preconditioner(adam: AdamState) -> torch.Tensor:
    """The A an AdamW step used, read after it: v̂ with the step's own bias correction (`adam.step` is the count
    before the step; before the first, v̂_1 = g²)."""
    if adam.exp_avg_sq is None:
        return preconditioner(adam).detach().clone()
    return preconditioner(dataclasses.replace(adam, step=(adam.step or 0) + 1)).detach().clone()


def _functional(model: torch.nn.Module):
    """(θ ↦ parameter dict, flat θ of the model) for torch.func over a flat parameter vector."""
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]

    def unflat(theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(p.shape) for (n, p), t in zip(named, theta.split(sizes))}
    return unflat, torch.cat([p.detach().reshape(-1) for _, p in named])


def metric_fn(model: torch.nn.Module, evaluator) -> callable:
    """θ ↦ the METRICS of iclnoise.evaluate as a differentiable tensor (Δ(f, g) = mean token loss of f against g)."""
    unflat, _ = _functional(model)
    s, D = evaluator.splits, evaluator.D
    nan = torch.tensor(math.nan)

    def f(theta: torch.Tensor) -> torch.Tensor:
        p = {k: functional_call(model, unflat(theta), (s[k].batch.xs, s[k].batch.ys)) for k in ("id", "ood")}

        def dist(split, ref):
            return nan.to(theta) if ref is None else token_losses(p[split], ref, D).mean()
        dd, dr = dist("id", s["id"].dmmse), dist("id", s["id"].ridge)
        return torch.stack([token_losses(p["ood"], s["ood"].batch.ys, D).mean(), dd / (dd + dr), dd, dr,
                            dist("ood", s["ood"].dmmse), dist("ood", s["ood"].ridge)])
    return f


def replay_run(run_dir: str | Path, names: list[str], conditions: dict, probes: int = 16, jac_batch: int = 16,
               seed: int = 0, device: str = "cpu") -> pd.DataFrame:
    """CNR_SCHEMA rows: every counterfactual of `names` (see `counterfactual`) × METRICS, for the run in run_dir."""
    run_dir = Path(run_dir)
    raw = {k: v for k, v in read_spec(run_dir).items() if k != "spec_hash"}
    spec = RunSpec.of(raw)
    cfs = [counterfactual(n, conditions, spec) for n in names]   # every name checked before the replay
    observed = read_parquet(run_dir / "metrics.parquet").iloc[-1]
    need = any(c.noise is not None and not c.own for c in cfs)
    if need and spec.exposure is None:
        raise ValueError(f"{run_dir}: the run has no exposure section, which the counterfactual conditions' "
                         f"covariances are measured with")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="cnr-") as tmp:
        m = Member(spec, Path(tmp), spec_hash(raw), torch.device(device))
        m.setup()
        (Path(tmp) / CKPT_DIR).mkdir()
        injector = next((h for h in m.hooks if isinstance(h, NoiseInjector)), None)
        rep = Replayer(spec, m.model, cfs, injector, probes, jac_batch, seed)
        m.hooks.append(rep)
        Ensemble([m], 0, "cnr").run(False)
        m.model.eval()
        f = metric_fn(m.model, m.evaluator)
        theta_T = _functional(m.model)[1].clone()
        paths = rep.finish(f, theta_T)
        replayed = f(theta_T).detach()
    seconds = time.time() - t0
    out = []
    for cf, (fu, su) in zip(cfs, paths[1:]):
        est = estimate(fu, su, *paths[0])
        lo, hi = est.interval()
        for i, name in enumerate(METRICS):
            obs = float(observed[name])
            out.append({"run_id": spec.keys.run_id, "counterfactual": cf.text, "metric": name, "observed": obs,
                        "replayed": float(replayed[i]), "delta": float(est.delta[i]), "se": float(est.se[i]),
                        "sd_draw": float(est.sd_draw[i]), "lo": obs + float(lo[i]), "hi": obs + float(hi[i]),
                        "predicted": obs + float(est.delta[i]), "probes": probes, "seconds": seconds})
    return pd.DataFrame(out, columns=CNR_SCHEMA.names)
