"""The CLIP backbone adapter: prompt layouts, text path, pixel prompts, weight loading."""

from __future__ import annotations

import pytest
import torch

from fpbench.backbones import catalog, create_backbone
from fpbench.backbones.clip import CLIP_MEAN, CLIP_STD, PromptedCLIP
from fpbench.backbones.clip_prompts import PixelPrompter, PromptLayout, init_context
from fpbench.errors import FpbenchError

NAMES = ["c00", "golden_retriever", "hard-leaved pocket orchid"]
TEMPLATES = {"end": "a photo of a {}.", "front": "{} a photo of a.", "middle": "a photo {} of a."}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("clip-cache")


@pytest.fixture(scope="module")
def clip(cache) -> PromptedCLIP:
    return create_backbone("clip-test", cache_dir=cache)


def _phrase_ctx(clip: PromptedCLIP, phrase: str = "a photo of a") -> torch.Tensor:
    ids = clip.tokenize([phrase])
    n = int(ids.argmax()) - 1
    return clip.token_embed(ids)[:, 1 : 1 + n]  # (1, n, d)


@pytest.mark.parametrize("position", ["end", "middle", "front"])
def test_prompt_path_reproduces_encode_text(clip, position):
    """Fed the tokens' own embeddings, the prompt path equals open_clip's encode_text."""
    layout = PromptLayout.build(clip, NAMES, 4, position)
    emb = layout.assemble(_phrase_ctx(clip))[0]  # (C, L, d)
    texts = [TEMPLATES[position].format(n.replace("_", " ")) for n in NAMES]
    ids = clip.tokenize(texts)
    with torch.no_grad():
        expected = clip.model.encode_text(ids)
        assert torch.equal(emb, clip.token_embed(ids))
        assert torch.equal(clip.encode_prompts(emb, layout.ids), expected)
        short = clip.encode_prompts(emb, layout.ids, truncate=True)
    torch.testing.assert_close(short, expected, atol=1e-5, rtol=1e-5)


def test_eot_index_is_the_same_for_every_position(clip):
    eots = [PromptLayout.build(clip, NAMES, 6, p).ids.argmax(-1) for p in TEMPLATES]
    lens = torch.tensor(PromptLayout.build(clip, NAMES, 6).name_lens)
    for eot in eots:
        assert torch.equal(eot.cpu(), 1 + 6 + lens + 1)


def test_context_of_any_length_and_class_specific_context(clip):
    d, c = clip.ctx_dim, len(NAMES)
    for n in (1, 3, 16):
        layout = PromptLayout.build(clip, NAMES, n)
        ctx = torch.randn(2, n, d)  # K = 2 clients, generic
        emb = layout.assemble(ctx)
        assert emb.shape == (2, c, clip.context_length, d)
        assert torch.equal(emb[1, 2, 1 : 1 + n], ctx[1])
    csc = torch.randn(1, c, 3, d)  # one context per class
    emb = PromptLayout.build(clip, NAMES, 3, "front").assemble(csc)
    lens = PromptLayout.build(clip, NAMES, 3).name_lens
    for k in range(c):  # front: SOT, name, ctx, ".", EOT
        assert torch.equal(emb[0, k, 1 + lens[k] : 1 + lens[k] + 3], csc[0, k])


def test_middle_splits_context_around_the_name(clip):
    layout = PromptLayout.build(clip, ["c00"], 5, "middle")
    ctx = torch.arange(5.0).view(1, 5, 1).expand(1, 5, clip.ctx_dim)
    emb = layout.assemble(ctx)[0, 0]  # (L, d)
    name_len = layout.name_lens[0]
    assert emb[1:3, 0].tolist() == [0.0, 1.0]  # ctx[:5 // 2]
    assert emb[3 + name_len : 6 + name_len, 0].tolist() == [2.0, 3.0, 4.0]


def test_init_from_phrase_uses_its_token_embeddings(clip):
    ctx = init_context(clip, torch.Generator().manual_seed(0), 99, "a photo of a")
    assert ctx.shape == (4, clip.ctx_dim)
    assert torch.equal(ctx, _phrase_ctx(clip)[0])
    rand = init_context(clip, torch.Generator().manual_seed(0), 16)
    assert rand.shape == (16, clip.ctx_dim) and 0.01 < float(rand.std()) < 0.03


def test_token_budget_is_checked_not_truncated(clip):
    with pytest.raises(FpbenchError, match="token budget"):
        PromptLayout.build(clip, ["2012 Lamborghini Gallardo LP 570-4 Superleggera"], 64)
    PromptLayout.build(clip, ["c00"], 70)  # 1 + 70 + 3 + 2 = 76 <= 77


def test_padding_prompt_owns_a_frame():
    assert 3 * PixelPrompter("padding", 224, 30).num_pixels == 69_840  # Bahng et al.
    p = PixelPrompter("padding", 8, 2)
    img = p.render(torch.ones(1, 3, p.num_pixels))[0, 0]  # (8, 8)
    inner = torch.zeros(8, 8, dtype=torch.bool)
    inner[2:6, 2:6] = True
    assert torch.equal(img == 0, inner)


def test_fixed_patch_sits_top_left_in_row_major_order():
    p = PixelPrompter("fixed_patch", 6, 2)
    values = torch.arange(1.0, 5.0).view(1, 1, 4).expand(1, 3, 4)
    img = p.render(values)[0, 1]
    assert img[:2, :2].tolist() == [[1.0, 2.0], [3.0, 4.0]] and img.sum() == 10


def test_random_patch_is_one_square_per_sample_at_varying_places():
    p = PixelPrompter("random_patch", 10, 3)
    imgs = p.render(torch.ones(64, 3, 9), torch.Generator().manual_seed(0))[:, 0]  # (64, 10, 10)
    corners = set()
    for img in imgs:
        rows, cols = (img != 0).nonzero(as_tuple=True)
        assert len(rows) == 9 and rows.max() - rows.min() == 2 and cols.max() - cols.min() == 2
        corners.add((int(rows.min()), int(cols.min())))
    assert len(corners) > 10


def test_pixel_prompt_is_added_to_the_normalised_image(clip):
    x = torch.randn(2, 3, clip.img_size, clip.img_size)
    v = torch.randn(2, 3, clip.img_size, clip.img_size)
    with torch.no_grad():
        torch.testing.assert_close(clip.encode_image(x, v), clip.model.encode_image(x + v))
        assert torch.equal(clip.forward_features(x).cls, clip.model.encode_image(x))


def test_preprocess_normalises_with_clip_statistics(clip):
    images = torch.full((2, 3, 24, 40), 128, dtype=torch.uint8)
    x = clip.preprocess(images)
    assert x.shape == (2, 3, clip.img_size, clip.img_size) and x.dtype == torch.float32
    expected = (128 / 255 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(x[0, :, 3, 5], expected, atol=1e-5, rtol=0)


def test_backbone_is_frozen_with_the_models_logit_scale(clip):
    assert not any(p.requires_grad for p in clip.parameters())
    assert not clip.model.training and not clip.train().training
    assert clip.logit_scale == pytest.approx(float(clip.model.logit_scale.exp()))


def test_tiny_weights_load_from_a_file_through_open_clip(cache, clip):
    files = list(cache.glob("clip-test-*.pth"))
    assert len(files) == 1
    seeded = create_backbone("clip-test", pretrained=False)  # same seeded init, no file
    for (k, a), b in zip(clip.state_dict().items(), seeded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    state = torch.load(files[0], weights_only=True)
    state["text_projection"] = state["text_projection"] + 1.0
    path = cache / "edited.pth"
    torch.save(state, path)
    edited = create_backbone("clip-test", weights=path, cache_dir=cache)
    assert torch.equal(edited.model.text_projection, state["text_projection"])


def test_bad_or_missing_weight_files_fail_clearly(cache, tmp_path):
    with pytest.raises(FpbenchError, match="does not exist"):
        create_backbone("clip-test", weights=tmp_path / "nope.pth", cache_dir=cache)
    other = create_backbone("clip-test-rn", cache_dir=cache)
    path = tmp_path / "rn.pth"
    torch.save(other.model.state_dict(), path)
    with pytest.raises(FpbenchError, match="does not fit backbone clip-test"):
        create_backbone("clip-test", weights=path, cache_dir=cache)


def test_rn_variant_encodes_images(cache):
    rn = create_backbone("clip-test-rn", cache_dir=cache)
    x = rn.preprocess(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))
    assert rn.forward_features(x).cls.shape == (2, rn.embed_dim)


@pytest.mark.parametrize("name", ["clip-vit-b16", "clip-rn50"])
def test_missing_pretrained_weights_say_what_to_download(monkeypatch, cache, name):
    monkeypatch.setattr(catalog, "hf_cached_file", lambda repo: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FpbenchError) as err:
        create_backbone(name, cache_dir=cache)
    msg = str(err.value)
    assert "\n" not in msg and "download https://huggingface.co/timm/" in msg
    assert f'name = "{name}", weights = "PATH"' in msg


@pytest.mark.parametrize("name", ["clip-test", "clip-test-rn"])
def test_encode_image_tokens_position_0_is_encode_image(cache, name):
    model = create_backbone(name, cache_dir=cache)
    gen = torch.Generator().manual_seed(0)
    size = model.img_size
    images = torch.randint(0, 256, (3, 3, size, size), generator=gen, dtype=torch.uint8)
    x = model.preprocess(images)
    prompt = 0.1 * torch.randn(3, 3, size, size, generator=gen)
    for pixels in (None, prompt):
        tokens = model.encode_image_tokens(x, pixels)  # (B, 1 + M, E)
        assert tokens.shape[0] == 3 and tokens.shape[1] > 1 and tokens.shape[2] == model.embed_dim
        torch.testing.assert_close(
            tokens[:, 0], model.encode_image(x, pixels), atol=1e-5, rtol=1e-5
        )
    # the local tokens are features of their own, not copies of the pooled one
    assert (tokens[:, 1:] - tokens[:, :1]).abs().amax() > 1e-5
