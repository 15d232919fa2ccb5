"""Datasets: each module of this package registers its loaders in `fpbench.registry.DATASETS`.

Every module here is imported, so a new dataset family is one file (plus its tests).
"""

import importlib
import pkgutil

from fpbench.data.base import ImageDataset

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ImageDataset"]
