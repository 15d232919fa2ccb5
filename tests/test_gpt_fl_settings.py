"""GPT-FL's generator settings as config (`gpt-fl`'s `generation`): the manifest a generated set
carries, the check that refuses a set made otherwise, and run keys unchanged at the defaults.
(Generation itself, with a tiny diffusion model: tests/test_gpt_fl_generate.py.)"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from fpbench.data.gpt_fl_generate import MANIFEST, Generation, check_generated, read_manifest
from fpbench.errors import FpbenchError
from fpbench.methods.gpt_fl import GPTFLConfig, require_generated
from fpbench.testing.tiny import tiny_config


def _set(root, manifest: dict | None) -> None:
    for c in ("c0", "c1"):
        (root / c).mkdir(parents=True)
        Image.new("RGB", (4, 4)).save(root / c / "00000.png")
    if manifest is not None:
        (root / MANIFEST).write_text(json.dumps(manifest))


def test_the_defaults_are_the_generator_fpbench_runs() -> None:
    assert Generation().model_dump() == {
        "model": "stable-diffusion-2-1", "per_class": 100, "template": "a photo of a {}.",
        "steps": 50, "guidance_scale": 7.5, "seed": 0, "precision": "auto",
    }  # fmt: skip
    assert GPTFLConfig().generation == Generation()


def test_a_set_made_with_other_settings_is_refused(tmp_path) -> None:
    _set(tmp_path, {**Generation().model_dump(), "steps": 20, "per_class": 4})
    assert read_manifest(tmp_path) == Generation(steps=20, per_class=4)
    check_generated(tmp_path, 2, Generation(steps=20, per_class=4))
    with pytest.raises(FpbenchError) as info:
        check_generated(tmp_path, 2, Generation())
    assert str(info.value) == (
        f"synthetic_dir {str(tmp_path)!r} was generated with per_class = 4 (expected 100), "
        "steps = 20 (expected 50): regenerate it or set gpt-fl's generation to match"
    )


def test_a_set_without_a_manifest_is_taken_as_it_is(tmp_path) -> None:
    _set(tmp_path, None)
    assert read_manifest(tmp_path) is None
    check_generated(tmp_path, 2, Generation())


def test_a_broken_manifest_is_one_clear_error(tmp_path) -> None:
    _set(tmp_path, None)
    (tmp_path / MANIFEST).write_text('{"steps": "many"}')
    with pytest.raises(FpbenchError, match="generation.json: not a generation manifest"):
        read_manifest(tmp_path)


def test_a_suite_checks_the_settings_before_writing_anything(tmp_path) -> None:
    _set(tmp_path, {**Generation().model_dump(), "template": "{}"})
    cfg = tiny_config("gpt-fl")
    args = {**cfg.method.args, "synthetic_dir": str(tmp_path), "server_epochs": 1}
    cell = cfg.model_copy(update={"method": cfg.method.model_copy(update={"args": args})})
    cell = cell.model_copy(update={"dataset": cell.dataset.model_copy(
        update={"args": {**cell.dataset.args, "num_classes": 2, "num_coarse": 1}})})  # fmt: skip
    with pytest.raises(FpbenchError, match="template = '{}' \\(expected 'a photo of a {}.'\\)"):
        require_generated([cell])
    good = {**args, "generation": {"template": "{}"}}
    require_generated([cell.model_copy(update={"method": cell.method.model_copy(
        update={"args": good})})])  # fmt: skip


def test_generation_is_in_the_config_and_out_of_the_run_key_at_its_default() -> None:
    cfg = tiny_config("gpt-fl")
    assert cfg.model_dump(mode="json")["method"]["args"]["generation"]["steps"] == 50
    assert "generation" not in cfg.identity()["method"]["args"]
    other = tiny_config("gpt-fl")
    args = {**other.method.args, "generation": Generation(steps=20).model_dump(mode="json")}
    other = other.model_copy(update={"method": other.method.model_copy(update={"args": args})})
    assert other.identity()["method"]["args"]["generation"]["steps"] == 20
    assert other.run_key != cfg.run_key
