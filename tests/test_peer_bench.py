"""The side-by-side benchmark with the official SGPT code: fpbench's half, without the peer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.suites import load_suite
from tests.peer import load_script

ROOT = Path(__file__).parents[1]
SCRIPTS = ROOT.parent / "shared" / "peer-sgpt"


@pytest.mark.parametrize("setting", ["tiny", "vit-b16"])
def test_fpbenchs_side_is_the_peer_setting(tmp_path, setting) -> None:
    sbs = load_script("sgpt_side_by_side")
    args = type("Args", (), {"setting": setting, "rounds": 3, "device": "cpu"})
    chosen = sbs.SETTINGS[setting]
    suite = tmp_path / "s.toml"
    sgpt = "\n".join(f"{k} = {v}" for k, v in chosen["sgpt"].items())
    suite.write_text(
        sbs.SUITE.format(
            setting=setting, backbone=chosen["backbone"], weights=tmp_path / "w.npz",
            rounds=args.rounds, device=args.device, precision="fp32", sgpt=sgpt,
        )
    )  # fmt: skip
    (cell,) = load_suite(str(suite)).cells
    assert cell.partition.name == "pathological" and cell.partition.args["s"] == 10
    assert (cell.partition.args["num_clients"], cell.train.participation) == (10, 0.2)
    assert (cell.train.batch_size, cell.train.local_epochs, cell.train.eval_every) == (16, 1, 1)
    assert cell.runtime.precision == "fp32"
    groups = chosen["sgpt"]["num_groups"]
    assert cell.method.args["num_groups"] == groups
    assert f"--key_prompt {groups}" in " ".join(chosen["peer"])


def test_report_prints_official_over_fpbench() -> None:
    sbs = load_script("sgpt_side_by_side")
    args = type("Args", (), {"setting": "tiny", "rounds": 2, "device": "cpu"})
    args.train_per_class, args.test_per_class = 5, 2
    official = {"total_s": 30.0, "rounds_s": [10.0, 14.0]}
    mine = {"bf16": {"total_s": 12.0, "rounds_s": [5.0, 7.0]}}
    mine["fp32"] = {"total_s": 15.0, "rounds_s": [6.0, 10.0]}
    text = sbs.report(official, mine, args).splitlines()
    assert text[1] == " " * 18 + "  official s fpbench bf16  ratio fpbench fp32  ratio"
    assert text[2] == "whole run                30.00      12.00   2.50      15.00   2.00"
    assert text[3] == "per round (mean)         12.00       6.00   2.00       8.00   1.50"
    assert text[5] == "round 1                  14.00       7.00   2.00      10.00   1.40"


@pytest.mark.skipif(not SCRIPTS.is_dir(), reason="needs the steering repo's shared/peer-sgpt")
def test_the_peers_random_npz_loads_into_fpbench_unchanged(tmp_path) -> None:
    npz = tmp_path / "tiny.npz"
    cmd = [sys.executable, "-B", SCRIPTS / "make_fake_vit_npz.py", "--out", npz, "--hidden", "192"]
    cmd += ["--heads", "3", "--mlp", "768", "--layers", "4", "--patch", "16"]
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)
    vit = create_backbone("vit-ti16-d4", weights=npz).vit
    w = np.load(npz)
    kernel = torch.from_numpy(w["embedding/kernel"]).permute(3, 2, 0, 1)  # HWIO -> OIHW
    assert torch.equal(vit.patch_embed.proj.weight, kernel)
    qkv = w["Transformer/encoderblock_3/MultiHeadDotProductAttention_1/query/kernel"]
    assert torch.equal(vit.blocks[3].attn.qkv.weight[:192], torch.from_numpy(qkv).flatten(1).T)
    assert len(vit.blocks) == 4 and vit.embed_dim == 192
