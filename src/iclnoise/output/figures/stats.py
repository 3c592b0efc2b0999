"""Figure 6 (headline: M* against noise level per source) and figure 7 (ICL against exposure)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

from ...analysis.dose import SERIES, series_name, with_schedule
from ...analysis.verdicts import optimizer_note
from ...core.tasks import M_INF
from . import style


def fig_threshold_vs_noise(th: pd.DataFrame, path: str | Path) -> None:
    """M* by each method with 95 % t-intervals over seeds, against the noise level: r50 (circles, solid: r = 0.5
    crossing of a logistic in log2 M with free plateaus), midpoint (triangles, dotted, a little to the left: half-way
    between that logistic's floor and ceiling) and crossover (squares, dashed, a little to the right: where the late
    pull on new tasks turns from dMMSE_M to ridge). Conditions without a threshold are listed
    with the reason; hollow markers: the condition failed a validity gate (thresholds.parquet gate_failures).

    The level is an effective inverse batch size: 1/B for batch noise, 1/B_target for injected noise
    emulating batch B_target (conditions with other levels are in figures 7, 8 and 10)."""
    style.setup()
    th = th.astype({c: float for c in ("M_star", "M_star_lo", "M_star_hi", "noise_level")})
    df = th[(th.noise_source == "batch") | (th.emulate_batch > 0)].copy()
    df["level"] = df.noise_level
    fig, ax = plt.subplots(figsize=(5.5, 4))
    # one line for batch noise across batch sizes, one per injected condition (source, shape)
    df["series"] = (np.where(df.noise_source == "batch", "batch noise", "injected: " + df.noise.astype(str))
                    + df.optimizer.map(optimizer_note))   # grid.optimizer: a line per optimizer
    _threshold_lines(ax, df)
    note = _no_threshold_notes(df)
    if note:  # below the axes, where it hides no data
        fig.set_figheight(4 + 0.12 * (note.count("\n") + 1))
        fig.text(0.01, 0.01, note, fontsize=6, color="dimgrey", va="bottom")
    if np.isfinite(df.M_star).any():
        _threshold_axes(ax, df)
    else:
        reasons = sorted({f"{r.method}, {r.noise}, B{r.batch}: {r.reason.removeprefix('no threshold: ')}"
                          for r in df.itertuples()}) or ["no condition in the grid"]
        ax.text(0.5, 0.5, "no threshold could be fitted\n" + "\n".join(reasons), transform=ax.transAxes,
                ha="center", va="center", color="grey", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("noise level: 1 / batch size (real or emulated)")
    ax.set_ylabel("task-diversity threshold M*  (95 % t-interval over seeds)")
    ax.set_title("Does more noise lower the task-diversity threshold?")
    if np.isfinite(df.M_star).any():
        handles, _ = ax.get_legend_handles_labels()
        if (~df.gates_passed.astype(bool) & np.isfinite(df.M_star)).any():
            handles.append(Line2D([], [], marker="o", ls="", mfc="white", mec="grey", mew=1.5,
                                  label="hollow: a validity gate failed,\nthe verdict reads inconclusive"))
        ax.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout(rect=(0, 0.03 * (note.count("\n") + 1) if note else 0, 1, 1))
    style.save_figure(fig, path, df)


def _threshold_lines(ax: plt.Axes, df: pd.DataFrame) -> None:
    """Figure 6's M* with intervals, a line per (series, method), side by side; hollow where a gate failed."""
    colour = {label: f"C{i}" for i, label in enumerate(sorted(df.series.unique()))}
    for (label, method), g in df.groupby(["series", "method"]):
        g = g.sort_values("level")
        x = g.level * {"crossover": 1.06, "midpoint": 0.94}.get(method, 1.0)   # side by side where several exist
        mk, ls = {"crossover": ("s", "--"), "midpoint": ("^", ":")}.get(method, ("o", "-"))
        yerr = np.vstack([g.M_star - g.M_star_lo, g.M_star_hi - g.M_star]).clip(min=0)
        ax.errorbar(x, g.M_star, yerr=np.nan_to_num(yerr), marker=mk, ls=ls, capsize=4, lw=1.5,
                    color=colour[label], label=f"{label} ({method})")
        bad = ~g.gates_passed.astype(bool) & np.isfinite(g.M_star)
        ax.scatter(x[bad], g.M_star[bad], s=40, marker=mk, facecolor="white", edgecolor=colour[label], zorder=4,
                   lw=1.5)


def _no_threshold_notes(df: pd.DataFrame) -> str:
    """The conditions without an M* or without an interval, with their reasons, wrapped; '' when none, or when no
    condition has an M* (the axes then say so)."""
    missing = df[~np.isfinite(df.M_star)]
    no_ci = df[np.isfinite(df.M_star) & ~np.isfinite(df.M_star_lo)]
    notes = [f"no M* ({r.method}): {r.noise}, B{r.batch}{optimizer_note(r.optimizer)}: {r.reason}"
             for r in missing.itertuples()]
    notes += [f"no interval ({r.method}): {r.noise}, B{r.batch}{optimizer_note(r.optimizer)}: "
              f"{r.reason.removeprefix('no interval: ')}"
              for r in no_ci.itertuples()]
    return "\n".join(textwrap.fill(n, 100) for n in notes) if notes and np.isfinite(df.M_star).any() else ""


def _threshold_axes(ax: plt.Axes, df: pd.DataFrame) -> None:
    """Log noise level with 1/B ticks; M* on a log2 axis where it spans more than 3 octaves."""
    ax.set_xscale("log")
    vals = df[["M_star", "M_star_lo", "M_star_hi"]].to_numpy(float)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if vals.max() / vals.min() > 8:  # log2 axis only when it spans several octaves: else it shows no ticks
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(ScalarFormatter())
    xs = np.sort(df.level.unique())
    ax.set_xticks(xs, [f"1/{1 / x:.0f}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())


def fig_icl_vs_exposure(out: pd.DataFrame, path: str | Path) -> None:
    """Ridge-likeness and OOD loss at the end of training against integrated exposure; colour M, marker the arm
    (batch size and noise condition)."""
    style.setup()
    col = "integrated_pne" if "integrated_pne" in out and out.integrated_pne.notna().any() else "integrated_lr_over_b"
    pal = style.m_palette(out.M)
    marks = style.arm_markers(out)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (M, b, n, o), g in out.groupby(["M", "batch", "noise", "optimizer"]):
        for ax, y in zip(axes, ("r", "ood_loss")):
            if y == "r" and M == M_INF:
                continue
            ax.scatter(g[col], g[y], color=pal[M], marker=marks[(int(b), str(n), str(o))], s=30, edgecolor="white",
                       lw=0.5)
    for ax, y in zip(axes, ("ridge-likeness r (end of training)", "OOD loss / D (end of training)")):
        ax.set_xscale("log")
        ax.set_xlabel(style.axis_label(col))
        ax.set_ylabel(y)
    axes[1].legend(handles=style.m_arm_legend(out.M, pal, marks), loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=8)
    fig.suptitle("ICL outcome against integrated noise exposure (H1, H3)", y=1.02)
    fig.tight_layout()
    style.save_figure(fig, path, out)


def fig_dose(levels: pd.DataFrame, path: str | Path) -> None:
    """Figure 6 for a dose series (aggregate/dose_levels.parquet; issues 43, 70): per series (columns), M* against
    total exposure (batch + injected integrated P-NE*, log axis: H1's own axis, method §11) with 95 % t-intervals
    over seeds, r50 (circles, solid) and midpoint (triangles, dotted), and where a dose has no M* of its own (the
    threshold ladder: 3 M) the ladder's reading, dose 0's M* moved by the ladder's shift (hollow, dashed; its
    interval is the shift's); below, r at M = 16. A levels table from before issue 70 (no total_exposure) is drawn
    against the realised injected dose, dose 0 half a decade left of the lowest. The operating regime (dose_levels'
    in_regime) is shaded green, the doses outside it grey with the reason listed below the axes."""
    style.setup()
    lv = with_schedule(levels).astype({c: float for c in levels.columns
                                       if c.startswith(("M_star", "ladder", "r16", "realised", "total"))})
    keys = sorted(lv.groupby(SERIES).groups)
    fig, axes = plt.subplots(2, len(keys), figsize=(5 * len(keys), 7), squeeze=False, sharex="col")
    notes = []
    for j, key in enumerate(keys):
        g = lv.groupby(SERIES).get_group(key).sort_values("target_dose")
        notes += _dose_column(axes[0, j], axes[1, j], g, key)
    fig.suptitle("ICL against the noise dose (green: operating regime; grey: outside)", y=1.0)
    note = "\n".join(textwrap.fill(n, 110) for n in notes)
    if note:
        fig.text(0.01, 0.0, note, fontsize=6, color="dimgrey", va="top")
    fig.tight_layout()
    style.save_figure(fig, path, lv)


def fig_batch_axis(levels: pd.DataFrame, path: str | Path) -> None:
    """Figure 6 on the batch axis (aggregate/batch_levels.parquet; issue 70 item 5), drawn by batch_axis_figure."""
    lv = levels.astype({c: float for c in levels.columns if c.startswith(("M_star", "r16", "total"))})
    style.save_figure(batch_axis_figure(lv), path, lv)


def batch_axis_figure(lv: pd.DataFrame) -> plt.Figure:
    """Per arm (columns: equal data, equal steps), M* against the batch noise's own total exposure (integrated
    P-NE*, log axis) with 95 % t-intervals over seeds, r50 (circles, solid) and midpoint (triangles, dotted), hollow
    where a batch size has no interval (the pooled fit, which the slope leaves out); below, r at M = 16; each tick
    names its batch size, and "unconverged" under a shaded band where its M = ∞ runs failed the convergence gate
    (the slope leaves it out while three converged batch sizes remain). The columns share their exposure and each
    row's limits, so a batch size's point in one
    arm reads against the other's: if M* follows the noise's exposure whatever the number of updates, the arms'
    points lie on one curve."""
    style.setup()
    keys = sorted(lv.groupby(["optimizer", "arm"]).groups)
    fig, axes = plt.subplots(2, len(keys), figsize=(5 * len(keys), 7), squeeze=False, sharex="col")
    for j, (opt, arm) in enumerate(keys):
        g = lv[(lv.optimizer == opt) & (lv.arm == arm)].sort_values("total_exposure")
        top, bottom, x = axes[0, j], axes[1, j], g.total_exposure.to_numpy()
        for k, (point, mk, ls) in enumerate((("r50", "o", "-"), ("midpoint", "^", ":"))):
            m, lo, hi = (g[f"M_star_{point}{s}"].to_numpy() for s in ("", "_lo", "_hi"))
            at, ci = x * (0.96 if point == "midpoint" else 1.0), np.isfinite(lo)
            top.plot(at, m, ls=ls, color=f"C{k}")
            top.errorbar(at[ci], m[ci], yerr=np.vstack([m - lo, hi - m])[:, ci].clip(min=0), marker=mk, ls="none",
                         color=f"C{k}", capsize=3, label=f"M* ({point})")
            top.plot(at[~ci], m[~ci], marker=mk, ls="none", color=f"C{k}", mfc="none",
                     label=f"M* ({point}), no interval" if (~ci & np.isfinite(m)).any() else None)
        r, rlo, rhi = (g[f"r16{s}"].to_numpy() for s in ("", "_lo", "_hi"))
        bottom.errorbar(x, r, yerr=np.nan_to_num(np.vstack([r - rlo, rhi - r]).clip(min=0)), marker="o",
                        color="C2", capsize=3)
        for ax in (top, bottom):
            ax.set_xscale("log")
        if np.isfinite(g.M_star_r50).any() or np.isfinite(g.M_star_midpoint).any():
            top.set_yscale("log", base=2)
            top.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            top.yaxis.set_major_formatter(ScalarFormatter())
            top.yaxis.set_minor_formatter(NullFormatter())
            top.legend(fontsize=7, loc="best")
        else:
            top.text(0.5, 0.5, "no M* at any batch size", transform=top.transAxes, ha="center", color="grey")
        top.set_title(f"batch noise at {arm}{optimizer_note(opt)}", fontsize=10)
        top.set_ylabel("task-diversity threshold M* (95 % CI)")
        bottom.set_ylabel("r at M = 16 (95 % CI over seeds)")
        bottom.set_xlabel("total exposure: the batch noise's integrated P-NE* (log)")
        ok = g.converged.to_numpy(bool) if "converged" in g else np.ones(len(g), bool)   # tables before 2026-12-07
        bottom.set_xticks(x, [f"{v:.2g}\nB{b}" + ("" if c else "\nunconverged") for v, b, c in zip(x, g.batch, ok)])
        for ax in (top, bottom):   # a batch size whose M = ∞ runs failed the convergence gate: shaded, named
            for at in x[~ok]:
                ax.axvspan(at / 1.15, at * 1.15, color="0.85", zorder=0)
        bottom.xaxis.set_minor_formatter(NullFormatter())
    xlim = min(a.get_xlim()[0] for a in axes.flat), max(a.get_xlim()[1] for a in axes.flat)
    for k, row in enumerate(axes):   # one scale across the arms (each column keeps its own batch-size ticks)
        same = [a for a in row if k == 1 or a.get_yscale() == "log"]   # not a column without an M*
        for ax in row:
            ax.set_xlim(*xlim)
        ylim = min((a.get_ylim()[0] for a in same), default=None), max((a.get_ylim()[1] for a in same), default=None)
        for ax in same:
            ax.set_ylim(*ylim)
    arms = " and at ".join(dict.fromkeys(arm for _, arm in keys))   # the arms drawn, not the design's
    fig.suptitle(f"ICL against the batch noise's own exposure: batch sizes at {arms}", y=1.0)
    fig.tight_layout()
    return fig


def _dose_column(top: plt.Axes, bottom: plt.Axes, g: pd.DataFrame, key: tuple) -> list[str]:
    """One series' column of the dose figure (`g`: its dose_levels rows by dose): M* above, r at M = 16 below, the
    regime shaded; returns the notes on the doses outside the regime."""
    pos = g[g.target_dose > 0]
    total = "total_exposure" in g and bool(g.total_exposure.notna().all())   # tables before issue 70: the dose
    x0 = g.total_exposure[g.target_dose == 0].min() if total else pos.realised_dose.min() / 10 ** 0.5
    at = g.total_exposure.to_numpy() if total else np.where(g.target_dose > 0, g.realised_dose, x0)
    g = g.assign(x_at=at)
    x = g.x_at.to_numpy()
    _plot_dose_mstar(top, g, x)
    r, rlo, rhi = (g[f"r16{s}"].to_numpy() for s in ("", "_lo", "_hi"))
    bottom.errorbar(x, r, yerr=np.nan_to_num(np.vstack([r - rlo, rhi - r]).clip(min=0)), marker="o", color="C2",
                    capsize=3)
    inside = g[g.in_regime & (g.target_dose > 0)]
    outside = g[~g.in_regime.astype(bool)]
    for ax in (top, bottom):
        ax.set_xscale("log")
        if len(inside):
            ax.axvspan(x0 / 1.2, inside.x_at.max() * 1.2, color="green", alpha=0.07, lw=0)
        for d in outside.itertuples():
            ax.axvspan(d.x_at / 1.2, d.x_at * 1.2, color="grey", alpha=0.25, lw=0)
    notes = [f"{key[0]} dose {d.target_dose:.3g}: outside the regime ({d.regime})" for d in outside.itertuples()]
    if any(np.isfinite(line.get_ydata()).any() for line in top.get_lines()):
        top.set_yscale("log", base=2)
        top.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))   # M* spans well under a decade: plain ticks
        top.yaxis.set_major_formatter(ScalarFormatter())
        top.yaxis.set_minor_formatter(NullFormatter())
    else:
        top.text(0.5, 0.5, "no M* at any dose", transform=top.transAxes, ha="center", color="grey")
    top.set_title(f"{series_name(key)}{optimizer_note(key[-1])}", fontsize=10)
    top.set_ylabel("task-diversity threshold M* (95 % CI)")
    bottom.set_ylabel("r at M = 16 (95 % CI over seeds)")
    if total:   # H1's own axis (method §11): dose 0 sits at the batch noise's own exposure
        bottom.set_xlabel("total exposure: integrated P-NE*, batch + injected (log)")
        kept = []   # a label per dose unless it would sit within 0.05 decade of the last one labelled
        for v in sorted(x[np.isfinite(x)]):
            if not kept or np.log10(v / kept[-1]) >= 0.05:
                kept.append(v)
        bottom.set_xticks(kept, [f"{v:.2g}" for v in kept])
    else:
        bottom.set_xlabel("realised injected dose: integrated P-NE* (0: none)")
        bottom.set_xticks([x0, *pos.realised_dose], ["0", *[f"{v:.2g}" for v in pos.realised_dose]])
    bottom.xaxis.set_minor_formatter(NullFormatter())
    bottom.tick_params(axis="x", labelrotation=35)   # neighbouring doses a factor 2 apart would overlap
    top.legend(fontsize=7, loc="best")
    return notes


def _plot_dose_mstar(top: plt.Axes, g: pd.DataFrame, x: np.ndarray) -> None:
    """M* by r50 and by midpoint at each dose (x: where the doses sit), and at every positive dose the ladder's
    reading: dose 0's M* moved by the ladder's shift (hollow, dashed; a little to the right where the dose has a full
    M grid of its own, so that the two readings of one dose can be compared)."""
    zero = g[g.target_dose == 0]
    for k, (point, mk, ls) in enumerate((("r50", "o", "-"), ("midpoint", "^", ":"))):
        m, lo, hi = (g[f"M_star_{point}{s}"].to_numpy() for s in ("", "_lo", "_hi"))
        xk = x * (0.94 if point == "midpoint" else 1.0)
        top.errorbar(xk, m, yerr=np.nan_to_num(np.vstack([m - lo, hi - m]).clip(min=0)), marker=mk, ls=ls,
                     color=f"C{k}", capsize=3, label=f"M* ({point})")
        base = float(zero[f"M_star_{point}"].iloc[0]) if len(zero) else np.nan
        own = np.isfinite(m)
        lad = base * 2.0 ** g.ladder_shift.to_numpy()
        ok = np.isfinite(lad)
        if ok.any():
            err = np.vstack([lad - base * 2.0 ** g.ladder_shift_lo.to_numpy(),
                             base * 2.0 ** g.ladder_shift_hi.to_numpy() - lad])[:, ok]
            xl = np.where(own, xk * 1.12, xk)
            top.errorbar(xl[ok], lad[ok], yerr=np.nan_to_num(err).clip(min=0), marker=mk, ls="--", mfc="white",
                         color=f"C{k}", capsize=3, label=f"M* ({point}) read from the ladder")
