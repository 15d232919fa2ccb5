"""The engine's small modules on their own: checkpoints, seeds, precision, the numerics context
and the observer's result (each pinned where a mutation run found it loose, issue #31)."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import logging
import os
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from fpbench.backbones import frozen_linear
from fpbench.engine import checkpoint, cost, frozen_cache, numerics, precision
from fpbench.engine.frozen_cache import read_entry, write_entry
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.methods.base import ServerState


def _state() -> ServerState:
    return ServerState(
        params={"p": torch.tensor([1.0, 2.0])},
        personal={"q": torch.tensor([[3.0]])},
        buffers={"b": torch.tensor([4])},
    )


def test_checkpoint_names_and_binding() -> None:
    assert checkpoint.checkpoint_path(Path("a/b"), "key1") == Path("a/b/key1.pt")
    assert checkpoint.folder_for(Path("ck"), "db-id") == Path("ck/db-id")
    assert checkpoint.binding("db-id", 7) == "db-id:7"


def test_a_checkpoint_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "new" / "folders" / "k.pt"
    ckpt = checkpoint.Checkpoint("k", 3, _state(), [{"acc": 0.5}], 12.5)
    checkpoint.save(path, ckpt, bound_to="db:1")
    assert sorted(p.name for p in path.parent.iterdir()) == ["k.pt"]
    assert checkpoint.saved_round(path) == (3, "db:1")
    got = checkpoint.load(path, "k", torch.device("cpu"), bound_to="db:1")
    assert (got.run_key, got.round, got.history, got.elapsed_s) == ("k", 3, [{"acc": 0.5}], 12.5)
    for part, want in _state().state_dict().items():
        mine = got.server.state_dict()[part]
        assert mine.keys() == want.keys()
        assert all(torch.equal(mine[n], t) and mine[n].dtype == t.dtype for n, t in want.items())
    checkpoint.save(path, ckpt)  # unbound: only a load that asks for no binding takes it
    assert checkpoint.saved_round(path) == (3, None)
    assert checkpoint.load(path, "k", torch.device("cpu")).round == 3
    assert checkpoint.load(path, "k", torch.device("cpu"), bound_to="db:1") is None


def test_a_checkpoint_of_another_run_or_binding_or_unreadable_is_ignored(
    tmp_path: Path, caplog
) -> None:
    path = tmp_path / "k.pt"
    cpu = torch.device("cpu")
    assert checkpoint.load(path, "k", cpu) is None and checkpoint.saved_round(path) is None
    checkpoint.save(path, checkpoint.Checkpoint("k", 2, _state(), [], 1.0), bound_to="db:1")
    assert checkpoint.load(path, "other", cpu) is None
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        assert checkpoint.load(path, "k", cpu, bound_to="db:2") is None
    assert caplog.messages == [
        f"ignoring checkpoint {path}: it was written for db:1, not for this run (db:2); "
        "the run restarts"
    ]
    caplog.clear()
    path.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        assert checkpoint.load(path, "k", cpu) is None
    assert checkpoint.saved_round(path) is None
    assert caplog.messages == [
        f"ignoring unreadable checkpoint {path} (UnpicklingError); the run restarts"
    ]


def test_derive_seed_is_the_sha256_of_the_joined_parts_less_one_bit() -> None:
    digest = hashlib.sha256(b"7/client-sampling/3").digest()
    want = int.from_bytes(digest[:8], "little") >> 1
    assert derive_seed(7, "client-sampling", 3) == want < 2**63
    assert derive_seed(7, "client-sampling", 3) != derive_seed(7, "client-sampling", 4)


def test_client_batches_are_a_seeded_permutation_cut_into_batches() -> None:
    idx = torch.tensor([10, 11, 12, 13, 14])
    order = torch.randperm(5, generator=torch.Generator().manual_seed(3))
    batches = client_batches(idx, 2, seed=3)
    assert [b.tolist() for b in batches] == [
        idx[order[:2]].tolist(),
        idx[order[2:4]].tolist(),
        idx[order[4:]].tolist(),
    ]


def _autocast_cpu() -> tuple[bool, torch.dtype]:
    return frozen_linear._cpu_autocast(), torch.get_autocast_dtype("cpu")


def test_bf16_precisions_autocast_in_bf16_and_fp32_does_not() -> None:
    cpu = torch.device("cpu")
    for name in ("bf16", "bf16-frozen"):
        with precision.autocast(cpu, name):
            assert _autocast_cpu() == (True, torch.bfloat16)
    with precision.autocast(cpu, "fp32"):
        assert not frozen_linear._cpu_autocast()


def test_start_params_are_computed_outside_autocast_and_moved_to_the_device() -> None:
    seen = []

    class Method:
        def client_params(self, server, client_ids, training):
            seen.append((server, client_ids.tolist(), training, frozen_linear._cpu_autocast()))
            return {"p": torch.ones(2, dtype=torch.float64)}

    cpu = torch.device("cpu")
    with precision.autocast(cpu, "bf16"):
        out = precision.start_params(Method(), "server", torch.tensor([1, 2]), cpu)
        precision.start_params(Method(), "server", torch.tensor([0]), cpu, training=False)
    assert seen == [("server", [1, 2], True, False), ("server", [0], False, False)]
    assert list(out) == ["p"] and out["p"].device == cpu and out["p"].dtype == torch.float64


def test_cell_numerics_sets_the_mode_threads_and_linear_backend_and_restores_them() -> None:
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    other = "blas" if frozen_linear._backend == "onednn" else "onednn"
    backend = frozen_linear._backend
    cfg = SimpleNamespace(
        runtime=SimpleNamespace(deterministic=not before[0], threads=1, cpu_linear=other)
    )
    with numerics.cell_numerics(cfg):
        assert torch.are_deterministic_algorithms_enabled() is (not before[0])
        assert torch.get_num_threads() == 1 and frozen_linear._backend == other
    assert frozen_linear._backend == backend
    assert torch.are_deterministic_algorithms_enabled() is before[0]


def test_a_cell_result_has_no_error_unless_given_and_the_observer_ignores_calls() -> None:
    assert CellResult("cfg", "done").error is None
    assert CellResult("cfg", "failed", "boom").error == "boom"
    seen = Observer()
    assert seen.cell_start(None, 0) is None and seen.round_end(None, 0, {}) is None
    assert seen.stage(None, "x", 0, 1) is None and seen.cell_end(None) is None


def test_a_checkpoint_holding_more_than_tensors_and_plain_data_is_not_unpickled(
    tmp_path: Path,
) -> None:
    """Read with `weights_only`: a file holding any other Python object is unreadable."""
    path = tmp_path / "k.pt"
    checkpoint.save(path, checkpoint.Checkpoint("k", 1, _state(), [], 1.0))
    blob = torch.load(path, weights_only=True)
    torch.save({**blob, "when": dt.date(2020, 1, 1)}, path)  # a whole checkpoint, and a date
    assert checkpoint.saved_round(path) is None
    assert checkpoint.load(path, "k", torch.device("cpu")) is None


def test_bf16_means_bf16_on_cuda_too_not_autocast_s_fp16_default(monkeypatch) -> None:
    made = []
    monkeypatch.setattr(torch, "autocast", lambda device, **kw: made.append((device, kw)))
    precision.autocast(torch.device("cuda"), "bf16")
    assert made == [("cuda", {"dtype": torch.bfloat16})]


def test_a_frozen_cache_entry_holding_a_foreign_object_is_not_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "entry.pt"
    assert write_entry(path, "key", torch.arange(3.0))
    entry = torch.load(path, weights_only=True)
    assert torch.equal(read_entry(path, "key"), torch.arange(3.0))
    torch.save({**entry, "when": dt.date(2020, 1, 1)}, path)  # a whole entry, and a date
    assert read_entry(path, "key") is None


def test_onednn_s_linear_is_registered_as_a_matrix_product(monkeypatch) -> None:
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        pytest.skip("this torch has no oneDNN linear")
    formula = flop_registry[op]
    cost._register_onednn_linear()  # registered at import: a second call changes nothing
    assert flop_registry[op] is formula
    monkeypatch.delitem(flop_registry, op)
    cost._register_onednn_linear()
    # x (4, 3, 5) times W^T with W (7, 5): 12 rows x 7 outputs x 5 multiply-adds, 2 FLOPs each
    assert flop_registry[op]((4, 3, 5), (7, 5), None, "none", [], "") == 2 * 12 * 7 * 5


def test_counting_is_true_only_inside_count_flops() -> None:
    assert not cost.counting()
    with cost.count_flops():
        assert cost.counting()
    assert not cost.counting()


def test_maxrss_is_the_process_peak_in_bytes() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peak = cost.maxrss()
    assert before <= peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_failed_frozen_cache_write_warns_once_from_the_caller_and_never_raises(
    tmp_path: Path, monkeypatch
) -> None:
    def full(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    def stuck(self, missing_ok=False):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(Path, "unlink", stuck)  # the leftover cannot be removed either
    path = tmp_path / "sub" / "entry.pt"
    with pytest.warns(UserWarning) as caught:
        assert write_entry(path, "key", torch.arange(3.0)) is False
    assert [str(w.message) for w in caught] == [
        f"cannot keep frozen values in {str(path.parent)!r} (No space left on device); they stay "
        "in memory for this process only"
    ]
    # stacklevel 2: the line that asked to keep them; under mutmut its trampoline stands
    # between the caller and the function, so that frame is the caller's
    caller = "trampoline.py" if "MUTANT_UNDER_TEST" in os.environ else __file__
    assert caught[0].filename.endswith(caller)


def test_peak_memory_reads_the_source_its_start_chose(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(d) or 7000)
    monkeypatch.setattr(cost, "_vmhwm", lambda: 4096)
    monkeypatch.setattr(cost, "maxrss", lambda: 999)
    gpu = torch.device("cuda", 1)
    peaks = {}
    for source, device in (("cuda", gpu), ("vmhwm", None), ("maxrss", None), ("", None)):
        peak = cost.PeakMemory(device or torch.device("cpu"))
        peak.source = source
        peaks[source] = peak.read()
    assert peaks == {"cuda": 7000, "vmhwm": 4096, "maxrss": 999, "": None}
    assert asked == [gpu]
    monkeypatch.setattr(cost, "_vmhwm", lambda: None)  # the mark became unreadable
    peak = cost.PeakMemory(torch.device("cpu"))
    peak.source = "vmhwm"
    assert peak.read() == 999


def test_the_weights_digest_is_redone_when_a_tensor_is_replaced() -> None:
    """A new tensor in place of one, at the same version, is a new digest: the kept digest is
    keyed by the tensors' identities, not only their versions."""
    model = torch.nn.Linear(2, 1)
    first = frozen_cache.weights_digest(model)
    assert frozen_cache.weights_digest(model) == first
    bias = torch.nn.Parameter(model.bias.detach() + 1)
    with torch.no_grad():
        bias.mul_(1)  # version 1, as the bias that `reset_parameters` filled in place
    assert bias._version == model.bias._version
    model.bias = bias
    assert frozen_cache.weights_digest(model) != first


def test_the_weights_digest_is_kept_while_no_tensor_changes(monkeypatch) -> None:
    model = torch.nn.Linear(2, 1)
    first = frozen_cache.weights_digest(model)
    hashed = []
    monkeypatch.setattr(frozen_cache, "_bytes", lambda t: hashed.append(t) or memoryview(b""))
    assert frozen_cache.weights_digest(model) == first and hashed == []  # kept: nothing hashed
    with torch.no_grad():
        model.weight[0, 0] += 1  # in place: a new version
    frozen_cache.weights_digest(model)
    assert [t is p for t, p in zip(hashed, (model.weight, model.bias), strict=True)] == [True, True]


def test_the_numerics_of_a_frozen_pass_name_what_sets_its_bits(monkeypatch) -> None:
    monkeypatch.setattr(frozen_cache, "_cpu_name", lambda: "Some CPU")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(frozen_linear, "_backend", "blas")
    assert frozen_cache.numerics(torch.device("cpu"), "tf32") == {
        "precision": "fp32",
        "torch": torch.__version__,
        "deterministic": True,
        "device": "cpu:Some CPU",
        "threads": 3,
        "cpu_linear": "blas",
    }
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: asked.append(d) or "H100")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    gpu = torch.device("cuda", 0)
    assert frozen_cache.numerics(gpu, "tf32") == {
        "precision": "tf32",
        "torch": torch.__version__,
        "deterministic": True,
        "device": "cuda:H100",
        "cuda": "12.8",
    }
    assert asked == [gpu]


class _Backbone(torch.nn.Module):
    """A backbone as `frozen_key` reads it: a name, an input size, a normalisation, weights."""

    def __init__(self, **attrs) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        self.mean, self.std = (0.5, 0.25, 0.125), (2, 3, 4)
        for k, v in attrs.items():
            setattr(self, k, v)


def test_preprocessing_is_the_backbones_type_size_and_normalisation_as_floats() -> None:
    got = frozen_cache.preprocessing(_Backbone(img_size=32.0))
    assert got == {"type": "_Backbone", "size": 32, "mean": [0.5, 0.25, 0.125], "std": [2, 3, 4]}
    assert type(got["size"]) is int and all(type(v) is float for v in got["std"])
    assert frozen_cache.preprocessing(_Backbone())["size"] == 0  # no input size: 0


def test_the_frozen_key_is_canonical_json_of_everything_it_names(monkeypatch) -> None:
    asked = []
    monkeypatch.setattr(
        frozen_cache, "numerics", lambda device, p: asked.append((device, p)) or {"n": p}
    )
    data = SimpleNamespace(name="synthetic", fingerprint=lambda: "fp")
    backbone = _Backbone(name="vit-x", img_size=8)
    digest = frozen_cache.weights_digest(backbone)
    cpu = torch.device("cpu")
    key = frozen_cache.frozen_key(backbone, data, "test", "cls", "bf16", 16, cpu)
    assert key == (
        '{"backbone":"vit-x","batch_size":16,"data":{"digest":"fp","name":"synthetic",'
        '"split":"test"},"feature":"cls","format":1,"numerics":{"n":"bf16"},"preprocess":'
        '{"mean":[0.5,0.25,0.125],"size":8,"std":[2.0,3.0,4.0],"type":"_Backbone"},'
        f'"weights":"{digest}"}}'
    )
    assert asked == [(cpu, "bf16")]
    unnamed = frozen_cache.frozen_key(_Backbone(), data, "test", "cls", "bf16", 16, cpu)
    assert '"backbone":"_Backbone"' in unnamed  # no name: the class's


def test_the_cpu_name_is_cpuinfos_first_model_name_or_the_platforms(monkeypatch) -> None:
    text = "processor\t: 0\nvendor_id\t: X\nmodel name\t: Fancy CPU: 9000 \nmodel name\t: B\n"
    opened = []

    def fake_open(path, *args, **kwargs):
        opened.append(path)
        return io.StringIO(text)

    monkeypatch.setattr(frozen_cache, "open", fake_open, raising=False)
    assert frozen_cache._cpu_name() == "Fancy CPU: 9000" and opened == ["/proc/cpuinfo"]
    monkeypatch.setattr(frozen_cache.platform, "processor", lambda: "proc")
    monkeypatch.setattr(frozen_cache.platform, "machine", lambda: "mach")
    text = "processor\t: 0\n"  # no model name
    assert frozen_cache._cpu_name() == "proc"
    monkeypatch.setattr(frozen_cache.platform, "processor", lambda: "")
    assert frozen_cache._cpu_name() == "mach"

    def missing(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(frozen_cache, "open", missing, raising=False)
    assert frozen_cache._cpu_name() == "mach"
