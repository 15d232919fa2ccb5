"""pFedPG: the prompt generator's descent and the clients' local state."""

from __future__ import annotations

import torch

from fpbench.methods.base import Updates

from ..conftest import seeded_server, with_config


def test_pfedpg_generator_descends_half_squared_distance_to_trained_prompts(tiny):
    _, task, method = tiny("pfedpg")
    method = with_config(method, server_lr=0.1)
    server = seeded_server(method)
    ids = torch.tensor([0, 2])
    start = method.client_params(server, ids)
    assert set(start) == {"prompts", "head_w", "head_b"}
    assert not torch.allclose(start["prompts"][0], start["prompts"][1])  # descriptor-specific
    gen = torch.Generator().manual_seed(1)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([3.0, 1.0]), {}))

    # the formula: phi' = phi - lr * grad_phi 1/2 mean_k ||P_k(phi) - P~_k||^2
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    gap = method.generate(leaves, ids)["prompts"] - trained["prompts"]
    (0.5 * gap.pow(2).sum() / len(ids)).backward()
    for k, v in server.params.items():
        torch.testing.assert_close(new.params[k], v - 0.1 * leaves[k].grad)
    # the direction: the generated prompts move towards the adapted ones (not away: +delta bug)
    before = (start["prompts"] - trained["prompts"]).flatten(1).norm(dim=1)
    after = (
        (method.generate(new.params, ids)["prompts"] - trained["prompts"]).flatten(1).norm(dim=1)
    )
    assert (after < before).all()


def test_pfedpg_keeps_heads_and_adapted_prompts_local(tiny):
    _, task, method = tiny("pfedpg")
    server = seeded_server(method)
    ids = torch.tensor([1, 3])
    start = method.client_params(server, ids)
    trained = {k: v + 1.0 for k, v in start.items()}
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([1.0, 1.0]), {}))
    ev = method.client_params(new, ids, training=False)
    for k in ("prompts", "head_w", "head_b"):
        torch.testing.assert_close(ev[k], trained[k])  # adapted prompts, own head
    assert torch.equal(new.personal["head_w"][0], server.personal["head_w"][0])
    down, up = method.communication(new)
    shape = (method.cfg.prompt_len, method.backbone.embed_dim)
    assert set(down) == set(up) == {"prompts"} and down["prompts"].shape == shape
