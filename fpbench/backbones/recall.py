"""Recall: frozen work found, not declared.

A method writes its forward on images and calls its backbone directly. The engine tells the
backbone wrappers, per batch, what that batch is (`Recall`: the very tensor it hands the
forward, the samples' split and indices, their rows, and, in a training phase without
augmentation, the phase's `PhaseStates`), and the wrappers keep what lies before the first
tensor that the current phase trains:

* run level: a value computed from the images alone (an unprompted forward's cls features,
  an unprompted block's cls, CLIP's image features without a pixel prompt) is read through
  `recalled`, which asks the engine's frozen store (`fpbench.engine.inputs`: computed once per
  sample in canonical units, kept in memory and on disk) instead of computing it;
* phase level: in a prompted forward, the hidden states entering the first block whose prompt
  requires grad depend only on the images and on lower prompts that this phase does not train,
  so `PhaseStates` keeps them per (row, sample) for the phase, with the lower prompts that gave
  them: a slot is reused only where the prompts handed in now are exactly those;
* evaluation level: where one evaluation scores many clients' models on the same test samples,
  `SharedStates` keeps, per sample and call site, the first model's hidden states entering and
  leaving each block (and the prompts it inserted); another client's item reuses them while its
  own values are exactly equal (compared, never assumed), so whatever every client shares (the
  whole backbone under personal heads, the blocks below client-conditioned prompts, a mixture's
  shared components) is computed once per test sample, not once per client.

Outside such a batch (no engine, another tensor than the engine's, e.g. an augmented or mixed
one, or inside the frozen store's own computation) everything is computed as asked, so the values
are the same either way (the conformance suite checks it, bit for bit, for every method).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fpbench.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor

    Frozen = Callable[[str, Callable[[Tensor], Tensor]], Tensor]  # (kind, fn) -> the batch's values


@dataclass
class Recall:
    """What the engine says about the batch it is about to hand a forward."""

    x: Tensor  # the preprocessed images (B, 3, S, S) handed to the forward: recalled only for it
    frozen: Frozen | None = None  # run level: the batch's values of frozen work `kind`
    states: PhaseStates | None = None  # phase level (training, no augmentation)
    idx: Tensor | None = None  # (B,) the samples' indices into their split
    rows: Tensor | None = None  # (B,) each sample's row (its client in this pass)
    calls: int = field(default=0)  # prompted forwards seen so far in this batch
    shared: SharedStates | None = None  # evaluation level (scoring many clients' models)
    sites: int = field(default=0)  # shared call sites seen so far in this batch


def shared_site(tokens: Tensor) -> tuple[_Site, Tensor] | None:
    """The next evaluation-level call site of the engine's batch and the slots (B,) of the
    items of tokens (B, ...) in it, or None where no such batch is being scored. tokens need
    not be the engine's tensor: every reuse is checked by value (`_Site.same`)."""
    found = _CURRENT.get()
    if found is None or found.shared is None or found.idx is None:
        return None
    slots = found.shared.slots(found.idx, tokens.shape[0])
    if slots is None:
        return None
    found.sites += 1
    return found.shared.site((found.sites, tokens.shape[0] // len(found.idx))), slots


_CURRENT: ContextVar[Recall | None] = ContextVar("fpbench_recall", default=None)


@contextmanager
def recalling(recall: Recall | None) -> Iterator[None]:
    """Make `recall` the batch the backbones see (None: none) for the duration."""
    token = _CURRENT.set(recall)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current(x: Tensor) -> Recall | None:
    """The engine's recall for x, or None where x is not the engine's batch."""
    found = _CURRENT.get()
    return found if found is not None and found.x is x else None


def recalled(kind: str, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x), a value of the images alone named `kind` (its cache key: change the name whenever
    the value would), read from the engine's frozen store where x is the engine's batch."""
    found = current(x)
    if found is None or found.frozen is None:
        return fn(x)
    with recalling(None):  # the store computes its units from its own tensors
        return found.frozen(kind, fn)


class PhaseStates:
    """Hidden states of one training phase per (row, train sample) and call site, filled on
    first use and kept while the phase lasts, each with the lower prompts that produced it."""

    def __init__(self, rows: list[Tensor], num_train: int) -> None:
        """rows: each row's train indices (n_r,) into the train split of size `num_train`."""
        device = rows[0].device
        self.slot = torch.full((len(rows), num_train), -1, dtype=torch.long, device=device)
        start = 0
        for r, idx in enumerate(rows):
            self.slot[r, idx] = torch.arange(start, start + len(idx), device=device)
            start += len(idx)
        self.size = start
        self.caches: dict[tuple, _Slots] = {}

    def get(
        self,
        key: tuple,
        idx: Tensor,
        rows: Tensor,
        guard: Tensor,
        compute: Callable[[Tensor], Tensor],
    ) -> Tensor:
        """States (B, T, d) of samples idx (B,) of rows (B,) at call site `key`; `guard` (B, g):
        the lower prompts, flattened; `compute(mask)` gives the states of the samples in mask."""
        slots = self.slot[rows, idx]  # (B,)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = _Slots(self.size, slots.device)
        return cache.get(slots, guard, compute)


class _Slots:
    def __init__(self, size: int, device: torch.device) -> None:
        self.filled = torch.zeros(size, dtype=torch.bool, device=device)
        self.states: Tensor | None = None  # (size, T, d), allocated on first use
        self.guard: Tensor | None = None  # (size, g)

    def get(self, slots: Tensor, guard: Tensor, compute: Callable[[Tensor], Tensor]) -> Tensor:
        missing = ~self.filled[slots]
        if self.guard is not None and self.guard.shape[1:] == guard.shape[1:]:
            missing |= ~(self.guard[slots] == guard).all(1)
        elif self.guard is not None:
            missing[:] = True
        if bool(missing.any()):
            with torch.no_grad():
                new = compute(missing).detach()  # (b, T, d)
            if self.states is None or self.states.shape[1:] != new.shape[1:]:
                self.states = new.new_empty(len(self.filled), *new.shape[1:])
                self.filled.zero_()
            if self.guard is None or self.guard.shape[1:] != guard.shape[1:]:
                self.guard = guard.new_empty(len(self.filled), *guard.shape[1:])
            self.states[slots[missing]] = new
            self.guard[slots[missing]] = guard[missing].detach()
            self.filled[slots[missing]] = True
        return self.states[slots]


def flat_prompts(prompts: Mapping[int, Tensor], batch: int, device: torch.device) -> Tensor:
    """The prompts of the given blocks, in block order, one row per sample (B, g)."""
    parts = [
        prompts[layer].detach().expand(batch, -1, -1).reshape(batch, -1).float()
        for layer in sorted(prompts)
    ]
    return torch.cat(parts, dim=1) if parts else torch.zeros(batch, 0, device=device)


class SharedStates:
    """One evaluation's values per test sample of a block of samples, shared by the clients'
    models that compute exactly the same ones (module doc, evaluation level)."""

    def __init__(self, idx: Tensor, num_test: int) -> None:
        """idx: the block's test indices (S,) into the test split of size `num_test`."""
        self.slot = torch.full((num_test,), -1, dtype=torch.long, device=idx.device)
        self.slot[idx] = torch.arange(len(idx), device=idx.device)
        self.size = len(idx)
        self.sites: dict[tuple, _Site] = {}

    def slots(self, idx: Tensor, batch: int) -> Tensor | None:
        """Slots (batch,) of a batch of the samples idx (B,), each sample taken batch / B times
        in a row (a mixture's learners); -1 outside the block; None where batch is no multiple."""
        if batch % max(len(idx), 1) or not len(idx):
            return None
        q = batch // len(idx)
        base = self.slot[idx]  # (B,)
        if q == 1:
            return base
        sub = torch.arange(q, device=base.device).repeat(len(idx))
        out = base.repeat_interleave(q) * q + sub
        return torch.where(base.repeat_interleave(q) >= 0, out, -1)

    def site(self, key: tuple) -> _Site:
        if key not in self.sites:
            self.sites[key] = _Site(self.size * key[1], self.slot.device)
        return self.sites[key]


class _Site:
    """The stored values of one call site: named tensors (size, ...) and which slots hold them."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.filled = torch.zeros(size, dtype=torch.bool, device=device)
        self.values: dict[str, Tensor] = {}

    def begin(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(fill, known): the items (B,) bool whose values this call stores (the first item of
        each slot not stored yet) and those whose slot holds values to compare against."""
        valid = slots >= 0
        known = valid & self.filled[slots.clamp_min(0)]
        fill = valid & ~known
        if bool(fill.any()):
            pos = torch.arange(len(slots), device=slots.device)
            first = torch.full_like(self.filled, len(slots), dtype=torch.long)
            first.scatter_reduce_(0, slots[fill], pos[fill], "amin")
            fill &= first[slots.clamp_min(0)] == pos
        return fill, known

    def same(self, name: str, slots: Tensor, value: Tensor, known: Tensor) -> Tensor:
        """(B,) bool: the known items whose `value` rows equal the stored ones exactly."""
        stored = self.values.get(name)
        if stored is None or stored.shape[1:] != value.shape[1:] or stored.dtype != value.dtype:
            return torch.zeros_like(known)
        if bool(known.all()):
            return (stored[slots] == value).flatten(1).all(1)
        out = torch.zeros_like(known)
        if bool(known.any()):
            rows = known.nonzero().squeeze(1)
            out[rows] = (stored[slots[rows]] == value[rows]).flatten(1).all(1)
        return out

    def store(self, name: str, slots: Tensor, value: Tensor) -> bool:
        """Keep value (b, ...) at slots (b,); False (nothing kept) for a value of another shape
        or dtype than the site's (then those slots must not be marked filled)."""
        stored = self.values.get(name)
        if stored is None:
            stored = self.values[name] = value.new_empty(len(self.filled), *value.shape[1:])
        if stored.shape[1:] != value.shape[1:] or stored.dtype != value.dtype:
            return False
        stored[slots] = value.detach()
        return True

    def get(self, name: str, slots: Tensor) -> Tensor:
        return self.values[name][slots]

    def map(self, x: Tensor, slots: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """fn(x) for the items (B, ...) of x, reusing the stored value where x is equal."""
        fill, known = self.begin(slots)
        hit = self.same("in", slots, x, known)
        live = (~hit).nonzero().squeeze(1)
        new = fn(x[live]) if len(live) else None
        if new is None:
            return self.get("out", slots)
        out = new.new_empty(len(x), *new.shape[1:])
        out[live] = new
        if bool(hit.any()):
            out[hit] = self.get("out", slots[hit])
        if bool(fill.any()):
            kept = self.store("in", slots[fill], x[fill])
            kept = self.store("out", slots[fill], out[fill]) and kept
            self.filled[slots[fill]] = kept
        return out
