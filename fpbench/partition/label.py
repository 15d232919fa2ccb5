"""Label-skew partitions: iid, pathological (s classes per client), Dirichlet, Pachinko."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition.base import (
    Client,
    PartitionConfig,
    dirichlet_split,
    local_test_sets,
    make_client,
    test_labels,
    train_labels,
)
from fpbench.registry import PARTITIONS


def _clients_from_train(
    parts: list[np.ndarray], data: ImageDataset, rng: np.random.Generator
) -> list[Client]:
    """Clients from train parts, with local test sets that follow their class shares."""
    y, y_test = train_labels(data), test_labels(data)
    tests = local_test_sets(parts, y, y_test, rng)
    return [
        make_client(i, p, t, y, data.num_classes)
        for i, (p, t) in enumerate(zip(parts, tests, strict=True))
    ]


@PARTITIONS.register("iid")
class Iid:
    """Uniform random split of the train set into near-equal parts."""

    name = "iid"

    class Config(PartitionConfig):
        pass

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        del cfg, info

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        parts = np.array_split(rng.permutation(len(data.train_labels)), cfg.num_clients)
        return _clients_from_train(parts, data, rng)


@PARTITIONS.register("pathological")
class Pathological:
    """SGPT's "noniid-labeluni" protocol: every client holds exactly `s` classes.

    Each class is shared by c = s * N / K clients with portions ~ U(0.4, 0.6) normalised per class.
    Classes are dealt client by client, each time among the classes with the most remaining slots
    (so they go out in passes over all classes); a class the client already holds is skipped,
    which never changes the reference's choice when K % s == 0. Client i takes
    floor(n_train_k * p) of class k's shuffled train samples and floor(n_test_k * p) of its test
    samples, consumed sequentially (disjoint; floors drop a few samples, as in the reference).
    """

    name = "pathological"

    class Config(PartitionConfig):
        s: int = Field(10, ge=1, description="Classes per client.")

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        K, N, s = info.num_classes, cfg.num_clients, cfg.s
        if s > K:
            raise FpbenchError(
                f"partition.s = {s} is larger than the number of classes ({K}); use s <= {K}"
            )
        if (s * N) % K:
            step = K // math.gcd(s, K)
            raise FpbenchError(
                f"partition.num_clients = {N} with partition.s = {s}: s * num_clients must be a "
                f"multiple of the number of classes ({K}); use num_clients a multiple of {step}"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        y, y_test = train_labels(data), test_labels(data)
        K = data.num_classes
        deal = _deal_classes(K, cfg.num_clients, cfg.s, rng)
        train_pools = [rng.permutation(np.flatnonzero(y == k)) for k in range(K)]
        test_pools = [rng.permutation(np.flatnonzero(y_test == k)) for k in range(K)]
        train_parts = _consume(deal, train_pools)
        test_parts = _consume(deal, test_pools)
        return [
            make_client(i, tr, te, y, K)
            for i, (tr, te) in enumerate(zip(train_parts, test_parts, strict=True))
        ]


def _deal_classes(
    K: int, N: int, s: int, rng: np.random.Generator
) -> list[list[tuple[int, float]]]:
    """Per client, its s (class, portion) pairs, in dealing order."""
    c = s * N // K
    u = rng.uniform(0.4, 0.6, size=(K, c))
    portions = [list(row) for row in u / u.sum(axis=1, keepdims=True)]
    slots = np.full(K, c)
    deal = []
    for _ in range(N):
        held: list[int] = []
        for _ in range(s):
            free = slots > 0
            free[held] = False
            if not free.any():
                raise FpbenchError(f"partition 'pathological' cannot deal {s} distinct classes")
            cand = np.flatnonzero(free & (slots == slots[free].max()))
            k = int(rng.choice(cand))
            slots[k] -= 1
            held.append(k)
        deal.append([(k, portions[k].pop()) for k in held])
    return deal


def _consume(deal: list[list[tuple[int, float]]], pools: list[np.ndarray]) -> list[np.ndarray]:
    """Take floor(len(pool_k) * p) samples of each dealt class, sequentially per class."""
    cursor = [0] * len(pools)
    parts = []
    for pairs in deal:
        mine = []
        for k, p in pairs:
            n = math.floor(pools[k].size * p)
            mine.append(pools[k][cursor[k] : cursor[k] + n])
            cursor[k] += n
        parts.append(np.concatenate(mine))
    return parts


@PARTITIONS.register("dirichlet")
class Dirichlet:
    """Dirichlet(alpha) label skew, by one of two schemes (`scheme`).

    * "niid-bench" (Li et al., 2022; FedOTP / FedPGP's CIFAR code): per class, shares over the
      clients ~ Dirichlet(alpha), redrawn until every client has `min_size` (`dirichlet_split`);
      client sizes vary.
    * "feddyn" (Acar et al., 2021, FedDyn's `utils_dataset.py`, which PEP-FedPT cites): per
      client, a class prior ~ Dirichlet(alpha) over the classes and an equal size floor(n / N)
      (the n mod N samples left over are dropped); see `prior_split`.
    """

    name = "dirichlet"

    class Config(PartitionConfig):
        alpha: float = Field(0.5, gt=0.0, description="Dirichlet concentration (small: skewed).")
        min_size: int = Field(10, ge=0, description="Resample until every client has this many.")
        max_retries: int = Field(100, ge=1, description="Give up (error) after this many draws.")
        scheme: Literal["niid-bench", "feddyn"] = Field(
            "niid-bench",
            description="niid-bench: per-class shares over clients (Li et al.); feddyn: "
            "per-client class priors with equal client sizes (Acar et al.)",
        )

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        del cfg, info

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        y = train_labels(data)
        idx = np.arange(y.size)
        if cfg.scheme == "feddyn":
            parts = prior_split(y, data.num_classes, cfg.num_clients, cfg.alpha, cfg.min_size, rng)
            return _clients_from_train(parts, data, rng)
        parts = dirichlet_split(
            idx, y, cfg.num_clients, cfg.alpha, cfg.min_size, cfg.max_retries, rng
        )
        return _clients_from_train(parts, data, rng)


def prior_split(
    y: np.ndarray,
    num_classes: int,
    num_clients: int,
    alpha: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """FedDyn's Dirichlet scheme: train indices per client, each of size floor(n / N).

    Each client draws a class prior ~ Dirichlet(alpha * 1_C). Until every client is full: pick a
    client uniformly among those not yet full, draw a class from its prior restricted to the
    classes with samples left (FedDyn redraws a class that has run out, which is the same
    distribution), and give it the next of that class's shuffled samples.

    Raises:
        FpbenchError: floor(n / N) < `min_size`.
    """
    size = y.size // num_clients
    if size < min_size:
        raise FpbenchError(
            f"partition.min_size = {min_size}: scheme 'feddyn' gives each of {num_clients} "
            f"clients {size} train samples; lower min_size or use fewer clients"
        )
    C = num_classes
    priors = rng.dirichlet(np.full(C, alpha), size=num_clients)  # (N, C)
    pools = [rng.permutation(np.flatnonzero(y == k)) for k in range(C)]
    left = np.array([p.size for p in pools])
    room = np.full(num_clients, size)
    taken: list[list[int]] = [[] for _ in range(num_clients)]
    for _ in range(size * num_clients):
        open_ = np.flatnonzero(room)
        i = int(open_[rng.integers(open_.size)])
        p = priors[i] * (left > 0)
        total = p.sum()
        # a prior that underflowed to 0 on every class left: uniform over them
        p = p / total if total > 0 else (left > 0) / np.count_nonzero(left)
        k = int(min(np.searchsorted(np.cumsum(p), rng.random(), side="right"), C - 1))
        while left[k] == 0:  # rounding in the cumsum can land on an empty class: step back
            k -= 1
        left[k] -= 1
        room[i] -= 1
        taken[i].append(int(pools[k][left[k]]))
    return [np.array(t, dtype=np.int64) for t in taken]


@PARTITIONS.register("pachinko")
class Pachinko:
    """Two-stage Pachinko allocation over coarse and fine labels (Reddi et al., 2021, app. C).

    Each client draws theta ~ Dirichlet(beta) over coarse labels and, per coarse label,
    phi ~ Dirichlet(beta_f) over its fine labels; it then takes its quota (an equal share of the
    train set) by sampling without replacement from theta x phi. When a fine label's pool runs dry
    its phi mass is renormalised over the group's remaining fine labels; when a whole coarse group
    runs dry theta is renormalised over the remaining groups. Sampling is batched (multinomial draws
    clipped to what is left, then redrawn from the renormalised distribution), so every train
    sample is assigned.
    """

    name = "pachinko"

    class Config(PartitionConfig):
        beta: float = Field(0.1, gt=0.0, description="Dirichlet concentration over coarse labels.")
        beta_f: float = Field(10.0, gt=0.0, description="Dirichlet concentration over fine labels.")

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        del cfg
        if not info.has_coarse:
            raise FpbenchError(
                "partition 'pachinko' needs coarse labels (coarse_of_class); this dataset has "
                "none: use partition 'dirichlet'"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        assert data.coarse_of_class is not None
        coarse = data.coarse_of_class.cpu().numpy().astype(np.int64)
        y = train_labels(data)
        pools = [rng.permutation(np.flatnonzero(y == k)) for k in range(data.num_classes)]
        sizes = np.array([p.size for p in pools])
        used = np.zeros_like(sizes)
        quotas = np.diff(np.linspace(0, y.size, cfg.num_clients + 1).astype(np.int64))
        parts = []
        for quota in quotas:
            take = _pachinko_counts(int(quota), coarse, sizes - used, cfg.beta, cfg.beta_f, rng)
            parts.append(
                np.concatenate([p[u : u + t] for p, u, t in zip(pools, used, take, strict=True)])
            )
            used += take
        return _clients_from_train(parts, data, rng)


def _pachinko_counts(
    quota: int,
    coarse: np.ndarray,
    avail: np.ndarray,
    beta: float,
    beta_f: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """How many samples of each fine class one client takes: (C,) int64."""
    G = int(coarse.max()) + 1
    theta = rng.dirichlet(np.full(G, beta))
    phi = np.zeros(coarse.size)
    for g in range(G):
        members = np.flatnonzero(coarse == g)
        if members.size:
            phi[members] = rng.dirichlet(np.full(members.size, beta_f))
    take = np.zeros(coarse.size, dtype=np.int64)
    while quota > 0:  # each pass fills the quota or empties at least one pool
        left = avail - take
        draw = rng.multinomial(quota, _joint(theta, phi, coarse, left > 0))
        got = np.minimum(draw, left)
        take += got
        quota -= int(got.sum())
    return take


def _joint(theta: np.ndarray, phi: np.ndarray, coarse: np.ndarray, open_: np.ndarray) -> np.ndarray:
    """theta x phi restricted to classes with samples left, renormalised per level: (C,)."""
    G = theta.size
    f = phi * open_
    mass = np.bincount(coarse, weights=f, minlength=G)
    has = np.bincount(coarse, weights=open_.astype(np.float64), minlength=G) > 0
    underflow = has & (mass <= 0)  # tiny beta_f can give exact zeros: fall back to uniform
    f = np.where(underflow[coarse] & open_, 1.0, f)
    mass = np.bincount(coarse, weights=f, minlength=G)
    t = theta * has
    t = t if t.sum() > 0 else has.astype(np.float64)
    t = t / t.sum()
    joint = t[coarse] * np.divide(f, mass[coarse], out=np.zeros_like(f), where=mass[coarse] > 0)
    return joint / joint.sum()


@PARTITIONS.register("natural")
class Natural:
    """The dataset's own clients: one per user id in `train_users` (e.g. iNaturalist-User-120k).

    `num_clients` must equal the number of users the dataset kept (it is checked at split time,
    since only the loaded data knows it). Local test sets follow each user's class shares.
    """

    name = "natural"

    class Config(PartitionConfig):
        pass

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        del cfg, info

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        if data.train_users is None:
            raise FpbenchError(
                f"partition 'natural' needs a dataset with per-user clients (train_users); "
                f"{data.name!r} has none: use iid, dirichlet or pathological"
            )
        users = data.train_users.numpy()
        num_users = int(users.max()) + 1 if len(users) else 0
        if cfg.num_clients != num_users:
            raise FpbenchError(
                f"partition.num_clients = {cfg.num_clients}, but {data.name!r} has {num_users} "
                f"users: set num_clients = {num_users}"
            )
        order = np.argsort(users, kind="stable")  # sample ids grouped by user, ascending
        parts = np.split(order, np.cumsum(np.bincount(users, minlength=num_users))[:-1])
        return _clients_from_train(parts, data, rng)
