"""Lazy frozen work: a sample's frozen features are computed when a batch first needs them, once."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from fpbench import stages
from fpbench.engine.cell import sampling_schedule
from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import train_clients
from fpbench.engine.inputs import FeatureCache, FrozenSplit, Inputs, owners
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from tests.conftest import tiny_config


@pytest.fixture
def forwards(monkeypatch) -> Counter:
    """Frozen forwards per (feature split, sample index), counted where they are computed."""
    seen: Counter = Counter()
    compute = FrozenSplit._compute

    def counting(self, unit, done, total):
        seen.update((self.what, i) for i in unit.tolist())
        return compute(self, unit, done, total)

    monkeypatch.setattr(FrozenSplit, "_compute", counting)
    return seen


def _samples(seen: Counter, what: str) -> set[int]:
    return {i for (w, i), _ in seen.items() if w == what}


def _frozen(method, inputs, idx):
    """The frozen values the method's backbone recalls (Select's block cls for SGPT, the final
    cls otherwise) of train samples idx, through the store."""
    vit = method.backbone
    if method.name == "sgpt":
        layer = method.query_layer
        return inputs.frozen(f"block{layer}-cls", lambda v: vit.block_cls(v, layer), "train")[idx]
    return inputs.frozen("cls", lambda v: vit.unprompted(v).cls, "train")[idx]


def _train_round(method, task, cfg, inputs, ids, r=0):
    server = method.init_server(torch.Generator().manual_seed(0))
    return train_clients(method, server, task, ids, cfg.train, round_idx=r, seed=0, inputs=inputs)


def test_owner_is_the_lowest_client_holding_a_sample() -> None:
    members = [torch.tensor([4, 1]), torch.tensor([1, 2]), torch.tensor([0])]
    assert owners(6, members).tolist() == [2, 0, 1, -1, 0, -1]


@pytest.mark.parametrize("name", ["sgpt", "head-tune"])
def test_training_computes_only_the_trained_clients_samples_once(tiny, forwards, name) -> None:
    cfg, task, method = tiny(name)
    inputs = Inputs.of(method, task, FeatureCache(), batch_size=16)
    what = f"block{method.query_layer}-cls" if name == "sgpt" else "cls"  # found, not declared
    a, b, never = task.trainable_clients()
    _train_round(method, task, cfg, inputs, [a, b])
    expected = set(task.train_idx[a].tolist()) | set(task.train_idx[b].tolist())
    assert _samples(forwards, f"{what} (train)") == expected
    assert not set(task.train_idx[never].tolist()) & expected  # the partition is disjoint
    assert set(forwards.values()) == {1} and not _samples(forwards, f"{what} (test)")
    _train_round(method, task, cfg, inputs, [b, a], r=1)  # kept: nothing new
    assert sum(forwards.values()) == len(expected)
    _train_round(method, task, cfg, inputs, [never], r=2)  # a new client: its samples only
    assert _samples(forwards, f"{what} (train)") == expected | set(task.train_idx[never].tolist())
    server = method.init_server(torch.Generator().manual_seed(0))
    evaluate(method, server, task, 16, inputs)
    evaluate(method, server, task, 16, inputs)
    assert _samples(forwards, f"{what} (test)") == set(range(len(task.data.test_labels)))
    assert set(forwards.values()) == {1}


def test_a_run_never_computes_a_client_it_does_not_sample(tmp_path, forwards) -> None:
    cfg = tiny_config("sgpt", rounds=2, participation=0.4)
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    from fpbench.engine.task import build_task

    task = build_task(cfg, torch.device("cpu"))
    schedule = sampling_schedule(cfg.seed, 2, task.trainable_clients(), 0.4)
    sampled = {c for r in schedule for c in r}
    assert len(sampled) < task.num_clients  # some clients (held-out ones at least) never train
    what = "block1-cls (train)"
    trained = {i for c in sampled for i in task.train_idx[c].tolist()}
    assert _samples(forwards, what) == trained
    assert all(n == 1 for n in forwards.values())


def test_values_do_not_depend_on_who_asked_first(tiny) -> None:
    """A sample's features come from its owner client's canonical unit: the same bits whether
    its client was trained first, last, or alone, in this cache or a fresh one."""
    cfg, task, method = tiny("head-tune")
    ids = task.trainable_clients()
    first = Inputs.of(method, task, FeatureCache(), batch_size=5)
    _train_round(method, task, cfg, first, ids)
    for c in ids:
        alone = Inputs.of(method, task, FeatureCache(), batch_size=5)
        idx = task.train_idx[c]
        assert torch.equal(_frozen(method, alone, idx), _frozen(method, first, idx))
        full = method.backbone.forward_features(
            method.backbone.preprocess(task.data.train_images[idx[:5]])
        ).cls
        torch.testing.assert_close(_frozen(method, alone, idx[:5]), full)


def test_disk_cache_serves_another_process_without_computing(tmp_path, tiny, forwards) -> None:
    cfg, task, method = tiny("sgpt")
    a, b, _ = task.trainable_clients()
    first = Inputs.of(method, task, FeatureCache(tmp_path), batch_size=16)
    _train_round(method, task, cfg, first, [a])
    computed = sum(forwards.values())
    assert computed == len(task.train_idx[a])
    again = Inputs.of(method, task, FeatureCache(tmp_path), batch_size=16)  # as a new process
    events: list[tuple[str, int, int]] = []
    idx = task.train_idx[a]
    with stages.reporting(lambda what, done, total: events.append((what, done, total))):
        assert torch.equal(_frozen(method, again, idx), _frozen(method, first, idx))
    assert sum(forwards.values()) == computed  # read from disk
    what = "frozen block1-cls (train)"
    assert events == [(what, 0, len(idx)), (what, len(idx), len(idx))]  # the bar starts and ends
    _frozen(method, again, task.train_idx[b])  # b was never computed: computed now, b only
    assert sum(forwards.values()) == computed + len(task.train_idx[b])


def test_frozen_passes_report_progress(tiny) -> None:
    cfg, task, method = tiny("sgpt")
    inputs = Inputs.of(method, task, FeatureCache(), batch_size=4)
    events: list[tuple[str, int, int]] = []
    ids = task.trainable_clients()[:2]
    with stages.reporting(lambda what, done, total: events.append((what, done, total))):
        _train_round(method, task, cfg, inputs, ids)
    n = sum(len(task.train_idx[c]) for c in ids)
    assert events[-1] == ("frozen block1-cls (train)", n, n)
    assert [d for _, d, _ in events] == sorted(d for _, d, _ in events)  # one pass, rising


def test_fpbench_run_shows_a_bar_per_frozen_pass_while_it_runs() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from fpbench.cli.run import _ProgressObserver

    cfg = tiny_config("sgpt")
    with Progress(console=Console(file=io.StringIO())) as progress:
        observer = _ProgressObserver(progress, 1)
        observer.stage(cfg, "frozen query (train split)", 16, 40)
        (bar,) = [t for t in progress.tasks if "frozen query (train split)" in t.description]
        assert (bar.completed, bar.total) == (16, 40)
        observer.stage(cfg, "frozen query (train split)", 40, 40)
        assert not [t for t in progress.tasks if "frozen" in t.description]  # gone when done
