"""Issue 48, everyday use: every missing input (datasets and backbone weights) named at once
before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fpbench.backbones import missing_weights
from fpbench.cli import app
from fpbench.suites import load_suite

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _suite(path: Path, dataset: str, backbone: str) -> Path:
    path.write_text(
        f'name = "w"\nseeds = [0]\n[defaults]\nbackbone = {backbone}\n'
        f'train = {{ rounds = 1 }}\n[[datasets]]\nname = "{dataset}"\n'
        '[[partitions]]\nname = "iid"\n[[methods]]\nname = "fedvpt"\n'
    )
    return path


def _hub_cache(root: Path, repo: str, filename: str) -> Path:
    """An (empty) weights file in the Hugging Face cache layout: presence, never loaded."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "snapshots" / "abc123" / filename).write_bytes(b"")
    return folder


def _no_probe() -> bool:
    raise AssertionError("the hub was probed for weights already cached")


def test_a_missing_dataset_and_a_missing_weights_file_are_one_error_and_nothing_is_written(here):
    _suite(here / "real.toml", "cifar10", '{ name = "vit-test", weights = "nowhere/w.pth" }')
    (here / "empty").mkdir()
    got = invoke("run", "--suite", "real.toml", "--data-root", "empty", "--db", "x.db")
    assert got.exit_code == 2, got.output
    said = " ".join(got.stderr.split())
    assert said.startswith("error: 2 inputs are missing: dataset 'cifar10' not found under")
    weights = here / "nowhere" / "w.pth"
    assert (
        f"; backbone weights file '{weights}' for vit-test does not exist; "
        "fix backbone.weights in the suite" in said
    )
    assert not (here / "x.db").exists() and not (here / "results").exists()
    dry = invoke("run", "--suite", "real.toml", "--data-root", "empty", "--db", "x.db", "--dry-run")
    assert dry.exit_code == 0, dry.output
    shown = " ".join(dry.stdout.split())
    assert (
        f"weights missing: backbone weights file '{weights}' for vit-test does not exist" in shown
    )
    assert not (here / "x.db").exists()


def test_a_weights_file_that_exists_and_offline_backbones_need_nothing(here):
    (here / "w.pth").write_bytes(b"")  # present: not loaded, so its content does not matter
    named = load_suite(
        str(_suite(here / "a.toml", "synthetic", '{ name = "vit-test", weights = "w.pth" }'))
    )
    offline = [
        load_suite(str(_suite(here / f"{b}.toml", "synthetic", f'{{ name = "{b}" }}'))).cells[0]
        for b in ("vit-test", "vit-smoke", "clip-test")
    ]
    assert missing_weights([*named.cells, *offline]) == []


def test_hub_weights_are_looked_for_in_the_local_cache_and_missing_offline(here, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(here / "hub"))
    cells = [
        load_suite(str(_suite(here / f"{b}.toml", "synthetic", f'{{ name = "{b}" }}'))).cells[0]
        for b in ("vit-b16-in21k", "clip-vit-b16")
    ]
    vit, clip = missing_weights(cells)
    assert vit.startswith("the weights for vit-b16-in21k (vit_base_patch16_224.orig_in21k) could")
    assert "(no network, or HF_HUB_OFFLINE is set)" in vit and 'weights = "PATH"' in vit
    assert clip.startswith("the openai weights of clip-vit-b16 (ViT-B-16-quickgelu) are missing")
    assert "download https://huggingface.co/timm/vit_base_patch16_clip_224.openai/" in clip
    _hub_cache(here / "hub", "timm/vit_base_patch16_224.orig_in21k", "model.safetensors")
    _hub_cache(here / "hub", "timm/vit_base_patch16_clip_224.openai", "open_clip_model.safetensors")
    from fpbench.registry import BACKBONES

    for name in ("vit-b16-in21k", "clip-vit-b16"):  # cached: present, the hub never asked
        assert BACKBONES.get(name).missing(None, _no_probe) is None


def test_uncached_hub_weights_with_the_hub_reachable_are_not_missing(here, monkeypatch):
    import huggingface_hub.constants as hf

    from fpbench.registry import BACKBONES

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(here / "hub"))
    assert BACKBONES.get("vit-b16-in21k").missing(None, lambda: True) is None  # run downloads
    assert (
        BACKBONES.get("clip-rn50")
        .missing(None, lambda: False)
        .startswith("the openai weights of clip-rn50")
    )
