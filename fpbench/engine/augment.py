"""On-device training augmentation: a random horizontal flip and rotation per sample.

Applied per training batch on the device, after resizing and normalising (the two commute with
a flip; a rotation fills with black, i.e. the normalised value of pixel 0, as torchvision's
`RandomRotation` with its defaults: nearest neighbour, no expansion, fill 0). This is SGPT's
reference transform on Office-Caltech10 (RandomHorizontalFlip, then RandomRotation(30)).

A sample's random draws depend only on its client's epoch seed (the one that orders its
batches) and its index, through a small counter-based hash, so a client sees the same views in
the reference and lockstep executors and after a resume. Frozen features and queries (e.g.
SGPT's) stay cached from the un-augmented images; SGPT's code caches the first augmented view it
meets instead, a small deviation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fpbench.specs import Augment

_MASK = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def uniforms(seeds: Tensor, idx: Tensor, n: int) -> Tensor:
    """(B, n) values in [0, 1) from each sample's seed (B,) and index (B,) (int64 tensors)."""
    base = _hash32(_hash32(seeds & _MASK) ^ (idx & _MASK))  # (B,)
    draws = [_hash32((base + (j + 1) * _GOLDEN) & _MASK) for j in range(n)]
    return torch.stack(draws, 1).double().div(2.0**32).float().clamp(max=1 - 2**-24)


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer (Wellons' lowbias32) on int64 tensors holding values < 2**32.

    Products may exceed int64; they wrap, and their low 32 bits, the only ones kept, are exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def augment(
    x: Tensor, cfg: Augment, u: Tensor, mean: tuple[float, ...], std: tuple[float, ...]
) -> Tensor:
    """Normalised images (B, 3, S, S), flipped / rotated as u (B, 2) in [0, 1) draws."""
    if cfg.hflip:
        flip = (u[:, 0] < 0.5).view(-1, 1, 1, 1)  # p = 0.5
        x = torch.where(flip, x.flip(-1), x)
    if cfg.rotate > 0:
        angle = (2 * u[:, 1] - 1) * math.radians(cfg.rotate)  # uniform in +-rotate degrees
        black = (-torch.tensor(mean) / torch.tensor(std)).to(x).view(1, 3, 1, 1)
        outside = 1 - _rotate(torch.ones_like(x[:, :1]), angle.to(x))  # (B, 1, S, S)
        x = _rotate(x, angle.to(x)) + black * outside
    return x


def _rotate(x: Tensor, angle: Tensor) -> Tensor:
    """Rotate each image (B, C, H, W) about its centre by angle (B,) radians, zeros outside."""
    cos, sin = angle.cos(), angle.sin()
    zero = torch.zeros_like(cos)
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (B, H, W, 2)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)
