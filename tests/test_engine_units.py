"""Small units of the engine's cost and frozen-cache code, each against hand-checked values:
where a cell's peak memory is read from, the frozen cache's folder names, its values' digest."""

from __future__ import annotations

import hashlib
import io
import struct
import sys
from types import SimpleNamespace

import pytest
import torch

from fpbench.engine import cost, frozen_cache


def test_peak_memory_starts_on_the_gpu_the_rss_mark_or_the_process_peak(monkeypatch) -> None:
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 7000)
    monkeypatch.setattr(cost, "_vmhwm", lambda: 4096)
    monkeypatch.setattr(cost, "maxrss", lambda: 999)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert cost.PeakMemory(cpu).read() is None  # not started: nothing measured
    peak = cost.PeakMemory(gpu)
    peak.start()
    assert (reset, peak.source, peak.read()) == ([gpu], "cuda", 7000)
    monkeypatch.setattr(cost, "_reset_hwm", lambda: True)
    peak = cost.PeakMemory(cpu)
    peak.start()
    assert (peak.source, peak.read()) == ("vmhwm", 4096)
    monkeypatch.setattr(cost, "_reset_hwm", lambda: False)  # no Linux mark: the process peak
    peak = cost.PeakMemory(cpu)
    peak.start()
    assert (peak.source, peak.read()) == ("maxrss", 999)
    assert reset == [gpu]


def test_maxrss_is_kib_on_linux_and_bytes_on_macos(monkeypatch) -> None:
    usage = SimpleNamespace(ru_maxrss=3000)
    monkeypatch.setattr(cost.resource, "getrusage", lambda who: usage)
    monkeypatch.setattr(sys, "platform", "linux")
    assert cost.maxrss() == 3000 * 1024
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cost.maxrss() == 3000


def _files(contents: dict[str, str | OSError]):
    """An `open` for cost's module that serves /proc files from `contents`."""

    def fake_open(path, mode="r"):
        found = contents[path]
        if isinstance(found, OSError):
            raise found
        return io.StringIO(found)

    return fake_open


def test_the_rss_mark_is_read_from_proc_in_bytes(monkeypatch) -> None:
    status = "Name:\tpython\nVmPeak:\t  9000 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1000 kB\n"
    monkeypatch.setattr(cost, "open", _files({"/proc/self/status": status}), raising=False)
    assert cost._vmhwm() == 2048 * 1024
    for broken in ("VmHWM:\n", "VmHWM: many kB\n", "VmRSS: 5 kB\n", OSError("no /proc")):
        monkeypatch.setattr(cost, "open", _files({"/proc/self/status": broken}), raising=False)
        assert cost._vmhwm() is None


def test_the_rss_mark_is_reset_only_where_it_can_be_read_after(monkeypatch) -> None:
    refs = io.StringIO()
    refs.close = lambda: None  # keep what was written readable
    files = {"/proc/self/clear_refs": refs, "/proc/self/status": "VmHWM: 1 kB\n"}

    def fake_open(path, mode="r"):
        return files[path] if path.endswith("clear_refs") else io.StringIO(files[path])

    monkeypatch.setattr(cost, "open", fake_open, raising=False)
    assert cost._reset_hwm() is True and refs.getvalue() == "5"
    files["/proc/self/status"] = "VmRSS: 1 kB\n"  # written, but the mark cannot be read
    assert cost._reset_hwm() is False
    monkeypatch.setattr(
        cost, "open", _files({"/proc/self/clear_refs": PermissionError()}), raising=False
    )  # noqa: E501
    assert cost._reset_hwm() is False


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("ViT-B/16 (open_clip)", "ViT-B_16__open_clip"),
        ("X-ray.", "X-ray"),
        ("..._frozen_.", "frozen"),
        ("a" * 100, "a" * 80),
        ("./_", "misc"),
    ],
)
def test_a_cache_folder_name_keeps_letters_digits_dots_underscores_and_dashes(text, name) -> None:
    assert frozen_cache.safe_name(text) == name


def test_the_values_digest_is_the_sha256_of_the_contiguous_bytes() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    want = hashlib.sha256(struct.pack("<4f", 1.0, 3.0, 2.0, 4.0)).hexdigest()
    assert frozen_cache.values_digest(values.t()) == want  # transposed: copied in its order
    assert frozen_cache.values_digest(torch.empty(0, 3)) == hashlib.sha256(b"").hexdigest()
    assert bytes(frozen_cache._bytes(torch.empty(0))) == b""
