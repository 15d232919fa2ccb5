"""Seeds and batches: every random draw of a run follows from its seed and a path of names.

`derive_seed(seed, round, client, phase, epoch)` gives each client's shuffles and augmentation
their own generator, so that training clients one at a time or together draws the same.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple of parts (stable across processes and platforms)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def client_batches(indices: Tensor, batch_size: int, seed: int) -> list[Tensor]:
    """One epoch of shuffled minibatches of a client's train indices (last one may be short)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(indices), generator=gen).to(indices.device)
    return list(indices[order].split(batch_size))
