"""The benchmark command runs and reports every figure (speed itself is never asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.executor import train_clients
from fpbench.engine.task import build_task
from fpbench.testing.tiny import tiny_config

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
    path = Path(__file__).parents[1] / "scripts/gpu/paper_run.py"
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


def test_bench_methods_federation_is_the_conformance_tests_one():
    from fpbench.measure import methods

    for name in ("fedvpt", "promptfl", "gpt-fl"):
        cell = methods.tiny_cell(name, torch.device("cpu"), "fp32")
        same = tiny_config(name)
        rest = {"train": {"eval_every", "eval_last"}, "runtime": True, "suite": True}
        assert cell.model_dump(exclude=rest) == same.model_dump(exclude=rest), name
        assert (cell.train.eval_every, cell.train.eval_last) == (10**9, 0)
        assert (cell.runtime.precision, cell.runtime.cache_features) == ("fp32", "memory")
    assert methods.tiny_cell("promptfl", torch.device("cpu"), "auto").backbone.name == "clip-test"


def test_bench_methods_times_the_engines_round_and_evaluation(tmp_path, monkeypatch, fpbench_cache):
    """One round of every trainable client and one evaluation through the engine's own code,
    1 + repeats times each, reported per method in the table and the JSON."""
    import fpbench.engine.rounds as rounds

    calls = []
    for name in ("play_round", "evaluate_populations"):
        real = getattr(rounds, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            cell = args[0]  # the round's clients, and the clients seen that evaluation reads
            calls.append((_name, cell.schedule[args[2]] if _name == "play_round" else args[-1]))
            return _real(*args, **kwargs)

        monkeypatch.setattr(rounds, name, spy)
    out = tmp_path / "methods.json"
    args = ["bench", "--methods", "fedvpt", "--device", "cpu", "--repeats", "2", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    clients = [1, 2, 3]  # the tiny federation's trainable clients (one of 4 held out)
    assert build_task(tiny_config("fedvpt"), torch.device("cpu")).trainable_clients() == clients
    assert (
        calls
        == [("play_round", clients), ("evaluate_populations", clients)]
        + [("play_round", clients)] * 2
        + [("evaluate_populations", clients)] * 2
    )
    (found,) = json.loads(out.read_text())
    assert (found["method"], found["backbone"], found["error"]) == ("fedvpt", "vit-test", None)
    fields = ("round_s", "round_cpu_s", "eval_s", "first_round_s", "first_eval_s")
    times = [found[k] for k in fields]
    assert all(t > 0 for t in times)
    row = next(line for line in result.output.splitlines() if "│ fedvpt " in line)
    assert row.split("│")[3].strip() == f"{found['round_s']:,.3f}"


def test_bench_methods_reports_a_failing_method_and_bad_input(monkeypatch, fpbench_cache):
    import fpbench.measure.methods as methods

    def broken(cfg, device, repeats):
        raise RuntimeError(f"{cfg.method.name} broke")

    monkeypatch.setattr(methods, "time_method", broken)
    result = CliRunner().invoke(app, ["bench", "--methods", "fedvpt*", "--device", "cpu"])
    assert result.exit_code == 1
    assert "method fedvpt not timed: RuntimeError: fedvpt broke" in result.output
    assert "method fedvpt-d not timed: RuntimeError: fedvpt-d broke" in result.output
    assert "all (0)" in result.output
    none = CliRunner().invoke(app, ["bench", "--methods", "nope*", "--device", "cpu"])
    assert none.exit_code == 2 and "no registered method matches 'nope*'" in none.output
    mixed = CliRunner().invoke(app, ["bench", "--methods", "*", "--backbone", "vit-test"])
    assert mixed.exit_code == 2  # the error wrapped to the width
    assert "--backbone, --clients, --batch and --steps" in " ".join(mixed.output.split())
