"""Evaluation modes (`RunConfig.evaluation`): what a run trains on, and what else it scores.

* base-to-novel (CoCoOp's protocol, CoOp's `subsample_classes`): the labels 0..C-1 are split
  into base = the first ceil(C/2) and novel = the rest, each re-indexed from 0. The run's dataset
  becomes its base classes (train and test samples), so training, partitioning and every usual
  metric see only them; `acc_base` is the run's `acc_global`. The novel classes' test images are
  scored with a classifier over the novel class names: `acc_novel`; `acc_hm` is the harmonic
  mean 2 b n / (b + n).
* cross-dataset: the run trains on its dataset as usual; each target dataset's whole test split
  is scored with a classifier over the target's class names: `acc_xd_<label>`, and the mean over
  targets `acc_xd_mean`.
* leave-one-domain-out: the held-out domain's samples leave the run's dataset (its domains are
  re-indexed, so a per-domain partition makes clients of the others); the held-out domain's
  test images are scored with the same classes: `acc_lodo`.

Each scored set is a task of its own whose clients are the run's clients with no local data: a
global method's model, or each trained client's own model for a personal method (the mean over
them, as `acc_global`), predicts its whole test split; `ece_<set>` is the calibration error
beside each accuracy. Where the classes change, the trained server state is handed to a second
instance of the method built with the other class names (`TaskInfo.class_names`), on the same
backbone: a method that builds its text classifier from the class names it is given works in
these modes unchanged. One whose parameters depend on the class count (class-specific context,
a linear head) cannot be scored on other classes and is refused before the run starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fpbench.data.base import ImageDataset
from fpbench.engine.metrics import domain_key
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.specs import Evaluation

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class EvalSet:
    """A dataset scored beside the run's: metrics `acc_<name>` / `ece_<name>`."""

    name: str
    data: ImageDataset
    same_classes: bool  # scored with the run's own method instance (same class names)


def split_for(
    evaluation: Evaluation | None, data: ImageDataset, load=None
) -> tuple[ImageDataset, list[EvalSet]]:
    """The dataset the run trains on, and the sets it also scores (`load`: Component ->
    ImageDataset, for cross-dataset targets)."""
    if evaluation is None:
        return data, []
    if evaluation.mode == "base2novel":
        base, novel = class_split(data)
        return base, [EvalSet("novel", novel, same_classes=False)]
    if evaluation.mode == "leave-one-domain-out":
        rest, held = without_domain(data, evaluation.domain or "")
        return rest, [EvalSet("lodo", held, same_classes=True)]
    return data, [
        EvalSet(f"xd_{domain_key(t.label)}", load(t), same_classes=False)
        for t in evaluation.targets
    ]


def class_split(data: ImageDataset) -> tuple[ImageDataset, ImageDataset]:
    """(base, novel): base = labels < ceil(C/2), novel = the rest, each re-indexed from 0."""
    c = data.num_classes
    if c < 2:
        raise FpbenchError(f"base-to-novel needs at least 2 classes; {data.name} has {c}")
    m = math.ceil(c / 2)
    return _classes(data, 0, m, "base"), _classes(data, m, c, "novel")


def _classes(data: ImageDataset, lo: int, hi: int, tag: str) -> ImageDataset:
    """The samples of labels lo..hi-1, relabelled 0..hi-lo-1."""
    tr = (data.train_labels >= lo) & (data.train_labels < hi)
    te = (data.test_labels >= lo) & (data.test_labels < hi)
    coarse = data.coarse_of_class
    return dataclasses.replace(
        _subset(data, tr, te, tag),
        train_labels=data.train_labels[tr] - lo,
        test_labels=data.test_labels[te] - lo,
        class_names=list(data.class_names[lo:hi]),
        coarse_of_class=None if coarse is None else coarse[lo:hi],
    )


def without_domain(data: ImageDataset, name: str) -> tuple[ImageDataset, ImageDataset]:
    """(the other domains, re-indexed; the domain `name` alone, as domain 0)."""
    names = data.domain_names or []
    keys = [domain_key(n) for n in names]
    if len(names) < 2 or domain_key(name) not in keys:
        raise FpbenchError(
            f"leave-one-domain-out: dataset {data.name} has no domain {name!r}; its domains: "
            f"{', '.join(names) or 'none (a single-domain dataset)'}"
        )
    d = keys.index(domain_key(name))
    assert data.train_domains is not None and data.test_domains is not None
    keep_tr, keep_te = data.train_domains != d, data.test_domains != d
    shift = lambda dom: dom - (dom > d).long()  # noqa: E731  (indices above d move down one)
    sizes = data.domain_train_sizes
    rest = dataclasses.replace(
        _subset(data, keep_tr, keep_te, f"without-{keys[d]}"),
        train_domains=shift(data.train_domains[keep_tr]),
        test_domains=shift(data.test_domains[keep_te]),
        domain_names=[n for i, n in enumerate(names) if i != d],
        domain_train_sizes=None if sizes is None else torch.cat([sizes[:d], sizes[d + 1 :]]),
    )
    held = dataclasses.replace(
        _subset(data, ~keep_tr, ~keep_te, f"domain-{keys[d]}"),
        train_domains=torch.zeros(int((~keep_tr).sum()), dtype=torch.long),
        test_domains=torch.zeros(int((~keep_te).sum()), dtype=torch.long),
        domain_names=[names[d]],
        domain_train_sizes=None if sizes is None else sizes[d : d + 1],
    )
    return rest, held


def _subset(data: ImageDataset, tr: Tensor, te: Tensor, tag: str) -> ImageDataset:
    """The train samples tr (n,) bool and test samples te (m,) bool, everything else kept."""
    pick = lambda t, m: None if t is None else t[m]  # noqa: E731
    return dataclasses.replace(
        data,
        train_images=data.train_images[tr],
        train_labels=data.train_labels[tr],
        test_images=data.test_images[te],
        test_labels=data.test_labels[te],
        train_domains=pick(data.train_domains, tr),
        test_domains=pick(data.test_domains, te),
        train_users=pick(data.train_users, tr),
        identity=None if data.identity is None else f"{data.identity}/{tag}",
    )


def derived(evaluation: Evaluation | None, agg: dict[str, float]) -> dict[str, float]:
    """The mode's summary metrics from a round's aggregates (`acc_<set>` already in `agg`)."""
    if evaluation is None:
        return {}
    out: dict[str, float] = {}
    if evaluation.mode == "base2novel" and "acc_global" in agg and "acc_novel" in agg:
        base, novel = agg["acc_global"], agg["acc_novel"]
        out["acc_base"] = base
        out["acc_hm"] = 2 * base * novel / (base + novel) if base + novel > 0 else 0.0
    if evaluation.mode == "cross-dataset":
        accs = [v for k, v in agg.items() if k.startswith("acc_xd_")]
        if accs:
            out["acc_xd_mean"] = sum(accs) / len(accs)
    return out
