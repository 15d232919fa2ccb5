"""FedVPT-D: one prompt set per layer."""

from __future__ import annotations

import torch

from fpbench.methods.base import Context


def test_fedvpt_d_inserts_one_prompt_set_per_layer(tiny):
    _, task, method = tiny("fedvpt-d")
    server = method.init_server(torch.Generator().manual_seed(0))
    prompts = server.params["prompts"]
    assert prompts.shape == (method.backbone.depth, 1, method.backbone.embed_dim)
    x = method.backbone.preprocess(task.data.train_images[:2])
    params = method.client_params(server, torch.tensor([0]))
    rows = torch.zeros(2, dtype=torch.long)
    expected = method.backbone.forward_features(
        x, {i: prompts[i].expand(2, -1, -1) for i in range(len(prompts))}, style="deep"
    ).cls
    logits = method.forward(params, x, rows, Context(training=True))
    torch.testing.assert_close(logits, expected @ params["head_w"][0].T + params["head_b"][0])
    leaf = params["prompts"].requires_grad_()
    method.forward(
        {**params, "prompts": leaf}, x, rows, Context(training=True)
    ).square().sum().backward()
    assert (leaf.grad.flatten(2).abs().sum(-1) > 0).all()  # every layer's prompt is used
