"""Greedy packing of consecutive items into chunks under a size limit."""

from __future__ import annotations

from collections.abc import Sequence


def consecutive_chunks(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices 0..n-1 cut into consecutive chunks, each adding items while their sizes sum to at
    most `limit` (an item larger than `limit` is a chunk of its own)."""
    chunks: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if chunks and used + size <= limit:
            chunks[-1].append(i)
            used += size
        else:
            chunks.append([i])
            used = size
    return chunks
