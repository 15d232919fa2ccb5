"""Building a cell (`fpbench.engine.build`), checked directly on the tiny federation: the device
and precision a setting resolves to, what a method is built with (its task info, the suite's
normalisation, bf16 blocks, compiled blocks), and the inputs each population and eval target
gets (the feature cache's memory and folder, batch size and frozen precision)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import fpbench.engine.build as build_mod
from fpbench.backbones.vit import PromptedViT
from fpbench.cache import frozen_dir
from fpbench.engine.build import (
    build_method,
    build_populations,
    resolve_device,
    resolve_precision,
)
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.task import build_task
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig
from fpbench.suites import expand_suite
from fpbench.tiny import tiny_suite
from tests.conftest import tiny_config

CPU = torch.device("cpu")


def _with(cfg: RunConfig, section: str, **values) -> RunConfig:
    part = getattr(cfg, section).model_copy(update=values)
    return cfg.model_copy(update={section: part})


@pytest.mark.parametrize(("cuda", "want"), [(False, "cpu"), (True, "cuda")])
def test_auto_is_cuda_where_there_is_one(monkeypatch, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == torch.device(want)


def test_a_named_device_is_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == CPU
    want = "^device 'cuda:1' requested but CUDA is not available; use --device cpu$"
    with pytest.raises(FpbenchError, match=want):
        resolve_device("cuda:1")
    with pytest.raises(FpbenchError, match="^invalid device 'gpu'; use auto, cpu, cuda or cuda:N$"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_auto_precision_is_bf16_on_cuda_and_fp32_elsewhere():
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert resolve_precision("auto", CPU) == "fp32"
    assert resolve_precision("bf16-frozen", CPU) == "bf16-frozen"
    assert resolve_precision("fp32", torch.device("cuda")) == "fp32"


def test_a_method_is_built_with_the_tasks_info_and_its_config():
    cfg = tiny_config("fedvpt")
    cfg = _with(cfg, "method", args={"prompt_len": 3})
    task = build_task(cfg, CPU)
    method = build_method(cfg, task, CPU)
    info = method.task
    assert (info.num_classes, info.num_clients, info.dataset) == (6, 4, "synthetic")
    assert info.class_priors is task.priors and info.train_sizes is task.train_sizes
    assert info.class_names == tuple(task.data.class_names) and len(info.class_names) == 6
    assert info.train_images is task.data.train_images
    assert info.train_labels is task.data.train_labels
    assert info.train_idx == tuple(task.train_idx) and info.heldout is task.heldout
    assert info.coarse_of_class is task.data.coarse_of_class
    assert method.cfg.prompt_len == 3
    assert type(method).__name__ == "FedVPT"


def test_a_suites_normalisation_replaces_the_backbones():
    cfg = tiny_config()
    plain = build_method(cfg, build_task(cfg, CPU), CPU).backbone
    ref = cfg.backbone.model_copy(update={"mean": (0.1, 0.2, 0.3), "std": (0.4, 0.5, 0.6)})
    cfg = cfg.model_copy(update={"backbone": ref})
    backbone = build_method(cfg, build_task(cfg, CPU), CPU).backbone
    assert (backbone.mean, backbone.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert (plain.mean, plain.std) != (backbone.mean, backbone.std)


def test_bf16_frozen_holds_bf16_blocks_and_compile_compiles_each_block(monkeypatch):
    compiled: list[tuple[torch.nn.Module, dict]] = []
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self, **kw: compiled.append((self, kw)), raising=False
    )
    cfg = tiny_config()
    task = build_task(cfg, CPU)
    assert build_method(cfg, task, CPU).backbone._bf16_blocks == [] and compiled == []
    cfg = _with(cfg, "runtime", precision="bf16-frozen", compile=True)
    backbone = build_method(cfg, task, CPU).backbone
    assert isinstance(backbone, PromptedViT) and len(backbone._bf16_blocks) == 1
    assert backbone._bf16_blocks[0][0].attn.qkv.weight.dtype == torch.bfloat16
    blocks = [*backbone.vit.blocks, *backbone._bf16_blocks[0]]
    assert [m for m, _ in compiled] == blocks and len(blocks) == 2 * len(backbone.vit.blocks)
    assert all(kw == {"dynamic": True} for _, kw in compiled)


def test_a_populations_inputs_keep_frozen_work_as_cache_features_says(tmp_path):
    cfg = _with(tiny_config(), "train", eval_batch_size=5)
    cfg = _with(cfg, "runtime", frozen_precision="bf16", feature_cache_dir=str(tmp_path / "f"))
    task = build_task(cfg, CPU)
    shared = FeatureCache()
    (pop,) = build_populations(cfg, task, CPU, cache=shared)
    inputs = pop.inputs
    assert (inputs.batch_size, inputs.precision, inputs.task) == (5, "bf16", task)
    assert inputs.backbone is pop.method.backbone
    assert inputs.cache.folder == tmp_path / "f" and inputs.cache._memory is shared._memory
    assert inputs.cache._stores is shared._stores
    assert pop.key == "" and pop.clients == [0, 1, 2, 3] and pop.cohorts[0].train == cfg.train
    assert pop.cohorts[0].name is None and pop.targets == ()
    (own,) = build_populations(cfg, task, CPU)  # no cache given: one of its own, same folder
    assert own.inputs.cache.folder == tmp_path / "f" and own.inputs.cache._memory == {}
    memory = _with(cfg, "runtime", cache_features="memory")
    (pop,) = build_populations(memory, task, CPU, cache=shared)
    assert pop.inputs.cache.folder is None and pop.inputs.cache._memory is shared._memory
    off = _with(cfg, "runtime", cache_features=False)
    (pop,) = build_populations(off, task, CPU, cache=shared)
    assert pop.inputs.cache is None


def test_the_default_feature_folder_is_the_caches(tmp_path):
    cfg = tiny_config()
    (pop,) = build_populations(cfg, build_task(cfg, CPU), CPU, cache=FeatureCache())
    assert pop.inputs.cache.folder == frozen_dir(None) and isinstance(frozen_dir(None), Path)
    assert pop.inputs.batch_size == 64 and pop.inputs.precision == "fp32"


def _het(profiles: list[dict], **partition) -> RunConfig:
    suite = tiny_suite("fedvpt")
    suite["defaults"] = {
        **suite["defaults"],
        "model_het": {"profiles": profiles},
        "partition": {**suite["defaults"]["partition"], **partition},
    }
    return expand_suite(suite, name="het").cells[0]


OTHER = {"name": "vit-test", "mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}


def test_model_het_builds_one_population_per_backbone_in_profile_order(monkeypatch):
    """Profiles a (1 client, the run's backbone), b (2, another), c (1, the run's): clients
    0 | 1, 2 | 3; a and c share the first population, b has the second."""
    made = []
    real = build_mod.build_method
    monkeypatch.setattr(build_mod, "build_method", lambda *a, **k: made.append(a) or real(*a, **k))
    cfg = _het(
        [
            {"name": "a", "clients": 1},
            {"name": "b", "clients": 2, "backbone": OTHER, "train": {"batch_size": 3}},
            {"name": "c", "clients": 1},
        ]
    )
    task = build_task(cfg, CPU)
    cache = FeatureCache()
    first, second = build_populations(cfg, task, CPU, cache=cache, pretrained=False)
    assert (first.key, second.key) == ("0-vit-test", "1-vit-test")
    assert [(c.name, c.clients) for c in first.cohorts] == [("a", (0,)), ("c", (3,))]
    assert [(c.name, c.clients) for c in second.cohorts] == [("b", (1, 2))]
    assert second.cohorts[0].train.batch_size == 3 and first.cohorts[0].train == cfg.train
    assert first.method.backbone.mean != (0.1, 0.2, 0.3)
    assert second.method.backbone.mean == (0.1, 0.2, 0.3)
    assert [a[0].backbone for a in made] == [cfg.backbone, cfg.model_het.profiles[1].backbone]
    assert [(a[1], a[2], a[3]) for a in made] == [(task, CPU, False)] * 2
    for pop in (first, second):
        assert pop.inputs.backbone is pop.method.backbone and pop.inputs.task is task
        assert pop.inputs.cache._memory is cache._memory and pop.targets == ()
    (plain,) = build_populations(tiny_config(), build_task(tiny_config(), CPU), CPU)
    assert plain.method.backbone is plain.inputs.backbone


def test_model_het_must_cover_the_partitions_clients():
    cfg = _het([{"name": "a", "clients": 2}, {"name": "b", "clients": 2, "backbone": OTHER}])
    task = build_task(cfg, CPU)
    task.clients = task.clients[:3]  # as a partition that made another number of clients
    want = "^model_het.profiles have 4 clients in all but the partition made 3; make them equal$"
    with pytest.raises(FpbenchError, match=want):
        build_populations(cfg, task, CPU)


def test_each_population_is_built_pretrained_unless_asked(monkeypatch):
    made = []
    real = build_mod.create_backbone
    monkeypatch.setattr(
        build_mod, "create_backbone", lambda name, **kw: made.append((name, kw)) or real(name, **kw)
    )
    cfg = tiny_config()
    task = build_task(cfg, CPU)
    build_populations(cfg, task, CPU)
    build_method(cfg, task, CPU)
    build_populations(cfg, task, CPU, pretrained=False)
    assert made == [("vit-test", {"weights": None, "pretrained": True})] * 2 + [
        ("vit-test", {"weights": None, "pretrained": False})
    ]
    weights = cfg.backbone.model_copy(update={"weights": "/w/vit.pth"})
    monkeypatch.setattr(build_mod, "create_backbone", lambda name, **kw: pytest.fail(str(kw)))
    with pytest.raises(pytest.fail.Exception, match="'weights': '/w/vit.pth'"):
        build_method(cfg.model_copy(update={"backbone": weights}), task, CPU)


def _eval_cell(evaluation: dict, method: dict | None = None) -> RunConfig:
    """5 classes on clip-test (base-to-novel: 3 base, 2 novel), 3 clients, PromptFL."""
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "clip-test" if method is None else "vit-test"},
            "dataset": {"num_classes": 5, "image_size": 16, "train_per_class": 6,
                        "test_per_class": 3},
            "partition": {"num_clients": 3, "heldout_frac": 0.0},
            "train": {"rounds": 1, "batch_size": 8, "eval_batch_size": 64},
            "evaluation": evaluation,
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "dirichlet", "alpha": 1.0, "min_size": 1}],
        "methods": [method or {"name": "promptfl", "n_ctx": 4}],
    }  # fmt: skip
    return expand_suite(raw, name="modes").cells[0]


def test_an_eval_target_is_scored_on_its_own_classes_by_a_method_built_for_them():
    """Base-to-novel: the novel set (2 classes) gets a second method instance over its
    classes, on the same backbone, and inputs over its own scoring task (no local data)."""
    cfg = _eval_cell({"mode": "base2novel"})
    task = build_task(cfg, CPU)
    cache = FeatureCache()
    (pop,) = build_populations(cfg, task, CPU, cache=cache)
    (target,) = pop.targets
    (s,) = task.eval_sets
    assert target.name == s.name == "novel" and target.task.data is s.data
    assert target.task.clients == task.clients and target.task.num_clients == 3
    assert [len(i) for i in target.task.train_idx] == [0, 0, 0]
    assert target.method is not pop.method and target.method.backbone is pop.method.backbone
    assert target.method.task.class_names == tuple(s.data.class_names)
    assert len(target.method.task.class_names) == 2 and pop.method.task.num_classes == 3
    assert target.inputs.task is target.task and target.inputs.backbone is pop.method.backbone
    assert target.inputs.cache._memory is cache._memory and target.inputs.batch_size == 64


def test_a_same_classes_eval_set_is_scored_by_the_runs_own_method():
    cfg = _eval_cell({"mode": "base2novel"})
    task = build_task(cfg, CPU)
    task.eval_sets = (dataclasses.replace(task.eval_sets[0], name="lodo", same_classes=True),)
    (pop,) = build_populations(cfg, task, CPU, cache=None)
    (target,) = pop.targets
    assert target.name == "lodo" and target.method is pop.method
    assert target.inputs.task is target.task and target.task.data is task.eval_sets[0].data


def test_a_method_that_cannot_score_other_classes_names_the_evaluation_mode():
    cfg = _eval_cell({"mode": "base2novel"}, method={"name": "fedvpt"})
    with pytest.raises(FpbenchError, match=r"on other classes \(evaluation mode base2novel\):"):
        build_populations(cfg, build_task(cfg, CPU), CPU)


def test_each_model_het_population_gets_eval_targets_of_its_own_method():
    cfg = _eval_cell({"mode": "base2novel"})
    clip = {"name": "clip-test", "mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}
    het = {"profiles": [{"name": "a", "clients": 1}, {"name": "b", "clients": 2, "backbone": clip}]}
    raw = cfg.model_dump(mode="json") | {"model_het": het}
    cfg = RunConfig.model_validate(raw)
    task = build_task(cfg, CPU)
    cache = FeatureCache()
    pops = build_populations(cfg, task, CPU, cache=cache)
    assert [p.key for p in pops] == ["0-clip-test", "1-clip-test"]
    for pop in pops:
        (target,) = pop.targets
        assert target.name == "novel" and target.method is not pop.method
        assert target.method.backbone is pop.method.backbone
        assert target.inputs.cache._memory is cache._memory
    assert pops[1].targets[0].method.backbone.mean == (0.1, 0.2, 0.3)
