"""`fpbench estimate`: cost shapes of a suite, their projection, and the command."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.measure.estimate import (
    Measurement,
    cost_group,
    estimate,
    plan,
    project,
    representatives,
    rescale,
    shape_of,
    shrunk,
)
from fpbench.suites import load_suite
from tests.conftest import TINY_SUITE_TOML

SUITES = sorted(p.stem for p in (Path(__file__).parents[1] / "benchmarks").glob("*.toml"))


def test_the_smoke_suite_has_one_shape_per_method_with_the_datasets_real_sizes() -> None:
    suite = load_suite("smoke")
    shapes = plan(suite)
    assert len(shapes) == 3 and sum(n for _, _, n in shapes) == len(suite.cells) == 6
    shape = shapes[0][0]
    data = suite.cells[0].dataset.args
    assert shape.train_size == data["num_classes"] * data["train_per_class"]
    assert shape.test_size == data["num_classes"] * data["test_per_class"]
    assert (shape.num_clients, shape.per_round) == (10, 4)  # participation 0.4 of 10


def test_paper_datasets_take_their_sizes_from_the_registry() -> None:
    cells = load_suite("sgpt-table1").cells
    shape = shape_of(next(c for c in cells if c.dataset.name == "cifar100"))
    assert (shape.image_size, shape.train_size, shape.test_size) == (32, 50_000, 10_000)
    assert shape.sizes_exact and shape.backbone == "vit-b16-in21k"


@pytest.mark.parametrize("name", SUITES)
def test_every_shipped_suite_plans_without_data_or_weights(name, monkeypatch) -> None:
    monkeypatch.setenv("FPBENCH_DATA", "/nonexistent")
    found = estimate(load_suite(name), device=None)
    assert sum(e.cells for e in found) == len(load_suite(name).cells)
    assert all(e.measured is None and e.shape.train_size > 0 for e in found)


def test_projection_adds_up_by_hand() -> None:
    shape = replace(
        shape_of(load_suite("smoke").cells[0]),
        num_clients=10, heldout_frac=0.0, per_round=4, train_size=1200, rounds=2, evals=1,
    )  # fmt: skip
    # 10 clients, 4 a round: 10 * (1 - 0.6^2) = 6.4 clients sampled, 1,200 / 10 = 120 samples each
    assert shape.expected_sampled == pytest.approx(6.4)
    m = Measurement(
        setup_s=1.0,
        train_round_s=2.0,
        eval_s=3.0,
        frozen_per_sample_s=0.01,
        test_frozen_s=4.0,
        device="cpu",
    )
    assert project(shape, m) == pytest.approx(1 + 2 * 2 + 1 * 3 + 0.01 * 6.4 * 120 + 4)


@pytest.fixture
def tiny_suite(tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SUITE_TOML)
    return path


def test_measurement_times_the_frozen_pass_only_where_a_method_has_one(tiny_suite) -> None:
    found = estimate(load_suite(str(tiny_suite)), torch.device("cpu"), rounds=1)
    by_method = {e.shape.method: e for e in found}
    assert set(by_method) == {"head-tune", "fedvpt"}
    assert by_method["head-tune"].measured.frozen_per_sample_s > 0  # cached cls features
    assert by_method["fedvpt"].measured.frozen_per_sample_s == 0  # nothing frozen
    assert by_method["fedvpt"].measured.test_frozen_s < 0.5
    for e in found:
        assert e.cell_s == pytest.approx(project(e.shape, e.measured))
        assert e.total_s == pytest.approx(e.cell_s * e.cells)


def test_estimate_command_measures_capped_shapes(tiny_suite, tmp_path) -> None:
    out = tmp_path / "est.json"
    args = ["estimate", "--suite", str(tiny_suite), "--device", "cpu", "--rounds", "1"]
    result = CliRunner().invoke(app, [*args, "--max-shapes", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "device-hours on cpu (the 1 of 2 cells measured)" in result.output
    assert "measuring shape 1/2: head-tune on vit-test" in result.output  # progress in a log
    assert "measuring shape 2/2" not in result.output
    assert "  frozen cls (train): 36 done\n  frozen cls (test): 36 done\n" in result.output
    assert "assumptions:" in result.output
    rows = json.loads(out.read_text())
    assert [r["measured"] is not None for r in rows] == [True, False]


def test_dry_estimate_of_a_paper_suite_and_bad_input(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "dry.json"
    args = ["estimate", "--suite", "sgpt-table1", "--dry", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "shapes, plan only)" in result.output
    rows = json.loads(out.read_text())
    assert sum(r["cells"] for r in rows) == len(load_suite("sgpt-table1").cells)
    cifar = next(r["shape"] for r in rows if r["shape"]["dataset"] == "cifar100")
    assert (cifar["train_size"], cifar["test_size"], cifar["image_size"]) == (50_000, 10_000, 32)
    bad = CliRunner().invoke(app, ["estimate", "--suite", "smoke", "--precision", "fp8"])
    assert bad.exit_code == 2 and "--precision" in bad.output


def test_estimate_of_one_method_and_an_unknown_one(tmp_path) -> None:
    out = tmp_path / "sgpt.json"
    args = ["estimate", "--suite", "sgpt-table1", "--method", "sgpt", "--dry", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    # s = 50 (preset cifar-s50) and s = 10 on CIFAR-100, G = 5 on Five-dataset
    assert [(r["shape"]["method"], r["shape"]["dataset"]) for r in rows] == [
        ("sgpt", "cifar100"), ("sgpt", "cifar100"), ("sgpt", "five-dataset"),
    ]  # fmt: skip
    bad = CliRunner().invoke(app, ["estimate", "--suite", "smoke", "--method", "nope", "--dry"])
    assert bad.exit_code == 2 and "method(s) ['nope'] not in suite smoke" in bad.output


def test_a_shape_whose_fake_images_do_not_fit_is_reported_not_allocated(monkeypatch) -> None:
    import fpbench.measure.estimate as est

    suite = load_suite("pep-table2")  # its iNaturalist cells: 155,941 images of 224px, 23.5 GB
    inat = [c for c in suite.cells if c.dataset.name == "inat-user-120k"]
    suite = suite.model_copy(update={"cells": inat})
    monkeypatch.setattr(est, "free_bytes", lambda device: 16 * 2**30)
    found = estimate(suite, torch.device("cpu"), rounds=1, max_shapes=1)
    assert found[0].measured is None and found[0].cell_s is None
    assert found[0].error == (
        "MemoryError: the fake inat-user-120k images (155,941 of 224px) take 21.9 GiB, over half "
        "of the 16.0 GiB free on cpu: estimate this shape on a device with more memory"
    )
    assert all(e.error is None and e.measured is None for e in found[1:])


@pytest.mark.parametrize("on", [True, False])
def test_a_shape_is_measured_as_its_cell_computes(tiny_suite, monkeypatch, on) -> None:
    """In the cell's deterministic mode and with its CPU linear backend (`cell_numerics`)."""
    import fpbench.backbones.frozen_linear as frozen_linear
    import fpbench.engine.rounds as rounds

    suite = load_suite(str(tiny_suite))
    runtime = {"deterministic": on, "cpu_linear": "onednn" if on else "blas"}
    cells = tuple(
        c.model_copy(update={"runtime": c.runtime.model_copy(update=runtime)}) for c in suite.cells
    )
    seen = []

    def spy(*args, **kwargs):
        seen.append((torch.are_deterministic_algorithms_enabled(), frozen_linear._backend))
        raise RuntimeError("spied")

    monkeypatch.setattr(rounds, "train_clients", spy)
    found = estimate(suite.model_copy(update={"cells": cells}), torch.device("cpu"), rounds=1)
    assert seen == [(on, runtime["cpu_linear"])] * 2
    assert [e.error for e in found] == ["RuntimeError: spied"] * 2
    assert torch.are_deterministic_algorithms_enabled() is False  # restored after each shape
    assert frozen_linear._backend == "onednn"


@pytest.mark.gpu
@pytest.mark.parametrize("suite", ["tiny", "smoke-clip"])
def test_every_shape_is_measured_on_cuda(tiny_suite, suite) -> None:
    """Data, weights and server state on the device (the first CUDA run found them split)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    found = estimate(
        load_suite(str(tiny_suite) if suite == "tiny" else suite), torch.device("cuda"), rounds=1
    )
    assert [e.error for e in found] == [None] * len(found)
    assert {e.measured.device for e in found} == {"cuda"}


def _cifar_shape():
    cells = load_suite("sgpt-table1").cells
    return shape_of(next(c for c in cells if c.dataset.name == "cifar100"))


def test_steps_and_shrunk_shapes_by_hand() -> None:
    shape = _cifar_shape()  # 50,000 train / 100 clients, batch 40, 5 epochs, test 10,000
    assert (shape.batch_size, shape.local_epochs, shape.eval_batch_size) == (40, 5, 160)
    assert shape.per_client == 500 and shape.local_steps == 5 * 13  # ceil(500 / 40) = 13
    small = shrunk(shape, 2)  # 2 batches a client, 2 evaluation batches of test samples
    assert (small.train_size, small.test_size, small.per_client) == (8_000, 320, 80)
    assert small.local_steps == 5 * 2 and cost_group(small) == cost_group(shape)
    capped = replace(shape, max_local_steps=7)
    assert capped.local_steps == 7 and shrunk(capped, 1).local_steps == 5
    few = replace(shape, shots=2)  # a few-shot client holds 2 x 100 classes = 200 samples
    assert few.per_client == 200 and few.local_steps == 5 * 5
    assert shrunk(few, 8).per_client == 200 and shrunk(few, 8).shots is None


def test_rescale_fits_a_fixed_part_and_a_cost_per_step() -> None:
    shape = _cifar_shape()  # 65 steps, 10,000 test samples
    small, big = shrunk(shape, 1), shrunk(shape, 2)
    # 5 and 10 steps; 200 (2 a client, over 1 evaluation batch of 160) and 320 test samples
    assert (small.local_steps, big.local_steps, small.test_size, big.test_size) == (5, 10, 200, 320)
    m = Measurement(1.0, 0.0, 0.5, 0.01, 0.2, "cpu", peak_mem_bytes=7)

    def at(s, round_s, eval_s, frozen_s):
        return s, replace(m, train_round_s=round_s, eval_s=eval_s, test_frozen_s=frozen_s)

    # round: 2 s fixed + 0.1 s a step: 2.5 s at 5 steps, 3 s at 10, 2 + 0.1 * 65 = 8.5 s at 65;
    # evaluation: 0.18 s fixed + 2 ms a sample: 0.58 s at 200, 0.82 s at 320, 20.18 s at 10,000
    out = rescale([at(small, 2.5, 0.58, 9.0), at(big, 3.0, 0.82, 0.32)], shape)
    assert out.train_round_s == pytest.approx(8.5)
    assert out.eval_s == pytest.approx(20.18)
    assert out.test_frozen_s == pytest.approx(10.0)  # 0.32 s x 10,000 / 320
    assert (out.setup_s, out.frozen_per_sample_s, out.peak_mem_bytes) == (1.0, 0.01, 7)
    # noise that makes the larger shape faster counts as no cost per step or sample
    flat = rescale([at(small, 3.0, 1.0, 1), at(big, 2.5, 0.9, 1)], shape)
    assert (flat.train_round_s, flat.eval_s) == (2.5, 0.9)


def test_a_scaled_estimate_times_each_cost_group_twice_and_scales_it(monkeypatch) -> None:
    import fpbench.measure.estimate as est

    suite = load_suite("sgpt-table1")
    timed = []

    def fake_measure(shape, cfg, device, precision, rounds, memo, warm):
        timed.append((shape, rounds, warm))  # a round: 1 s + 0.25 s a step; 1 ms a test sample
        steps, tests = shape.local_steps, shape.test_size
        return Measurement(0.0, 1 + 0.25 * steps, 0.001 * tests, 0.0, 0.0, str(device))

    monkeypatch.setattr(est, "measure", fake_measure)
    found = estimate(suite, torch.device("cpu"), batches=1)
    groups = {cost_group(e.shape) for e in found}
    assert len(timed) == 2 * len(groups) < 2 * len(found)  # shared within a group
    assert all(warm for _, _, warm in timed)
    # 1 then 2 batches a client, the second one round (warm from the first)
    assert [(s.local_steps, rounds) for s, rounds, _ in timed[:2]] == [(5, 2), (10, 1)]
    for e in found:
        assert e.measured.train_round_s == pytest.approx(1 + 0.25 * e.shape.local_steps)
        assert e.measured.eval_s == pytest.approx(0.001 * e.shape.test_size)
        assert e.cell_s == pytest.approx(project(e.shape, e.measured))


def test_a_scaled_estimate_stops_measuring_past_its_deadline(tiny_suite) -> None:
    found = estimate(load_suite(str(tiny_suite)), torch.device("cpu"), batches=1, deadline=0.0)
    assert [e.error for e in found] == ["out of time", "out of time"]


def test_a_memo_builds_each_backbone_once_and_hands_out_copies(tiny) -> None:
    from fpbench.engine.build import build_method

    cfg, task, _ = tiny("fedvpt")
    backbones: dict = {}
    a = build_method(cfg, task, torch.device("cpu"), pretrained=False, backbones=backbones)
    b = build_method(cfg, task, torch.device("cpu"), pretrained=False, backbones=backbones)
    (pristine,) = backbones.values()
    assert a.backbone is not b.backbone and a.backbone is not pristine
    got, want = a.backbone.state_dict(), pristine.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_estimate_command_scaled(tiny_suite, tmp_path) -> None:
    out = tmp_path / "est.json"
    args = ["estimate", "--suite", str(tiny_suite), "--device", "cpu", "--scaled", "1"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "--scaled: a round is a fixed part plus a cost per optimiser step" in " ".join(
        result.output.split()
    )
    assert all(r["measured"] is not None for r in json.loads(out.read_text()))
    bad = CliRunner().invoke(app, [*args[:-1], "0"])
    assert bad.exit_code == 2 and "--scaled" in bad.output


def test_paper_costs_sum_each_paper_and_count_a_shared_suite_once(monkeypatch, tmp_path):
    import importlib.util

    import fpbench.measure.estimate as est

    path = Path(__file__).parents[1] / "scripts/gpu/paper_costs.py"
    spec = importlib.util.spec_from_file_location("paper_costs", path)
    costs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(costs)
    assert costs.paper_suites("sgpt") == ["sgpt-table1", "sgpt-table2", "sgpt-ablations"]
    assert "clip-fewshot" in costs.paper_suites("tpfl") and "!" not in str(costs.paper_suites)

    def fake_measure(shape, cfg, device, precision, rounds, memo, warm):  # 3.6 s a step
        if shape.method == "fedem":
            raise RuntimeError("no memory")
        return Measurement(0.0, 3.6 * shape.local_steps, 0.0, 0.0, 0.0, "cpu")

    monkeypatch.setattr(est, "measure", fake_measure)
    out = tmp_path / "costs.json"
    args = ["--device", "cpu", "--budget-s", "600", "--papers", "sgpt", "fgpt", "--json", str(out)]
    assert costs.main(args) == 0
    got = json.loads(out.read_text())
    for name, suite in got["suites"].items():
        rows = suite["estimates"]
        assert suite["cells"] == len(load_suite(name).cells) == sum(r["cells"] for r in rows)
        fedem = sum(r["cells"] for r in rows if r["shape"]["method"] == "fedem")
        assert suite["cells_measured"] == suite["cells"] - fedem
        assert all(r["error"] == "RuntimeError: no memory" for r in rows if r["measured"] is None)
        want = 0.0  # rounds x 3.6 s a client's step, at the cell's own step count
        for r in rows:
            s = r["shape"]
            if s["method"] != "fedem":
                steps = est.Shape(**s).local_steps
                want += r["cells"] * s["rounds"] * 3.6 * steps / 3600
        assert suite["device_hours"] == pytest.approx(want)
    sgpt = got["papers"]["sgpt"]
    assert sgpt["device_hours"] == pytest.approx(
        sum(got["suites"][s]["device_hours"] for s in sgpt["suites"])
    )


def test_a_cost_group_is_timed_on_the_method_settings_most_of_its_cells_use() -> None:
    table1, ablations = plan(load_suite("sgpt-table1")), plan(load_suite("sgpt-ablations"))
    sgpt = next(s for s, _, _ in table1 if s.method == "sgpt" and s.dataset == "cifar100")
    group = cost_group(sgpt)
    # every SGPT setting of the two suites is one cell: a tie, which goes to the earlier suite
    rep, cfg = representatives(table1 + ablations)[group]
    assert rep.method_args == sgpt.method_args and cfg.method.label == "sgpt"
    rep, cfg = representatives(ablations + table1)[group]
    assert cfg.method.label == "sgpt-shared-only"  # the ablations' first
    # settings that more cells share win: two cells of the shared-only ablation
    shared_only = next(x for x in ablations if x[1].method.label == "sgpt-shared-only")
    rep, cfg = representatives(table1 + ablations + [shared_only])[group]
    assert cfg.method.label == "sgpt-shared-only"
    assert cfg.method.args == json.loads(rep.method_args)
