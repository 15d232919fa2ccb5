"""Datasets: each family registers a loader in `fpbench.registry.DATASETS`."""

from fpbench.data import synthetic  # noqa: F401  (registers "synthetic")
from fpbench.data.base import ImageDataset

__all__ = ["ImageDataset"]
