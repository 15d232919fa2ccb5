"""A method's batches and the lazy store of frozen work (`fpbench.engine.inputs`), checked
directly on a fake backbone (preprocess: float, the frozen work: a counted function), so every
unit, batch, tag and progress report can be written down by hand. The tiny federation's runs
through it are in tests/test_lazy_frozen.py and tests/test_frozen_cache.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

import fpbench.engine.inputs as inputs_mod
from fpbench.backbones.recall import _CURRENT
from fpbench.engine.frozen_cache import entry_path, read_entry, write_entry
from fpbench.engine.inputs import (
    FeatureCache,
    FrozenSplit,
    Inputs,
    SplitStore,
    _tag,
    _unit_digest,
    owners,
)
from fpbench.specs import Augment
from fpbench.stages import reporting

CPU = torch.device("cpu")


class _Counted:
    """fn(x) = 10 * x's first column plus a second column 1; records each batch's values."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x[:, 0].tolist())
        return torch.stack([10 * x[:, 0], torch.ones(len(x))], 1)


def _backbone():
    return SimpleNamespace(
        name="fake bb/1", preprocess=lambda im: im.float() + 0.5, mean=(0.1,), std=(0.2,)
    )


def _split(owner: list[int], fn, cache=None, batch_size: int = 2, key: str = "K"):
    images = torch.arange(len(owner))[:, None]  # image i: its index; preprocessed: i + 0.5
    return FrozenSplit(
        "cls (train)", fn, _backbone(), images, torch.tensor(owner),
        cache=cache or FeatureCache(), key=lambda: key, kind="fake--cls", batch_size=batch_size,
    )  # fmt: skip


def test_owners_are_the_lowest_member_holding_each_sample():
    members = [torch.tensor([1, 3]), torch.tensor([3, 4]), torch.tensor([0])]
    assert owners(6, members).tolist() == [2, 0, -1, 0, 1, -1]
    assert owners(3, [torch.tensor([2, 0])]).tolist() == [0, -1, 0]
    none = owners(3, [])
    assert none.tolist() == [-1, -1, -1] and none.dtype == torch.long


def test_a_units_digest_and_tag():
    idx = torch.tensor([3, 5], dtype=torch.long)
    want = hashlib.sha256(b"4" + idx.numpy().tobytes()).hexdigest()
    assert _unit_digest(idx, 4) == want != _unit_digest(idx, 5)
    assert _tag(want) == int(want[:16], 16) >> 1
    assert _tag("f" * 64) == (2**64 - 1) >> 1 and _tag("0" * 15 + "1" + "0" * 48) == 1


def test_a_split_store_allocates_on_the_first_unit_and_tags_its_samples():
    store = SplitStore(4, CPU)
    assert store.values is None and store.tag.tolist() == [0, 0, 0, 0]
    store.put(torch.tensor([1, 3]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 7)
    assert store.values.tolist() == [[0, 0], [1, 2], [0, 0], [3, 4]]
    assert store.tag.tolist() == [0, 7, 0, 7]


def test_a_cache_on_another_folder_shares_its_memory(tmp_path):
    cache = FeatureCache()
    assert cache.on(None) is cache
    other = cache.on(tmp_path)
    assert other.folder == tmp_path and other is not cache
    assert other._memory is cache._memory and other._stores is cache._stores
    assert other.on(tmp_path) is other


def test_get_computes_once_and_keeps_it_on_disk_under_its_kind(tmp_path):
    cache, calls = FeatureCache(tmp_path), []

    def compute():
        calls.append(1)
        return torch.tensor([1.0, 2.0])

    got = cache.get("k1", compute, CPU, kind="prior")
    assert cache.get("k1", compute, CPU, kind="prior") is got and calls == [1]
    assert read_entry(entry_path(tmp_path, "k1", "prior"), "k1").tolist() == [1.0, 2.0]
    fresh = FeatureCache(tmp_path)  # another process: read from disk, not computed
    assert fresh.get("k1", lambda: pytest.fail("computed"), CPU, "prior").tolist() == [1.0, 2.0]
    assert not entry_path(tmp_path, "k1", "misc").exists()
    cache.get("k3", compute, CPU)  # no kind: the "misc" folder
    cache.unit("k4", compute, CPU)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["misc", "prior"]
    assert entry_path(tmp_path, "k3", "misc").is_file()
    assert entry_path(tmp_path, "k4", "misc").is_file()
    assert FeatureCache().get("k2", compute, CPU).tolist() == [1.0, 2.0] and len(calls) == 4


def test_a_unit_on_disk_with_the_wrong_row_count_is_recomputed(tmp_path):
    cache = FeatureCache(tmp_path)
    cache.unit("u", lambda: torch.ones(2, 1), CPU, "k", rows=2)
    assert cache.unit("u", lambda: pytest.fail("computed"), CPU, "k", rows=2).tolist() == [[1], [1]]
    assert cache.unit("u", lambda: torch.zeros(3, 1), CPU, "k", rows=3).tolist() == [[0]] * 3
    assert read_entry(entry_path(tmp_path, "u", "k"), "u").tolist() == [[0]] * 3  # replaced
    assert cache.unit("u", lambda: pytest.fail("computed"), CPU, "k").tolist() == [[0]] * 3


def test_the_store_of_a_split_is_replaced_when_its_size_changes():
    cache = FeatureCache()
    first = cache.store("s", 4, CPU)
    assert cache.store("s", 4, CPU) is first
    second = cache.store("s", 5, CPU)
    assert second is not first and len(second.tag) == 5 and cache.store("s", 5, CPU) is second


def test_a_split_computes_only_the_units_asked_in_batches_and_reports_progress():
    """Owners [0, 0, 1, -1, 1, 1]: unit 0 = samples 0, 1; unit 1 = 2, 4, 5; sample 3 in none."""
    fn, seen = _Counted(), []
    split = _split([0, 0, 1, -1, 1, 1], fn, batch_size=2)
    assert [u.tolist() for u in split.units] == [[0, 1], [2, 4, 5]]
    with reporting(lambda what, done, total: seen.append((what, done, total))):
        got = split[torch.tensor([4])]
    assert got.tolist() == [[45.0, 1.0]]
    assert fn.batches == [[2.5, 4.5], [5.5]]  # unit 1 only, 2 at a time, preprocessed
    assert seen == [("frozen cls (train)", 0, 3), ("frozen cls (train)", 2, 3),
                    ("frozen cls (train)", 3, 3)]  # fmt: skip
    assert split.computed == 3 and split.ready.tolist() == [False, False, True, False, True, True]
    assert split.store.tag[2].item() == _tag(_unit_digest(torch.tensor([2, 4, 5]), 2))
    assert split[torch.tensor([5, 2])].tolist() == [[55.0, 1.0], [25.0, 1.0]]
    assert len(fn.batches) == 2  # nothing computed again
    assert split[torch.tensor([3])].tolist() == [[35.0, 1.0]]  # an orphan: computed as asked
    assert split.computed == 4 and split[1:3].tolist() == [[15.0, 1.0], [25.0, 1.0]]
    assert fn.batches[-1] == [0.5, 1.5] and split.computed == 6


def test_a_split_reads_units_another_split_of_the_same_key_computed(tmp_path):
    """The memory of a process's cache is keyed by split: a second cell's split of the same key
    reuses the first one's units; a unit from disk reports the pass as finished."""
    cache, fn = FeatureCache(tmp_path), _Counted()
    _split([0, 0, 1], fn, cache)[torch.tensor([0, 2])]
    assert len(fn.batches) == 2
    again = _split([0, 0, 1], fn, cache)
    assert again[torch.tensor([1])].tolist() == [[15.0, 1.0]] and len(fn.batches) == 2
    assert again.computed == 0
    seen = []
    other = _split([0, 0, 1], fn, FeatureCache(tmp_path))  # another process: from disk
    with reporting(lambda what, done, total: seen.append((what, done, total))):
        assert other[torch.tensor([2])].tolist() == [[25.0, 1.0]]
    assert len(fn.batches) == 2 and other.computed == 0
    assert seen == [("frozen cls (train)", 0, 1), ("frozen cls (train)", 1, 1)]
    digest = _unit_digest(torch.tensor([2]), 2)
    assert entry_path(tmp_path, f"K|unit={digest}", "fake--cls").is_file()  # the split's kind
    moved = _split([0, 1, 1], fn, FeatureCache(tmp_path))  # other units: other digests
    assert moved[torch.tensor([2])].tolist() == [[25.0, 1.0]] and fn.batches[-1] == [1.5, 2.5]


def test_a_split_in_memory_reuses_the_units_it_filled():
    """Memory only: a second split of the same key finds unit 0 filled by the first (its
    samples carry unit 0's tag) and computes only unit 1."""
    cache, fn = FeatureCache(), _Counted()
    _split([0, 0, 1, 1], fn, cache)[torch.tensor([0])]
    assert fn.batches == [[0.5, 1.5]]
    again = _split([0, 0, 1, 1], fn, cache)
    assert again[torch.tensor([1, 3])].tolist() == [[15.0, 1.0], [35.0, 1.0]]
    assert fn.batches == [[0.5, 1.5], [2.5, 3.5]] and again.computed == 2


def test_a_units_samples_are_in_index_order():
    """The unit (and so its digest and batches) lists its samples in index order, whatever
    order a sort of the owners gives equal keys (100 samples: numpy-style unstable sorts
    reorder them)."""
    owner = torch.randint(-1, 3, (100,), generator=torch.Generator().manual_seed(0))
    split = _split(owner.tolist(), _Counted())
    for u, unit in enumerate(split.units):
        assert unit.tolist() == torch.nonzero(owner == u).flatten().tolist()


def test_an_entry_of_the_right_key_with_the_wrong_rows_is_recomputed(tmp_path):
    fn = _Counted()
    _split([0, 0], fn, FeatureCache(tmp_path))[torch.tensor([0])]
    key = f"K|unit={_unit_digest(torch.tensor([0, 1]), 2)}"
    path = entry_path(tmp_path, key, "fake--cls")
    write_entry(path, key, torch.zeros(3, 2))  # damaged: 3 rows for a unit of 2
    again = _split([0, 0], fn, FeatureCache(tmp_path))
    assert again[torch.tensor([1])].tolist() == [[15.0, 1.0]] and again.computed == 2
    assert read_entry(path, key).tolist() == [[5.0, 1.0], [15.0, 1.0]]


def _task(train_idx, n_test: int = 3):
    n = sum(len(i) for i in train_idx) + 1
    return SimpleNamespace(
        num_clients=len(train_idx),
        train_idx=[torch.tensor(i) for i in train_idx],
        priors=torch.zeros(len(train_idx), 2),
        data=SimpleNamespace(
            train_images=torch.arange(n)[:, None],
            test_images=100 + torch.arange(n_test)[:, None],
            train_labels=torch.zeros(n, dtype=torch.long),
            test_labels=torch.zeros(n_test, dtype=torch.long),
        ),
    )


def test_inputs_find_each_split_once_with_its_owners_folder_and_key(monkeypatch):
    keys = []
    monkeypatch.setattr(inputs_mod, "frozen_key", lambda *a: keys.append(a) or f"key{len(keys)}")
    task = _task([[2, 3], [0, 2]])
    inp = Inputs(_backbone(), task, cache=FeatureCache(), batch_size=7, precision="bf16")
    fn = _Counted()
    train = inp.frozen("cls/q", fn, "train")
    assert inp.frozen("cls/q", fn, "train") is train and inp.frozen_splits() == [train]
    assert train.owner.tolist() == [1, -1, 0, 0, -1] and train.kind == "fake_bb_1--cls_q"
    assert (train.batch_size, train.precision, train.what) == (7, "bf16", "cls/q (train)")
    assert train.images is task.data.train_images
    test = inp.frozen("cls/q", fn, "test")
    assert test.owner.tolist() == [0, 0, 0] and test.images is task.data.test_images
    assert inp.frozen_splits() == [train, test]
    assert (train.key, test.key) == ("key1", "key2")
    assert keys[0] == (inp.backbone, task.data, "train", "cls/q", "bf16", 7, CPU)
    assert keys[1][2] == "test"
    nameless = Inputs(SimpleNamespace(preprocess=float), task, cache=FeatureCache(), batch_size=1)
    assert nameless.frozen("cls", fn, "test").kind == "backbone--cls"


def test_inputs_preprocess_augment_and_recall(monkeypatch):
    task = _task([[0, 1], [2]])
    inp = Inputs(_backbone(), task, cache=None, batch_size=2)
    assert inp.train(torch.tensor([2, 0])).tolist() == [[2.5], [0.5]]
    assert inp.test(torch.tensor([1])).tolist() == [[101.5]]
    got = []
    monkeypatch.setattr(inputs_mod, "augment", lambda *a: got.append(a) or "views")
    aug, draws = Augment(hflip=True), torch.zeros(1, 2)
    assert inp.train(torch.tensor([1]), augmentation=(aug, draws)) == "views"
    (args,) = got
    assert args[0].tolist() == [[1.5]] and args[1:] == (aug, draws, (0.1,), (0.2,))
    recalls = []
    monkeypatch.setattr(inputs_mod, "recalling", lambda r: recalls.append(r) or "ctx")
    idx, rows = torch.tensor([1]), torch.tensor([0])
    assert inp.recall(torch.ones(1, 1), "train", idx, rows, "states") == "ctx"
    (r,) = recalls
    assert r.frozen is None and r.states == "states" and r.idx is idx and r.rows is rows


def test_a_recall_with_a_cache_reads_the_splits_frozen_work(monkeypatch):
    monkeypatch.setattr(inputs_mod, "frozen_key", lambda *a: "key")
    task = _task([[0, 1], [2]])
    inp = Inputs(_backbone(), task, cache=FeatureCache(), batch_size=2)
    fn = _Counted()
    x = inp.test(torch.tensor([2]))
    with inp.recall(x, "test", torch.tensor([2])):
        rec = _CURRENT.get()
        assert rec.x is x
        assert rec.frozen("cls", fn).tolist() == [[1025.0, 1.0]]
    assert list(inp.splits) == [("cls", "test")]


def test_the_defaults_are_fp32_frozen_passes_256_at_a_time_without_a_cache():
    task = _task([[0]])
    bb = _backbone()
    inp = Inputs.of(SimpleNamespace(backbone=bb), task)
    assert (inp.backbone, inp.task, inp.cache) == (bb, task, None)
    assert (inp.batch_size, inp.precision) == (256, "fp32")
    assert Inputs(bb, task, cache=None, batch_size=3).precision == "fp32"
    assert _split([0, 0], _Counted()).precision == "fp32"


def test_test_map_runs_fn_over_the_test_split_in_batches_without_gradients():
    task = _task([[0]], n_test=5)
    inp = Inputs(_backbone(), task, cache=None, batch_size=2)
    sizes = []

    def fn(x):
        sizes.append((len(x), torch.is_grad_enabled()))
        return x * 2

    recalls = []
    real = inp.recall

    def recall(x, split, idx, *rest):
        recalls.append((x, split, idx.tolist()))
        return real(x, split, idx, *rest)

    inp.recall = recall
    assert inp.test_map(fn)[:, 0].tolist() == [201.0, 203.0, 205.0, 207.0, 209.0]
    assert sizes == [(2, False), (2, False), (1, False)]
    assert [(split, idx) for _, split, idx in recalls] == [
        ("test", [0, 1]), ("test", [2, 3]), ("test", [4]),
    ]  # fmt: skip
    assert [x[:, 0].tolist() for x, _, _ in recalls] == [[100.5, 101.5], [102.5, 103.5], [104.5]]
