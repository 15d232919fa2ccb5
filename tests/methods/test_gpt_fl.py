"""GPT-FL: generated images, read and used to pretrain the prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from fpbench.cli.data import data_app
from fpbench.data.gpt_fl_generate import class_folder, generate_images, load_generated
from fpbench.errors import FpbenchError

from ..conftest import seeded_server


def _write_generated(root, names, per_class=3, size=20):
    rng = np.random.default_rng(0)
    for name in names:
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size + 4 * i, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:05d}.png")


def test_load_generated_reads_class_folders(tmp_path):
    _write_generated(tmp_path, ["golden_retriever", "tabby cat"], per_class=2)
    assert class_folder(tmp_path, "golden retriever").name == "golden_retriever"
    assert class_folder(tmp_path, "tabby_cat").name == "tabby cat"
    images, labels = load_generated(tmp_path, ["tabby_cat", "golden retriever"])
    assert images.shape == (4, 3, 20, 20) and images.dtype == torch.uint8  # first's short side
    assert labels.tolist() == [0, 0, 1, 1]
    # the second image is 24 wide, 20 high: it keeps its rows and loses 2 columns each side
    raw = torch.from_numpy(np.asarray(Image.open(tmp_path / "tabby cat" / "00001.png")).copy())
    assert torch.equal(images[1], raw.permute(2, 0, 1)[:, :, 2:22])
    small, _ = load_generated(tmp_path, ["tabby_cat"], size=8)
    assert small.shape == (2, 3, 8, 8)
    with pytest.raises(FpbenchError, match="no folder for class 'dog'"):
        load_generated(tmp_path, ["dog"])


def test_gpt_fl_without_images_stops_with_one_line_and_opts_out_with_zero_epochs(tiny):
    _, _, method = tiny("gpt-fl")
    _, _, promptfl = tiny("promptfl")
    assert method.cfg.server_epochs == 0  # the offline opt-out: PromptFL from CoOp's init
    torch.testing.assert_close(
        seeded_server(method).params["ctx"], seeded_server(promptfl).params["ctx"]
    )
    method.cfg = method.Config()
    with pytest.raises(FpbenchError, match=r"^gpt-fl needs generated images: run `fpbench data "
                       r"generate-gpt-fl synthetic --out DIR"):  # fmt: skip
        seeded_server(method)
    method.cfg = method.Config(synthetic_dir="nowhere/{dataset}")
    with pytest.raises(FpbenchError, match="in 'nowhere/synthetic': run `fpbench data generate"):
        seeded_server(method)


def test_gpt_fl_pretrains_the_prompt_on_generated_images(tiny, tmp_path):
    _, task, method = tiny("gpt-fl")
    _write_generated(tmp_path, task.data.class_names, per_class=4, size=16)
    images, labels = load_generated(tmp_path, list(task.data.class_names))
    feats = method.generated_features(images)
    start = seeded_server(method).params["ctx"]

    def loss(ctx):
        rows = torch.zeros(len(labels), dtype=torch.long)
        logits = method.logits(F.normalize(feats, dim=-1), method.text_features(ctx[None]), rows)
        return F.cross_entropy(logits, labels).item()

    (tmp_path / "synthetic").symlink_to(tmp_path, target_is_directory=True)
    folder = str(tmp_path / "{dataset}")  # the cell's dataset fills it in
    method.cfg = method.Config(synthetic_dir=folder, server_epochs=5, server_lr=0.05)
    pretrained = seeded_server(method).params["ctx"]
    assert pretrained.shape == start.shape and loss(pretrained) < loss(start)


def test_generation_says_what_is_missing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def no_diffusers(name, *args):
        return None if name == "diffusers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_diffusers)
    with pytest.raises(FpbenchError, match="pip install diffusers"):
        generate_images(["cat"], tmp_path, tmp_path, 1)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        data_app, ["generate-gpt-fl", "synthetic", "--out", str(out), "--model", str(tmp_path)]
    )
    assert result.exit_code == 2 and "diffusers" in result.output and not out.exists()


def _suite_with_gpt_fl(tmp_path, synthetic_dir):
    """The tiny suite on CLIP with PromptFL first and GPT-FL reading `synthetic_dir` second."""
    from tests.conftest import TINY_SUITE_TOML

    text = TINY_SUITE_TOML.replace('{ name = "vit-test" }', '{ name = "clip-test" }')
    methods = '[[methods]]\nname = "head-tune"\n[[methods]]\nname = "fedvpt"\n'
    gpt_fl = f'[[methods]]\nname = "gpt-fl"\nsynthetic_dir = "{synthetic_dir}"\nserver_epochs = 1\n'
    suite = tmp_path / "s.toml"
    suite.write_text(text.replace(methods, '[[methods]]\nname = "promptfl"\n' + gpt_fl))
    return suite


@pytest.mark.parametrize("filled", [0, 3])  # an empty folder; images for 3 of 6 classes
def test_gpt_fl_missing_class_images_stop_a_suite_before_anything_is_written(
    tmp_path, monkeypatch, filled
):
    from fpbench.cli import app

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "generated"
    root.mkdir()
    names = [f"class_{i}" for i in range(6)]
    _write_generated(root, names[:filled], per_class=1, size=8)
    (root / names[-1]).mkdir()  # a class folder without images
    suite = _suite_with_gpt_fl(tmp_path, root)
    result = CliRunner().invoke(app, ["run", "--suite", str(suite), "--db", "r.db"])
    assert result.exit_code != 0
    assert "class folder(s) ['class_5'] hold no images" in " ".join(result.output.split())
    assert not (tmp_path / "r.db").exists()  # not even the PromptFL row before it
    (root / names[-1]).rmdir()
    result = CliRunner().invoke(app, ["run", "--suite", str(suite), "--db", "r.db"])
    assert result.exit_code != 0 and not (tmp_path / "r.db").exists()
    assert f"holds images for {filled} classes, the dataset has 6" in " ".join(
        result.output.split()
    )


def test_load_generated_refuses_a_class_folder_without_images(tmp_path):
    _write_generated(tmp_path, ["cat"], per_class=1)
    (tmp_path / "dog").mkdir()
    with pytest.raises(FpbenchError, match="class 'dog' has no images"):
        load_generated(tmp_path, ["cat", "dog"])
