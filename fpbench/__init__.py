"""fpbench: a benchmark suite for federated prompt tuning of frozen pretrained models."""

__version__ = "0.1.0"
