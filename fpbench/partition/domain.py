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
