"""Keyed selection shared by the prompt-pool methods (SGPT, FGPT, Fed-DualPrompt).

Each sample's frozen query is compared with a set of keys by cosine similarity; the nearest
key(s) pick the prompts it is trained and evaluated with, and the counts of those picks weigh
what the server aggregates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.lazy import F, torch
from fpbench.methods.numerics import fp32

if TYPE_CHECKING:
    from torch import Tensor


@fp32
def key_cosines(query: Tensor, keys: Tensor, client_index: Tensor) -> Tensor:
    """cos(query_b, key g of sample b's row) (B, G) for query (B, d) and keys (K, G, d)."""
    unit = F.normalize(keys, dim=-1)[client_index]  # (B, G, d)
    return (unit * query.unsqueeze(1)).sum(-1)


@fp32
def select_groups(query: Tensor, keys: Tensor, k: int = 1) -> Tensor:
    """Indices (B, k) of the k keys with the highest cosine similarity to each query (B, dq)."""
    sims = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T  # (B, G)
    return sims.topk(k, dim=-1).indices


@fp32
def nearest_group(queries: Tensor, keys: Tensor) -> Tensor:
    """Test-time selection (n,): each query (n, dq) takes its nearest key of keys (G, dq)."""
    unit = F.normalize(keys.detach().float().to(queries.device), dim=-1)  # (G, dq)
    return (queries @ unit.T).argmax(1)


def group_counts(groups: Tensor, client_index: Tensor, k: int, g: int) -> Tensor:
    """How often each row picked each group (K, G), as int64."""
    counts = torch.zeros(k, g, dtype=torch.long, device=groups.device)
    return counts.index_put_((client_index, groups), torch.ones_like(groups), accumulate=True)
