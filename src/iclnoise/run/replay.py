"""Counterfactual noise replay of a run directory (method §13, CNR; issue 46): a run's final metrics had its injected
noise been another, predicted from the run without retraining it. The formulas, and the approximations they make,
are iclnoise.noise.cnr's; this module builds their inputs from a run and adds its own:

- trajectory: the run is replayed by the training engine in a scratch directory, from step 0 or from one of its
  resume states at t0 (`state`: a windowed replay, the counterfactual noise over [t0, T] only, cost ∝ T − t0); its
  initialisation, data stream and injection are seeded and its resume is bitwise, so the replay is the run
  (`replayed` beside `observed` in cnr.parquet shows it). Forward-mode products go the way training goes, so the
  paths ride along (`Replayer`) and nothing is stored;
- update map (`adamw_map`): AdamW's step on the whole state x = (θ, m, v), m' = β1 m + (1 − β1) c g,
  v' = β2 v + (1 − β2) c² g², θ' = θ(1 − η wd) − η a(v') m' / (1 − β1ⁿ), a(v') = 1/(√(v'/(1 − β2ⁿ)) + ε): its
  tangent map is AdamW's Jacobian in (θ, m, v) (checked against finite differences of torch's AdamW), so a
  perturbation renormalises through v as AdamW does, to first order. Held: the clip factor c_t (its dependence on
  ‖g‖ dropped); a = 0 on the round-off coordinates where the step's a is (iclnoise.core.adam; AdamW moves them by
  round-off). The gradient is the recorded one (the injected gradient noise in) plus the change of the gradient on
  the first `jac_batch` sequences of the step's batch (a sub-sampled Jacobian: the sub-batch's curvature stands
  for the batch's), so the map passes through the recorded state;
- noise: grad source is an input of the step (ε ~ N(0, s_t R'_t) added to g before the held clip), so its first
  order and its drift (v's growth by (1 − β2) c² ε², the smaller steps that follow) come from the map; param
  source η_t A_t ε is added to θ after the step (isotropic: τ² I, τ² P = η² s Tr(A R' A)), with A_t the injector's
  (before the first update A = 1/(|g_0| + ε) of one batch, v̂_1 = g_0²: the run's own, replayed as it was) and its
  dependence on the perturbed v dropped (a product of the draw and the perturbation: zero mean, higher order);
  R'_t the injector's at that step;
- counterfactuals (`counterfactual`): `none`, `self*k` (the run's own noise, covariance × k), or a noise condition
  of params.yaml (× k) whose level is open loop (emulate_batch): its R' is shaped from the gradient covariance
  measured on the replayed trajectory every exposure.every steps; closed-loop levels (budget, controlled) are
  refused, since their scale depends on the counterfactual run itself; a counterfactual's grad-source noise is
  clipped by the run's own clip factors.

Cost: the replay (training from t0) plus, per step, a JVP of a JVP of the gradient on `jac_batch` sequences for
every path: (1 + counterfactuals) × probes paths, all counterfactuals in one pass. `Replayer.norms` keeps the RMS
‖δθ‖ and ‖eθ‖ of the run's own noise's paths after each step (one realisation's displacement, linearised, and the
drift: the diagnostics of where the expansion leaves its range, experiments/reproductions/cnr_paths.py).
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

from ..config.grid import spec_hash
from ..core.io import read_parquet
from ..core.model import mse_loss
from ..core.predictors import token_losses
from ..core.runspec import RunSpec
from ..core.sections import NoiseCondition
from ..core.tasks import seed_mix
from ..noise import shaped_covariance
from ..noise.cnr import Map, estimate, metric_terms, propagate, propagate1
from ..noise.exposure import AdamState, grad_noise, group_grads, preconditioner
from ..noise.hooks import Unrecorded
from ..noise.injection import NoiseInjector
from .ensemble import Ensemble
from .member import Member
from .runs import CKPT_DIR, load_torch, read_spec

METRICS = ("ood_loss", "r", "delta_dmmse", "delta_ridge", "ood_delta_dmmse", "ood_delta_ridge")
CNR_SCHEMA = pa.schema([
    pa.field("run_id", pa.string()), pa.field("counterfactual", pa.string()), pa.field("metric", pa.string()),
    pa.field("observed", pa.float64()),    # the run's final value (metrics.parquet)
    pa.field("replayed", pa.float64()),    # the same metric on the replayed trajectory (equal up to rounding)
    pa.field("delta", pa.float64()),       # predicted change of E f (second order, iclnoise.noise.cnr)
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
        if spec.noise.layers and spec.noise.shape == "isotropic":
            raise ValueError(f"counterfactual {text!r}: run {spec.keys.run_id}'s isotropic noise is on some layers "
                             f"(noise.layers), which this replay does not restrict; iclnoise cnr retrains it")
        if spec.noise.source == "none":
            raise ValueError(f"counterfactual {text!r}: run {spec.keys.run_id} injects no noise to scale; name a "
                             f"noise condition instead")
        return Counterfactual(text, spec.noise, True, k)
    if name not in conditions:
        raise ValueError(f"counterfactual {text!r}: {name!r} is not a noise condition of params.yaml "
                         f"(noise.conditions: {', '.join(sorted(conditions))}; or none, self)")
    cond = NoiseCondition.from_dict({k2: v for k2, v in conditions[name].items() if k2 not in ("batch_sizes", "M")})
    if cond.layers:
        raise ValueError(f"counterfactual {text!r}: noise condition {name!r} is on some layers (noise.layers), which "
                         f"this replay does not restrict; iclnoise cnr retrains it")
    if cond.source == "none":
        return Counterfactual(text, None, False, 0.0)
    if cond.emulate_batch is None:
        raise ValueError(f"counterfactual {text!r}: noise condition {name!r} sets its level in closed loop (budget "
                         f"or target), which depends on the counterfactual run itself; CNR replays open-loop "
                         f"levels only: use self*k on a run of that condition, or an emulate_batch condition")
    return Counterfactual(text, cond, False, k)


class Replayer(Unrecorded):
    """A step hook (iclnoise.noise.hooks protocol) that carries CNR's paths forward beside the replayed run. Each step's
    record (state, gradient, clip factor) is kept at `on_update`; at the next step's `on_grads` (or `finish`), once
    the injector has written that step's row, every path goes through the step's linearised update (module
    docstring), gradient-source draws entering it as inputs, and parameter-source draws are added after it. Put
    last, so the injector has set this step's covariance and gradient noise before it reads them; it writes nothing
    into the run."""

    name, schema = "cnr", pa.schema([pa.field("step", pa.int64())])
    order = 2   # the expansion carried: 2, (δ, e); 1, δ alone (its second-order term `e` stays None: zero)

    def __init__(self, spec: RunSpec, model: torch.nn.Module, cfs: list[Counterfactual], injector: NoiseInjector | None,
                 probes: int, jac_batch: int, seed: int):
        self.spec, self.model, self.injector = spec, model, injector
        self.groups = [None, *cfs]          # group 0: the run's own noise; then one per counterfactual
        self.probes, self.jac_batch, self.seed = probes, jac_batch, seed
        o = spec.train.optimizer
        self.betas, self.wd, self.eps = tuple(o.betas), o.weight_decay, o.eps
        self.unflat, theta = _functional(model)
        self.P = theta.numel()
        cov_cf = [c for c in cfs if c.noise is not None and not c.own]
        self.every = spec.exposure.every if cov_cf else None
        self.n_groups = spec.exposure.groups if cov_cf else 0
        self.noise, self.measured, self.covs = None, None, {}
        self.delta: torch.Tensor | None = None   # (groups · probes, 3P): state (θ, m, v) perturbations
        self.e: torch.Tensor | None = None
        self.now: dict | None = None
        self.pending: dict | None = None
        self.norms: list[tuple[int, float, float]] = []   # (step, RMS ‖δθ‖, RMS ‖eθ‖ of the own noise's paths)
        self.windows = [None if c is None or c.noise is None or c.own else
                        c.noise.window(spec.train.steps) for c in self.groups]

    # ------------------------------------------------------------ the hook
    def on_grads(self, ctx) -> None:
        self._advance()
        b, adam = ctx.batch, ctx.adam
        if self.every is not None and (self.measured is None or ctx.step - self.measured >= self.every):
            K = min(self.n_groups, len(b))
            self.noise = grad_noise(group_grads(ctx.model, ctx.loss_fn, b.xs, b.ys, K), len(b) // K)
            self.measured = ctx.step
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
        theta = flat(ctx.model.parameters())
        zero = torch.zeros_like(theta)
        self.now = {"step": ctx.step, "theta": theta,
                    "m": zero if adam.exp_avg is None else flat(adam.exp_avg),
                    "v": zero if adam.exp_avg_sq is None else flat(adam.exp_avg_sq),
                    "n": adam.step or 0, "g": flat(p.grad for p in ctx.model.parameters()),  # the injector's noise in
                    "a": preconditioner(adam).detach().clone(), "lr": ctx.lr,
                    "xs": b.xs[:self.jac_batch], "ys": b.ys[:self.jac_batch],
                    "cov": None if self.injector is None else self.injector.cov, "noise": self.noise}

    def on_update(self, ctx) -> None:
        now, self.now = self.now, None
        now["clip"], now["live"] = float(ctx.clip_coef), step_preconditioner(ctx.adam) > 0
        self.pending = now

    def _advance(self) -> None:
        """The pending step: every path through its linearised update, its draws added (the injector's row of that
        step is written by now)."""
        now, self.pending = self.pending, None
        if now is None:
            return
        row = self.injector.rows()[-1] if self.injector is not None else None
        draws = [self._draw(g, now, row, k) for g in range(len(self.groups)) for k in range(self.probes)]
        P, n = self.P, len(draws)
        grad_in = any(d is not None and d[0] == "grad" for d in draws)
        if self.delta is not None or grad_in:
            phi, x = self._phi(now), torch.cat([now["theta"], now["m"], now["v"]])
            delta = torch.zeros(n, 3 * P, dtype=x.dtype, device=x.device) if self.delta is None else self.delta
            if grad_in:   # the gradient noise is an input of the step: (x, u) ↦ Φ(x, u), u = 0 on the record
                u = torch.stack([d[1] if d is not None and d[0] == "grad" else torch.zeros_like(now["g"])
                                 for d in draws])
                x, delta = torch.cat([x, torch.zeros_like(now["g"])]), torch.cat([delta, u], 1)
                e = None if self.e is None else torch.cat([self.e, torch.zeros_like(u)], 1)
                step = lambda y: phi(y[:3 * P], y[3 * P:])  # noqa: E731
            else:
                e, step = self.e, lambda y: phi(y, None)  # noqa: E731
            if self.order == 1:
                self.delta = vmap(lambda d: propagate1(step, x, d))(delta)
            elif e is None:
                self.delta, self.e = vmap(lambda d: propagate(step, x, d, None))(delta)
            else:
                self.delta, self.e = vmap(lambda d, ee: propagate(step, x, d, ee))(delta, e)
        w = [d[1] if d is not None and d[0] == "param" else None for d in draws]
        if any(d is not None for d in w):
            zero = torch.zeros(3 * P, dtype=now["theta"].dtype, device=now["theta"].device)
            add = torch.stack([zero if d is None else torch.cat([d, zero[P:]]) for d in w])
            self.delta = add if self.delta is None else self.delta + add
        if self.delta is not None:   # one realisation's displacement, linearised, and its drift: the expansion's size
            rms = [float(x[:self.probes, :P].norm(dim=1).square().mean().sqrt()) if x is not None else 0.0
                   for x in (self.delta, self.e)]
            self.norms.append((now["step"], *rms))

    # ------------------------------------------------------------ the linearised step and its noise
    def _phi(self, now: dict):
        """AdamW's step on the state (θ, m, v) (`adamw_map`), its gradient at θ the recorded one plus the change
        of the gradient on the first `jac_batch` sequences, the clip factor held."""
        g = grad(lambda th: mse_loss(lambda u, v: functional_call(self.model, self.unflat(th), (u, v)), now["xs"],
                                     now["ys"]))
        g_rec, g_sub = now["g"], g(now["theta"]).detach()
        return adamw_map(lambda th: g_rec + (g(th) - g_sub), now["lr"], self.wd, self.betas, self.eps, now["n"],
                         now["clip"], now["live"])

    def _draw(self, g: int, now: dict, row: dict | None, k: int) -> tuple[str, torch.Tensor] | None:
        """Path k of group g: the step's noise, ("grad", ε) a gradient input of the step or ("param", w) added to θ
        after it; ε from the generator of (seed, step, k) (paired)."""
        cf = self.groups[g]
        if cf is None or cf.own:
            if row is None or not row["active"] or row["scale"] <= 0:
                return None
            cond, cov = self.spec.noise, now["cov"]
            var = row["scale"] * (cf.factor if cf is not None else 1.0)   # s_t (× k)
        else:
            if cf.noise is None or not (self.windows[g][0] <= now["step"] < self.windows[g][1]):
                return None
            cond, var = cf.noise, cf.factor
            key = (id(now["noise"]), g)
            if key not in self.covs:
                coef = 1.0 / cond.emulate_batch - 1.0 / self.spec.keys.batch
                self.covs = {kk: v for kk, v in self.covs.items() if kk[0] == key[0]}
                self.covs[key] = shaped_covariance(now["noise"], coef, cond.shape, cond.rank or 0)[0]
            cov = self.covs[key]
        gen = torch.Generator(device=now["a"].device).manual_seed(seed_mix(self.seed, now["step"], k))
        eps, a, lr = cov.sample(gen) * math.sqrt(var), now["a"], now["lr"]
        if cond.source == "grad":   # into the step's gradient, before its clip (held)
            return "grad", eps
        if cond.shape == "isotropic":   # param noise is shaped by A before the step (the injector's)
            tau2 = lr ** 2 * var * float((a.square() * cov.diag()).sum()) / a.numel()
            return "param", math.sqrt(tau2) * torch.randn(a.numel(), generator=gen, device=a.device, dtype=a.dtype)
        return "param", lr * a * eps

    def finish(self, f, theta_T: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(first, second) per group, each (probes, metrics), after the last step and its draws."""
        self._advance()
        x = torch.cat([theta_T, torch.zeros(2 * self.P, dtype=theta_T.dtype, device=theta_T.device)])
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


def adamw_map(g: Map, lr: float, wd: float, betas: tuple[float, float], eps: float, n: int, clip: float,
              live: torch.Tensor):
    """AdamW's update `n` (0-based: bias corrections 1 − βⁿ⁺¹) as a map of the state x = (θ, m, v) and a gradient
    input u (None: none), the gradient c (g(θ) + u) with c held:

        m' = β1 m + (1 − β1) c (g + u),   v' = β2 v + (1 − β2) c² (g + u)²,
        θ' = θ (1 − η λ) − η a(v') m' / (1 − β1ⁿ⁺¹),   a(v') = 1 / (√(v' / (1 − β2ⁿ⁺¹)) + ε)   (torch's AdamW);

    `live` masks a to 0 where the recorded step's a is (iclnoise.core.adam: round-off coordinates), so the map is smooth
    on every coordinate (its derivative in v, a³-like, would otherwise divide by √v' = 0)."""
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** (n + 1), 1 - b2 ** (n + 1)

    def phi(x: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        theta, m, v = x.chunk(3)
        gt = clip * (g(theta) if u is None else g(theta) + u)
        m2, v2 = b1 * m + (1 - b1) * gt, b2 * v + (1 - b2) * gt * gt
        a = torch.where(live, 1.0 / ((torch.where(live, v2, 1.0) / bc2).sqrt() + eps), 0.0)
        return torch.cat([theta * (1 - lr * wd) - lr * a * m2 / bc1, m2, v2])
    return phi


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
    """θ ↦ the METRICS of iclnoise.run.evaluate as a differentiable tensor (Δ(f, g) = mean token loss of f against
    g)."""
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
               seed: int = 0, device: str = "cpu", state: str | Path | None = None) -> pd.DataFrame:
    """CNR_SCHEMA rows: every counterfactual of `names` (see `counterfactual`) × METRICS, for the run in run_dir.

    `state`: a resume state of this run (its resume.pt or resume.prev.pt, or a copy kept from an earlier commit)
    at step t0: the replay starts there, so the counterfactuals change the noise over [t0, T] only (a windowed
    replay: its cost ∝ T − t0)."""
    run_dir = Path(run_dir)
    raw = {k: v for k, v in read_spec(run_dir).items() if k != "spec_hash"}
    spec = RunSpec.of(raw)
    cfs = [counterfactual(n, conditions, spec) for n in names]   # every name checked before the replay
    observed = read_parquet(run_dir / "metrics.parquet").iloc[-1]
    st = None if state is None else load_torch(state, "cpu")
    if st is not None and st.get("spec_hash") != spec_hash(raw):
        raise ValueError(f"{state}: not a resume state of {run_dir}'s run (spec hash {st.get('spec_hash')} against "
                         f"{spec_hash(raw)}); pass one the run wrote, or no state to replay from step 0")
    t0 = time.time()
    paths, replayed, _ = replay_paths(spec, cfs, probes, jac_batch, seed, device, st)
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


def replay_paths(spec: RunSpec, cfs: list[Counterfactual], probes: int, jac_batch: int, seed: int, device: str,
                 state: dict | None = None, stop_after: int | None = None):
    """Replay the run of `spec` in a scratch directory with the paths of `cfs` beside it (from step 0, or from a
    resume state), to its end or `stop_after` steps: ((first, second) per path group (Replayer.finish), the
    metrics on the replayed trajectory, Replayer.norms)."""
    if any(c.noise is not None and not c.own for c in cfs) and spec.exposure is None:
        raise ValueError(f"run {spec.keys.run_id} has no exposure section, which the counterfactual conditions' "
                         f"covariances are measured with")
    with tempfile.TemporaryDirectory(prefix="cnr-") as tmp:
        m = Member(spec, Path(tmp), spec_hash(spec.raw), torch.device(device))
        m.setup()
        start = 0 if state is None else m.resume_from(state)
        (Path(tmp) / CKPT_DIR).mkdir()
        injector = next((h for h in m.hooks if isinstance(h, NoiseInjector)), None)
        rep = Replayer(spec, m.model, cfs, injector, probes, jac_batch, seed)
        m.hooks.append(rep)
        Ensemble([m], start, "cnr").run(False, stop_after)
        m.model.eval()
        f = metric_fn(m.model, m.evaluator)
        theta_T = _functional(m.model)[1].clone()
        return rep.finish(f, theta_T), f(theta_T).detach(), rep.norms
