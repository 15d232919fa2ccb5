"""GPT-FL generation end to end on a tiny random Stable Diffusion pipeline built offline.

The pipeline (UNet, VAE, CLIP text encoder, character-level BPE tokenizer, DDIM) is built from
configs with seeded random weights and saved to a folder, so `generate_images` and the CLI load
it exactly as they would a downloaded model. Skipped when diffusers or transformers is missing.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from fpbench.cli.data import data_app
from fpbench.data.gpt_fl_generate import Generation, generate_images, load_generated, read_manifest
from fpbench.errors import FpbenchError

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

CLASSES = ["cat", "red_car"]
IMAGE = 16  # pixels: latent 8 x VAE factor 2


def _tokenizer(folder: Path):
    """CLIP's BPE over single characters (no merges): any lower-case prompt tokenizes."""
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ".")
    tokens = ["<|startoftext|>", "<|endoftext|>", *chars, *(c + "</w>" for c in chars)]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    vocab, merges = str(folder / "vocab.json"), str(folder / "merges.txt")
    return CLIPTokenizer(vocab, merges, model_max_length=32)


def build_tiny_pipeline(folder: Path) -> Path:
    """Save a seeded random StableDiffusionPipeline writing 16 px images; returns its folder."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    folder.mkdir(parents=True)
    tokenizer = _tokenizer(folder)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=IMAGE // 2,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=IMAGE,
    )
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder / "model")
    return folder / "model"


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the pipeline runs hundreds of tiny ops per step, and on a busy
    2-core machine two threads wait on each other at every op (15x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("sd") / "tiny")


def _pixels(path: Path) -> torch.Tensor:
    with Image.open(path) as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (IMAGE, IMAGE)
        return torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)


def test_generates_resumes_and_reads_back(model, tmp_path):
    out = tmp_path / "out"
    assert generate_images(CLASSES, out, model, per_class=2, steps=2, device="cpu") == 4
    files = [out / c / f"{i:05d}.png" for c in CLASSES for i in range(2)]
    assert sorted(out.rglob("*.png")) == sorted(files)
    pixels = [_pixels(f) for f in files]
    assert all(p.float().std() > 0 for p in pixels)  # not blank
    # each (class, index) has its own seed and prompt: all four images differ
    assert all(not torch.equal(a, b) for i, a in enumerate(pixels) for b in pixels[i + 1 :])

    assert generate_images(CLASSES, out, model, per_class=2, steps=2, device="cpu") == 0
    assert all(torch.equal(_pixels(f), p) for f, p in zip(files, pixels, strict=True))  # files kept
    files[1].unlink()  # an interrupted run: the missing image comes back identical
    assert generate_images(CLASSES, out, model, per_class=2, steps=2, device="cpu") == 1
    assert torch.equal(_pixels(files[1]), pixels[1])

    images, labels = load_generated(out, CLASSES, size=16)
    assert images.shape == (4, 3, 16, 16) and images.dtype == torch.uint8
    assert labels.tolist() == [0, 0, 1, 1]
    assert torch.equal(images[2].permute(1, 2, 0).flatten(), pixels[2])


def test_cli_generates_with_the_local_model(model, tmp_path):
    out = tmp_path / "gen"
    args = ["generate-gpt-fl", "synthetic", "--out", str(out), "--model", str(model)]
    args += ["--per-class", "1", "--seed", "3", "--steps", "2", "--device", "cpu"]
    for item in ("num_classes=2", "num_coarse=1", "train_per_class=1", "test_per_class=1"):
        args += ["--set", item]
    result = CliRunner().invoke(data_app, args)
    assert result.exit_code == 0, result.output
    assert "wrote 2 images for 2 classes" in result.output
    assert sorted(out.rglob("*.png")) == [out / "c0" / "00000.png", out / "c1" / "00000.png"]
    assert not torch.equal(_pixels(out / "c0" / "00000.png"), _pixels(out / "c1" / "00000.png"))


def test_gpt_fl_pretrains_the_prompt_on_a_generated_set(model, tmp_path, tiny):
    _, task, method = tiny("gpt-fl")
    names = list(task.data.class_names)
    out = tmp_path / "gen"
    assert generate_images(names, out, model, per_class=2, steps=1, device="cpu") == 2 * len(names)
    images, labels = load_generated(out, names)
    feats = method.generated_features(images)
    start = method.init_server(torch.Generator().manual_seed(0)).params["ctx"]

    def loss(ctx):
        rows = torch.zeros(len(labels), dtype=torch.long)
        unit = F.normalize(feats, dim=-1)  # pretrain's normalised frozen features
        logits = method.logits(unit, method.text_features(ctx[None]), rows)
        return F.cross_entropy(logits, labels).item()

    # a random model's images are not class-separable, so check one full-batch gradient step
    # (12 images <= server_batch_size): with a small lr it must lower the loss
    made = {"model": model.name, "per_class": 2, "steps": 1}  # as generation.json records
    method.cfg = method.Config(synthetic_dir=str(out), server_epochs=1, server_lr=0.01)
    with pytest.raises(FpbenchError, match=f"was generated with model = '{model.name}'"):
        method.init_server(torch.Generator().manual_seed(0))
    method.cfg = method.Config(
        synthetic_dir=str(out), server_epochs=1, server_lr=0.01, generation=made
    )
    pretrained = method.init_server(torch.Generator().manual_seed(0)).params["ctx"]
    assert pretrained.shape == start.shape and not torch.equal(pretrained, start)
    assert loss(pretrained) < loss(start) - 1e-4


def test_the_settings_are_recorded_and_a_resume_with_others_is_refused(model, tmp_path):
    out = tmp_path / "out"
    generate_images(CLASSES[:1], out, model, per_class=1, steps=1, guidance_scale=2.0, device="cpu")
    assert read_manifest(out) == Generation(
        model=model.name, per_class=1, steps=1, guidance_scale=2.0
    )
    with pytest.raises(FpbenchError, match=r"steps = 1 \(expected 2\)"):
        generate_images(CLASSES[:1], out, model, per_class=1, steps=2, guidance_scale=2.0)
