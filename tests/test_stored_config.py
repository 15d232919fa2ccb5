"""Each run is stored with the settings that change its numbers but are not part of its key:
the precision it computed with ("auto" resolved), the client executor and `unseen_clients`."""

from __future__ import annotations

import torch

from fpbench.engine.runner import run_cell, stored_config
from fpbench.store import Store
from tests.conftest import tiny_config


def test_auto_precision_is_stored_as_it_resolves_on_the_device():
    cfg = tiny_config()
    assert cfg.runtime.precision == "auto"
    assert stored_config(cfg, torch.device("cpu"))["runtime"]["precision"] == "fp32"
    assert stored_config(cfg, torch.device("cuda"))["runtime"]["precision"] == "bf16"
    fixed = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"precision": "fp32"})})
    assert stored_config(fixed, torch.device("cuda"))["runtime"]["precision"] == "fp32"


def test_a_run_stores_its_precision_executor_and_unseen_clients(tmp_path):
    cfg = tiny_config(rounds=1, unseen_clients="score")
    cfg = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"executor": "reference"})}
    )
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path / "ck").status == "done"
        record = store.find_run(cfg.run_key)
        config = store.get_run(record.id).config
    assert (config["runtime"]["precision"], config["runtime"]["executor"]) == ("fp32", "reference")
    assert config["train"]["unseen_clients"] == "score"
    assert record.run_key == cfg.run_key  # the runtime section stays out of the identity
