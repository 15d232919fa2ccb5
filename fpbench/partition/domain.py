"""Feature-shift partitions: one client per domain, or each domain split by Dirichlet label skew."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition.base import (
    Client,
    PartitionConfig,
    dirichlet_split,
    domains_of,
    local_test_sets,
    make_client,
    test_labels,
    train_labels,
)
from fpbench.partition.label import _consume, _deal_classes
from fpbench.registry import PARTITIONS


def _need_domains(name: str, info: DatasetInfo) -> None:
    if info.num_domains < 2:
        raise FpbenchError(
            f"partition {name!r} needs a dataset with several domains; this one has "
            f"{info.num_domains}: use a label-skew partition such as 'dirichlet'"
        )


@PARTITIONS.register("domain")
class Domain:
    """One client per domain, holding all of that domain's train and test samples (SGPT, FedBN)."""

    name = "domain"

    class Config(PartitionConfig):
        pass

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        _need_domains(Domain.name, info)
        if cfg.num_clients != info.num_domains:
            raise FpbenchError(
                f"partition.num_clients = {cfg.num_clients} must equal the number of domains "
                f"({info.num_domains}) for partition 'domain'; set "
                f"partition.num_clients = {info.num_domains}"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        del rng
        d_train, d_test = domains_of(data)
        y = train_labels(data)
        return [
            make_client(
                d, np.flatnonzero(d_train == d), np.flatnonzero(d_test == d), y, data.num_classes, d
            )
            for d in range(cfg.num_clients)
        ]


@PARTITIONS.register("domain-dirichlet")
class DomainDirichlet:
    """Each domain split into `clients_per_domain` clients by Dirichlet(alpha) label skew.

    The SDFed / PEP-FedPT DomainNet protocol. Clients d*k .. d*k+k-1 belong to domain d. Local test
    sets come from the client's domain, per class in proportion to its share of the class's train
    samples within that domain.
    """

    name = "domain-dirichlet"

    class Config(PartitionConfig):
        clients_per_domain: int = Field(2, ge=1, description="Clients per domain (k).")
        alpha: float = Field(0.3, gt=0.0, description="Dirichlet concentration within a domain.")
        min_size: int = Field(10, ge=0, description="Resample until every client has this many.")
        max_retries: int = Field(100, ge=1, description="Give up (error) after this many draws.")

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        _need_domains(DomainDirichlet.name, info)
        want = cfg.clients_per_domain * info.num_domains
        if cfg.num_clients != want:
            raise FpbenchError(
                f"partition.num_clients = {cfg.num_clients} must equal clients_per_domain x "
                f"domains ({cfg.clients_per_domain} x {info.num_domains}) for partition "
                f"'domain-dirichlet'; set partition.num_clients = {want}"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        d_train, d_test = domains_of(data)
        y, C, k = train_labels(data), data.num_classes, cfg.clients_per_domain
        parts: list[np.ndarray] = []
        for d in range(data.num_domains):
            idx = np.flatnonzero(d_train == d)
            parts += dirichlet_split(idx, y, k, cfg.alpha, cfg.min_size, cfg.max_retries, rng)
        tests = local_test_sets(parts, d_train * C + y, d_test * C + test_labels(data), rng)
        return [
            make_client(i, p, t, y, C, domain=i // k)
            for i, (p, t) in enumerate(zip(parts, tests, strict=True))
        ]


@PARTITIONS.register("domain-pathological")
class DomainPathological:
    """Each domain split into `clients_per_domain` clients holding `s` of its classes each.

    PEP-FedPT's DomainNet protocol (Table 7: 10 clients per domain, 5 classes per client; A.4.7:
    one client per domain held out). Within each domain, classes are dealt and split as in
    `pathological` (each class shared by s * k / C clients, U(0.4, 0.6) portions), train and
    test samples from that domain's pools. Clients d*k .. d*k+k-1 belong to domain d.
    `heldout_per_domain` clients of each domain (drawn at random) are held out, in place of
    `heldout_frac`.
    """

    name = "domain-pathological"

    class Config(PartitionConfig):
        clients_per_domain: int = Field(10, ge=1, description="Clients per domain (k).")
        s: int = Field(5, ge=1, description="Classes per client, within its domain.")
        heldout_per_domain: int = Field(0, ge=0, description="Held-out clients per domain.")

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        _need_domains(DomainPathological.name, info)
        k, C, s = cfg.clients_per_domain, info.num_classes, cfg.s
        if cfg.num_clients != k * info.num_domains:
            raise FpbenchError(
                f"partition.num_clients = {cfg.num_clients} must equal clients_per_domain x "
                f"domains ({k} x {info.num_domains}) for partition 'domain-pathological'; set "
                f"partition.num_clients = {k * info.num_domains}"
            )
        if s > C or (s * k) % C:
            raise FpbenchError(
                f"partition 'domain-pathological': s * clients_per_domain ({s} x {k}) must be a "
                f"multiple of the number of classes ({C}) with s <= {C}"
            )
        if cfg.heldout_per_domain and (cfg.heldout_frac or cfg.heldout_per_domain >= k):
            raise FpbenchError(
                "partition.heldout_per_domain needs heldout_frac = 0 and fewer than "
                f"clients_per_domain ({k}) held-out clients per domain"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        d_train, d_test = domains_of(data)
        y, y_test, C, k = (
            train_labels(data),
            test_labels(data),
            data.num_classes,
            cfg.clients_per_domain,
        )
        clients: list[Client] = []
        for d in range(data.num_domains):
            deal = _deal_classes(C, k, cfg.s, rng)
            train = [rng.permutation(np.flatnonzero((d_train == d) & (y == c))) for c in range(C)]
            test = [
                rng.permutation(np.flatnonzero((d_test == d) & (y_test == c))) for c in range(C)
            ]
            held = set(rng.choice(k, size=cfg.heldout_per_domain, replace=False).tolist())
            for j, (tr, te) in enumerate(
                zip(_consume(deal, train), _consume(deal, test), strict=True)
            ):
                clients.append(make_client(d * k + j, tr, te, y, C, d, j in held))
        return clients
