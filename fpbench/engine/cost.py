"""What a run costs, measured as it runs: its peak memory and the FLOPs of a round.

Peak memory: on CUDA, the most memory PyTorch's allocator held for tensors while the cell ran
(`torch.cuda.max_memory_allocated`, reset when the cell starts); on the CPU, the process's peak
resident set: Linux's high-water mark (`VmHWM`), reset when the cell starts by writing 5 to
`/proc/self/clear_refs`, or where that cannot be done, `resource.getrusage`'s `ru_maxrss`, the
peak of the whole process so far (earlier cells of the same process included). Both count
every page the process holds (Python, PyTorch and the data included), not only tensors.

FLOPs: the matrix products, convolutions and attention of the first round a run plays (forward
and backward, training and, where that round evaluates, its evaluation), by the formulas of
`torch.utils.flop_counter` (2 per multiply-add; elementwise work is not counted), summed by a
dispatch mode lighter than its `FlopCounterMode` (the same totals; no module tracking, no
decomposition of other operations, about half the overhead on small operations). Frozen
passes inside the round are left out (`uncounted`): they are computed once per sample and
suite, and read from the cache after. oneDNN's linear kernel, which frozen layers use on the
CPU (`fpbench.backbones.frozen_linear`), gets the formula of a matrix product here.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula

_active: list[_Counter] = []  # the counts `count_flops` has open, innermost last


def _register_onednn_linear() -> None:
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or op in flop_registry:
        return

    @register_flop_formula(op)
    def _linear(x_shape: Any, w_shape: Any, *args: Any, **kwargs: Any) -> int:
        return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


_register_onednn_linear()


class _Counter(TorchDispatchMode):
    """Adds each operation's FLOPs by PyTorch's formulas (`flop_registry`) as it runs; unlike
    `FlopCounterMode` it tracks no modules and decomposes nothing (it runs what would run)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.paused = 0  # > 0 inside `uncounted`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused and (formula := flop_registry.get(func.overloadpacket)) is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class FlopCount:
    """The FLOPs counted inside `count_flops` (`total` once the block has ended)."""

    total: int = 0


@contextmanager
def count_flops() -> Iterator[FlopCount]:
    """Count the FLOPs of the block (see the module docstring)."""
    result, counter = FlopCount(), _Counter()
    with counter:
        _active.append(counter)
        try:
            yield result
        finally:
            _active.pop()
    result.total = counter.total


def counting() -> bool:
    """Whether FLOPs are being counted now (a fast path that hides its kernels from PyTorch's
    dispatcher, e.g. a CUDA graph replay or a compiled region, should run plainly while this is
    true, or its FLOPs go uncounted)."""
    return bool(_active)


@contextmanager
def uncounted() -> Iterator[None]:
    """Leave the block's FLOPs out of the open count (a frozen pass done once per suite)."""
    if not _active:
        yield
        return
    counter = _active[-1]
    counter.paused += 1
    try:
        yield
    finally:
        counter.paused -= 1


class PeakMemory:
    """The peak memory of `device` from `start` on (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = ""  # how `read` measures: cuda, vmhwm or maxrss

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.source = "cuda"
        elif _reset_hwm():
            self.source = "vmhwm"
        else:
            self.source = "maxrss"

    def read(self) -> int | None:
        """Peak bytes since `start`; None where it cannot be read."""
        if self.source == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.source == "vmhwm" and (hwm := _vmhwm()) is not None:
            return hwm
        if self.source:
            return maxrss()
        return None


def maxrss() -> int:
    """The process's peak resident set so far, bytes (`ru_maxrss`: KiB on Linux, bytes on
    macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _reset_hwm() -> bool:
    """Reset Linux's peak-RSS mark of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _vmhwm() is not None


def _vmhwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
