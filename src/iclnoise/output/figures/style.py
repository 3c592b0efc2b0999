"""One look for every figure: seaborn theme, M palette, and saving PDF + PNG + the data."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import seaborn as sns  # noqa: E402

from ...analysis.verdicts import optimizer_note  # noqa: E402
from ...core.io import atomic_path  # noqa: E402
from ...core.runspec import parse_run_id  # noqa: E402
from ...core.sections import OPTIMIZERS  # noqa: E402
from ...core.tasks import M_INF, m_label  # noqa: E402


def setup() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "axes.titleweight": "bold",
                         "legend.frameon": False, "pdf.fonttype": 42})


def m_order(ms) -> list[int]:
    """Finite M ascending, then ∞."""
    ms = sorted(set(int(m) for m in ms))
    return [m for m in ms if m != M_INF] + ([M_INF] if M_INF in ms else [])


def m_palette(ms) -> dict[int, tuple]:
    """Sequential colours by log M (dMMSE-like dark → ridge-like light); ∞ gets its own hue."""
    order = m_order(ms)
    finite = [m for m in order if m != M_INF]
    colours = sns.color_palette("viridis", max(len(finite), 1))
    pal = {m: colours[i] for i, m in enumerate(finite)}
    if M_INF in order:
        pal[M_INF] = (0.85, 0.2, 0.2)
    return pal


def m_legend_label(M: int) -> str:
    return "M = ∞" if M == M_INF else f"M = {m_label(M)}"


def with_optimizer(df: pd.DataFrame) -> pd.DataFrame:
    """A per-run table (keyed by the KEY_FIELDS, which leave the optimizer out) with each run's optimizer, read from
    its run id, so a figure keeps grid.optimizer's arms apart."""
    return df.assign(optimizer=[parse_run_id(r).optimizer for r in df.run_id])


def arm_markers(out: pd.DataFrame) -> dict[tuple[int, str, str], str]:
    """A marker per compared arm (batch size, noise condition, optimizer) of a per-run table (markers repeat past 10
    arms)."""
    arms = sorted({(int(b), str(n), str(o)) for b, n, o in zip(out.batch, out.noise, out.optimizer)})
    return dict(zip(arms, itertools.cycle("osD^vP*X<>")))


def arm_label(batch: int, noise: str, optimizer: str = OPTIMIZERS[0]) -> str:
    """'batch 64, grad_b16', with ' (sgd_momentum)' for an optimizer other than AdamW."""
    return (f"batch {batch}" if noise == "none" else f"batch {batch}, {noise}") + optimizer_note(optimizer)


def m_arm_legend(ms, pal: dict, marks: dict[tuple[int, str, str], str]) -> list:
    """Legend handles: one colour per M, then one grey marker per arm ("batch 64, grad_b16")."""
    handles = [plt.Line2D([], [], marker="o", ls="", color=pal[M], label=m_legend_label(M)) for M in m_order(ms)]
    return handles + [plt.Line2D([], [], marker=mk, ls="", color="grey", label=arm_label(*arm))
                      for arm, mk in marks.items()]


AXIS_LABELS = {"integrated_pne": "integrated P-NE* (noise exposure)", "integrated_lr_over_b": "integrated η / B",
               "hessian_trace": "Hessian trace", "top_eigenvalue": "largest Hessian eigenvalue",
               "min_eigenvalue": "smallest Hessian eigenvalue", "sam_sharpness": "SAM sharpness"}


def axis_label(col: str) -> str:
    """A column's axis label: AXIS_LABELS, else the column name with spaces."""
    return AXIS_LABELS.get(col, col.replace("_", " "))


def save_figure(fig: plt.Figure, path: str | os.PathLike, data: pd.DataFrame | None = None) -> list[Path]:
    """Save `path` as .pdf and .png (atomically) and `data` beside it as .parquet; close fig."""
    base = Path(path).with_suffix("")
    written = []
    for ext in (".pdf", ".png"):
        final, tmp = atomic_path(base.with_suffix(ext))
        try:
            fig.savefig(tmp, format=ext[1:], bbox_inches="tight")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(final)
    if data is not None:
        final, tmp = atomic_path(base.with_suffix(".parquet"))
        try:
            pq.write_table(pa.Table.from_pandas(data, preserve_index=False), tmp)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(final)
    plt.close(fig)
    return written
