"""Sizes and counts for people: bytes in binary units, FLOPs in decimal ones."""

from __future__ import annotations

import math


def human_bytes(n: float | None) -> str:
    """1536 -> '1.50 KiB'; None -> '-'."""
    if n is None or math.isnan(n):
        return "-"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.0f} B" if i == 0 else f"{n:,.2f} {units[i]}"


def human_flops(n: float | None) -> str:
    """2.5e12 -> '2.50 TFLOP'; None -> '-'."""
    if n is None or math.isnan(n):
        return "-"
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} FLOP"
