"""Cheap facts about a dataset, known before (or without) generating or loading its images."""

from __future__ import annotations

from dataclasses import dataclass

from fpbench.data.base import ImageDataset


@dataclass(frozen=True)
class DatasetInfo:
    """What partitions need to validate their config before any data is loaded.

    Attributes:
        num_classes: Number of fine classes.
        num_domains: Number of domains (1 for a single-domain dataset).
        has_coarse: Whether `coarse_of_class` is set (the Pachinko partition needs it).
    """

    num_classes: int
    num_domains: int
    has_coarse: bool

    @classmethod
    def of(cls, data: ImageDataset) -> DatasetInfo:
        """The info of an already loaded dataset."""
        return cls(
            num_classes=data.num_classes,
            num_domains=data.num_domains,
            has_coarse=data.coarse_of_class is not None,
        )
