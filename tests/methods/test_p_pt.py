"""pFedPT-style P-PT: prompts never aggregated."""

from __future__ import annotations

import torch

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Updates

from ..conftest import seeded_server


def test_p_pt_never_aggregates_prompts(tiny):
    cfg, task, method = tiny("p-pt")
    server = seeded_server(method)
    assert set(server.params) == {"head_w", "head_b"} and set(server.personal) == {"prompts"}
    ids = task.trainable_clients()[:2]
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    weights = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, weights, local.stats))
    for row, c in enumerate(ids):
        assert torch.equal(new.personal["prompts"][c], local.params["prompts"][row])
    others = [c for c in range(task.num_clients) if c not in ids]
    assert torch.equal(new.personal["prompts"][others], server.personal["prompts"][others])
    w = weights / weights.sum()
    torch.testing.assert_close(new.params["head_w"], torch.tensordot(w, local.params["head_w"], 1))
    down, up = method.communication(new)
    assert set(down) == set(up) == {"head_w", "head_b"}
