"""Frozen work once per suite: frozen values kept on disk in fpbench's cache folder, keyed by what
determines them, verified on every read, and the same bits whether the cache was cold or warm."""

from __future__ import annotations

import copy
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fpbench.cache import FROZEN, cache_dir, frozen_dir
from fpbench.cli import app
from fpbench.engine.frozen_cache import entry_path, frozen_key, read_entry, write_entry
from fpbench.engine.inputs import FeatureCache, FrozenSplit, Inputs
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from tests.conftest import tiny_config

CPU = torch.device("cpu")


@pytest.fixture
def forwards(monkeypatch) -> Counter:
    """Samples computed by frozen passes, per split."""
    seen: Counter = Counter()
    compute = FrozenSplit._compute

    def counting(self, unit, done, total):
        seen[self.what] += len(unit)
        return compute(self, unit, done, total)

    monkeypatch.setattr(FrozenSplit, "_compute", counting)
    return seen


def _stored(db: Path) -> tuple[list, list]:
    """Every metric row and round row of a results file, without wall times."""
    with sqlite3.connect(db) as con:
        metrics = con.execute(
            "SELECT round, client_id, name, value, count FROM metrics "
            "ORDER BY round, client_id, name"
        ).fetchall()
        rounds = con.execute(
            "SELECT round, loss_train, bytes_up, bytes_down FROM rounds ORDER BY round"
        ).fetchall()
    return metrics, rounds


@pytest.mark.parametrize("method", ["sgpt", "head-tune"])
def test_a_warm_cache_stores_the_same_bits_without_computing(tmp_path, forwards, method) -> None:
    cfg = tiny_config(method, rounds=2)
    results = []
    for name in ("cold", "warm"):
        before = sum(forwards.values())
        db = tmp_path / f"{name}.db"
        store = Store(f"sqlite:///{db}")
        assert run_cell(cfg, store, checkpoint_dir=tmp_path / name).status == "done"
        results.append((_stored(db), sum(forwards.values()) - before))
        store.close()
    (cold, computed), (warm, again) = results
    assert computed > 0 and again == 0  # the warm run read every frozen value from disk
    assert cold == warm  # metrics (every client's too) and losses, bit for bit
    entries = list((cache_dir() / FROZEN).glob("*/*.pt"))
    assert entries and all(p.parent.name.startswith("vit-test--") for p in entries)


def test_the_default_folder_is_in_fpbench_s_cache_and_the_setting_moves_it(tmp_path) -> None:
    assert cache_dir() != Path.home() / ".cache" / "fpbench"  # tests have their own (conftest)
    assert frozen_dir() == cache_dir() / "frozen"
    assert frozen_dir(str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"


def test_feature_cache_dir_and_memory_only(tmp_path, forwards) -> None:
    elsewhere = tmp_path / "elsewhere"
    cfg = tiny_config("sgpt", rounds=1)
    moved = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"feature_cache_dir": str(elsewhere)})}
    )
    store = Store(f"sqlite:///{tmp_path}/a.db")
    assert run_cell(moved, store, checkpoint_dir=tmp_path).status == "done"
    assert list(elsewhere.glob("*/*.pt")) and not (cache_dir() / FROZEN).exists()
    memory = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"cache_features": "memory"})}
    )
    before = sum(forwards.values())
    run_cell(memory, Store(f"sqlite:///{tmp_path}/b.db"), checkpoint_dir=tmp_path)
    assert sum(forwards.values()) > before  # not read from `elsewhere`
    assert not (cache_dir() / FROZEN).exists()  # nor written anywhere


def _values(n: int = 5) -> torch.Tensor:
    return torch.arange(n * 3, dtype=torch.float32).view(n, 3) / 7


def test_an_entry_of_another_key_is_recomputed_and_replaced(tmp_path) -> None:
    cache = FeatureCache(tmp_path)
    cache.unit("key-a", _values, CPU, "k")
    path_a, path_b = entry_path(tmp_path, "key-a", "k"), entry_path(tmp_path, "key-b", "k")
    path_b.write_bytes(path_a.read_bytes())  # b's file holds a's entry (e.g. copied over)
    calls = []

    def compute_b() -> torch.Tensor:
        calls.append(1)
        return _values() + 1

    got = FeatureCache(tmp_path).unit("key-b", compute_b, CPU, "k")
    assert calls == [1] and torch.equal(got, _values() + 1)
    assert torch.equal(read_entry(path_b, "key-b"), _values() + 1)  # replaced by b's own
    assert read_entry(path_b, "key-a") is None


def test_an_entry_with_the_wrong_row_count_is_recomputed(tmp_path) -> None:
    FeatureCache(tmp_path).unit("key", _values, CPU, "k", rows=5)
    got = FeatureCache(tmp_path).unit("key", lambda: _values(4), CPU, "k", rows=4)
    assert got.shape == (4, 3)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty"])
def test_a_damaged_entry_is_recomputed(tmp_path, damage) -> None:
    FeatureCache(tmp_path).unit("key", _values, CPU, "k")
    path = entry_path(tmp_path, "key", "k")
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":  # one byte of the values: the file still loads
        at = data.index(_values().numpy().tobytes()) + 13
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
        assert torch.load(path, weights_only=True)["key"] == "key"
    elif damage == "garbage":
        path.write_bytes(b"not a torch file")
    else:
        path.write_bytes(b"")
    assert read_entry(path, "key") is None
    calls = []

    def compute() -> torch.Tensor:
        calls.append(1)
        return _values()

    assert torch.equal(FeatureCache(tmp_path).unit("key", compute, CPU, "k"), _values())
    assert calls == [1] and torch.equal(read_entry(path, "key"), _values())  # rewritten


@pytest.mark.parametrize(
    "error",
    [OSError(28, "No space left on device"), RuntimeError("file write failed: No space left")],
)
def test_writes_are_atomic_and_a_failed_write_only_warns(tmp_path, monkeypatch, error) -> None:
    path = entry_path(tmp_path, "key", "k")
    assert write_entry(path, "key", _values())
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left

    def fail(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half an entry")  # what a full disk leaves
        raise error

    monkeypatch.setattr(torch, "save", fail)
    other = entry_path(tmp_path, "other", "k")
    with pytest.warns(UserWarning, match="No space left"):
        assert not write_entry(other, "other", _values())
    assert not other.exists() and [p.name for p in path.parent.iterdir()] == [path.name]
    assert torch.equal(FeatureCache(tmp_path).unit("key", _values, CPU, "k"), _values())


def _key(backbone, data, **kw) -> str:
    args = dict(split="train", feature="query-x", precision="fp32", batch_size=16, device=CPU)
    args.update(kw)
    return frozen_key(backbone, data, **args)


def test_the_key_covers_everything_that_sets_the_values(tiny) -> None:
    cfg, task, method = tiny("sgpt")
    backbone, data = method.backbone, task.data
    base = _key(backbone, data)
    assert _key(backbone, data) == base
    changed = {
        "split": _key(backbone, data, split="test"),
        "feature": _key(backbone, data, feature="query-y"),
        "precision": _key(backbone, data, precision="bf16"),
        "batch": _key(backbone, data, batch_size=8),
    }
    assert len({base, *changed.values()}) == 5
    # tf32 exists only on CUDA: on the CPU it computes, and is keyed, as fp32
    assert _key(backbone, data, precision="tf32") == base
    # the last pixel of the last test image: the data digest covers all of it
    other = data.moved(CPU)
    other.test_images = other.test_images.clone()
    other.test_images[-1, -1, -1, -1] ^= 1
    assert other.fingerprint() != data.fingerprint() and _key(backbone, other) != base
    # preprocessing, then one weight of the last block
    mean = backbone.mean
    backbone.mean = (0.0, 0.0, 0.0)
    assert _key(backbone, data) != base
    backbone.mean = mean
    fresh = copy.deepcopy(backbone)
    assert _key(fresh, data) == base  # the same weights in another module
    with torch.no_grad():
        list(fresh.vit.blocks[-1].parameters())[-1][0] += 1  # noticed: the digest is redone
    assert _key(fresh, data) != base


def test_the_key_covers_the_machine_s_numerics(tiny) -> None:
    from fpbench.backbones.frozen_linear import cpu_linear
    from fpbench.determinism import deterministic

    _, task, method = tiny("sgpt")
    with deterministic(True, threads=1), cpu_linear("onednn"):
        base = _key(method.backbone, task.data)
        assert '"threads":1' in base and '"cpu_linear":"onednn"' in base
        with cpu_linear("blas"):
            assert _key(method.backbone, task.data) != base
    with deterministic(True, threads=2), cpu_linear("onednn"):
        assert _key(method.backbone, task.data) != base
    with deterministic(False, threads=1), cpu_linear("onednn"):
        assert _key(method.backbone, task.data) != base


def test_bf16_frozen_passes_are_kept_apart_from_fp32(tiny, tmp_path) -> None:
    cfg, task, method = tiny("sgpt")
    idx = task.train_idx[task.trainable_clients()[0]]
    cache = FeatureCache(tmp_path)
    layer, vit = method.query_layer, method.backbone
    kind, fn = f"block{layer}-cls", lambda v: vit.block_cls(v, layer)  # Select's cls
    fp32 = Inputs.of(method, task, cache, 16, "fp32").frozen(kind, fn, "train")[idx]
    bf16 = Inputs.of(method, task, cache, 16, "bf16").frozen(kind, fn, "train")[idx]
    tf32 = Inputs.of(method, task, cache, 16, "tf32").frozen(kind, fn, "train")[idx]
    with torch.no_grad():
        plain = fn(vit.preprocess(task.data.train_images[idx]))
    assert torch.equal(fp32, tf32)  # the same entry on the CPU
    torch.testing.assert_close(fp32, plain)
    assert not torch.equal(bf16, fp32)
    torch.testing.assert_close(bf16, fp32, atol=0.1, rtol=0.05)  # bf16's 8 mantissa bits
    assert len(list(tmp_path.glob("*/*.pt"))) == 2


def _populate(root: Path) -> None:
    entry = entry_path(root / FROZEN, "key", "vit-test--query-x")
    write_entry(entry, "key", _values())
    (root / "vit-smoke-0123456789.pth").write_bytes(b"w" * 100)
    (root / "open_clip_configs").mkdir()
    (root / "open_clip_configs" / "clip-tiny.json").write_text("{}")
    (root / "notes.txt").write_text("mine")
    (root / FROZEN / "vit-test--query-x" / "keep.me").write_text("mine too")
    deep = root / "project" / "frozen" / "kind"  # fpbench's names, but not where it writes
    deep.mkdir(parents=True)
    (deep / "0123456789abcdef0123456789abcdef.pt").write_text("x")
    (root / "project" / "vit-smoke-0123456789.pth").write_text("y")


def test_cache_info_shows_sizes_per_kind_and_clear_removes_only_fpbench_s(tmp_path) -> None:
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    _unlink_linked_weights(root)
    _populate(root)
    entry_size = next((root / FROZEN).glob("*/*.pt")).stat().st_size
    result = CliRunner().invoke(app, ["cache", "info"])
    assert result.exit_code == 0, result.output
    assert f"cache folder: {root}" in result.output
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "│     1 │" in lines["frozen vit-test--query-x"]
    assert f"{entry_size / 1024:.2f} KiB" in lines["frozen vit-test--query-x"]  # 1-2 KiB
    assert "100 B" in lines["backbone weights"] and "2 B" in lines["open_clip configs"]
    assert "│     4 │" in lines["not fpbench's (kept)"]
    result = CliRunner().invoke(app, ["cache", "clear", "--frozen-only"])
    assert result.exit_code == 0 and "removed 1 frozen values" in result.output
    assert (root / "vit-smoke-0123456789.pth").exists()
    result = CliRunner().invoke(app, ["cache", "clear"])
    assert result.exit_code == 0 and "removed 2 files (102 B)" in result.output
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == [
        "frozen/vit-test--query-x/keep.me",
        "notes.txt",
        "project/frozen/kind/0123456789abcdef0123456789abcdef.pt",
        "project/vit-smoke-0123456789.pth",
    ]
    assert not (root / "open_clip_configs").exists()  # emptied folders go too


def _unlink_linked_weights(root: Path) -> None:
    """Leave out the real vit-smoke weights the `fpbench_cache` fixture links in (present only
    where they were made before) and the seeded CLIP weights tests/conftest.py links in, so the
    counts are those of what the test writes."""
    for linked in [*root.glob("vit-smoke-*.pth"), *root.glob("clip-test*.pth")]:
        if linked.is_symlink():
            linked.unlink()


def test_cache_clear_of_another_frozen_folder(tmp_path) -> None:
    _unlink_linked_weights(cache_dir())
    elsewhere = tmp_path / "features"
    write_entry(entry_path(elsewhere, "key", "kind"), "key", _values())
    result = CliRunner().invoke(app, ["cache", "info", "--frozen-dir", str(elsewhere)])
    assert result.exit_code == 0 and "frozen kind" in result.output
    result = CliRunner().invoke(app, ["cache", "clear", "--frozen-dir", str(elsewhere)])
    assert "removed 1 files" in result.output
    assert elsewhere.is_dir() and not list(elsewhere.iterdir())  # the folder itself stays


def test_a_run_with_bf16_frozen_passes_says_so_and_keys_them(tmp_path) -> None:
    cfg = tiny_config("sgpt", rounds=1)
    cfg = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"frozen_precision": "bf16"})}
    )
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    assert store.find_run(cfg.run_key).device.endswith(" (fp32, frozen bf16)")
    entries = list((cache_dir() / FROZEN).glob("*/*.pt"))
    keys = [torch.load(p, weights_only=True)["key"] for p in entries]
    assert keys and all('"precision":"bf16"' in k for k in keys)


def test_fpbench_run_sets_the_frozen_precision(tmp_path) -> None:
    from tests.conftest import TINY_SUITE_TOML

    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE_TOML)
    db = str(tmp_path / "r.db")
    args = ["run", "--suite", str(suite), "--db", db, "--method", "head-tune"]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    bad = CliRunner().invoke(app, [*args, "--frozen-precision", "fp8"])
    assert bad.exit_code == 2 and "--frozen-precision must be fp32, tf32 or bf16" in bad.output
    result = CliRunner().invoke(app, [*args, "--frozen-precision", "bf16"])
    assert result.exit_code == 0, result.output
    with Store(f"sqlite:///{db}") as store:
        assert store.get_run(1).device.endswith("(fp32, frozen bf16)")
