"""A method's batches, and the store that computes frozen work lazily, once.

A forward takes preprocessed images: uint8 images stay on the device and are resized and
normalised there per batch. Work on them that depends on nothing trained (an unprompted
backbone's features, a Select query's cls) is found by the backbone itself
(`fpbench.backbones.recall`): while the engine's batch runs, it reads such values from a
`FeatureCache`, where each is computed once per sample and kept, in memory and on disk (by
default in fpbench's cache folder, `runtime.feature_cache_dir`), so training a head on frozen
features skips the backbone entirely. Every cell, seed and method of a suite, and the next
suite, reads what an earlier one computed.

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

A training phase whose lower blocks see nothing it trains keeps the hidden states entering its
first trained block in a `fpbench.backbones.recall.PhaseStates`, filled on first use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from fpbench.backbones import PromptedViT
from fpbench.backbones.recall import PhaseStates, Recall, SharedStates, recalling
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
from fpbench.methods.base import Context, Method, ServerState
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
    """A population's batches: preprocessed images, and the recall (`fpbench.backbones.recall`)
    through which its backbone reads frozen work from the run's store instead of redoing it."""

    def __init__(
        self,
        backbone: PromptedViT,
        task: Task,
        *,
        cache: FeatureCache | None,
        batch_size: int,
        precision: FrozenPrecision = "fp32",
    ) -> None:
        self.backbone, self.task, self.cache = backbone, task, cache
        self.batch_size, self.precision = batch_size, precision
        self.splits: dict[tuple[str, str], FrozenSplit] = {}  # (kind, split): found so far
        data = task.data
        self._images = {"train": data.train_images, "test": data.test_images}
        self._owners: dict[str, Tensor] = {}

    @classmethod
    def of(
        cls,
        method: Method,
        task: Task,
        cache: FeatureCache | None = None,
        batch_size: int = 256,
        precision: FrozenPrecision = "fp32",
    ) -> Inputs:
        """The batches of `method`'s backbone.

        With a cache, the frozen work its backbone does is computed once per sample, when first
        needed (in batches of `batch_size`, in `precision`); without one, every batch computes
        it anew.
        """
        return cls(method.backbone, task, cache=cache, batch_size=batch_size, precision=precision)

    def frozen_splits(self) -> list[FrozenSplit]:
        """The frozen splits found so far."""
        return list(self.splits.values())

    @torch.no_grad()
    def discover(self, method: Method, server: ServerState) -> list[FrozenSplit]:
        """The frozen splits (train and test) of the work `method`'s evaluation forward reads,
        found by running it on one train sample without storing anything (for estimates and
        benchmarks that time frozen passes apart from training)."""
        row = next(c for c in range(self.task.num_clients) if len(self.task.train_idx[c]))
        idx = self.task.train_idx[row][:1]
        x, seen = self.train(idx), []

        def note(kind: str, fn: Callable[[Tensor], Tensor]) -> Tensor:
            seen.append((kind, fn))
            return fn(x)

        ids = torch.tensor([row])
        params = method.client_params(server, ids, training=False)
        ctx = Context(False, priors=self.task.priors[ids.to(self.task.priors.device)],
                      buffers=server.buffers)  # fmt: skip
        with recalling(Recall(x, note, None, idx)):
            method.forward(params, x, torch.zeros_like(idx), ctx)
        if self.cache is None:
            return []
        return [self.frozen(kind, fn, split) for kind, fn in seen for split in ("train", "test")]

    def frozen(self, kind: str, fn: Callable[[Tensor], Tensor], split: str) -> FrozenSplit:
        """The store of frozen work `kind` (fn of preprocessed images) on `split`."""
        found = self.splits.get((kind, split))
        if found is not None:
            return found
        assert self.cache is not None
        data, backbone, task = self.task.data, self.backbone, self.task
        device = task.priors.device
        folder = f"{safe_name(getattr(backbone, 'name', 'backbone'))}--{safe_name(kind)}"
        if split not in self._owners:
            self._owners[split] = (
                owners(len(data.train_labels), task.train_idx)
                if split == "train"
                else torch.zeros(len(data.test_labels), dtype=torch.long, device=device)
            )
        precision, batch_size = self.precision, self.batch_size
        found = self.splits[kind, split] = FrozenSplit(
            f"{kind} ({split})", fn, backbone, self._images[split], self._owners[split],
            cache=self.cache, kind=folder, batch_size=batch_size, precision=precision,
            key=lambda: frozen_key(backbone, data, split, kind, precision, batch_size, device),
        )  # fmt: skip
        return found

    def recall(
        self,
        x: Tensor,
        split: str,
        idx: Tensor,
        rows: Tensor | None = None,
        states: PhaseStates | None = None,
        shared: SharedStates | None = None,
    ) -> AbstractContextManager[None]:
        """While a forward runs on x (the preprocessed images of split[idx], not augmented),
        its backbone recalls frozen work (and, given `states`, the phase's hidden states;
        given `shared`, the states that the clients scored on these samples share)."""
        frozen = None
        if self.cache is not None:
            frozen = lambda kind, fn: self.frozen(kind, fn, split)[idx]  # noqa: E731
        return recalling(Recall(x, frozen, states, idx, rows, shared=shared))

    def train(self, idx: Tensor, augmentation: tuple[Augment, Tensor] | None = None) -> Tensor:
        """Preprocessed train images idx (B,); `augmentation` (config, draws (B, n)) gives
        each sample its random view."""
        bb = self.backbone
        x = bb.preprocess(self.task.data.train_images[idx])
        if augmentation is None:
            return x
        cfg, draws = augmentation
        return augment(x, cfg, draws, bb.mean, bb.std)

    def test(self, idx: Tensor | slice) -> Tensor:
        return self.backbone.preprocess(self.task.data.test_images[idx])

    def test_map(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """fn over the whole test split's preprocessed images, `batch_size` at a time, without
        gradients: (M, ...); the frozen work fn does is recalled as in evaluation."""
        data = self.task.data
        idx = torch.arange(len(data.test_labels), device=data.test_labels.device)
        out = []
        with torch.no_grad():
            for part in idx.split(self.batch_size):
                x = self.test(part)
                with self.recall(x, "test", part):
                    out.append(fn(x))
        return torch.cat(out)
