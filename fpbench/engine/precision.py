"""Precision: where bf16 autocast applies, and the fp32 start of what a client trains."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from fpbench.methods.base import Method, ServerState

# a method's `draw(n)` at evaluation: (x, y, client_index) of n train samples of each client
Draw = Callable[[int], tuple[Tensor, Tensor, Tensor]]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast where asked for (CUDA); parameters and optimiser stay fp32."""
    if precision in ("bf16", "bf16-frozen"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def start_params(
    method: Method,
    server: ServerState,
    client_ids: Tensor,
    device: torch.device,
    training: bool = True,
    draws: Callable[[contextlib.ExitStack], Draw] | None = None,
) -> dict[str, Tensor]:
    """`method.client_params` on `device`, computed outside autocast: it is server work (a
    generated or mixed start prompt), and what a client trains must start in fp32.

    `draws` (evaluation) makes the clients' `draw` (see `Method.client_params`) from a stack
    that holds what each draw enters (gradients, autocast, recall) until client_params
    returns; None: no `draw` is passed."""
    with torch.autocast(device.type, enabled=False), contextlib.ExitStack() as held:
        if draws is None:
            start = method.client_params(server, client_ids, training=training)
        else:
            start = method.client_params(server, client_ids, training=training, draw=draws(held))
    return {n: p.to(device) for n, p in start.items()}
