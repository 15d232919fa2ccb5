"""Deterministic mode (`runtime.deterministic`): a cell's numbers follow from its config and seed.

Every launcher reaches `run_cell`, which trains inside `deterministic(cfg.runtime.deterministic)`.
On, it selects PyTorch's deterministic kernels and raises where an op has none (named in an
`FpbenchError`); the CUDA settings those kernels need come with it. What the mode fixes here:
the backward of per-sample gathers (`params[name][client_index]`, the seam every method uses) and
`index_put_(accumulate=True)` accumulate with atomic adds in parallel on CPU, in an order that
depends on thread scheduling; with the mode they accumulate in a fixed order. On CUDA it also
fixes `index_add_` / `scatter_add_`, cuBLAS's workspace split and cuDNN's algorithm choice.

CPU matrix kernels split their work by the number of threads, so the last bits of a product
depend on it: a cell computes with `runtime.threads`, which `fpbench run` sets in deterministic
mode to its own count for every launcher on this machine (`--jobs` workers and Ray tasks would
otherwise use fewer); see `fpbench.engine.dispatch.pin_threads`.

PyTorch's deterministic mode also fills every new tensor with NaN, a guard against kernels that
read memory they did not write; fpbench's kernels write what they allocate (the reproducibility
tests compare runs bit for bit), and the fill took 18% of a ViT-B/16 round on the CPU, so the
mode leaves it off.

The rest of the engine needs nothing: every seed is derived from the config (no clock, no
global RNG left unseeded), dicts iterate in insertion order, sets are only tested for
membership, and no DataLoader workers are used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

from fpbench.errors import FpbenchError
from fpbench.lazy import torch

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs to pick one reduction order (CUDA >= 10.2)
_NO_KERNEL = re.compile(r"^(\S+) does not have a deterministic implementation")


@contextmanager
def deterministic(on: bool, threads: int | None = None) -> Iterator[None]:
    """PyTorch's deterministic algorithms on (or off) for the block, computing with `threads`
    CPU threads where given; the old state comes back."""
    own_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    if on:
        # read by cuBLAS when it creates its handle, i.e. before CUDA's first matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(on, warn_only=False)
    fill = _fill_uninitialized(False)  # on: PyTorch would fill every new tensor with NaN
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False if on else before[3]
    try:
        yield
    except RuntimeError as e:
        if on and (op := nondeterministic_op(e)) is not None:
            raise FpbenchError(
                f"{op} has no deterministic implementation on this device; set "
                "runtime.deterministic = false (fpbench run --no-deterministic) to run it anyway"
            ) from e
        raise
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        _fill_uninitialized(fill)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]
        torch.set_num_threads(own_threads)


def _fill_uninitialized(on: bool | None) -> bool | None:
    """Set whether deterministic mode fills new tensors with NaN (torch >= 2.1); the old value."""
    flags = getattr(torch.utils, "deterministic", None)
    before = getattr(flags, "fill_uninitialized_memory", None)
    if before is not None and on is not None:
        flags.fill_uninitialized_memory = on
    return before


def nondeterministic_op(e: BaseException) -> str | None:
    """The op PyTorch names when deterministic mode meets a kernel without such a version."""
    match = _NO_KERNEL.match(str(e))
    return match.group(1) if match else None
