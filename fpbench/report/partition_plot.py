"""Per-client class histograms of a partition (SGPT Fig. 7), drawn before any run.

`suite_partition` builds the clients of one suite cell exactly as a run would (same dataset
config, partition config and seed); `class_counts` counts each client's train samples per class;
`partition_figure` draws them as stacked bars or as a clients x classes heatmap, held-out clients
marked. Figures use matplotlib's object API on an Agg canvas; only the CLI saves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fpbench.errors import FpbenchError
from fpbench.partition import Client

KINDS = ("auto", "bars", "heatmap")
MAX_BAR_CLASSES = 20  # above this, stacked bars have too many colours to read: use a heatmap
HELDOUT_COLOR = "crimson"


@dataclass(frozen=True)
class PartitionView:
    """What the plot needs: train counts (N, C), held-out flags, class names and a title."""

    counts: np.ndarray  # (N, C) train samples of each class per client
    heldout: list[bool]
    class_names: list[str]
    title: str


def select_cell(cells: Sequence, dataset: str | None, partition: str | None, seed: int | None):
    """The first cell of a suite matching the dataset / partition labels and the seed.

    Raises:
        FpbenchError: a filter matches no cell (the message lists the valid values).
    """
    for field, want in (("dataset", dataset), ("partition", partition), ("seed", seed)):
        if want is None:
            continue
        valid = list(dict.fromkeys(_field(c, field) for c in cells))
        if want not in valid:
            shown = ", ".join(str(v) for v in valid)
            raise FpbenchError(f"--{field} {want!r} is not in the suite; valid: {shown}")
        cells = [c for c in cells if _field(c, field) == want]
    return cells[0]


def _field(cell, field: str):
    return cell.seed if field == "seed" else getattr(cell, field).label


def suite_partition(cell) -> PartitionView:
    """The clients of a suite cell, built from its config as a run builds them."""
    from fpbench.engine.task import load_dataset
    from fpbench.partition import make_clients

    data = load_dataset(cell.dataset)
    clients = make_clients(cell.partition.name, cell.partition.args, data, seed=cell.seed)
    labels = data.train_labels.cpu().numpy()
    title = (
        f"{cell.dataset.label} / {cell.partition.label} / seed {cell.seed} "
        f"(suite {cell.suite}): train samples per class"
    )
    counts = class_counts(clients, labels, data.num_classes)
    return PartitionView(counts, [c.heldout for c in clients], list(data.class_names), title)


def class_counts(clients: Sequence[Client], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(N, C) number of train samples of each class held by each client."""
    rows = [np.bincount(labels[c.train_idx], minlength=num_classes) for c in clients]
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, num_classes), np.int64)


def partition_figure(view: PartitionView, kind: str = "auto") -> Figure:
    """Stacked bars (one segment per class) or a clients x classes heatmap of train counts.

    Held-out clients get red tick labels marked "(held out)" and, on bars, a hatch.

    Raises:
        FpbenchError: unknown `kind`.
    """
    if kind not in KINDS:
        raise FpbenchError(f"unknown plot kind {kind!r}; choose one of {', '.join(KINDS)}")
    counts = view.counts  # (N, C)
    if kind == "auto":
        kind = "bars" if counts.shape[1] <= MAX_BAR_CLASSES else "heatmap"
    n = len(counts)
    width = max(6.0, min(0.35 * n + 2.5, 18.0))
    fig = Figure(figsize=(width, 4.8 if kind == "bars" else max(3.5, 0.25 * n + 2)))
    fig.set_layout_engine("constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if kind == "bars":
        _bars(ax, counts, view)
    else:
        _heatmap(fig, ax, counts, view)
    ax.set_title(view.title, fontsize="medium")
    return fig


def _client_labels(heldout: Sequence[bool]) -> list[str]:
    return [f"{i} (held out)" if h else str(i) for i, h in enumerate(heldout)]


def _mark_heldout(labels, heldout: Sequence[bool]) -> None:
    for label, h in zip(labels, heldout, strict=True):
        if h:
            label.set_color(HELDOUT_COLOR)


def _class_colors(num_classes: int) -> list:
    """Distinct qualitative colours up to 20 classes, else samples of a continuous map."""
    if num_classes <= 20:
        return list(colormaps["tab20"].colors)[:num_classes]
    return list(colormaps["turbo"](np.linspace(0, 1, num_classes)))


def _bars(ax: Axes, counts: np.ndarray, view: PartitionView) -> None:
    """One bar per client, one stacked segment per class."""
    n, num_classes = counts.shape
    colors = _class_colors(num_classes)
    x, bottom = np.arange(n), np.zeros(n)
    hatch = ["//" if h else "" for h in view.heldout]
    for k in range(num_classes):
        ax.bar(x, counts[:, k], bottom=bottom, color=colors[k], label=view.class_names[k],
               hatch=hatch, edgecolor="white", linewidth=0.3)  # fmt: skip
        bottom += counts[:, k]
    ax.set_xticks(x, _client_labels(view.heldout), rotation=90 if n > 8 else 0)
    _mark_heldout(ax.get_xticklabels(), view.heldout)
    ax.set_xlabel("client")
    ax.set_ylabel("train samples")
    ax.legend(title="class", fontsize="x-small", ncols=2, loc="upper left", bbox_to_anchor=(1, 1))


def _heatmap(fig: Figure, ax: Axes, counts: np.ndarray, view: PartitionView) -> None:
    """Rows clients, columns classes, colour = train samples."""
    n, num_classes = counts.shape
    image = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="train samples")
    ax.set_yticks(np.arange(n), _client_labels(view.heldout), fontsize="small")
    _mark_heldout(ax.get_yticklabels(), view.heldout)
    step = max(1, num_classes // 25)
    ticks = np.arange(0, num_classes, step)
    ax.set_xticks(ticks, [view.class_names[k] for k in ticks], rotation=90, fontsize="small")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
