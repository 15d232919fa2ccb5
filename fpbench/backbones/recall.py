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
* evaluation level: within an evaluation, a function of tensors alone (CLIP's text features of
  prompt embeddings) keeps its last call, reused while its inputs are exactly equal
  (`last_call`); where one evaluation scores many clients' models on the same test samples,
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
    forwards: int = field(default=0)  # shared whole forwards seen so far in this batch


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
    return found.shared.site(found.sites, tokens.shape[0] // len(found.idx)), slots


def shared_forward(x: Tensor, key: tuple) -> tuple[_Site, Tensor] | None:
    """The next evaluation-level whole-forward site of the engine's batch, where x is that
    batch itself (so item i is the image of test sample idx[i]), and the slots (B,) of its
    items; `key` names what else the forward's values depend on besides its images and the
    values compared item by item. None where no such batch is being scored."""
    found = current(x)
    if found is None or found.shared is None or found.idx is None:
        return None
    slots = found.shared.slots(found.idx, x.shape[0])
    if slots is None or x.shape[0] != len(found.idx):
        return None
    found.forwards += 1
    return found.shared.site(("forward", found.forwards, *key), 1), slots


_CURRENT: ContextVar[Recall | None] = ContextVar("fpbench_recall", default=None)


class LastCalls:
    """One evaluation's last call of each keyed function of tensors: its output is reused
    while the function is called again on exactly equal inputs (compared, never assumed)."""

    def __init__(self) -> None:
        self.last: dict[object, tuple[tuple[Tensor, ...], Tensor]] = {}

    def get(self, key: object, inputs: tuple[Tensor, ...], fn: Callable[[], Tensor]) -> Tensor:
        """fn(), a value of `inputs` alone under `key`, or the last call's where they are equal."""
        held = self.last.get(key)
        if held is not None and all(map(_equal, held[0], inputs)):
            return held[1]
        out = fn()
        self.last[key] = (tuple(t.detach().clone() for t in inputs), out)
        return out


def autocast_key(x: Tensor) -> tuple:
    """The autocast state a computation on x runs under (its values depend on it)."""
    kind = x.device.type
    try:
        on = torch.is_autocast_enabled(kind)
        return (on, torch.get_autocast_dtype(kind) if on else None)
    except (AttributeError, TypeError):  # torch < 2.4: no per-device queries
        return (torch.is_autocast_cpu_enabled() if kind == "cpu" else torch.is_autocast_enabled(),)


def _equal(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


_EVALUATION: ContextVar[LastCalls | None] = ContextVar("fpbench_evaluation", default=None)


@contextmanager
def evaluating() -> Iterator[None]:
    """Within: an evaluation, whose backbones keep their last calls (`last_call`)."""
    token = _EVALUATION.set(LastCalls())
    try:
        yield
    finally:
        _EVALUATION.reset(token)


def last_call(key: object, inputs: tuple[Tensor, ...], fn: Callable[[], Tensor]) -> Tensor:
    """fn(), a value of `inputs` alone: within an evaluation and without gradients, the last
    call's under the same key where the inputs are exactly equal (every client's model of a
    shared prompt asks for the same text features batch after batch); else computed."""
    memo = _EVALUATION.get()
    if memo is None or torch.is_grad_enabled():
        return fn()
    return memo.get(key, inputs, fn)


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

    def site(self, key: object, repeats: int) -> _Site:
        """The call site `key`, whose batches take each sample `repeats` times in a row."""
        if (key, repeats) not in self.sites:
            self.sites[key, repeats] = _Site(self.size * repeats, self.slot.device)
        return self.sites[key, repeats]


class _Site:
    """The stored values of one call site: named tensors (size, ...) and which slots hold them."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.filled = torch.zeros(size, dtype=torch.bool, device=device)
        self.values: dict[str, Tensor] = {}
        self.uniform: dict[str, Tensor] = {}  # name -> the one row every stored row equals

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
            one = self.uniform.get(name)
            if one is not None and value.stride(0) == 0:  # one row against one row
                return torch.full_like(known, torch.equal(one, value[0]))
            at = _run(slots)
            if at is not None and torch.equal(stored[at], value):  # one pass, the usual case
                return torch.ones_like(known)
            return (stored[slots] == value).flatten(1).all(1)
        out = torch.zeros_like(known)
        if bool(known.any()):
            rows = known.nonzero().squeeze(1)
            out[rows] = (stored[slots[rows]] == value[rows]).flatten(1).all(1)
        return out

    def store(self, name: str, slots: Tensor, value: Tensor, items: Tensor | None = None) -> bool:
        """Keep value[items] (b, ...) at slots (b,) (items: a bool mask, None: all); False
        (nothing kept) for a value of another shape or dtype than the site's (then those slots
        must not be marked filled). A value of one row expanded (stride 0) is remembered as the
        row every stored row equals, while every store is such a row, and the same one."""
        stored = self.values.get(name)
        first = stored is None
        if first:
            stored = self.values[name] = value.new_empty(len(self.filled), *value.shape[1:])
        if stored.shape[1:] != value.shape[1:] or stored.dtype != value.dtype:
            return False
        one = value[0].detach() if len(value) and value.stride(0) == 0 else None
        if one is None or not (first or torch.equal(self.uniform.get(name, one), one)):
            self.uniform.pop(name, None)
        elif first:
            self.uniform[name] = one.clone()
        stored[slots] = (value if items is None else value[items]).detach()
        return True

    def get(self, name: str, slots: Tensor) -> Tensor:
        at = _run(slots)
        return self.values[name][slots if at is None else at]


def _run(slots: Tensor) -> slice | None:
    """slots as a slice where they are consecutive ascending slots (a view instead of a copy)."""
    first = int(slots[0]) if len(slots) else -1
    if first < 0 or int(slots[-1]) != first + len(slots) - 1:
        return None
    if len(slots) > 2 and not bool((slots.diff() == 1).all()):
        return None
    return slice(first, first + len(slots))
