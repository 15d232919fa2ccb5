"""Backbones named in a suite by timm or open_clip name, built and loaded offline."""

from __future__ import annotations

import json

import open_clip
import pytest
import timm
import torch
from typer.testing import CliRunner

from fpbench.backbones import PromptedCLIP, PromptedViT, create_backbone
from fpbench.backbones.custom import open_clip_backbone
from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES
from fpbench.store import Store
from tests.conftest import TINY_SUITE_TOML, error_messages

DEIT = "deit_tiny_distilled_patch16_224"  # 2 prefix tokens (class + distillation)
CLIP2 = "fpbench-test-clip2"  # unlike clip-test: GELU, joint width 24, 24 px images, 1 layer
CLIP2_CFG = {
    "embed_dim": 24,
    "vision_cfg": {"image_size": 24, "layers": 1, "width": 16, "patch_size": 12, "head_width": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def deit_file(tmp_path_factory):
    """Random DeiT-tiny weights saved as a file, the way a downloaded checkpoint arrives."""
    torch.manual_seed(0)
    model = timm.create_model(DEIT, pretrained=False, num_classes=0)
    path = tmp_path_factory.mktemp("w") / "deit.pth"
    torch.save(model.state_dict(), path)
    return path, model


@pytest.fixture(scope="module")
def clip2_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("oc")
    (folder / f"{CLIP2}.json").write_text(json.dumps(CLIP2_CFG))
    if CLIP2 not in open_clip.list_models():
        open_clip.add_model_config(folder / f"{CLIP2}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(CLIP2, pretrained=None)
    torch.save(model.state_dict(), folder / "clip2.pth")
    return folder / "clip2.pth", model


def test_any_timm_vit_by_name_loads_a_file_and_equals_upstream(deit_file):
    path, upstream = deit_file
    bb = create_backbone(f"timm:{DEIT}", weights=path)
    assert isinstance(bb, PromptedViT) and bb.name == f"timm:{DEIT}"
    assert (bb.num_prefix_tokens, bb.embed_dim, bb.img_size) == (2, 192, 224)
    assert bb.mean == pytest.approx((0.485, 0.456, 0.406))  # DeiT's pretrained config
    upstream.eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ours = bb.forward_features(x).cls
        theirs = upstream.forward_features(x)[:, 0]
    torch.testing.assert_close(ours, theirs)  # no prompts: exactly the upstream model


def test_timm_normalisation_follows_the_pretrained_tag():
    assert BACKBONES.get("timm:vit_small_patch16_224.augreg_in21k").timm_name == (
        "vit_small_patch16_224.augreg_in21k"
    )
    bb = create_backbone("timm:vit_small_patch16_224.augreg_in21k", pretrained=False)
    assert bb.mean == (0.5, 0.5, 0.5) and bb.depth == 12


def test_any_open_clip_config_by_name_loads_a_file(clip2_file):
    path, upstream = clip2_file
    bb = create_backbone(f"open_clip:{CLIP2}", weights=path)
    assert isinstance(bb, PromptedCLIP) and (bb.embed_dim, bb.ctx_dim, bb.img_size) == (24, 16, 24)
    ids = bb.tokenize(["a photo of a cat"])
    with torch.no_grad():
        torch.testing.assert_close(bb.encode_text(ids), upstream.encode_text(ids))
        x = torch.randn(2, 3, 24, 24)
        torch.testing.assert_close(bb.forward_features(x).cls, upstream.encode_image(x))


def test_open_clip_tag_gives_weights_source_and_normalisation():
    spec = open_clip_backbone("ViT-B-32@laion2b_s34b_b79k")
    assert (spec.model_name, spec.tag) == ("ViT-B-32", "laion2b_s34b_b79k")
    assert spec.hf_repo == "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
    with pytest.raises(FpbenchError, match="names no pretrained tag: give backbone.weights"):
        create_backbone("open_clip:RN50")


def test_clip_normalisation_comes_from_the_models_preprocess_cfg(clip2_file):
    _, model = clip2_file
    model.visual.preprocess_cfg = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    bb = PromptedCLIP(model)
    assert (bb.mean, bb.std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    img = torch.full((1, 3, 24, 24), 255, dtype=torch.uint8)
    assert bb.preprocess(img).flatten()[0].item() == pytest.approx((1.0 - 0.5) / 0.25)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("timm:resnet18", "timm model 'resnet18' is a ResNet, not a ViT"),
        ("timm:vit_medium_patch16_gap_256", "has no class token"),
        ("timm:vit_tiny_patchh16_224", "unknown timm model 'vit_tiny_patchh16_224'; did you mean"),
        ("open_clip:ViT-B-16-SigLIP", "has a custom text tower"),
        ("open_clip:ViT-B-32@nope", "has no pretrained tag 'nope'; valid: openai,"),
        ("open_clip:ViT-Q-99", "unknown open_clip model 'ViT-Q-99'"),
    ],
)
def test_unpromptable_or_unknown_models_are_one_clear_error(name, message):
    with pytest.raises(FpbenchError, match=message):
        BACKBONES.get(name)


def test_suite_with_an_unpromptable_backbone_exits_2_with_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    suite = tmp_path / "s.toml"
    suite.write_text(TINY_SUITE_TOML.replace('"vit-test"', '"timm:resnet18"'))
    result = CliRunner().invoke(app, ["run", "--suite", str(suite)])
    assert result.exit_code == 2
    first, *rest = [line for line in result.output.splitlines() if line.strip()]
    assert first.startswith("error: ") and all(x.startswith("  ") for x in rest)  # one message
    (message,) = error_messages(result.output)
    assert "timm model 'resnet18' is a ResNet, not a ViT" in message
    assert not (tmp_path / "results").exists()  # nothing written


def _run_tiny_suite(folder, backbone: str, method: str, few: bool = False):
    """`fpbench run` on the tiny suite with this backbone line and only `method` (`few`: 4
    training and 2 test images a class instead of 12 and 6, for a 224 px model)."""
    methods = '[[methods]]\nname = "head-tune"\n[[methods]]\nname = "fedvpt"\n'
    text = TINY_SUITE_TOML.replace('backbone = { name = "vit-test" }', f"backbone = {backbone}")
    if few:
        assert "train_per_class = 12, test_per_class = 6" in text
        text = text.replace(
            "train_per_class = 12, test_per_class = 6", "train_per_class = 4, test_per_class = 2"
        )
    suite = folder / "s.toml"
    suite.write_text(text.replace(methods, f'[[methods]]\nname = "{method}"\n'))
    return CliRunner().invoke(app, ["run", "--suite", str(suite), "--db", "r.db"])


def test_suite_runs_with_an_open_clip_model_fpbench_does_not_list(
    tmp_path, monkeypatch, clip2_file
):
    path, _ = clip2_file
    monkeypatch.chdir(tmp_path)
    backbone = f'{{ name = "open_clip:{CLIP2}", weights = "{path}" }}'
    result = _run_tiny_suite(tmp_path, backbone, "coop-local")
    assert result.exit_code == 0, result.output
    assert "coop-local / synthetic / pathological / seed 0  done" in result.output


def test_suite_runs_with_a_timm_model_fpbench_does_not_list(tmp_path, monkeypatch, deit_file):
    path, _ = deit_file
    monkeypatch.chdir(tmp_path)
    backbone = f'{{ name = "timm:{DEIT}", weights = "{path}" }}'
    result = _run_tiny_suite(tmp_path, backbone, "fedvpt", few=True)
    assert result.exit_code == 0, result.output
    assert "fedvpt / synthetic / pathological / seed 0  done" in result.output
    with Store("sqlite:///r.db") as store:
        runs = store.runs()
        config = store.get_run(str(runs["id"].iloc[0])).config
    assert runs["status"].tolist() == ["done"] and runs["last_round"].tolist() == [1]
    assert config["backbone"]["name"] == f"timm:{DEIT}"
