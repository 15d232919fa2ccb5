"""Per-client class histograms of a partition (SGPT Fig. 7), drawn before any run.

`suite_partition` builds the clients of one suite cell exactly as a run would (same dataset
config, partition config and seed); `suite_partitions` does so for every distinct (dataset,
partition, seed) of a suite's cells, one view per distinct picture (seeds that deal the same
counts share one); `class_counts` counts each client's train samples per class;
`partition_figure` draws them as stacked bars or as a clients x classes heatmap, held-out clients
marked. Figures use matplotlib's object API on an Agg canvas; only the CLI saves them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

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
    return select_cells(cells, dataset, partition, seed)[0]


def select_cells(
    cells: Sequence, dataset: str | None, partition: str | None, seed: int | None
) -> list:
    """The cells of a suite matching the dataset / partition labels and the seed (None: any).

    Raises:
        FpbenchError: a filter matches no cell (the message lists the valid values).
    """
    cells = list(cells)
    for field, want in (("dataset", dataset), ("partition", partition), ("seed", seed)):
        if want is None:
            continue
        valid = list(dict.fromkeys(_field(c, field) for c in cells))
        if want not in valid:
            shown = ", ".join(str(v) for v in valid)
            raise FpbenchError(f"--{field} {want!r} is not in the suite; valid: {shown}")
        cells = [c for c in cells if _field(c, field) == want]
    return cells


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


def suite_partitions(cells: Sequence) -> list[tuple[str, PartitionView]]:
    """(name, view) of every distinct partition the cells deal, in suite order.

    Cells of one dataset config, partition config and seed deal the same clients (the method
    plays no part), so each such triple is built once, each dataset loaded once. Seeds of one
    (dataset, partition) that deal the same per-client counts and held-out clients draw the same
    picture: it is kept once, its title naming them all. Names are `<dataset>-<partition>`, with
    `-s<seed>` (the picture's first seed) where the seeds of that pair draw different pictures;
    characters other than letters, digits, `_`, `.` and `-` become `_`.
    """
    from fpbench.engine.task import load_dataset
    from fpbench.partition import make_clients

    pairs: dict[tuple[str, str], tuple[object, list[int]]] = {}
    for c in cells:  # (dataset config, partition config) -> a cell of it, its seeds
        key = (c.dataset.model_dump_json(), c.partition.model_dump_json())
        cell, seeds = pairs.setdefault(key, (c, []))
        if c.seed not in seeds:
            seeds.append(c.seed)
    datasets: dict[str, object] = {}
    named: list[tuple[str, PartitionView]] = []
    taken: set[str] = set()
    for (data_key, _), (cell, seeds) in pairs.items():
        if data_key not in datasets:
            datasets[data_key] = load_dataset(cell.dataset)
        data = datasets[data_key]
        labels = data.train_labels.cpu().numpy()
        pictures: list[tuple[PartitionView, list[int]]] = []
        for seed in seeds:
            clients = make_clients(cell.partition.name, cell.partition.args, data, seed=seed)
            counts = class_counts(clients, labels, data.num_classes)
            heldout = [c.heldout for c in clients]
            same = next(
                (
                    s
                    for v, s in pictures
                    if v.heldout == heldout and np.array_equal(v.counts, counts)
                ),
                None,
            )
            if same is not None:
                same.append(seed)
            else:
                pictures.append(
                    (PartitionView(counts, heldout, list(data.class_names), ""), [seed])
                )
        base = _slug(f"{cell.dataset.label}-{cell.partition.label}")
        for view, shown in pictures:
            name = base if len(pictures) == 1 else f"{base}-s{shown[0]}"
            name = _unique(name, taken)
            which = f"seed{'s' if len(shown) > 1 else ''} {', '.join(map(str, shown))}"
            title = (
                f"{cell.dataset.label} / {cell.partition.label} / {which} "
                f"(suite {cell.suite}): train samples per class"
            )
            named.append((name, replace(view, title=title)))
    return named


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... where labels of distinct configs coincide."""
    found, n = name, 1
    while found in taken:
        n += 1
        found = f"{name}-{n}"
    taken.add(found)
    return found


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
