"""Keyed selection shared by SGPT, FGPT and Fed-DualPrompt (fpbench.methods.keys)."""

import math

import torch

from fpbench.methods.keys import group_counts, key_cosines, nearest_group, select_groups


def test_key_cosines_use_each_samples_row_and_normalised_keys():
    keys = torch.tensor([[[2.0, 0.0], [0.0, 3.0]], [[1.0, 1.0], [1.0, -1.0]]])  # (K=2, G=2, d=2)
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    cos = key_cosines(query, keys, torch.tensor([0, 1]))
    r = 1 / math.sqrt(2)
    torch.testing.assert_close(cos, torch.tensor([[1.0, 0.0], [r, -r]]))


def test_select_uses_cosine_not_dot_product_and_orders_top_k():
    keys = torch.tensor([[10.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    query = torch.tensor([[0.2, 1.0], [3.0, 0.1]])
    # query 0: cos = (0.196, 0.981, 0.832) -> group 1 although key 0 is long; then group 2
    assert select_groups(query, keys, 2).tolist() == [[1, 2], [0, 2]]
    assert select_groups(5 * query, keys, 1).tolist() == [[1], [0]]  # scale-free


def test_nearest_group_normalises_the_keys_not_the_queries():
    keys = torch.tensor([[10.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    unit_queries = torch.nn.functional.normalize(torch.tensor([[0.2, 1.0], [3.0, 0.1]]), dim=-1)
    assert nearest_group(unit_queries, keys).tolist() == [1, 0]


def test_group_counts_per_row():
    rows = torch.tensor([0, 1, 1, 0, 1])
    groups = torch.tensor([2, 0, 0, 2, 1])
    counts = group_counts(groups, rows, 2, 3)
    assert counts.dtype == torch.long and counts.tolist() == [[0, 0, 2], [2, 1, 0]]
