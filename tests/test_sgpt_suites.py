"""SGPT's suites run the reference code's protocol where the paper is silent: input
normalisation, FedAvg weights on Office-Caltech10 / DomainNet, and the s = 50 block layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpbench.data import ImageDataset
from fpbench.data.cifar import SGPT_CIFAR_MEAN, SGPT_CIFAR_STD
from fpbench.data.fedbn import SGPT_UNIT_MEAN, SGPT_UNIT_STD
from fpbench.engine.task import aggregation_sizes, build_task
from fpbench.errors import FpbenchError
from fpbench.partition import Client
from fpbench.suites import load_suite
from tests.conftest import tiny_config

SGPT_SUITES = ("sgpt-table1", "sgpt-table2", "sgpt-ablations", "feature-het")
UNIT_DATASETS = ("office-caltech10", "domainnet10")


@pytest.mark.parametrize("suite", SGPT_SUITES)
def test_sgpt_suites_normalise_inputs_as_the_reference_code(suite):
    cells = [c for c in load_suite(suite).cells if c.dataset.args.get("sgpt_subset", True)]
    assert cells
    for c in cells:
        unit = c.dataset.name in UNIT_DATASETS
        want = (SGPT_UNIT_MEAN, SGPT_UNIT_STD) if unit else (SGPT_CIFAR_MEAN, SGPT_CIFAR_STD)
        assert (c.backbone.mean, c.backbone.std) == want, (suite, c.dataset.label)


@pytest.mark.parametrize("suite", ["sgpt-table2", "feature-het"])
def test_office_and_domainnet_one_per_domain_weigh_clients_by_full_domain_size(suite):
    for c in load_suite(suite).cells:
        want = "domain_size" if c.dataset.args.get("sgpt_subset") else "train_size"
        assert c.train.aggregation_weights == want, (suite, c.dataset.label, c.partition.label)


def _client(i: int, n: int, domain: int | None) -> Client:
    idx = np.arange(n, dtype=np.int64)
    return Client(i, idx, idx, np.full(2, 0.5), domain, False)


def _data(sizes) -> ImageDataset:
    empty = torch.zeros(0, 3, 2, 2, dtype=torch.uint8)
    none = torch.zeros(0, dtype=torch.long)
    return ImageDataset("d", empty, none, empty, none, ["a", "b"], domain_train_sizes=sizes)


def test_domain_size_weights_share_each_domains_full_size_among_its_clients():
    sizes = torch.tensor([766, 898, 125, 236])  # the FedBN Office train lists
    one_each = [_client(d, 62, d) for d in range(4)]
    assert aggregation_sizes("domain_size", _data(sizes), one_each).tolist() == [766, 898, 125, 236]
    assert aggregation_sizes("train_size", _data(sizes), one_each) is None
    two_in_0 = [_client(0, 31, 0), _client(1, 31, 0), _client(2, 62, 2)]
    assert aggregation_sizes("domain_size", _data(sizes), two_in_0).tolist() == [383, 383, 125]
    with pytest.raises(FpbenchError, match="per-domain partition"):
        aggregation_sizes("domain_size", _data(sizes), [_client(0, 5, None)])
    with pytest.raises(FpbenchError, match="prepare again"):
        aggregation_sizes("domain_size", _data(None), one_each)


def test_task_carries_the_aggregation_weights():
    task = build_task(tiny_config("fedvpt"), torch.device("cpu"))
    torch.testing.assert_close(task.aggregation_weights, task.train_sizes)
    with pytest.raises(FpbenchError, match="domain_size"):
        build_task(tiny_config("fedvpt", aggregation_weights="domain_size"), torch.device("cpu"))


def test_label_het_s50_runs_sgpt_with_the_s50_block_layout():
    cells = load_suite("label-het").cells
    s50 = [c for c in cells if c.partition.label == "path-s50"]
    s10 = [c for c in cells if c.partition.label == "path-s10" and c.dataset.name == "cifar100"]
    assert sorted(c.method.label for c in s50) == sorted(c.method.label for c in s10)
    (sgpt,) = [c for c in s50 if c.method.name == "sgpt"]
    assert (sgpt.method.args["shared_layers"], sgpt.method.args["group_layers"]) == (
        [0, 1, 2, 3, 4], [5, 6],
    )  # fmt: skip
