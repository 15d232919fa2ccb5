"""The benchmark command runs and reports every figure (speed itself is never asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.executor import train_clients

KEYS = {
    "train_samples_per_s_reference",
    "train_samples_per_s_lockstep",
    "lockstep_vs_reference",
    "headtune_round_s_uncached",
    "headtune_round_s_cached",
    "headtune_cached_speedup",
    "headtune_cache_build_s",
    "eval_samples_per_s",
    "fedrep_round_s_recomputed",
    "fedrep_round_s_cached",
    "hidden_cache_speedup",
}


def test_bench_cli_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--backbone",
            "vit-test",
            "--clients",
            "2",
            "--batch",
            "4",
            "--steps",
            "2",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert set(figures) >= KEYS
    assert all(figures[k] > 0 for k in KEYS)
    assert (
        figures["lockstep_vs_reference"]
        == figures["train_samples_per_s_lockstep"] / figures["train_samples_per_s_reference"]
    )
    assert "lockstep_vs_reference" in result.output


def test_bench_rejects_unknown_backbone():
    result = CliRunner().invoke(app, ["bench", "--backbone", "vit-nope"])
    assert result.exit_code == 2 and "unknown backbone" in result.output


def test_bf16_autocast_trains_close_to_fp32(tiny):
    cfg, task, method = tiny("fedvpt")
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()
    runs = {
        p: train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, precision=p)
        for p in ("fp32", "bf16")
    }
    for k, v in runs["fp32"].params.items():
        assert runs["bf16"].params[k].dtype == torch.float32
        torch.testing.assert_close(runs["bf16"].params[k], v, atol=5e-2, rtol=5e-2)
    assert not torch.equal(runs["bf16"].params["prompts"], runs["fp32"].params["prompts"])


def test_the_paper_sized_run_is_sgpt_table1s_cell_but_for_rounds_weights_and_device():
    path = Path(__file__).parents[1] / "benchmarks/gpu/paper_run.py"
    spec = importlib.util.spec_from_file_location("paper_run", path)
    paper_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paper_run)
    full, cfg = paper_run.paper_cell("vit-b16-in21k", Path("/w.pth"), 10, "cuda", False)
    assert (full.method.name, full.dataset.name) == ("sgpt", "cifar100")
    assert (full.partition.name, full.partition.args["s"]) == ("pathological", 10)
    assert (full.partition.args["num_clients"], full.train.participation) == (100, 0.05)
    assert (full.train.rounds, full.train.local_epochs, full.train.batch_size) == (60, 5, 40)
    assert (cfg.train.rounds, cfg.train.eval_last, cfg.backbone.weights) == (10, 0, "/w.pth")
    assert (cfg.runtime.device, cfg.runtime.deterministic) == ("cuda", False)
    rest = {"train": {"rounds", "eval_last"}, "backbone": {"weights"}, "runtime": True}
    assert cfg.model_dump(exclude=rest) == full.model_dump(exclude=rest)
