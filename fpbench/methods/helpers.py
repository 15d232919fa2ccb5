"""Small building blocks that methods share: initialisers, per-client heads, the weighted
mean, batched frozen queries. None of them is part of the interface (`fpbench.methods.base`), which
imports this module, never the other way round."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from fpbench.backbones.recall import last_call
from fpbench.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones import PromptedViT


def weighted_mean(stacked: Tensor, w: Tensor) -> Tensor:
    """sum_k w_k * stacked[k] for stacked (K, ...) and weights (K,)."""
    return torch.tensordot(w, stacked.detach(), dims=1)


def batched_queries(
    query: Callable[[Tensor], Tensor],
    backbone: PromptedViT,
    images: Tensor,
    idx: Tensor,
    batch: int = 256,
) -> Tensor:
    """A frozen query (n, dq) of the uint8 images[idx], `batch` at a time, in float32."""
    with torch.no_grad():
        parts = [
            query(backbone.preprocess(images[idx[i : i + batch]])).float()
            for i in range(0, len(idx), batch)
        ]
    return torch.cat(parts)


def init_linear(gen: torch.Generator, out_dim: int, in_dim: int) -> tuple[Tensor, Tensor]:
    """PyTorch's default nn.Linear init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias."""
    bound = 1.0 / math.sqrt(in_dim)
    w = (torch.rand(out_dim, in_dim, generator=gen) * 2 - 1) * bound
    b = (torch.rand(out_dim, generator=gen) * 2 - 1) * bound
    return w, b


def init_prompts(gen: torch.Generator, length: int, dim: int, patch_size: int) -> Tensor:
    """VPT's uniform init: U(-v, v), v = sqrt(6 / (3 * patch^2 + d))."""
    v = math.sqrt(6.0 / (3 * patch_size**2 + dim))
    return (torch.rand(length, dim, generator=gen) * 2 - 1) * v


def rows_of(t: Tensor, client_index: Tensor) -> Tensor:
    """Each sample's row of a per-client tensor t (K, ...): t[client_index] (B, ...). Without
    gradients, where every sample is one client's, that row expanded instead (the same values
    in one row of memory, compared once where an evaluation shares work across clients)."""
    if not torch.is_grad_enabled() and len(client_index) > 1:
        first = client_index[:1]
        if bool((client_index == first).all()):
            return t[first].expand(len(client_index), *t.shape[1:])
    return t[client_index]


def per_client_linear(feats: Tensor, w: Tensor, b: Tensor, client_index: Tensor) -> Tensor:
    """Apply each sample's client head: feats (B, d), w (K, C, d), b (K, C) -> (B, C).

    All K heads are applied densely and each sample keeps its own row: for the few clients of
    a round this is one matmul, much cheaper (forward and backward) than gathering a (B, C, d)
    copy of the weights.
    """
    if w.shape[0] == 1:
        return feats @ w[0].T + b[0]
    k, c, d = w.shape

    def dense() -> Tensor:
        return (feats @ w.reshape(k * c, d).T).view(-1, k, c) + b  # (B, K, C)

    # within an evaluation, a chunk's clients scoring the same features reuse the product
    logits = last_call("per_client_linear", (feats, w, b), dense)
    return logits[torch.arange(len(feats), device=feats.device), client_index]
