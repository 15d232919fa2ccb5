"""SGPT's clustering diagnostics: appendix D.2's congruence of Select's groups with
centralised k-means (Fig. 6a), and Table 4's clustering accuracy against coarse labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


def kmeans(
    x: Tensor, k: int, seed: int = 0, iters: int = 100, restarts: int = 4
) -> tuple[Tensor, Tensor]:
    """Seeded k-means++ then Lloyd; the lowest-inertia restart: (labels (n,), centres (k, d)).

    Deterministic for a seed; an empty cluster keeps its previous centre.
    """
    gen = torch.Generator().manual_seed(seed)
    x = x.float()
    best: tuple[float, Tensor, Tensor] | None = None
    for _ in range(restarts):
        centres = _kmeanspp(x, k, gen)  # (k, d)
        labels = torch.cdist(x, centres).argmin(1)  # (n,)
        for _ in range(iters):
            centres = _centres(x, labels, centres)
            new = torch.cdist(x, centres).argmin(1)
            if torch.equal(new, labels):
                break
            labels = new
        inertia = float(((x - centres[labels]) ** 2).sum())
        if best is None or inertia < best[0]:
            best = (inertia, labels, centres)
    assert best is not None
    return best[1], best[2]


def _kmeanspp(x: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """k-means++ seeding (k, d): each next centre drawn with probability ~ squared distance."""
    n = len(x)
    first = int(torch.randint(n, (1,), generator=gen))
    centres = [x[first]]
    d2 = ((x - x[first]) ** 2).sum(1)  # (n,)
    for _ in range(1, k):
        probs = d2.cpu().double()
        pick = int(torch.multinomial(probs, 1, generator=gen)) if probs.sum() > 0 else 0
        centres.append(x[pick])
        d2 = torch.minimum(d2, ((x - x[pick]) ** 2).sum(1))
    return torch.stack(centres)


def _centres(x: Tensor, labels: Tensor, old: Tensor) -> Tensor:
    """Cluster means (k, d); an empty cluster keeps its old centre."""
    k = len(old)
    sums = torch.zeros_like(old).index_add_(0, labels, x)  # (k, d)
    counts = torch.bincount(labels, minlength=k).unsqueeze(1)  # (k, 1)
    return torch.where(counts > 0, sums / counts.clamp(min=1), old)


def contingency(rows: Tensor, cols: Tensor, n_rows: int, n_cols: int) -> Tensor:
    """Normalised contingency matrix (n_rows, n_cols): fraction of samples with each label pair."""
    table = torch.zeros(n_rows * n_cols, dtype=torch.float64, device=rows.device)
    table.index_add_(
        0, rows * n_cols + cols, torch.ones(len(rows), dtype=torch.float64, device=rows.device)
    )
    return (table / max(len(rows), 1)).view(n_rows, n_cols)


def overlap(rows: Tensor, cols: Tensor, n_rows: int, n_cols: int) -> float:
    """The sum of each row's maximum of the normalised contingency matrix of (rows, cols)."""
    return float(contingency(rows, cols, n_rows, n_cols).max(1).values.sum())


def congruence(
    kmeans_labels: Tensor, groups: Tensor, classes: Tensor, k: int, g: int, c: int
) -> tuple[float, float]:
    """(Acc_overlap, Acc_overlap / Q_kmeans) of SGPT appendix D.2.

    Acc_overlap: row maxima of the normalised contingency matrix with k-means clusters as rows
    and Select's groups as columns (the order the paper names them), summed. Q_kmeans: the same
    with classes as rows and k-means clusters as columns (the share of each class in its most
    common cluster). Note the literal definition: if every sample takes one group,
    Acc_overlap = 1.
    """
    acc = overlap(kmeans_labels, groups, k, g)
    return acc, acc / overlap(classes, kmeans_labels, c, k)


def cluster_accuracy(groups: Tensor, coarse: Tensor, g: int, c: int) -> float:
    """SGPT Table 4's clustering accuracy of groups (n,) against coarse classes (n,).

    The share of samples whose group is matched to their coarse class under the one-to-one
    matching of the g groups to the c classes that maximises it (Hungarian algorithm); with
    g != c the unmatched groups count as wrong.
    """
    from scipy.optimize import linear_sum_assignment  # 0.4 s to import; suites load without it

    table = contingency(groups, coarse, g, c).cpu().numpy()  # (g, c)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return float(table[rows, cols].sum())
