"""What a method's forward receives as `x`, and the cache that computes frozen work once.

Most methods take preprocessed images: uint8 images stay on the device and are resized and
normalised there per batch. A method that declares `frozen_input = "cls"` (e.g. head-tune) takes
the frozen backbone's final cls features instead; those do not depend on anything trained, so
they are computed once per (backbone, dataset, split), kept in memory and optionally on disk,
and training a head on them skips the backbone entirely. A training phase whose lower blocks
see nothing it trains (`Phase.resume_layer`) gets the hidden states entering its first trained
block from a `HiddenCache`, filled on first use and kept for the phase.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from fpbench.backbones import PromptedViT
from fpbench.engine.augment import augment
from fpbench.engine.task import Task
from fpbench.methods.base import Method
from fpbench.specs import Augment
from fpbench.stages import report


class FeatureCache:
    """Frozen features by key, in memory and (with a folder) on disk."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._memory: dict[str, Tensor] = {}

    def get(self, key: str, compute, device: torch.device) -> Tensor:
        if key in self._memory:
            return self._memory[key]
        path = self.folder / f"{key}.pt" if self.folder else None
        if path is not None and path.is_file():
            feats = torch.load(path, map_location=device, weights_only=True)
        else:
            feats = compute()
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(feats.cpu(), path.with_suffix(".tmp"))
                path.with_suffix(".tmp").replace(path)
        self._memory[key] = feats
        return feats


def backbone_fingerprint(backbone: PromptedViT) -> str:
    h = hashlib.sha256(backbone.name.encode())
    h.update(repr((backbone.mean, backbone.std)).encode())  # the input normalisation counts too
    for t in list(getattr(backbone, "vit", backbone).state_dict().values())[:4]:
        h.update(t.detach().float().cpu().numpy().tobytes()[: 1 << 16])
    return h.hexdigest()[:12]


@torch.no_grad()
def _batched(
    fn: Callable[[Tensor], Tensor],
    backbone: PromptedViT,
    images: Tensor,
    batch_size: int,
    what: str = "frozen pass",
) -> Tensor:
    """fn over preprocessed uint8 images, in batches: (N, dq) fp32 ((0, d) for no images).

    Reports its progress in images as stage `what` (`fpbench.engine.stages`)."""
    out = []
    report(what, 0, len(images))
    for i in range(0, len(images), batch_size):
        out.append(fn(backbone.preprocess(images[i : i + batch_size])).float())
        report(what, min(i + batch_size, len(images)), len(images))
    return torch.cat(out) if out else images.new_zeros(0, backbone.embed_dim).float()


class Inputs:
    """Builds `x` for a batch of train or test indices, as the method's `frozen_input` asks."""

    def __init__(
        self,
        backbone: PromptedViT,
        task: Task,
        frozen_input: str | None,
        *,
        cache: FeatureCache | None,
        batch_size: int,
        query: tuple[str, Callable[[Tensor], Tensor]] | None = None,
    ) -> None:
        self.backbone, self.task, self.frozen_input = backbone, task, frozen_input
        self.cached: dict[str, Tensor] = {}
        self.queries: dict[str, Tensor] = {}
        if cache is None or (query is None and frozen_input != "cls"):
            return  # nothing frozen to keep
        data, device = task.data, task.priors.device
        base = f"{backbone_fingerprint(backbone)}-{data.fingerprint()}"

        def frozen(kind: str, fn: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
            """fn's features of both splits, computed once (keyed `kind`)."""
            return {
                split: cache.get(
                    f"{base}-{kind}-{split}",
                    lambda im=images, s=split: _batched(
                        fn, backbone, im, batch_size, f"frozen {kind} features ({s} split)"
                    ),
                    device,
                )
                for split, images in (("train", data.train_images), ("test", data.test_images))
            }

        if query is not None:
            self.queries = frozen(f"query-{query[0]}", query[1])
        if frozen_input == "cls":
            self.cached = frozen("cls", lambda x: backbone.forward_features(x).cls)

    @classmethod
    def of(
        cls, method: Method, task: Task, cache: FeatureCache | None = None, batch_size: int = 256
    ) -> Inputs:
        """The inputs `method` asks for (its `frozen_input`, its `frozen_query`).

        With a cache, frozen features and queries are computed once (in batches of
        `batch_size`); without one, every batch computes them anew.
        """
        name = method.frozen_query()
        return cls(
            method.backbone,
            task,
            method.frozen_input,
            cache=cache,
            batch_size=batch_size,
            query=(name, method.query) if name else None,
        )

    def query(self, split: str, idx: Tensor) -> Tensor | None:
        """Cached frozen queries of these samples, or None when not cached."""
        cached = self.queries.get(split)
        return None if cached is None else cached[idx]

    def train(self, idx: Tensor, augmentation: tuple[Augment, Tensor] | None = None) -> Tensor:
        """`x` of train samples idx (B,); `augmentation` (config, draws (B, 2)) gives each
        sample its random view, computed from the images (never from cached features)."""
        if augmentation is None:
            return self._get("train", self.task.data.train_images, idx)
        cfg, draws = augmentation
        bb = self.backbone
        x = augment(bb.preprocess(self.task.data.train_images[idx]), cfg, draws, bb.mean, bb.std)
        if self.frozen_input == "cls":
            with torch.no_grad():
                return bb.forward_features(x).cls
        return x

    def test(self, idx: Tensor | slice) -> Tensor:
        return self._get("test", self.task.data.test_images, idx)

    def _get(self, split: str, images: Tensor, idx: Tensor | slice) -> Tensor:
        if split in self.cached:
            return self.cached[split][idx]
        x = self.backbone.preprocess(images[idx])
        if self.frozen_input == "cls":
            with torch.no_grad():
                return self.backbone.forward_features(x).cls
        return x


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
