"""`runtime.precision = "bf16-frozen"`: a ViT's frozen blocks held and computed in bf16.

On the CPU (bf16 autocast works there too), with the test-sized ViT."""

from __future__ import annotations

import torch

from fpbench.backbones import create_backbone
from fpbench.engine.build import build_method
from fpbench.engine.executor import train_clients
from fpbench.engine.task import build_task
from tests.conftest import tiny_config


def _images(vit, n: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, 3, vit.img_size, vit.img_size), generator=gen)
    return vit.preprocess(raw.to(torch.uint8))


def test_bf16_blocks_run_under_bf16_autocast_only():
    vit = create_backbone("vit-test")
    x = _images(vit)
    fp32 = vit.forward_features(x).cls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = vit.forward_features(x).cls
    vit.hold_bf16_blocks()
    # autocast off (frozen passes): the fp32 blocks, bit for bit
    assert torch.equal(vit.forward_features(x).cls, fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, _, _ = vit.run_blocks(vit.embed(x), 0, vit.depth)
        fast = vit.forward_features(x).cls
    assert tokens.dtype == torch.bfloat16  # the residual stream is bf16 end to end
    assert autocast.dtype == torch.float32  # autocast alone keeps it fp32 (final norm: fp32)
    assert not torch.equal(fast.float(), autocast)  # another computation ...
    rel = (fast.float() - fp32).norm() / fp32.norm()
    assert rel < 0.05, rel  # ... of the same function, to bf16 accuracy


def test_bf16_copy_is_no_state_and_follows_to():
    vit = create_backbone("vit-test")
    keys = set(vit.state_dict())
    vit.hold_bf16_blocks()
    vit.hold_bf16_blocks()  # once
    assert len(vit._bf16_blocks) == 1
    assert set(vit.state_dict()) == keys  # checkpoints and fingerprints never see it
    vit.to(torch.float64)  # a dtype cast leaves the copy bf16
    assert {p.dtype for p in vit._bf16_blocks[0].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in vit.vit.parameters()} == {torch.float64}
    assert not any(p.requires_grad for p in vit._bf16_blocks[0].parameters())


def test_precision_bf16_frozen_reaches_the_backbone_and_trains():
    """The wire: runtime.precision -> build_method holds the copy -> training autocasts."""
    cfg = tiny_config("fedvpt")
    cfg = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"precision": "bf16-frozen"})}
    )
    task = build_task(cfg, torch.device("cpu"))
    method = build_method(cfg, task, torch.device("cpu"))
    assert len(method.backbone._bf16_blocks) == 1
    plain = build_method(tiny_config("fedvpt"), task, torch.device("cpu"))
    assert plain.backbone._bf16_blocks == []
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()[:2]
    out = train_clients(
        method, server, task, ids, cfg.train, round_idx=0, seed=0, precision="bf16-frozen"
    )
    ref = train_clients(plain, server, task, ids, cfg.train, round_idx=0, seed=0, precision="bf16")
    (name,) = [n for n in out.params if n == "prompts"] or list(out.params)[:1]
    assert out.params[name].dtype == torch.float32  # trained tensors stay fp32
    assert torch.isfinite(out.loss).all()
    # the same training to bf16 accuracy, but not the autocast computation
    assert not torch.equal(out.params[name], ref.params[name])
    delta = (out.params[name] - server.params[name]).norm()
    ref_delta = (ref.params[name] - server.params[name]).norm()
    assert abs(delta - ref_delta) / ref_delta < 0.1
