"""The in-memory form of every dataset: uint8 images at native resolution plus labels."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from fpbench.lazy import torch


@dataclass
class ImageDataset:
    """Train and test splits of one dataset, kept as uint8 tensors (N, 3, H, W).

    `train_domains` / `test_domains` give a domain index per sample (None: one domain).
    `coarse_of_class` maps each fine class to a coarse group (None: no hierarchy); the
    two-stage Pachinko partition needs it. `train_users` gives datasets that define their own
    clients (iNaturalist's per-user split) a user index 0..U-1 per train sample (None: none).
    """

    name: str
    train_images: torch.Tensor  # (N, 3, H, W) uint8
    train_labels: torch.Tensor  # (N,) int64
    test_images: torch.Tensor  # (M, 3, H, W) uint8
    test_labels: torch.Tensor  # (M,) int64
    class_names: list[str]
    train_domains: torch.Tensor | None = None  # (N,) int64
    test_domains: torch.Tensor | None = None  # (M,) int64
    domain_names: list[str] | None = None
    coarse_of_class: torch.Tensor | None = None  # (C,) int64
    train_users: torch.Tensor | None = None  # (N,) int64 natural client per sample (iNaturalist)
    # (D,) int64 each domain's full train-list size before any subsetting (the SGPT code weighs
    # Office / DomainNet clients by it); None where the dataset does not record it
    domain_train_sizes: torch.Tensor | None = None
    # a stable id of the contents where the maker knows one (fake data: its seed and shape);
    # None: `fingerprint` hashes the contents (`dataclasses.replace` keeps it: set it only on
    # data that is never edited)
    identity: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_domains(self) -> int:
        return len(self.domain_names) if self.domain_names else 1

    def fingerprint(self) -> str:
        """A hash of the whole contents (images, labels, class names, domains), keying the
        caches of frozen values; `identity` where the dataset declares one. Computed once per
        dataset (and shared with its `moved` copies), on the CPU."""
        if self.identity is not None:
            return self.identity
        # kept as plain attributes, not fields: `dataclasses.replace` and saving leave them out
        origin = getattr(self, "_origin", None)
        if origin is not None:
            source, ids = origin  # unchanged on either side since the move: the same data
            if ids == (source._tensor_ids(), self._tensor_ids()):
                return source.fingerprint()
        digest = getattr(self, "_digest", None)
        if digest is None or digest[1] != self._tensor_ids():
            digest = self._digest = (self._hash(), self._tensor_ids())
        return digest[0]

    def moved(self, device: torch.device | str) -> ImageDataset:
        """The dataset with its images and labels on `device` (same fingerprint, computed on
        this copy's first ask from the original)."""
        out = dataclasses.replace(
            self,
            train_images=self.train_images.to(device),
            train_labels=self.train_labels.to(device),
            test_images=self.test_images.to(device),
            test_labels=self.test_labels.to(device),
        )
        out._origin = (self, (self._tensor_ids(), out._tensor_ids()))
        return out

    def _tensors(self) -> list[torch.Tensor | None]:
        return [
            self.train_images, self.train_labels, self.test_images, self.test_labels,
            self.train_domains, self.test_domains, self.coarse_of_class, self.train_users,
            self.domain_train_sizes,
        ]  # fmt: skip

    def _tensor_ids(self) -> tuple[int, ...]:
        return tuple(id(t) for t in self._tensors())

    def _hash(self) -> str:
        h = hashlib.sha256()
        for t in self._tensors():
            if t is None:
                h.update(b"none;")
                continue
            h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
            flat = t.detach().reshape(-1)
            step = max(1, (64 << 20) // t.element_size())  # 64 MiB at a time
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step].contiguous().cpu()
                h.update(memoryview(part.view(torch.uint8).numpy()))
        names = [self.class_names, self.domain_names or []]
        h.update(json.dumps(names).encode())
        return h.hexdigest()[:32]
