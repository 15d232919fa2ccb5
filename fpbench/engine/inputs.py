"""What a method's forward receives as `x`, and the cache that computes frozen work lazily, once.

Most methods take preprocessed images: uint8 images stay on the device and are resized and
normalised there per batch. A method's `frozen` work (`fpbench.methods.base.Frozen`) is either
its input instead of the images (`as_input`, e.g. head-tune's final cls features) or a
per-sample query handed over in `ctx.query` (e.g. SGPT's Select). It depends on nothing
trained, so with a `FeatureCache` it is computed once per sample and kept, in memory and on
disk (by default in fpbench's cache folder, `runtime.feature_cache_dir`), and training a head on
cached features skips the backbone entirely. Every cell, seed and method of a suite, and the
next suite, reads what an earlier one computed.

Lazily: a sample's frozen features are computed the first time a batch needs them, so a run pays
only for the clients it trains and, once it first evaluates, the test split. The unit of work is
canonical, so the values never depend on which client, round, cell or process asked first (a
resumed run and every executor get the same bits): a train sample is computed with its owner
client's samples (the lowest-id client holding it), in index order, `batch_size` at a time; the
test split as a whole. Units are keyed, in memory and on disk, by everything that determines
their values (`fpbench.engine.frozen_cache.frozen_key`: backbone and weights digest, data
digest and split, preprocessing, the feature read, the frozen pass's precision
`runtime.frozen_precision`, the numerics of the machine) and their indices and batch size; an
entry on disk whose stored key or digest does not match is recomputed, never used.

A training phase whose lower blocks see nothing it trains (`Phase.resume_layer`) gets the hidden
states entering its first trained block from a `HiddenCache`, filled on first use and kept for
the phase.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from fpbench.backbones import PromptedViT
from fpbench.engine.augment import augment
from fpbench.engine.cost import uncounted
from fpbench.engine.frozen_cache import (
    FrozenPrecision,
    entry_path,
    frozen_key,
    frozen_precision,
    read_entry,
    safe_name,
    write_entry,
)
from fpbench.engine.task import Task
from fpbench.methods.base import Frozen, Method
from fpbench.methods.helpers import batched_queries
from fpbench.specs import Augment
from fpbench.stages import report


class SplitStore:
    """One split's frozen features (n, d), filled unit by unit; `tag` says which unit filled
    each sample (0: none), so a sample is reused only where its canonical unit computed it."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.values: Tensor | None = None  # (n, d) fp32, allocated on the first unit
        self.tag = torch.zeros(n, dtype=torch.long, device=device)

    def put(self, idx: Tensor, feats: Tensor, tag: int) -> None:
        if self.values is None:
            self.values = feats.new_zeros(len(self.tag), *feats.shape[1:])
        self.values[idx] = feats.to(self.values.device)
        self.tag[idx] = tag


class FeatureCache:
    """Frozen features, in memory (per split, shared by the cells of a process) and, with a
    folder, on disk (one entry per unit, see `fpbench.engine.frozen_cache`)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._memory: dict[str, Tensor] = {}
        self._stores: dict[str, SplitStore] = {}

    def on(self, folder: Path | None) -> FeatureCache:
        """This cache's memory with another disk folder (None: memory only)."""
        if folder == self.folder:
            return self
        other = FeatureCache(folder)
        other._memory, other._stores = self._memory, self._stores
        return other

    def get(
        self, key: str, compute: Callable[[], Tensor], device: torch.device, kind: str = "misc"
    ) -> Tensor:
        """`compute()` once for `key` (then from memory, or from disk in another process)."""
        if key not in self._memory:
            self._memory[key] = self.unit(key, compute, device, kind)
        return self._memory[key]

    def store(self, key: str, n: int, device: torch.device) -> SplitStore:
        """The in-memory store of split `key` with n samples."""
        found = self._stores.get(key)
        if found is None or len(found.tag) != n:
            found = self._stores[key] = SplitStore(n, device)
        return found

    def unit(
        self,
        key: str,
        compute: Callable[[], Tensor],
        device: torch.device,
        kind: str = "misc",
        rows: int | None = None,
    ) -> Tensor:
        """One unit's features: from disk where an entry for exactly `key` (with `rows` rows)
        is kept there, else computed (and kept, replacing a stale or damaged entry)."""
        path = entry_path(self.folder, key, kind) if self.folder else None
        if path is not None:
            found = read_entry(path, key)
            if found is not None and (rows is None or len(found) == rows):
                return found.to(device)
        feats = compute()
        if path is not None:
            write_entry(path, key, feats)
        return feats


def owners(n: int, members: list[Tensor]) -> Tensor:
    """(n,) the lowest index k with i in members[k], -1 where none (on members' device)."""
    device = members[0].device if members else torch.device("cpu")
    owner = torch.full((n,), -1, dtype=torch.long, device=device)
    for k in range(len(members) - 1, -1, -1):
        owner[members[k]] = k
    return owner


def _unit_digest(idx: Tensor, batch_size: int) -> str:
    """A unit's identity: its sorted indices and the batch size (SHA-256, hex)."""
    h = hashlib.sha256(str(batch_size).encode())
    h.update(idx.cpu().numpy().tobytes())
    return h.hexdigest()


def _tag(digest: str) -> int:
    """A nonzero 63-bit tag of a unit from its digest."""
    return int(digest[:16], 16) >> 1 or 1


class FrozenSplit:
    """`fn`'s frozen features of one split's images, computed unit by unit on demand."""

    def __init__(
        self,
        what: str,
        fn: Callable[[Tensor], Tensor],
        backbone: PromptedViT,
        images: Tensor,
        owner: Tensor,
        *,
        cache: FeatureCache,
        key: Callable[[], str],
        kind: str,
        batch_size: int,
        precision: FrozenPrecision = "fp32",
    ) -> None:
        """`key()` gives the split's key (`frozen_key`), asked when the first unit is needed;
        `kind` names its entries' folder on disk; `precision`: of the frozen pass."""
        self.what, self.fn, self.backbone, self.images = what, fn, backbone, images
        self.cache, self._key, self.kind, self.batch_size = cache, key, kind, batch_size
        self.precision = precision
        self.owner = owner  # (n,) each sample's unit, -1: none
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner + 1, minlength=int(owner.max()) + 2).tolist()
        self.units = list(order.split(counts))[1:]  # unit u: its samples, in index order
        self.ready = torch.zeros(len(owner), dtype=torch.bool, device=owner.device)
        self.computed = 0  # samples this split computed (not read from memory or disk)

    @cached_property
    def key(self) -> str:
        return self._key()

    @cached_property
    def store(self) -> SplitStore:
        return self.cache.store(self.key, len(self.owner), self.owner.device)

    def __getitem__(self, idx: Tensor | slice) -> Tensor:
        """Features (B, d) of samples idx, computing the units they need first."""
        if isinstance(idx, slice):
            idx = torch.arange(len(self.owner), device=self.owner.device)[idx]
        if not bool(self.ready[idx].all()):
            self._fill(idx[~self.ready[idx]])
        assert self.store.values is not None
        return self.store.values[idx]

    def _fill(self, missing: Tensor) -> None:
        need = [self.units[u] for u in self.owner[missing].unique().tolist() if u >= 0]
        orphans = missing[self.owner[missing] < 0].unique()  # in no unit: computed as asked
        need += [orphans] if len(orphans) else []
        digests = [_unit_digest(unit, self.batch_size) for unit in need]
        todo = [(u, d) for u, d in zip(need, digests, strict=True) if not self._has(u, _tag(d))]
        total, done = sum(len(u) for u, _ in todo), [0]
        if total:
            report(f"frozen {self.what}", 0, total)
        for unit, digest in todo:
            key = f"{self.key}|unit={digest}"
            compute = lambda u=unit: self._compute(u, done, total)  # noqa: E731
            feats = self.cache.unit(key, compute, self.owner.device, self.kind, rows=len(unit))
            self.store.put(unit, feats, _tag(digest))
        if done[0] < total:  # some units came from disk
            report(f"frozen {self.what}", total, total)
        for unit in need:
            self.ready[unit] = True

    def _has(self, unit: Tensor, tag: int) -> bool:
        return self.store.values is not None and bool((self.store.tag[unit] == tag).all())

    @torch.no_grad()
    def _compute(self, unit: Tensor, done: list[int], total: int) -> Tensor:
        """fn over the images of unit (n,), `batch_size` at a time, in the frozen precision
        whatever the run's (the kept values serve every run), stored as fp32: (n, d). Its
        FLOPs are not counted in a round's (`fpbench.engine.cost`): it is work done once."""
        out = []
        for part in unit.split(self.batch_size):
            with uncounted(), frozen_precision(self.precision, unit.device):
                out.append(self.fn(self.backbone.preprocess(self.images[part])).float())
            done[0] += len(part)
            self.computed += len(part)
            report(f"frozen {self.what}", done[0], total)
        return torch.cat(out)


class Inputs:
    """Builds `x` for a batch of train or test indices, and `ctx.query`, as `Method.frozen`
    declares."""

    def __init__(
        self,
        backbone: PromptedViT,
        task: Task,
        frozen: Frozen | None,
        *,
        cache: FeatureCache | None,
        batch_size: int,
        precision: FrozenPrecision = "fp32",
    ) -> None:
        self.backbone, self.task, self.frozen = backbone, task, frozen
        self.takes_features = frozen is not None and frozen.as_input  # x: features, not images
        self.batch_size, self.precision = batch_size, precision
        self._test_queries: Tensor | None = None  # without a cache: computed once, kept
        self.cached: dict[str, FrozenSplit] = {}  # the forward's x, when `takes_features`
        self.queries: dict[str, FrozenSplit] = {}  # ctx.query otherwise
        if cache is None or frozen is None:
            return  # nothing frozen to keep
        data = task.data
        kind = frozen.name if frozen.as_input else f"query-{frozen.name}"
        folder = f"{safe_name(getattr(backbone, 'name', 'backbone'))}--{safe_name(kind)}"
        device = task.priors.device

        def key(split: str) -> Callable[[], str]:
            return lambda: frozen_key(backbone, data, split, kind, precision, batch_size, device)

        split_owners = {
            "train": owners(len(data.train_labels), task.train_idx),
            "test": torch.zeros(len(data.test_labels), dtype=torch.long, device=task.priors.device),
        }
        images = {"train": data.train_images, "test": data.test_images}
        splits = {
            split: FrozenSplit(
                f"{kind} ({split})", frozen.fn, backbone, images[split], split_owners[split],
                cache=cache, key=key(split), kind=folder, batch_size=batch_size,
                precision=precision,
            )
            for split in ("train", "test")
        }  # fmt: skip
        if frozen.as_input:
            self.cached = splits
        else:
            self.queries = splits

    @classmethod
    def of(
        cls,
        method: Method,
        task: Task,
        cache: FeatureCache | None = None,
        batch_size: int = 256,
        precision: FrozenPrecision = "fp32",
    ) -> Inputs:
        """The inputs `method` asks for (its `frozen` work).

        With a cache, frozen features and queries are computed once per sample, when first
        needed (in batches of `batch_size`, in `precision`); without one, every batch computes
        them anew.
        """
        return cls(
            method.backbone, task, method.frozen(), cache=cache, batch_size=batch_size,
            precision=precision,
        )  # fmt: skip

    def frozen_splits(self) -> list[FrozenSplit]:
        return [*self.queries.values(), *self.cached.values()]

    def query(self, split: str, idx: Tensor) -> Tensor | None:
        """Cached frozen queries of these samples, or None when not cached."""
        cached = self.queries.get(split)
        return None if cached is None else cached[idx]

    def test_queries(self) -> Tensor:
        """Frozen queries (M, dq) of the whole test split: from the cache (computed there once,
        as for evaluation), or without one computed once here, `batch_size` at a time."""
        data = self.task.data
        idx = torch.arange(len(data.test_labels), device=data.test_labels.device)
        cached = self.query("test", idx)
        if cached is not None:
            return cached
        if self.frozen is None or self.frozen.as_input:
            raise RuntimeError("the method declares no frozen query; its test split has none")
        if self._test_queries is None:
            device = data.test_images.device
            with uncounted(), frozen_precision(self.precision, device):
                self._test_queries = batched_queries(
                    self.frozen.fn, self.backbone, data.test_images, idx, self.batch_size
                )
        return self._test_queries

    def train(self, idx: Tensor, augmentation: tuple[Augment, Tensor] | None = None) -> Tensor:
        """`x` of train samples idx (B,); `augmentation` (config, draws (B, 2)) gives each
        sample its random view, computed from the images (never from cached features)."""
        if augmentation is None:
            return self._get("train", self.task.data.train_images, idx)
        cfg, draws = augmentation
        bb = self.backbone
        x = augment(bb.preprocess(self.task.data.train_images[idx]), cfg, draws, bb.mean, bb.std)
        return self._features(x)

    def test(self, idx: Tensor | slice) -> Tensor:
        return self._get("test", self.task.data.test_images, idx)

    def _get(self, split: str, images: Tensor, idx: Tensor | slice) -> Tensor:
        if split in self.cached:
            return self.cached[split][idx]
        return self._features(self.backbone.preprocess(images[idx]))

    def _features(self, x: Tensor) -> Tensor:
        """The forward's `x` of preprocessed images: themselves, or the frozen features."""
        if not self.takes_features:
            return x
        assert self.frozen is not None
        with torch.no_grad():
            return self.frozen.fn(x)


class HiddenCache:
    """Hidden states of each (row, train sample) of one training phase, computed on first use.

    They depend on the row's parameters that the phase keeps fixed, so they live only as long
    as the phase: a row's sample is run through the lower blocks once, not once per epoch.
    """

    def __init__(self, rows: list[Tensor], num_train: int) -> None:
        """rows: each row's train indices (n_r,) into the train split of size `num_train`."""
        device = rows[0].device
        self.slot = torch.full((len(rows), num_train), -1, dtype=torch.long, device=device)
        start = 0
        for r, idx in enumerate(rows):
            self.slot[r, idx] = torch.arange(start, start + len(idx), device=device)
            start += len(idx)
        self.filled = torch.zeros(start, dtype=torch.bool, device=device)
        self.states: Tensor | None = None  # (total, T, d), allocated on first use

    def get(self, idx: Tensor, rows: Tensor, compute: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """States (B, T, d) of samples idx (B,) of rows (B,); `compute(idx, rows)` gives the
        missing ones."""
        slots = self.slot[rows, idx]  # (B,)
        missing = ~self.filled[slots]
        if bool(missing.any()):
            with torch.no_grad():
                new = compute(idx[missing], rows[missing]).detach()  # (b, T, d)
            if self.states is None:
                self.states = new.new_empty(len(self.filled), *new.shape[1:])
            self.states[slots[missing]] = new
            self.filled[slots[missing]] = True
        return self.states[slots]
