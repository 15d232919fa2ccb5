"""FedRep: head epochs then prompt epochs; prompts averaged, heads personal."""

from __future__ import annotations

import torch

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Updates


def test_fedrep_phases_train_head_then_one_epoch_of_prompts(tiny):
    """FedRep: 10 head epochs, then 1 representation epoch whatever train.local_epochs says."""
    _, _, method = tiny("fedrep")
    assert [(p.name, p.trainable, p.epochs) for p in method.phases(3, ())] == [
        ("head", ("head_w", "head_b"), 10),
        ("representation", ("prompts",), 1),
    ]
    method.cfg = method.cfg.model_copy(update={"rep_epochs": None})
    assert method.phases(3, ())[1].epochs == 3


def _prompt_phase_forwards(method, task, cfg, rep_epochs) -> int:
    """Training forwards of the prompt phase."""
    method.cfg = method.cfg.model_copy(update={"head_epochs": 1, "rep_epochs": rep_epochs})
    calls, forward = [], method.forward
    method.forward = lambda p, x, ci, ctx: calls.append(ctx.phase) or forward(p, x, ci, ctx)
    server = method.init_server(torch.Generator().manual_seed(0))
    train_clients(
        method, server, task, task.trainable_clients()[:2], cfg.train, round_idx=0, seed=0
    )
    del method.forward
    return calls.count("representation")


def test_fedrep_runs_rep_epochs_of_the_prompt_phase(tiny):
    cfg, task, method = tiny("fedrep", local_epochs=3)
    one = _prompt_phase_forwards(method, task, cfg, 1)
    assert one > 0
    assert _prompt_phase_forwards(method, task, cfg, 2) == 2 * one
    assert _prompt_phase_forwards(method, task, cfg, None) == 3 * one


def test_fedrep_averages_prompts_and_keeps_heads_personal(tiny):
    cfg, task, method = tiny("fedrep")
    server = method.init_server(torch.Generator().manual_seed(0))
    assert set(server.params) == {"prompts"} and set(server.personal) == {"head_w", "head_b"}
    ids = task.trainable_clients()[:2]
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    weights = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, weights, local.stats))
    w = weights / weights.sum()
    torch.testing.assert_close(
        new.params["prompts"], torch.tensordot(w, local.params["prompts"], 1)
    )
    for row, c in enumerate(ids):
        assert torch.equal(new.personal["head_w"][c], local.params["head_w"][row])
    untouched = [c for c in range(task.num_clients) if c not in ids]
    assert torch.equal(new.personal["head_w"][untouched], server.personal["head_w"][untouched])
    down, up = method.communication(new)
    assert set(down) == set(up) == {"prompts"}
