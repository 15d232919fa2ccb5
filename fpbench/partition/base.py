"""The client record, the common partition config and the helpers every partition shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError


@dataclass(frozen=True, eq=False)
class Client:
    """One federated client: its data as (read-only) indices into the dataset's splits.

    Attributes:
        id: Position in the client list (0..N-1).
        train_idx: int64 indices into the train split, sorted.
        test_idx: int64 indices into the test split (the local test set), sorted.
        class_prior: (C,) float64 train label distribution (sums to 1; uniform if no train data).
        domain: The client's domain for per-domain partitions, else None.
        heldout: Held-out clients never train; they are only evaluated.
    """

    id: int
    train_idx: np.ndarray
    test_idx: np.ndarray
    class_prior: np.ndarray
    domain: int | None
    heldout: bool


class PartitionConfig(BaseModel):
    """Knobs every partition has; each partition's `Config` subclasses this."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_clients: int = Field(10, ge=1, description="Number of clients (held-out ones included).")
    heldout_frac: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of clients held out (never trained)."
    )
    shots: int | None = Field(
        None, ge=1, description="n-shot: keep at most this many train samples per class per client."
    )
    min_train: int = Field(
        1, ge=0, description="Every client needs at least this many train samples (after shots)."
    )


class Partition(Protocol):
    """What a registered partition provides (all static)."""

    name: ClassVar[str]
    Config: ClassVar[type[PartitionConfig]]

    @staticmethod
    def check(cfg: Any, info: DatasetInfo) -> None: ...

    @staticmethod
    def split(cfg: Any, data: ImageDataset, rng: np.random.Generator) -> list[Client]: ...


def train_labels(data: ImageDataset) -> np.ndarray:
    return data.train_labels.cpu().numpy().astype(np.int64)


def test_labels(data: ImageDataset) -> np.ndarray:
    return data.test_labels.cpu().numpy().astype(np.int64)


def domains_of(data: ImageDataset) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample domains of the (train, test) splits; an error if the dataset has none."""
    if data.train_domains is None or data.test_domains is None:
        raise FpbenchError(f"dataset {data.name!r} has no per-sample domains")
    tr, te = data.train_domains.cpu().numpy(), data.test_domains.cpu().numpy()
    return tr.astype(np.int64), te.astype(np.int64)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.sort(np.asarray(a, dtype=np.int64))
    a.setflags(write=False)
    return a


def make_client(
    cid: int,
    train_idx: np.ndarray,
    test_idx: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    domain: int | None = None,
    heldout: bool = False,
) -> Client:
    """Build a client; `class_prior` comes from `labels[train_idx]`."""
    train_idx = _frozen(train_idx)
    counts = np.bincount(labels[train_idx], minlength=num_classes).astype(np.float64)
    total = counts.sum()
    prior = counts / total if total > 0 else np.full(num_classes, 1.0 / num_classes)
    prior.setflags(write=False)
    return Client(cid, train_idx, _frozen(test_idx), prior, domain, heldout)


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer quotas summing to `total`, proportional to `weights` (Hamilton's method)."""
    exact = total * weights / weights.sum()
    quota = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - quota), kind="stable")
    quota[order[: total - quota.sum()]] += 1
    return quota


def local_test_sets(
    train_parts: list[np.ndarray],
    train_keys: np.ndarray,
    test_keys: np.ndarray,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Split the test set into disjoint local test sets that follow the clients' train shares.

    A key is a class (or a (domain, class) pair). The test samples of key k are shuffled and dealt
    so that client i gets about n_test_k * share_ik of them, where share_ik is client i's share of
    the train samples of key k (largest-remainder rounding: every test sample of a key present in
    some client's train set is given out). Best effort afterwards: a client with train data but no
    test sample takes one, of its most frequent key, from the client holding most of that key.
    """
    n_keys = int(max(train_keys.max(initial=-1), test_keys.max(initial=-1))) + 1
    counts = np.stack([np.bincount(train_keys[p], minlength=n_keys) for p in train_parts])
    owned: list[dict[int, np.ndarray]] = [{} for _ in train_parts]  # client -> key -> indices
    order = np.argsort(test_keys, kind="stable")
    bounds = np.searchsorted(test_keys[order], np.arange(n_keys + 1))
    for k in range(n_keys):
        pool = rng.permutation(order[bounds[k] : bounds[k + 1]])
        if counts[:, k].sum() == 0 or pool.size == 0:
            continue
        quota = _largest_remainder(pool.size, counts[:, k].astype(np.float64))
        holders = np.flatnonzero(quota)
        for i, chunk in zip(holders, np.split(pool, np.cumsum(quota[holders])[:-1]), strict=True):
            owned[i][k] = chunk
    _give_empty_a_test_sample(owned, counts)
    return [np.concatenate(list(o.values()) or [np.empty(0, np.int64)]) for o in owned]


def _give_empty_a_test_sample(owned: list[dict[int, np.ndarray]], counts: np.ndarray) -> None:
    for i, mine in enumerate(owned):
        if mine or counts[i].sum() == 0:
            continue
        for k in np.argsort(-counts[i], kind="stable")[: np.count_nonzero(counts[i])].tolist():
            sizes = [o[k].size if k in o else 0 for o in owned]
            donor = int(np.argmax(sizes))
            if sizes[donor] > 1:
                mine[k] = owned[donor][k][-1:]
                owned[donor][k] = owned[donor][k][:-1]
                break


def dirichlet_split(
    idx: np.ndarray,
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    min_size: int,
    max_retries: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Label-skewed split of `idx` (labels `labels[idx]`) by per-class Dirichlet(alpha) shares.

    Follows the common NIID-Bench protocol (Li et al., 2022): for each class, shares over clients
    are drawn from Dirichlet(alpha), clients already holding more than an equal share of the
    samples get nothing more, and the class's shuffled samples are cut at the cumulative shares.
    The draw is repeated until every client has >= `min_size` samples, at most `max_retries` times.
    """
    if min_size * num_clients > idx.size:
        raise FpbenchError(
            f"partition.min_size = {min_size} is impossible: {num_clients} clients x {min_size} > "
            f"{idx.size} train samples; lower min_size or use fewer clients"
        )
    y = labels[idx]
    for _ in range(max_retries):
        parts = _dirichlet_once(idx, y, num_clients, alpha, rng)
        if min(p.size for p in parts) >= min_size:
            return parts
    raise FpbenchError(
        f"partition.min_size = {min_size}: no Dirichlet(alpha={alpha}) split gave every client at "
        f"least {min_size} train samples in {max_retries} tries (partition.max_retries); lower "
        "min_size, raise alpha or use fewer clients"
    )


def _dirichlet_once(
    idx: np.ndarray, y: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for c in np.unique(y):
        pool = rng.permutation(idx[y == c])
        share = rng.dirichlet(np.full(num_clients, alpha))
        open_ = share * (sizes < idx.size / num_clients)
        share = open_ if open_.sum() > 0 else share
        cuts = (np.cumsum(share / share.sum()) * pool.size).astype(np.int64)[:-1]
        for i, chunk in enumerate(np.split(pool, cuts)):
            chunks[i].append(chunk)
            sizes[i] += chunk.size
    return [np.concatenate(c) for c in chunks]
