"""pFedHN: the hypernetwork's outputs and its server step."""

from __future__ import annotations

import pytest
import torch

from fpbench.methods.base import Updates

from ..conftest import seeded_server


def test_pfedhn_outputs_every_clients_prompts_and_head_and_gradients_reach_the_hypernetwork(tiny):
    _, task, method = tiny("pfedhn")
    server = seeded_server(method)
    n, d, c = task.num_clients, method.backbone.embed_dim, task.data.num_classes
    assert server.params["embeddings"].shape == (n, 1 + n // 4)
    ids = torch.tensor([2, 0, 2])
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    out = method.generate(leaves, ids)
    assert out["prompts"].shape == (3, method.cfg.prompt_len, d)
    assert out["head_w"].shape == (3, c, d) and out["head_b"].shape == (3, c)
    torch.testing.assert_close(out["head_w"][0], out["head_w"][2])  # same client, same model
    sum(t.square().sum() for t in out.values()).backward()
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.abs().sum() > 0, k
    used = leaves["embeddings"].grad.abs().sum(1) > 0
    assert used.tolist() == [i in (0, 2) for i in range(n)]  # only the clients' own embeddings


@pytest.mark.parametrize(("reduce", "divide"), [("sum", 1), ("mean", 2)])
def test_pfedhn_server_step_is_torch_sgd_on_the_delta_gradient(tiny, reduce, divide):
    """Default "sum": each client's delta gets the full server step (pFedHN's per-client step)."""
    _, task, method = tiny("pfedhn")
    assert method.cfg.server_reduce == "sum"
    method.cfg = method.cfg.model_copy(update={"server_reduce": reduce})
    server = seeded_server(method)
    ids = torch.tensor([0, 1])
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    opt = torch.optim.SGD(leaves.values(), lr=1e-2, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):  # two rounds: the momentum buffer carries over in the server buffers
        start = method.client_params(server, ids)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
        server = method.aggregate(server, Updates(trained, ids, torch.ones(2), {}))
        opt.zero_grad()
        out = method.generate(leaves, ids)
        sum(0.5 * (out[k] - trained[k]).pow(2).sum() for k in out).div(divide).backward()
        opt.step()
    for k, v in leaves.items():
        torch.testing.assert_close(server.params[k], v.detach(), atol=1e-6, rtol=1e-5)
