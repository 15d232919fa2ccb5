"""The in-memory form of every dataset: uint8 images at native resolution plus labels."""

from __future__ import annotations

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

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_domains(self) -> int:
        return len(self.domain_names) if self.domain_names else 1

    def fingerprint(self) -> str:
        """A short content hash, used to key caches of frozen features."""
        import hashlib

        h = hashlib.sha256()
        for t in (self.train_images, self.train_labels, self.test_images, self.test_labels):
            h.update(str(tuple(t.shape)).encode())
            head = t.reshape(-1)[: (1 << 20) // t.element_size() + 1]  # the first MiB, any device
            h.update(head.cpu().numpy().tobytes()[: 1 << 20])
        h.update(",".join(self.class_names).encode())
        return h.hexdigest()[:16]
