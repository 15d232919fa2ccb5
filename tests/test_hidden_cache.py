"""A phase's kept hidden states (`fpbench.backbones.recall.PhaseStates`): found from the prompts'
`requires_grad`, never declared; the same result with less work."""

from __future__ import annotations

import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.backbones.recall import PhaseStates, Recall, recalling
from fpbench.engine.executor import train_clients
from fpbench.specs import Augment


@pytest.mark.parametrize("style", ["accumulate", "deep"])
def test_forward_from_a_prefix_equals_the_full_forward(style: str) -> None:
    vit = create_backbone("vit-test")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 3, vit.img_size, vit.img_size, generator=gen)
    prompts = {0: torch.randn(3, 2, vit.embed_dim, generator=gen)}
    prompts[1] = torch.randn(3, 2, vit.embed_dim, generator=gen)
    full = vit.forward_features(x, prompts, style)
    for start in range(vit.depth + 1):
        resumed = vit.forward_from(vit.prefix(x, start, prompts, style), start, prompts, style)
        torch.testing.assert_close(resumed.tokens, full.tokens, atol=0, rtol=0)
        assert resumed.prompt_tokens.shape == full.prompt_tokens.shape


def test_phase_states_compute_each_row_sample_once_and_check_the_lower_prompts() -> None:
    rows = [torch.tensor([0, 3, 5]), torch.tensor([3, 7])]  # sample 3 is in both rows
    states = PhaseStates(rows, num_train=8)
    calls: list[list[tuple[int, int]]] = []

    def get(idx: list[int], r: list[int], guard: torch.Tensor) -> torch.Tensor:
        idx_t, r_t = torch.tensor(idx), torch.tensor(r)

        def compute(mask: torch.Tensor) -> torch.Tensor:
            calls.append(list(zip(r_t[mask].tolist(), idx_t[mask].tolist(), strict=True)))
            return (100 * r_t[mask] + idx_t[mask]).float().view(-1, 1, 1).expand(-1, 2, 4)

        return states.get(("site",), idx_t, r_t, guard, compute)

    same = torch.zeros(3, 1)
    first = get([3, 3, 0], [0, 1, 0], same)
    again = get([0, 7, 3], [0, 1, 1], same)
    assert calls == [[(0, 3), (1, 3), (0, 0)], [(1, 7)]]
    assert first[:, 0, 0].tolist() == [3.0, 103.0, 0.0]
    assert again[:, 0, 0].tolist() == [0.0, 107.0, 103.0]
    calls.clear()
    get([0, 5], [0, 0], torch.tensor([[1.0], [0.0]]))  # sample 0's lower prompts changed
    assert calls == [[(0, 0), (0, 5)]]


def test_a_forward_keeps_the_states_below_the_first_trained_prompt() -> None:
    vit = create_backbone("vit-test")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, vit.img_size, vit.img_size, generator=gen)
    fixed = torch.randn(4, 2, vit.embed_dim, generator=gen)
    trained = torch.randn(4, 2, vit.embed_dim, generator=gen).requires_grad_()
    prompts = {0: fixed, 1: trained}
    seen = [0, 0]  # samples through block 0 and block 1
    hooks = [
        vit.vit.blocks[b].register_forward_hook(
            lambda _m, args, _o, b=b: seen.__setitem__(b, seen[b] + args[0].shape[0])
        )
        for b in (0, 1)
    ]
    states = PhaseStates([torch.arange(4)], num_train=4)
    recall = Recall(x, None, states, torch.arange(4), torch.zeros(4, dtype=torch.long))
    try:
        with recalling(recall):
            a = vit.forward_features(x, prompts).tokens
            recall.calls = 0  # the next batch
            b = vit.forward_features(x, prompts).tokens
    finally:
        for h in hooks:
            h.remove()
    full = vit.forward_features(x, prompts).tokens  # not the engine's batch: all computed
    assert torch.equal(a, full) and torch.equal(b, full)
    assert seen == [4, 8]  # block 0 once (kept), block 1 every time


def _block0_samples(method, task, cfg, reuse: bool) -> int:
    """Samples that pass through block 0 during one lockstep round."""
    seen = [0]
    hook = method.backbone.vit.blocks[0].register_forward_hook(
        lambda _m, args, _out: seen.__setitem__(0, seen[0] + args[0].shape[0])
    )
    try:
        server = method.init_server(torch.Generator().manual_seed(0))
        ids = task.trainable_clients()
        train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, reuse_frozen=reuse)
    finally:
        hook.remove()
    return seen[0]


def test_fedrep_head_epochs_run_the_backbone_once_per_sample(tiny) -> None:
    cfg, task, method = tiny("fedrep", local_epochs=2)
    method.cfg = method.cfg.model_copy(update={"head_epochs": 3, "rep_epochs": 2})
    n = sum(len(task.train_idx[c]) for c in task.trainable_clients())
    # head phase: 3 epochs -> once; prompt phase: 2 epochs, prompts at block 0 train
    assert _block0_samples(method, task, cfg, reuse=False) == 3 * n + 2 * n
    assert _block0_samples(method, task, cfg, reuse=True) == 1 * n + 2 * n


def test_sgpt_group_phase_runs_its_lower_blocks_once_per_sample(tiny) -> None:
    cfg, task, method = tiny("sgpt", local_epochs=2)
    n = sum(len(task.train_idx[c]) for c in task.trainable_clients())
    assert min(method.group_layers) > 0 and min(method.shared_layers) == 0
    # the shared phase and Select's unprompted query (no store here) run block 0 every epoch
    # either way; the group phase's prompted forward runs it once when its states are kept
    recomputed = _block0_samples(method, task, cfg, reuse=False)
    kept = _block0_samples(method, task, cfg, reuse=True)
    assert recomputed - kept == n  # the group phase's second epoch reads block 0's states


def test_no_kept_states_under_augmentation(tiny) -> None:
    cfg, task, method = tiny("fedrep", local_epochs=1)
    method.cfg = method.cfg.model_copy(update={"head_epochs": 2, "rep_epochs": 1})
    cfg = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"augment": Augment(hflip=True)})}
    )
    n = sum(len(task.train_idx[c]) for c in task.trainable_clients())
    assert _block0_samples(method, task, cfg, reuse=True) == 3 * n
