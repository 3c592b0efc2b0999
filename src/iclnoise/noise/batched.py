"""An ensemble's injectors for all their runs at once (method §5; issue 41 item 3, issue 66): the step path of
iclnoise.noise.injection's NoiseInjector over a run axis, with no host read on the step, booking each run's rows
through its own NoiseInjector."""
from __future__ import annotations

import math

import torch

from ..core import rng
from .covariance import target_at
from .exposure import AdamState, budget_scale, ne_unit, preconditioner
from .injection import MAX_LOG_SCALE, NoiseInjector, closed_loop_scale, counter_noise


class BatchedInjection:
    """An ensemble's injectors (NoiseInjector.batched) for all their runs at once (issue 41 item 3, issue 66). On the
    step path everything is an (n,) float64 tensor over the runs, with no host read and no copy to the device: this
    step's a from the stacked AdamW state (exposure.preconditioner), Curv_t = max(floor, Σ a² diag Ĥ), the NE unit
    (exposure.ne_unit), |g|², the scale s_t (closed_loop_scale at a budget, 1 for emulate_batch) and, after the update,
    c² and the realised P-NE* after clipping. Each run's noise is drawn from its own stream (NoiseInjector.draw's
    values: on the counter stream all runs in one call, R' = U diag(lam) Uᵀ + diag(d) with each run's rank padded),
    scaled, and added to the stacked gradients or weights in one call per parameter tensor.

    The step's values stay on the device until `flush` books them into each run's NoiseInjector (NoiseInjector.book,
    the per-run path's bookkeeping: its rows, realised budget and the exposure state's sums). The ensemble flushes
    whenever a batched run's exposure logger acts (it reads those sums and may measure R', κ or diag Ĥ anew) and
    before each commit, so between two flushes every host value a row carries (R' and its trace, diag Ĥ's step and
    error) is constant. A frozen run (on the device, whether or not the host has looked) gets no noise and no row,
    as the per-run path never calls a frozen run's hooks."""

    def __init__(self, runs: list[int], injectors: list[NoiseInjector], loggers: list, R: int, device: torch.device):
        self.runs, self.inj, self.loggers = runs, injectors, loggers
        self.counter = injectors[0].counter   # one train section per ensemble
        self.keys = torch.tensor([i.noise_key for i in injectors], device=device)
        self.any_iso = any(i.source == "param" and i.shape == "isotropic" for i in injectors)
        self.whole = runs == list(range(R))   # every run of the ensemble, in order: no gather
        f64 = {"dtype": torch.float64, "device": device}
        self.idx = torch.tensor(runs, device=device)
        self.budget = torch.tensor([i.budget or 0.0 for i in injectors], **f64)
        self.fixed = torch.tensor([i.budget is None and i.ctl is None for i in injectors], device=device)  # s = 1
        self.ctl = torch.tensor([i.ctl is not None for i in injectors], device=device)   # the PI controller's s
        self.ctl_runs = [k for k, i in enumerate(injectors) if i.ctl is not None]
        self.log_s = torch.tensor([i.ctl.log_s if i.ctl else 0.0 for i in injectors], **f64)
        self.start = torch.tensor([i.start for i in injectors], **f64)
        self.stop = torch.tensor([i.stop for i in injectors], **f64)
        self.floor = torch.tensor([i.floor for i in injectors], **f64)
        self.clip = torch.tensor([i.clip if i.source == "grad" and i.clip is not None else math.inf
                                  for i in injectors], **f64)   # the param source's noise is not clipped
        self.grad = torch.tensor([i.source == "grad" for i in injectors], device=device)
        self.iso = torch.tensor([i.source == "param" and i.shape == "isotropic" for i in injectors], device=device)
        self.zmask = None   # (n, P): noise.layers' masks of isotropic noise's z (built with the first draw)
        self.support = torch.tensor([i.support or 0 for i in injectors], **f64)   # 0: every coordinate
        self.realised = torch.tensor([i.realised for i in injectors], **f64)
        self.rows = {src: torch.tensor([k for k, i in enumerate(injectors) if i.source == src], device=device,
                                       dtype=torch.long) for src in ("grad", "param")}
        self.f64 = f64
        self.diag = self.curv_diag = None   # (n, P): R' and diag Ĥ of each run, copied when they change (_sync)
        self.sqrt_d = self.U = self.sqrt_lam = None   # R' = U diag(lam) Uᵀ + diag(d): (n, P), (n, P, r), (n, r)
        self._seen: list[tuple] = [(None, None)] * len(runs)
        self._buf: list[tuple[int, torch.Tensor]] = []   # (step, (n, 6) values of the step) until flushed
        self._step: tuple | None = None
        self._noise: torch.Tensor | None = None

    def acting(self, step: int, ctxs: dict) -> bool:
        """A live run's exposure logger acts at this step (so the host looks: ensemble._looks; the ensemble makes a
        context for exactly the live runs whose hooks act)."""
        return any(r in ctxs for r in self.runs)

    def _sync(self, P: int, dtype: torch.dtype) -> None:
        """Copy each run's R' diagonal, trace, clipped trace, κ and diag Ĥ to the device where they changed."""
        n, dev = len(self.runs), self.f64["device"]
        if self.diag is None:
            self.diag = torch.zeros(n, P, dtype=dtype, device=dev)
            self.curv_diag = torch.full((n, P), math.nan, dtype=dtype, device=dev)
            self.sqrt_d = torch.zeros(n, P, dtype=dtype, device=dev)
        r = max((i.cov.U.shape[1] for i in self.inj if i.cov is not None), default=0)   # padded: lam 0 beyond a
        if self.U is None or self.U.shape[2] != r:                                       # run's own rank
            self.U, self.sqrt_lam = torch.zeros(n, P, r, dtype=dtype, device=dev), torch.zeros(n, r, dtype=dtype,
                                                                                              device=dev)
            self._seen = [(None, s[1]) for s in self._seen]
        for k, i in enumerate(self.inj):
            cov, curv = self._seen[k]
            if i.cov is not None and i.cov is not cov:
                rk = i.cov.U.shape[1]
                self.diag[k], self.sqrt_d[k] = i._diag, i.cov.d.sqrt()
                self.U[k].zero_(), self.sqrt_lam[k].zero_()
                self.U[k, :, :rk], self.sqrt_lam[k, :rk] = i.cov.U, i.cov.lam.sqrt()
            if i.state.curv_diag is not None and i.state.curv_diag is not curv:
                self.curv_diag[k] = i.state.curv_diag
            self._seen[k] = (i.cov, i.state.curv_diag)
        self.trace = torch.tensor([i._trace if i.cov is not None else 0.0 for i in self.inj], **self.f64)
        self.clipped = torch.tensor([i.clipped for i in self.inj], **self.f64)
        self.kappa = torch.tensor([i._kappa() for i in self.inj], **self.f64)

    def on_grads(self, step: int, lr: float, live: set[int], ctxs: dict, adam: AdamState, frozen: torch.Tensor,
                 acting: bool) -> None:
        """NoiseInjector.on_grads of every live run at once (R' refreshed per run on its due steps, as there: a due
        run's logger acts, so it has a context in `ctxs`)."""
        live = [k for k, r in enumerate(self.runs) if r in live]
        due = [k for k in live if self.inj[k].meter.due(step) or self.inj[k].cov is None]
        if due:
            self.flush()   # the rows so far carry the R' they used
        for k in due:
            self.inj[k]._refresh(ctxs[self.runs[k]])
        grads = adam.grads
        R, P = grads[0].shape[0], sum(g[0].numel() for g in grads)
        if acting or due or self.diag is None:
            self._sync(P, grads[0].dtype)
        ok = ~frozen[self.idx]
        act = [k for k in live if self.inj[k].start <= step < self.inj[k].stop]
        self._noise = None
        if not act:
            zero = torch.zeros(len(self.runs), **self.f64)
            self._step = (step, ok, zero, zero, torch.full_like(zero, math.nan))
            return
        sub = (lambda t: t) if self.whole else (lambda t: t[self.idx])  # noqa: E731
        a = sub(preconditioner(adam))
        on = (self.start <= step) & (self.stop > step)
        curv = torch.where(on, torch.maximum(self.floor, (a.square() * self.curv_diag).sum(-1).double()), math.nan)
        unit = ne_unit(lr, self.kappa, a, self.diag)
        g2 = sub(torch.stack([g.reshape(R, -1).norm(dim=1) for g in grads], 1).square().sum(1)).double()  # _grad_sq
        s = closed_loop_scale(self.budget - self.realised, self.stop - step, curv, unit, g2, self.trace, self.clip)
        if self.ctl_runs:
            s = torch.where(self.ctl, self._controlled(step, curv, unit, g2), s)
        s = torch.where(on & ok, torch.where(self.fixed, 1.0, s), 0.0)
        ne = torch.where(s > 0, s * unit, 0.0)
        self._step = (step, ok, s, ne, curv)
        self._add_noise(step, lr, set(act), a, s, grads)

    def _controlled(self, step: int, curv: torch.Tensor, unit: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """The PI controllers' scales exp(log s) (NoiseInjector._scale's): each controller takes the P-NE* after
        clipping of a row its logger wrote since the last step (on the host: no read); on a controller's first step
        its open-loop estimate, the scale that reaches the target by itself (budget_scale), read to start it there."""
        changed = False
        for k in self.ctl_runs:
            i = self.inj[k]
            pne, i.state.pne_postclip = i.state.pne_postclip, None
            if i.ctl_started and pne is not None:
                i.ctl.update(pne, step / i.total)
                changed = True
        new = [k for k in self.ctl_runs if not self.inj[k].ctl_started]
        if new:
            target = torch.tensor([target_at(i.ctl.target, step / i.total) if i.ctl else 0.0 for i in self.inj],
                                  **self.f64)
            s0 = budget_scale(target, curv, unit, g2, self.trace, self.clip).tolist()   # a controller's first step
            for k in new:
                i = self.inj[k]
                i.ctl.u = i.ctl.log_s = min(MAX_LOG_SCALE, math.log(s0[k])) if 0 < s0[k] else -MAX_LOG_SCALE
                i.ctl_started = changed = True
        if changed:
            self.log_s.copy_(torch.tensor([i.ctl.log_s if i.ctl else 0.0 for i in self.inj], dtype=torch.float64))
        return self.log_s.exp()

    def _add_noise(self, step: int, lr: float, act: set[int], a: torch.Tensor, s: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        """Each active run's draws (its own stream; zeros for the others), scaled by sqrt(s): the grad source's added
        to the stacked gradients now, the param source's kept for on_update (η a ε; isotropic z·τ, τ² P = η² Σ a² sR'_ii
        as NoiseInjector.on_grads)."""
        P = a.shape[1]
        if self.counter:   # every run's words at once, in NoiseInjector.draw's layout
            r = self.U.shape[2]
            w = rng.normal(rng.bits(self.keys, step, 2 * P + r if r else 2 * P if self.any_iso else P), a.dtype)
            eps, zs = counter_noise(self.sqrt_d, self.U, self.sqrt_lam, w), w[:, P:2 * P]
            if self.any_iso and any(i.mask is not None for i in self.inj):
                if self.zmask is None:
                    self.zmask = torch.stack([a.new_ones(P) if i.mask is None else i.mask.to(a) for i in self.inj])
                zs = zs * self.zmask
        else:
            zero = a.new_zeros(P)
            draws = [self.inj[k].draw(step) if k in act else (zero, None) for k in range(len(self.runs))]
            eps = torch.stack([e for e, _ in draws])
            zs = torch.stack([zero if z is None else z for _, z in draws]) if self.any_iso else None
        eps = eps * s.sqrt().float()[:, None]
        if len(self.rows["grad"]):
            self._scatter(grads, eps[self.rows["grad"]], self.rows["grad"])
        if not len(self.rows["param"]):
            return
        noise = lr * a * eps
        if self.any_iso:
            tau2 = lr ** 2 * (a.square() * self.diag).sum(-1).double() * s / torch.where(self.support > 0,
                                                                                            self.support, P)
            noise = torch.where(self.iso[:, None], zs * tau2.sqrt().float()[:, None], noise)
        self._noise = noise[self.rows["param"]]

    def _scatter(self, stacked: list[torch.Tensor], flat: torch.Tensor, rows: torch.Tensor) -> None:
        """Add flat (m, P) rows to the stacked tensors (R, ...) at the runs of `rows` (indices into self.runs)."""
        at = self.idx[rows]
        for x, part in zip(stacked, flat.split([x[0].numel() for x in stacked], 1)):
            x.index_add_(0, at, part.view(-1, *x.shape[1:]))

    def on_update(self, coefs: torch.Tensor, params: list[torch.Tensor], acting: bool) -> None:
        """NoiseInjector.on_update of every live run at once: c², the realised P-NE* after clipping, the realised
        budget; the param source's noise added to the updated weights. Flushed when `acting`."""
        step, ok, s, ne, curv = self._step
        c2 = torch.where(self.grad, coefs[self.idx].double().square(), 1.0)
        pne = torch.where(ok & (ne > 0) & (curv > 0), c2 * ne / curv, 0.0)
        self.realised += pne
        self._buf.append((step, torch.stack([s, ne, curv, c2, pne, ok.double()], 1)))
        if self._noise is not None:
            with torch.no_grad():
                self._scatter([p.detach() for p in params], self._noise, self.rows["param"])
            self._noise = None
        if acting:
            self.flush()

    def flush(self) -> None:
        """Book the steps since the last flush into each run's NoiseInjector (one device-to-host read)."""
        if not self._buf:
            return
        vals = torch.stack([v for _, v in self._buf]).cpu().tolist()
        for (step, _), rows in zip(self._buf, vals):
            for inj, (s, ne, curv, c2, pne, ok) in zip(self.inj, rows):
                if ok:
                    inj.book(inj.pending(step, inj.start <= step < inj.stop, s, ne, curv), c2, pne)
        self._buf = []


