"""PromptedViT: zero-prompt invariant vs timm, prompt styles, preprocessing, registry, loading."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from fpbench.backbones import (
    VIT_TEST_ARCH,
    BackboneSpec,
    PromptedViT,
    create_backbone,
    preprocess_images,
    smoke,
)
from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES

D = 32  # vit-test width
TINY_RECIPE = smoke.SmokeRecipe(
    arch=dict(VIT_TEST_ARCH, depth=1),
    num_classes=4,
    num_coarse=2,
    train_per_class=8,
    num_domains=1,
    steps=4,
    batch_size=8,
    warmup_steps=2,
)


@pytest.fixture(scope="module")
def vit() -> PromptedViT:
    return create_backbone("vit-test")


def smoke_sized() -> PromptedViT:
    spec = BackboneSpec(name="smoke-random", timm_name="test_vit", timm_kwargs=smoke.SMOKE_ARCH)
    return spec.create()


def images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def batch(vit: PromptedViT, n: int = 3, seed: int = 0) -> torch.Tensor:
    return vit.preprocess(images(n, vit.img_size, seed))


def rand_prompts(n: int, p: int, seed: int) -> torch.Tensor:
    return torch.randn(n, p, D, generator=torch.Generator().manual_seed(seed))  # (B, p, d)


def blocks(vit: PromptedViT, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
    for layer in range(start, end):
        tokens = vit.vit.blocks[layer](tokens)
    return tokens


# ---------------------------------------------------------------- zero-prompt invariant


@pytest.mark.parametrize("make", [lambda: create_backbone("vit-test"), smoke_sized])
def test_no_prompts_equal_timm_forward_features(make) -> None:
    vit = make()
    x = batch(vit, 4)
    ref = vit.vit.forward_features(x)  # (B, T, d)
    for prompts in (None, {}):
        out = vit.forward_features(x, prompts)
        torch.testing.assert_close(out.tokens, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.cls, ref[:, 0], atol=1e-6, rtol=0)
        assert out.prompt_tokens.shape == (4, 0, vit.embed_dim)


def test_attributes_of_vit_test(vit: PromptedViT) -> None:
    assert (vit.embed_dim, vit.depth, vit.num_prefix_tokens) == (32, 2, 1)
    assert (vit.img_size, vit.patch_size, vit.name) == (16, 8, "vit-test")
    assert vit.mean == (0.5, 0.5, 0.5) and vit.std == (0.5, 0.5, 0.5)
    assert vit.embed(batch(vit)).shape == (3, 1 + 4, 32)  # cls + 2x2 patches


# ---------------------------------------------------------------- prompt styles


def test_accumulate_keeps_all_prompts_most_recent_first(vit: PromptedViT) -> None:
    x, p0, p1 = batch(vit), rand_prompts(3, 2, 1), rand_prompts(3, 3, 2)
    out = vit.forward_features(x, {0: p0, 1: p1}, style="accumulate")
    t0 = vit.embed(x)  # (B, 5, d)
    h = blocks(vit, torch.cat([t0[:, :1], p0, t0[:, 1:]], 1), 0, 1)  # (B, 7, d)
    h = blocks(vit, torch.cat([h[:, :1], p1, h[:, 1:]], 1), 1, 2)  # (B, 10, d): cls p1 p0 patches
    ref = vit.vit.norm(h)
    assert out.tokens.shape == (3, 5 + 2 + 3, D)
    torch.testing.assert_close(out.tokens, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.prompt_tokens, ref[:, 1:6], atol=1e-6, rtol=0)


def test_deep_replaces_previous_prompts(vit: PromptedViT) -> None:
    x, p0, p1 = batch(vit), rand_prompts(3, 2, 1), rand_prompts(3, 2, 2)
    out = vit.forward_features(x, {0: p0, 1: p1}, style="deep")
    t0 = vit.embed(x)
    h = blocks(vit, torch.cat([t0[:, :1], p0, t0[:, 1:]], 1), 0, 1)  # (B, 7, d)
    h = blocks(vit, torch.cat([h[:, :1], p1, h[:, 3:]], 1), 1, 2)  # p0's outputs dropped
    assert out.tokens.shape == (3, 5 + 2, D)
    torch.testing.assert_close(out.tokens, vit.vit.norm(h), atol=1e-6, rtol=0)
    assert out.prompt_tokens.shape == (3, 2, D)


def test_deep_at_a_single_layer_inserts(vit: PromptedViT) -> None:
    x, p1 = batch(vit), rand_prompts(3, 2, 2)
    deep = vit.forward_features(x, {1: p1}, style="deep")
    acc = vit.forward_features(x, {1: p1}, style="accumulate")
    torch.testing.assert_close(deep.tokens, acc.tokens, atol=0, rtol=0)


def test_deep_needs_equal_lengths(vit: PromptedViT) -> None:
    with pytest.raises(ValueError, match="one length"):
        vit.forward_features(
            batch(vit), {0: rand_prompts(3, 2, 1), 1: rand_prompts(3, 3, 2)}, "deep"
        )


def test_shallow_is_layer_zero_accumulate(vit: PromptedViT) -> None:
    x, p0 = batch(vit), rand_prompts(3, 4, 1)
    shallow = vit.forward_features(x, {0: p0}, style="shallow")
    acc = vit.forward_features(x, {0: p0}, style="accumulate")
    torch.testing.assert_close(shallow.tokens, acc.tokens, atol=0, rtol=0)
    assert shallow.tokens.shape == (3, 5 + 4, D)
    with pytest.raises(ValueError, match="layer 0 only"):
        vit.forward_features(x, {1: p0}, style="shallow")


def test_bad_prompt_arguments_raise(vit: PromptedViT) -> None:
    x = batch(vit)
    with pytest.raises(ValueError, match="style"):
        vit.forward_features(x, {0: rand_prompts(3, 1, 0)}, style="vpt")
    with pytest.raises(ValueError, match="outside"):
        vit.forward_features(x, {2: rand_prompts(3, 1, 0)})
    with pytest.raises(ValueError, match=r"\(B=3"):
        vit.forward_features(x, {0: torch.zeros(2, 1, D)})
    with pytest.raises(ValueError, match="return_layers"):
        vit.forward_features(x, return_layers=[5])


def test_prompts_change_cls_only_from_the_insertion_layer(vit: PromptedViT) -> None:
    x = batch(vit)
    plain = vit.forward_features(x, return_layers=[0, 1])
    a = vit.forward_features(x, {1: rand_prompts(3, 1, 1)}, return_layers=[0, 1])
    b = vit.forward_features(x, {1: rand_prompts(3, 1, 2)}, return_layers=[0, 1])
    assert torch.equal(a.layer_cls[0], plain.layer_cls[0])
    assert torch.equal(b.layer_cls[0], plain.layer_cls[0])
    assert not torch.allclose(a.layer_cls[1], b.layer_cls[1], atol=1e-4)
    assert not torch.allclose(a.cls, b.cls, atol=1e-4)
    torch.testing.assert_close(vit.vit.norm(plain.layer_cls[1]), plain.cls, atol=1e-6, rtol=0)


def test_per_sample_prompts_equal_each_sample_alone(vit: PromptedViT) -> None:
    x, p = batch(vit, 2), {0: rand_prompts(2, 2, 1), 1: rand_prompts(2, 1, 2)}
    both = vit.forward_features(x, p)
    for i in range(2):
        alone = vit.forward_features(x[i : i + 1], {k: v[i : i + 1] for k, v in p.items()})
        torch.testing.assert_close(both.tokens[i : i + 1], alone.tokens, atol=1e-5, rtol=0)


def test_batch_one_prompts_broadcast(vit: PromptedViT) -> None:
    x, p = batch(vit, 3), rand_prompts(1, 2, 1)
    out = vit.forward_features(x, {0: p})
    ref = vit.forward_features(x, {0: p.expand(3, -1, -1)})
    torch.testing.assert_close(out.tokens, ref.tokens, atol=0, rtol=0)


def test_run_blocks_resumes_from_cached_states(vit: PromptedViT) -> None:
    x, p = batch(vit), {0: rand_prompts(3, 2, 1), 1: rand_prompts(3, 1, 2)}
    for style, second in (("accumulate", p[1]), ("deep", rand_prompts(3, 2, 3))):
        prompts = {0: p[0], 1: second}
        full = vit.forward_features(x, prompts, style, return_layers=[1])
        h, _, n = vit.run_blocks(vit.embed(x), 0, 1, prompts, style)
        h, cls, n = vit.run_blocks(h, 1, 2, prompts, style, num_prompt_tokens=n, return_layers=[1])
        resumed = vit.finish(h, n, cls)
        torch.testing.assert_close(resumed.tokens, full.tokens, atol=0, rtol=0)
        torch.testing.assert_close(resumed.prompt_tokens, full.prompt_tokens, atol=0, rtol=0)
        assert torch.equal(resumed.layer_cls[1], full.layer_cls[1])


# ---------------------------------------------------------------- frozen-ness and gradients


def test_prompts_get_gradients_backbone_does_not(vit: PromptedViT) -> None:
    prompt = rand_prompts(3, 2, 1).requires_grad_(True)
    out = vit.forward_features(batch(vit), {0: prompt})
    (out.cls**2).sum().backward()  # sum(cls) alone is constant under a unit LayerNorm
    assert prompt.grad is not None and prompt.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in vit.parameters())


def test_stays_in_eval_mode() -> None:
    vit = create_backbone("vit-test")
    vit.train()
    assert not any(m.training for m in vit.modules())
    vit.train(True)
    assert not vit.vit.training


# ---------------------------------------------------------------- preprocessing


def normalize(x: torch.Tensor) -> torch.Tensor:
    return (x - 0.5) / 0.5


def test_preprocess_constant_image(vit: PromptedViT) -> None:
    for size in (8, 16, 40):  # upsample, same size, shrink
        img = torch.full((2, 3, size, size), 51, dtype=torch.uint8)
        out = vit.preprocess(img)
        assert out.dtype == torch.float32 and out.shape == (2, 3, 16, 16)
        torch.testing.assert_close(out, torch.full_like(out, (0.2 - 0.5) / 0.5))


def test_preprocess_antialiases_when_shrinking() -> None:
    img = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    img[..., 0, 0] = 255  # bilinear without antialias (32 -> 8) never reads pixel 0
    out = preprocess_images(img, 8, (0.5,) * 3, (0.5,) * 3)
    plain = F.interpolate(img.float() / 255, size=(8, 8), mode="bilinear", align_corners=False)
    assert plain[0, 0, 0, 0] == 0 and out[0, 0, 0, 0] > normalize(torch.tensor(0.0))
    x = images(2, 32)
    ref = F.interpolate(x.float() / 255, (8, 8), mode="bilinear", antialias=True)
    torch.testing.assert_close(preprocess_images(x, 8, (0.5,) * 3, (0.5,) * 3), normalize(ref))


def test_preprocess_upsamples_bilinear_half_pixel(vit: PromptedViT) -> None:
    x = images(2, 8)
    ref = F.interpolate(x.float() / 255, (16, 16), mode="bilinear", align_corners=False)
    torch.testing.assert_close(vit.preprocess(x), normalize(ref))


def test_preprocess_rejects_float_images(vit: PromptedViT) -> None:
    with pytest.raises(ValueError, match="uint8"):
        vit.preprocess(torch.zeros(1, 3, 16, 16))


# ---------------------------------------------------------------- registry and loading


def test_registry_names() -> None:
    names = BACKBONES.names("vit-*")
    for name in ("vit-test", "vit-smoke", "vit-b16-in21k", "vit-b16-augreg-in21k"):
        assert name in names
    assert BACKBONES.get("vit-b16-in21k").timm_name == "vit_base_patch16_224.orig_in21k"
    assert BACKBONES.get("vit-smoke").pretrained == "smoke"
    with pytest.raises(FpbenchError, match="vit-test"):
        create_backbone("vit-tset")


def test_random_init_is_seeded_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = create_backbone("vit-test"), create_backbone("vit-test")
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_load_weights_from_file(tmp_path, suffix: str) -> None:
    spec = BackboneSpec(name="other", timm_name="test_vit", timm_kwargs=VIT_TEST_ARCH, seed=7)
    source = spec.create().vit.state_dict()
    path = tmp_path / f"w{suffix}"
    if suffix == ".pth":
        torch.save(source, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in source.items()}, str(path))
    loaded = create_backbone("vit-test", weights=path).vit.state_dict()
    assert loaded.keys() == source.keys()
    assert all(torch.equal(loaded[k], source[k]) for k in source)
    assert not torch.equal(loaded["pos_embed"], create_backbone("vit-test").vit.pos_embed)


def test_missing_weights_file_names_the_path(tmp_path) -> None:
    path = tmp_path / "nope.pth"
    with pytest.raises(FpbenchError, match="nope.pth"):
        create_backbone("vit-test", weights=path)


def test_unfitting_weights_file_raises(tmp_path) -> None:
    path = tmp_path / "smoke.pth"
    torch.save(smoke_sized().vit.state_dict(), path)
    with pytest.raises(FpbenchError, match="does not fit"):
        create_backbone("vit-test", weights=path)


def test_hub_offline_fails_fast_with_a_fix(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    start = time.monotonic()
    with pytest.raises(FpbenchError) as err:
        create_backbone("vit-b16-in21k")
    assert time.monotonic() - start < 5
    msg = str(err.value)
    assert "vit-b16-in21k" in msg and "vit_base_patch16_224.orig_in21k" in msg
    assert 'weights = "PATH"' in msg and "\n" not in msg


def test_hub_offline_uses_cached_weights_without_network(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants as hf
    from safetensors.torch import save_file

    source = BackboneSpec(name="s", timm_name="test_vit", timm_kwargs=VIT_TEST_ARCH, seed=3)
    weights = source.create().vit.state_dict()
    repo = tmp_path / "models--timm--test_vit.r160_in1k"  # the Hugging Face cache layout
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    save_file(dict(weights), str(repo / "snapshots" / "abc123" / "model.safetensors"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path))
    spec = BackboneSpec(name="h", timm_name="test_vit", timm_kwargs=VIT_TEST_ARCH, pretrained="hub")
    loaded = spec.create().vit.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())


# ---------------------------------------------------------------- vit-smoke pretraining


def test_ensure_pretrained_trains_once_then_hits_the_cache(tmp_path, monkeypatch) -> None:
    steps: list[int] = []
    path = smoke.ensure_pretrained(tmp_path, lambda s, n, loss: steps.append(s), TINY_RECIPE)
    assert steps == [1, 2, 3, 4] and path.is_file()
    assert TINY_RECIPE.digest() in path.name and not list(tmp_path.glob("*.tmp"))

    def boom(*args, **kwargs):
        raise AssertionError("retrained despite a cached file")

    monkeypatch.setattr(smoke, "pretrain", boom)
    assert smoke.ensure_pretrained(tmp_path, None, TINY_RECIPE) == path
    other = smoke.SmokeRecipe(**{**TINY_RECIPE.__dict__, "steps": 5})
    assert other.digest() != TINY_RECIPE.digest()

    spec = BackboneSpec(name="tiny", timm_name="test_vit", timm_kwargs=TINY_RECIPE.arch)
    loaded = spec.create(weights=path).vit.state_dict()
    saved = torch.load(path, weights_only=True)
    assert "head.weight" not in saved and loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_pretraining_is_deterministic() -> None:
    a, b = smoke.pretrain(TINY_RECIPE), smoke.pretrain(TINY_RECIPE)
    assert all(torch.equal(a[k], b[k]) for k in a)
    init = BackboneSpec(name="t", timm_name="test_vit", timm_kwargs=TINY_RECIPE.arch).create()
    assert not torch.equal(a["pos_embed"], init.vit.pos_embed)  # it did train


def test_vit_smoke_loads_its_cached_weights(tmp_path, monkeypatch) -> None:
    fake = smoke_sized().vit.state_dict()
    monkeypatch.setattr(smoke, "pretrain", lambda recipe, progress=None, **_: fake)
    vit = create_backbone("vit-smoke", cache_dir=tmp_path)
    assert (vit.img_size, vit.depth, vit.embed_dim, vit.patch_size) == (32, 4, 128, 8)
    assert all(torch.equal(vit.vit.state_dict()[k], v) for k, v in fake.items())
    assert len(list(tmp_path.glob("vit-smoke-*.pth"))) == 1


def test_unwritable_smoke_cache_is_a_user_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(FpbenchError, match="FPBENCH_CACHE"):
        smoke.ensure_pretrained(blocker / "cache", None, TINY_RECIPE)
