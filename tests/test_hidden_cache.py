"""Phases that resume from cached hidden states (`Phase.resume_layer`): same result, less work."""

from __future__ import annotations

import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.engine.build import build_method
from fpbench.engine.executor import resume_layer, train_clients
from fpbench.engine.inputs import FeatureCache, HiddenCache, Inputs
from fpbench.engine.task import build_task
from fpbench.registry import METHODS
from fpbench.specs import Augment
from tests.conftest import tiny_config


def _resuming_methods() -> list[str]:
    """The ViT methods with a phase that sets a resume layer (built on the tiny config)."""
    task = build_task(tiny_config(), torch.device("cpu"))
    out = []
    for name in METHODS.names():
        cfg = tiny_config(name)
        if cfg.backbone.name != "vit-test":
            continue
        method = build_method(cfg, task, torch.device("cpu"))
        names = tuple(method.init_params(torch.Generator().manual_seed(0)))
        if any(p.resume_layer for p in method.phases(2, names)):
            out.append(name)
    return out


RESUMING = _resuming_methods()


def test_the_methods_that_should_resume_do() -> None:
    assert {"fedrep", "sgpt"} <= set(RESUMING)
    assert "fedvpt" not in RESUMING


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


def test_hidden_cache_computes_each_row_sample_once() -> None:
    rows = [torch.tensor([0, 3, 5]), torch.tensor([3, 7])]  # sample 3 is in both rows
    cache = HiddenCache(rows, num_train=8)
    calls: list[list[tuple[int, int]]] = []

    def compute(idx: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        calls.append(list(zip(r.tolist(), idx.tolist(), strict=True)))
        return (100 * r + idx).float().view(-1, 1, 1).expand(-1, 2, 4)  # (b, T=2, d=4)

    first = cache.get(torch.tensor([3, 3, 0]), torch.tensor([0, 1, 0]), compute)
    again = cache.get(torch.tensor([0, 7, 3]), torch.tensor([0, 1, 1]), compute)
    assert calls == [[(0, 3), (1, 3), (0, 0)], [(1, 7)]]
    assert first[:, 0, 0].tolist() == [3.0, 103.0, 0.0]
    assert again[:, 0, 0].tolist() == [0.0, 107.0, 103.0]


@pytest.mark.parametrize(
    ("name", "executor"), [(n, "lockstep") for n in RESUMING] + [("sgpt", "reference")]
)
def test_resuming_from_cached_states_changes_nothing(tiny, name: str, executor: str) -> None:
    cfg, task, method = tiny(name, local_epochs=2, weight_decay=1e-3, grad_clip=1.0)
    inputs = Inputs.of(method, task, FeatureCache(), batch_size=16)
    names = tuple(method.init_params(torch.Generator().manual_seed(0)))
    assert any(resume_layer(inputs, p, cfg.train) for p in method.phases(2, names))
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()
    runs = [
        train_clients(
            method, server, task, ids, cfg.train, round_idx=0, seed=0,
            executor=executor, inputs=inputs, reuse_frozen=reuse,
        )
        for reuse in (False, True)
    ]  # fmt: skip
    for k in runs[0].params:
        torch.testing.assert_close(runs[1].params[k], runs[0].params[k], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runs[1].loss, runs[0].loss, atol=1e-5, rtol=1e-5)
    for k in runs[0].stats:
        torch.testing.assert_close(runs[1].stats[k], runs[0].stats[k])


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


def test_no_resume_under_augmentation_or_without_a_cached_query(tiny) -> None:
    cfg, task, method = tiny("sgpt")
    names = tuple(method.init_params(torch.Generator().manual_seed(0)))
    group = next(p for p in method.phases(1, names) if p.name == "group")
    assert group.resume_layer == min(method.group_layers) > 0
    cached = Inputs.of(method, task, FeatureCache(), batch_size=16)
    assert resume_layer(cached, group, cfg.train) == group.resume_layer
    assert resume_layer(Inputs.of(method, task), group, cfg.train) == 0  # no query
    augmenting = cfg.train.model_copy(update={"augment": Augment(hflip=True)})
    assert resume_layer(cached, group, augmenting) == 0
