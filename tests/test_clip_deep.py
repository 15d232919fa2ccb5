"""Deep (per-layer) prompt tokens in both CLIP towers: MaPLe's and PromptSRC's layout."""

from __future__ import annotations

import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.backbones.clip import (
    PromptedCLIP,
    encode_image_deep,
    encode_prompts_deep,
    vision_width,
)
from fpbench.backbones.clip_prompts import PromptLayout
from fpbench.errors import FpbenchError

NAMES = ["c00", "golden_retriever", "hard-leaved pocket orchid"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("clip-cache")


@pytest.fixture(scope="module")
def clip(cache) -> PromptedCLIP:
    return create_backbone("clip-test", cache_dir=cache)


def _images(clip: PromptedCLIP, b: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(b, 3, clip.img_size, clip.img_size, generator=gen)


def test_zero_depth_equals_the_existing_encoders_exactly(clip):
    ids = clip.tokenize(["a photo of a cat.", "a dog."])
    x = _images(clip)
    with torch.no_grad():
        emb = clip.token_embed(ids)
        assert torch.equal(encode_prompts_deep(clip, emb, ids, []), clip.encode_prompts(emb, ids))
        assert torch.equal(encode_prompts_deep(clip, emb, ids, []), clip.model.encode_text(ids))
        assert torch.equal(encode_image_deep(clip, x, None, []), clip.encode_image(x))


def _text_by_hand(clip, emb, ids, deep):
    """The text tower block by block, written out, tokens 1..m replaced before block i >= 1."""
    m = clip.model
    x = emb + m.positional_embedding
    for i, block in enumerate(m.transformer.resblocks):
        if 1 <= i <= len(deep):
            x = x.clone()
            x[:, 1 : 1 + deep[i - 1].shape[-2]] = deep[i - 1]
        x = block(x, attn_mask=m.attn_mask)
    x = m.ln_final(x)[torch.arange(len(ids)), ids.argmax(-1)]
    return x @ m.text_projection


def test_deep_text_prompts_replace_tokens_1_to_m_entering_each_layer(clip):
    layout = PromptLayout.build(clip, NAMES, 2)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 2, clip.ctx_dim, generator=gen)
    emb = layout.assemble(ctx)[0]  # (C, L, d)
    deep = [torch.randn(2, clip.ctx_dim, generator=gen)]  # layer 1 (clip-test has 2)
    with torch.no_grad():
        got = encode_prompts_deep(clip, emb, layout.ids, deep)
        want = _text_by_hand(clip, emb, layout.ids, deep)
        plain = clip.encode_prompts(emb, layout.ids)
        short = encode_prompts_deep(clip, emb, layout.ids, deep, truncate=True)
        per_prompt = encode_prompts_deep(clip, emb, layout.ids, [deep[0].expand(3, -1, -1)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(short, got, atol=1e-5, rtol=1e-5)
    assert torch.equal(per_prompt, got)
    assert (got - plain).abs().max() > 1e-3  # the layer-1 prompt does change the features


def _image_by_hand(clip, x, shallow, deep):
    v = clip.model.visual
    t = v.conv1(x).flatten(2).transpose(1, 2)  # (B, g*g, w)
    t = torch.cat([v.class_embedding.expand(len(x), 1, -1), t], 1) + v.positional_embedding
    t = v.ln_pre(torch.cat([t, shallow.expand(len(x), -1, -1)], 1))
    for i, block in enumerate(v.transformer.resblocks):
        if 1 <= i <= len(deep):
            t = torch.cat([t[:, : -deep[i - 1].shape[-2]], deep[i - 1].expand(len(x), -1, -1)], 1)
        t = block(t)
    return v.ln_post(t[:, 0]) @ v.proj


def test_deep_visual_prompts_are_appended_then_replaced_each_layer(clip):
    x = _images(clip)
    w = vision_width(clip)
    gen = torch.Generator().manual_seed(2)
    shallow, deep = torch.randn(3, w, generator=gen), [torch.randn(3, w, generator=gen)]
    with torch.no_grad():
        got = encode_image_deep(clip, x, shallow, deep)
        want = _image_by_hand(clip, x, shallow, deep)
        only_shallow = encode_image_deep(clip, x, shallow)
        per_sample = encode_image_deep(
            clip, x, shallow.expand(3, -1, -1), [deep[0].expand(3, -1, -1)]
        )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(per_sample, got)
    assert (got - only_shallow).abs().max() > 1e-3
    assert (only_shallow - clip.encode_image(x)).abs().max() > 1e-3


def test_prompt_depth_beyond_the_layers_and_resnets_are_refused(clip, cache):
    ids = clip.tokenize(["a cat."])
    deep = [torch.zeros(1, clip.ctx_dim)] * 2
    with pytest.raises(FpbenchError, match="at most 2"):
        encode_prompts_deep(clip, clip.token_embed(ids), ids, deep)
    with pytest.raises(FpbenchError, match="shallow"):
        encode_image_deep(clip, _images(clip), None, [torch.zeros(1, vision_width(clip))])
    rn = create_backbone("clip-test-rn", cache_dir=cache)
    with pytest.raises(FpbenchError, match="needs a ViT CLIP"):
        encode_image_deep(rn, _images(rn), torch.zeros(1, 8))
