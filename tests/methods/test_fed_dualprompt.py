"""Fed-DualPrompt: key selection, key loss, block defaults and config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.errors import FpbenchError
from fpbench.methods.base import Context
from fpbench.methods.fed_dualprompt import DualPromptConfig, default_layers, select_prompts


def test_keys_select_by_cosine_not_dot_product():
    keys = torch.tensor([[[10.0, 0.0], [0.0, 0.1], [-1.0, 0.0]]])  # (K=1, M=3, d=2)
    query = torch.tensor([[1.0, 1.2], [3.0, 0.1], [-1.0, -0.5]])
    index, match = select_prompts(keys, query, torch.zeros(3, dtype=torch.long))
    assert index.tolist() == [1, 0, 2]  # a dot product would pick key 0 for the first
    cosines = [1.2 / math.hypot(1, 1.2), 3 / math.hypot(3, 0.1), 1 / math.hypot(1, 0.5)]
    expected = torch.tensor(cosines)
    torch.testing.assert_close(match, expected)


def test_key_loss_moves_only_the_selected_key_towards_its_query():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]], requires_grad=True)
    query = torch.tensor([[1.0, 0.5]])  # client row 1 selects key 0
    _, match = select_prompts(keys, query, torch.tensor([1]))
    (1 - match).sum().backward()
    assert torch.count_nonzero(keys.grad[0]) == 0 and torch.count_nonzero(keys.grad[1, 1]) == 0
    stepped = keys.detach() - 0.1 * keys.grad
    assert F.cosine_similarity(stepped[1, 0], query[0], 0) > match.detach()[0]


def test_default_blocks_follow_dualprompt_and_scale_with_depth():
    assert default_layers(12) == ((0, 1), (2, 3, 4))
    assert default_layers(2) == ((0,), (1,))
    assert default_layers(4) == ((0,), (1,))
    with pytest.raises(FpbenchError):
        default_layers(1)


def test_each_sample_uses_the_e_prompt_of_its_key(tiny):
    _, task, method = tiny("fed-dualprompt")
    params = method.client_params(
        method.init_server(torch.Generator().manual_seed(0)), torch.tensor([0])
    )
    x = method.backbone.preprocess(task.data.train_images[:4])
    rows = torch.zeros(4, dtype=torch.long)
    query = method.backbone.forward_features(x).cls
    params["e_keys"] = torch.zeros_like(params["e_keys"])
    params["e_keys"][0, 3] = query.mean(0)  # every sample picks E-prompt 3
    base = method.forward(params, x, rows, Context(training=False)).logits
    other = dict(params, e_prompts=params["e_prompts"].clone())
    bump = torch.randn(params["e_prompts"].shape[2:], generator=torch.Generator().manual_seed(1))
    other["e_prompts"][0, 5] += bump  # not a constant shift: LayerNorm would remove that
    torch.testing.assert_close(method.forward(other, x, rows, Context(training=False)).logits, base)
    chosen = dict(params, e_prompts=params["e_prompts"].clone())
    chosen["e_prompts"][0, 3] += bump
    g, e = chosen["g_prompts"][0], chosen["e_prompts"][0, 3]  # the selected E-prompt, by hand
    prompts = {b: g[i].expand(4, -1, -1) for i, b in enumerate(method.g_layers)}
    prompts |= {b: e[i].expand(4, -1, -1) for i, b in enumerate(method.e_layers)}
    cls = method.backbone.forward_features(x, prompts, style="deep").cls
    expected = cls @ params["head_w"][0].T + params["head_b"][0]
    out = method.forward(chosen, x, rows, Context(training=False))
    torch.testing.assert_close(out.logits, expected)


def test_dualprompt_config_errors_name_the_fix(tiny):
    _, _, method = tiny("fed-dualprompt")
    cls = type(method)
    with pytest.raises(FpbenchError, match="g_len"):
        cls(DualPromptConfig(g_len=3), method.backbone, method.task)
    with pytest.raises(FpbenchError, match="e_layers"):
        cls(DualPromptConfig(e_layers=(5,)), method.backbone, method.task)
