"""Cheap facts about a dataset, known before (or without) generating or loading its images."""

from __future__ import annotations

from dataclasses import dataclass, field

from fpbench.data.base import ImageDataset


@dataclass(frozen=True)
class DatasetInfo:
    """What partitions need to validate their config before any data is loaded.

    Attributes:
        num_classes: Number of fine classes.
        num_domains: Number of domains (1 for a single-domain dataset).
        has_coarse: Whether `coarse_of_class` is set (the Pachinko partition needs it).
        train_size: Train images (None: unknown); `fpbench estimate` builds fake data this big.
        test_size: Test images (None: unknown).
        image_size: Side of the stored (square) images in pixels (None: unknown).
        sizes_exact: False where the sizes are the standard release's, approximate, because
            they depend on the files found (folder layouts, split files).
    """

    num_classes: int
    num_domains: int
    has_coarse: bool
    # sizes are estimates of what the files hold: they do not take part in comparisons
    train_size: int | None = field(default=None, compare=False)
    test_size: int | None = field(default=None, compare=False)
    image_size: int | None = field(default=None, compare=False)
    sizes_exact: bool = field(default=True, compare=False)

    @classmethod
    def of(cls, data: ImageDataset) -> DatasetInfo:
        """The info of an already loaded dataset."""
        return cls(
            num_classes=data.num_classes,
            num_domains=data.num_domains,
            has_coarse=data.coarse_of_class is not None,
            train_size=len(data.train_labels),
            test_size=len(data.test_labels),
            image_size=int(data.train_images.shape[-1]),
        )
