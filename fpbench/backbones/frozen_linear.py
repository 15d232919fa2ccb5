"""The frozen backbones' linear layers through oneDNN on the CPU (`runtime.cpu_linear`).

PyTorch computes an fp32 `nn.Linear` on the CPU with MKL, which takes a slower code path on
CPUs that are not Intel's: on a 2-core AMD EPYC Zen 5 (full-width AVX-512), a ViT-B/16
MLP-sized product ran at about 190 GFLOP/s with MKL and 350-460 with oneDNN (`torch.ops.mkldnn`),
and a ViT-B/16 forward of 16 images took 1.4 s instead of 2.9 s; on a Zen 4 (AVX-512 in two
halves) oneDNN gains only about 10% (155-190 against 175-210 GFLOP/s). A frozen backbone's
linear layers (weights that never train) therefore compute their forward and their input
gradient with oneDNN on the CPU; the products equal MKL's up to float rounding, and are as
reproducible (one result for one thread count). Everywhere else (CUDA, autocast, a weight that
trains, a build without oneDNN, `cpu_linear = "blas"`) the layer is a plain `nn.Linear`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CpuLinear = Literal["onednn", "blas"]
_backend: CpuLinear = "onednn"
_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


@contextmanager
def cpu_linear(backend: CpuLinear) -> Iterator[None]:
    """Compute the frozen CPU linear layers with `backend` inside the block."""
    global _backend
    before, _backend = _backend, backend
    try:
        yield
    finally:
        _backend = before


def _cpu_autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with frozen W and b; backward gives the input gradient only, itself
    differentiable (its backward is the same product with W^T)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, weight_t: Tensor) -> Tensor:
        ctx.save_for_backward(weight_t)
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (weight_t,) = ctx.saved_tensors
        if torch.is_grad_enabled() and grad.requires_grad:  # double backward (FedMix)
            return _OneDNNLinear.apply(grad, weight_t, None, weight_t.t()), None, None, None
        return _onednn(grad, weight_t, None), None, None, None


class FrozenLinear(nn.Linear):
    """An `nn.Linear` whose frozen fp32 weights compute through oneDNN on the CPU."""

    _weight_t: tuple[tuple[int, int], Tensor] | None = None  # (data_ptr, version) -> W^T

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if not (
            _backend == "onednn"
            and _HAS_ONEDNN
            and x.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and not w.requires_grad
            and (self.bias is None or not self.bias.requires_grad)
            and not _cpu_autocast()
        ):
            return F.linear(x, w, self.bias)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return _onednn(x, w, self.bias)
        return _OneDNNLinear.apply(x, w, self.bias, self._transposed())

    def _transposed(self) -> Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._weight_t is None or self._weight_t[0] != key:
            self._weight_t = (key, self.weight.detach().t().contiguous())
        return self._weight_t[1]


def freeze_linears(model: nn.Module) -> nn.Module:
    """Make every plain `nn.Linear` of a frozen model a `FrozenLinear` (same parameters)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FrozenLinear
    return model
