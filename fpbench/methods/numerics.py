"""Full precision for the small computations that make discrete choices or mixing weights.

Under bf16 autocast (the CUDA default) a matmul runs in bf16 even on fp32 inputs, so a cosine
similarity that picks a group or key, or a softmax over prototype similarities that mixes
prompts, would be computed with about 3 significant digits: near ties flip and weights shift.
`fp32` runs such a function with autocast off and its floating-point tensor arguments in fp32;
gradients flow through the casts as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fpbench.lazy import torch

if TYPE_CHECKING:
    pass


F = TypeVar("F", bound=Callable[..., Any])


def _full(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def fp32(fn: F) -> F:
    """Decorator: run `fn` in fp32 with autocast disabled on its tensors' device type."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device = tensors[0].device.type if tensors else "cpu"
        with torch.autocast(device_type=device, enabled=False):
            return fn(*map(_full, args), **{k: _full(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]
