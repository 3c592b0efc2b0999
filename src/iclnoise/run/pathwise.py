"""A first-order pathwise estimator of CNR (method §13; issue 67, item 3): the derivative of E f(θ_T) with respect to
the log-level α of the run's own injected noise over [t0, T), from N replays, no counterfactual retrained.

Along one realisation of the noise, the injected draw at step t is ξ_t(α) = e^{α/2} ξ_t (the level multiplies the
covariance), so its tangent is ½ ξ_t, the draw itself halved. Carried through the linearised AdamW step
(iclnoise.run.linearised) beside the replayed run (`Pathwise`: the training engine retrains the run from its state
at t0, bitwise, and the hook carries the tangent), it gives dθ_T/dα along that realisation, and
g_i = ∇f(θ_T) · dθ_T/dα. Averaging over realisations i (noise_seed i) estimates d E f / dα, since the derivative
of the mean is the mean of the derivatives where f ∘ θ_T is smooth in α; its SE is the spread of the g_i over √N.
The prediction for the level × k is ΔE f ≈ ḡ · ln k, first order in α = ln k.

Per layer and window (`split_sensitivities`): the level of the noise on some parameters alone over some steps,
α_{ℓ,w}, has the tangent ½ M_ℓ ξ_t for t in window w and 0 elsewhere (M_ℓ the 0/1 mask of those parameters,
iclnoise.noise.covariance.parameter_mask). Disjoint groups that cover every parameter and every step split g
exactly, g = Σ_{ℓ,w} g_{ℓ,w} (linear in the tangent): which layers' noise, and when, moves f. Each group is one more
tangent path of the same replay.

What it leaves out (beyond the linearised step's own, iclnoise.run.linearised): the closed loop's answer to the
counterfactual (a budget level sets s_t from the realised exposure; here s_t is taken to scale by k exactly), and
every term of second and higher order in ln k. A gradient-source draw enters the step as an input (through AdamW's
map, before the held clip), a parameter-source draw is added after it.

Cost: the replay (training from t0) plus, per step and tangent path, one JVP of the gradient on `jac_batch`
sequences."""
from __future__ import annotations

import copy
import math
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch
from torch.func import functional_call, grad, vmap

from ..config.grid import spec_hash
from ..core.model import mse_loss
from ..core.runspec import RunSpec
from ..noise.cnr import change, propagate
from ..noise.covariance import parameter_mask
from ..noise.hooks import Unrecorded
from ..noise.injection import NoiseInjector
from .crn import counterfactual, labelled, member_spec, states_at
from .ensemble import Ensemble
from .linearised import METRICS, adamw_map, flat_params, metric_fn, step_preconditioner
from .member import Member
from .runs import CKPT_DIR, load_torch

ALL = "all"   # the group of every parameter: the level of the whole noise

PATHWISE_SCHEMA = pa.schema([   # <run>/cnr_pathwise.parquet: one row per (layers, window, metric, k)
    pa.field("run_id", pa.string()), pa.field("seed", pa.int64()), pa.field("t0", pa.int64()),
    pa.field("layers", pa.string()),   # the parameters whose noise level moves: ALL, a group of --layers, or rest
    pa.field("window_start", pa.int64()), pa.field("window_stop", pa.int64()),   # the steps [start, stop) it moves on
    pa.field("metric", pa.string()), pa.field("k", pa.float64()),   # the level × k of the run's own noise
    pa.field("n_realisations", pa.int64()),
    pa.field("g", pa.float64()), pa.field("g_se", pa.float64()),   # ḡ = d E f / d ln k and its SE over realisations
    pa.field("predicted", pa.float64()), pa.field("predicted_se", pa.float64()),   # ΔE f ≈ ḡ ln k, |ln k| SE
    pa.field("seconds", pa.float64()),   # the replays' wall time (the fork's training not included)
])


class Pathwise(Unrecorded):
    """A step hook (iclnoise.noise.hooks protocol) that carries one tangent path per (mask, window) (None: every
    parameter, every step) beside the replayed run, driven by the run's own injected draws halved and masked, on
    the path's window's steps (module docstring). Each step's record (state, gradient, clip factor) is kept at
    `on_update`; at the next step's `on_grads` (or `finish`), once the injector has drawn that step's noise, every
    path goes through the step's linearised update, a gradient-source draw entering it as an input, a
    parameter-source draw added after it. Put after the injector; it writes nothing into the run."""

    name, schema = "pathwise", pa.schema([pa.field("step", pa.int64())])

    def __init__(self, spec: RunSpec, model: torch.nn.Module, injector: NoiseInjector, jac_batch: int,
                 paths: list[tuple[torch.Tensor | None, tuple[int, int] | None]] = ((None, None),)):
        self.spec, self.model, self.injector, self.jac_batch = spec, model, injector, jac_batch
        self.paths = list(paths)
        injector.keep_draw = True
        o = spec.train.optimizer
        self.betas, self.wd, self.eps = tuple(o.betas), o.weight_decay, o.eps
        self.unflat, theta = flat_params(model)
        self.P = theta.numel()
        self.delta: torch.Tensor | None = None   # (paths, 3P): the tangents of the state (θ, m, v)
        self.now: dict | None = None
        self.pending: dict | None = None

    def on_grads(self, ctx) -> None:
        self._advance()
        b, adam = ctx.batch, ctx.adam
        flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
        theta = flat(ctx.model.parameters())
        zero = torch.zeros_like(theta)
        eps = self.injector.drawn   # this step's injected draw (the injector acted first)
        self.now = {"step": ctx.step, "theta": theta,
                    "m": zero if adam.exp_avg is None else flat(adam.exp_avg),
                    "v": zero if adam.exp_avg_sq is None else flat(adam.exp_avg_sq),
                    "n": adam.step or 0, "g": flat(p.grad for p in ctx.model.parameters()),  # the injected noise in
                    "lr": ctx.lr,
                    "xs": b.xs[:self.jac_batch], "ys": b.ys[:self.jac_batch],
                    "drawn": None if eps is None else eps.detach().clone()}

    def on_update(self, ctx) -> None:
        now, self.now = self.now, None
        now["clip"], now["live"] = float(ctx.clip_coef), step_preconditioner(ctx.adam) > 0
        self.pending = now

    def _draw(self, now: dict, k: int) -> torch.Tensor:
        """Path k's tangent input of the step (`drawn` the step's injected draw): ½ M_k ε (a gradient input, source
        grad) or ½ M_k w (added to θ after the step, source param); 0 outside its window."""
        m, span = self.paths[k]
        if span is not None and not span[0] <= now["step"] < span[1]:
            return torch.zeros_like(now["drawn"])
        return 0.5 * (now["drawn"] if m is None else now["drawn"] * m.to(now["drawn"]))

    def _advance(self) -> None:
        """The pending step: every path through its linearised update, its draws added."""
        now, self.pending = self.pending, None
        if now is None:
            return
        draws = None if now["drawn"] is None else [self._draw(now, k) for k in range(len(self.paths))]
        P, grad_in = self.P, self.spec.noise.source == "grad" and draws is not None
        if self.delta is not None or grad_in:
            phi, x = self._phi(now), torch.cat([now["theta"], now["m"], now["v"]])
            delta = torch.zeros(len(self.paths), 3 * P, dtype=x.dtype, device=x.device) if self.delta is None \
                else self.delta
            if grad_in:   # the gradient noise is an input of the step: (x, u) ↦ Φ(x, u), u = 0 on the record
                x, delta = torch.cat([x, torch.zeros_like(now["g"])]), torch.cat([delta, torch.stack(draws)], 1)
                step = lambda y: phi(y[:3 * P], y[3 * P:])  # noqa: E731
            else:
                step = lambda y: phi(y, None)  # noqa: E731
            self.delta = vmap(lambda d: propagate(step, x, d))(delta)
        if self.spec.noise.source == "param" and draws is not None:
            add = torch.cat([torch.stack(draws), torch.zeros(len(draws), 2 * P, dtype=draws[0].dtype,
                                                             device=draws[0].device)], 1)
            self.delta = add if self.delta is None else self.delta + add

    def _phi(self, now: dict):
        """AdamW's step on the state (θ, m, v) (`adamw_map`), its gradient at θ the recorded one plus the change
        of the gradient on the first `jac_batch` sequences, the clip factor held."""
        g = grad(lambda th: mse_loss(lambda u, v: functional_call(self.model, self.unflat(th), (u, v)), now["xs"],
                                     now["ys"]))
        g_rec, g_sub = now["g"], g(now["theta"]).detach()
        return adamw_map(lambda th: g_rec + (g(th) - g_sub), now["lr"], self.wd, self.betas, self.eps, now["n"],
                         now["clip"], now["live"])

    def finish(self, f, theta_T: torch.Tensor) -> torch.Tensor:
        """(paths, metrics): ∇f·δ_T of each path, after the last step and its draws."""
        self._advance()
        x = torch.cat([theta_T, torch.zeros(2 * self.P, dtype=theta_T.dtype, device=theta_T.device)])
        fx = lambda y: f(y[:self.P])  # noqa: E731 - the metrics read θ only
        if self.delta is None:
            return torch.zeros(len(self.paths), *fx(x).shape, dtype=x.dtype)
        return vmap(lambda d: change(fx, x, d))(self.delta)


def layer_groups(model: torch.nn.Module, layers: list[str]) -> dict[str, torch.Tensor]:
    """The masks of `layers` (each a group: dotted parameter-name prefixes joined by commas, e.g. blocks.0.attn or
    embed,pos_embed), plus `rest` for the parameters none names; the groups must not overlap, so they split g."""
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    groups = {g: parameter_mask(names, g.split(",")) for g in layers}
    total = sum(groups.values())
    if len(groups) < len(layers) or (total > 1).any():
        raise ValueError(f"--layers {' '.join(layers)}: the groups overlap (a parameter in two), so their "
                         f"sensitivities would not split the whole; give disjoint groups")
    if (total == 0).any():
        groups["rest"] = (total == 0).float()
    return groups


def windows_of(t0: int, total: int, n: int) -> list[tuple[int, int]]:
    """[t0, total) cut into n consecutive windows of (nearly) equal steps."""
    if not 1 <= n <= total - t0:
        raise ValueError(f"windows = {n}: give 1 to {total - t0} (the steps from t0 = {t0} to {total})")
    cuts = [t0 + round(i * (total - t0) / n) for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def sensitivity(spec: RunSpec, state: dict, jac_batch: int, device: str = "cpu") -> dict[str, float]:
    """g = df(θ_T)/dα for each of METRICS along the realisation of `spec` (its noise_seed), replayed from the resume
    state `state` (its step is t0)."""
    return sensitivities([spec], state, jac_batch, device)[0]


def sensitivities(specs: list[RunSpec], state: dict, jac_batch: int, device: str = "cpu") -> list[dict[str, float]]:
    """`sensitivity` of each spec (realisations of one run), all replayed from `state` in one ensemble: the runs
    train stacked, each carries its own tangent; each g is the one its spec's replay alone gives (tested)."""
    return [next(iter(g.values())) for g in split_sensitivities(specs, state, jac_batch, device=device)]


def split_sensitivities(specs: list[RunSpec], state: dict, jac_batch: int, layers: list[str] | None = None,
                        windows: int = 1, device: str = "cpu") -> list[dict[tuple[str, int, int], dict[str, float]]]:
    """Per spec, {(layers, start, stop): {metric: g}}: `sensitivities` per layer group (`layer_groups`; None: ALL)
    and per window of [t0, T) (`windows_of`), every (group, window) a tangent path of the same replay."""
    for s in specs:
        if not s.injects:
            raise ValueError(f"run {s.keys.run_id} injects no noise: there is no level to differentiate")
    spans = windows_of(state["step"], specs[0].train.steps, windows)
    with tempfile.TemporaryDirectory(prefix="pathwise-") as tmp:
        members, reps, start = [], [], None
        for j, s in enumerate(specs):   # a run id of its own each: an ensemble lists each run once
            s = RunSpec.of(labelled(s.raw, j)) if len(specs) > 1 else s
            d = Path(tmp) / f"{j}"
            d.mkdir()
            m = Member(s, d, spec_hash(s.raw), torch.device(device))
            m.setup()
            (d / CKPT_DIR).mkdir()
            start = m.resume_from(copy.deepcopy(state))
            injector = next(h for h in m.hooks if isinstance(h, NoiseInjector))
            groups = {ALL: None} if layers is None else layer_groups(m.model, layers)
            keys = [(g, *w) for g in groups for w in spans]
            reps.append(Pathwise(s, m.model, injector, jac_batch,
                                 [(groups[g], None if windows == 1 else (a, b)) for g, a, b in keys]))
            m.hooks.append(reps[-1])
            members.append(m)
        Ensemble(members, start, "pathwise").run(False)
        out = []
        for m, rep in zip(members, reps):
            m.model.eval()
            first = rep.finish(metric_fn(m.model, m.evaluator), flat_params(m.model)[1].clone())
            out.append({key: {k: float(v) for k, v in zip(METRICS, first[j])} for j, key in enumerate(keys)})
    return out


def predict(g: list[dict[str, float]], k: float, form: str = "log") -> dict[str, tuple[float, float]]:
    """The first-order prediction of ΔE f at the level × k, with its SE, per metric, from the per-realisation
    sensitivities `g` = dE f/d ln k at k = 1 (method §13, "A first-order pathwise estimator"). `form` "log": first
    order in ln k, ḡ ln k ± |ln k| sd(g)/√N, NaN at k = 0 (ln k = −∞). "linear": first order in the variance
    itself (dE f/dk = dE f/d ln k at k = 1), ḡ (k − 1) ± |k − 1| sd(g)/√N, defined at k = 0 too. The two agree to
    first order in ln k and differ at the second: (k − 1) − ln k = (ln k)²/2 + O((ln k)³)."""
    if form not in ("log", "linear"):
        raise ValueError(f"form must be 'log' or 'linear', got {form!r}")
    x = (math.log(k) if k > 0 else math.nan) if form == "log" else k - 1.0
    out = {}
    for metric in METRICS:
        v = torch.tensor([gi[metric] for gi in g], dtype=torch.float64)
        se = float(v.std()) / math.sqrt(len(v)) if len(v) > 1 else math.nan
        out[metric] = (float(v.mean()) * x, abs(x) * se)
    return out


def fork_state(raw: dict, t0: int, device: str = "cpu") -> dict:
    """The run's resume state at step t0 (t0 > 0), trained from step 0 alone, as `crn(..., fork=...)` keeps it: the
    state in memory at t0, not the last commit before it (a commit falls on a checkpoint step)."""
    own = counterfactual("self", {}, RunSpec.of(raw))
    with tempfile.TemporaryDirectory(prefix="pathwise-fork-") as tmp:
        return states_at(raw, [own], t0, Path(tmp), device)[own.structure]


def pathwise(raw: dict, ks: list[float], realisations: int, t0: int | None = None, fork: str | Path | None = None,
             jac_batch: int = 64, device: str = "cpu", layers: list[str] | None = None,
             windows: int = 1) -> pd.DataFrame:
    """PATHWISE_SCHEMA rows: the prediction ΔE f ≈ ḡ ln k for the run's own noise level × k, k in `ks`, from
    `realisations` replays (noise_seed 0..N−1, the realisations CRN pairs: iclnoise.run.crn) of [t0, T) from the
    run's state at t0 (default: the start of its injection window): `fork` (a state at t0, as `crn(..., fork=...)`
    keeps it) or trained here. `layers`: per layer group (`layer_groups`), the level of the noise on those
    parameters alone × k; None: the whole noise's (layers ALL). `windows`: per window of [t0, T) (`windows_of`), the
    level over those steps alone."""
    raw = {k: v for k, v in raw.items() if k != "spec_hash"}
    spec = RunSpec.of(raw)
    if not spec.injects:
        raise ValueError(f"run {spec.keys.run_id} injects no noise: there is no level to differentiate")
    if any(not k > 0 for k in ks):
        raise ValueError(f"every k must be > 0 (ln k: the first-order prediction), got {ks}")
    t0 = spec.window[0] if t0 is None else t0
    if spec.window[0] < t0:
        raise ValueError(f"run {spec.keys.run_id} injects from step {spec.window[0]}, before t0 = {t0}: its noise "
                         f"before t0 would be held, not differentiated; fork at or before {spec.window[0]}")
    state = load_torch(Path(fork), device) if fork is not None else fork_state(raw, t0, device)
    if state["step"] != t0:
        raise ValueError(f"{fork}: a state at step {state['step']}, not t0 = {t0}")
    own = counterfactual("self", {}, spec)
    t = time.time()
    by = split_sensitivities([RunSpec.of(member_spec(raw, own, i)) for i in range(realisations)], state, jac_batch,
                             layers, windows, device)
    seconds = time.time() - t
    rows = []
    for key in by[0]:
        g = [b[key] for b in by]
        for k in ks:
            for metric, (pred, se) in predict(g, k).items():
                v = torch.tensor([gi[metric] for gi in g], dtype=torch.float64)
                rows.append({"run_id": spec.keys.run_id, "seed": spec.keys.seed, "t0": t0, "layers": key[0],
                             "window_start": key[1], "window_stop": key[2], "metric": metric, "k": k,
                             "n_realisations": realisations, "g": float(v.mean()),
                             "g_se": float(v.std()) / math.sqrt(len(v)) if len(v) > 1 else math.nan,
                             "predicted": pred, "predicted_se": se, "seconds": seconds})
    return pd.DataFrame(rows, columns=PATHWISE_SCHEMA.names)
