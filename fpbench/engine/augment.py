"""On-device training augmentation: a random resized crop, horizontal flip and rotation per sample.

Applied per training batch on the device, after resizing and normalising (the two commute with
a flip; a rotation fills with black, i.e. the normalised value of pixel 0, as torchvision's
`RandomRotation` with its defaults: nearest neighbour, no expansion, fill 0). Flip and rotation
are SGPT's reference transform on Office-Caltech10 (RandomHorizontalFlip, then
RandomRotation(30)). The crop is torchvision's `RandomResizedCrop` as CoOp / Dassl train with it
(scale (0.08, 1), ratio (3/4, 4/3), bicubic), then the flip: the box is drawn by torchvision's
rule (`crop_boxes`) and resized back to S x S bicubic, clamped to the pixel range as an 8-bit
image is. One departure: the crop is cut from the preprocessed S x S image (for CoOp's datasets
the centred square of the original; Dassl cuts it from the whole original image).

A sample's random draws depend only on its client's epoch seed (the one that orders its
batches) and its index, through a small counter-based hash, so a client sees the same views in
the reference and lockstep executors and after a resume. An augmented batch is not the stored
images, so nothing is recalled for it (`fpbench.backbones.recall`): frozen features and queries
(e.g. SGPT's Select query, CLIP's image features) are computed from each view, never read from
the frozen store of the un-augmented images. (SGPT's code caches the first augmented view it
meets instead, a small deviation.)
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


CROP_TRIES = 10  # torchvision's attempts at a box inside the image before the centre fallback


def draws_needed(cfg: Augment) -> int:
    """How many draws a sample's view takes: flip, rotation, then the crop's 2 per attempt and
    its 2 for the position (draw j never depends on how many are taken)."""
    return 2 + (2 * CROP_TRIES + 2 if cfg.crop else 0)


def augment(
    x: Tensor, cfg: Augment, u: Tensor, mean: tuple[float, ...], std: tuple[float, ...]
) -> Tensor:
    """Normalised images (B, 3, S, S), cropped / flipped / rotated as u (B, `draws_needed`) in
    [0, 1) draws."""
    if cfg.crop:
        boxes = crop_boxes(u[:, 2:], x.shape[-2], x.shape[-1], cfg.crop_scale, cfg.crop_ratio)
        lo = (-torch.tensor(mean) / torch.tensor(std)).to(x).view(1, 3, 1, 1)
        hi = ((1 - torch.tensor(mean)) / torch.tensor(std)).to(x).view(1, 3, 1, 1)
        x = resized_crops(x, boxes).clamp(lo, hi)
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


def crop_boxes(
    u: Tensor, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> Tensor:
    """(B, 4) int64 boxes (top, left, h, w) from draws u (B, 2 * CROP_TRIES + 2), by
    torchvision's `RandomResizedCrop.get_params`: attempt t takes area share
    scale[0] + (scale[1] - scale[0]) * u[:, 2t] and aspect exp(log r0 + (log r1 - log r0) *
    u[:, 2t + 1]), w = round(sqrt(area * aspect)), h = round(sqrt(area / aspect)) (half to
    even); the first attempt with 0 < w <= width and 0 < h <= height is placed at top =
    floor(u[:, -2] * (height - h + 1)), left = floor(u[:, -1] * (width - w + 1)). Without one,
    the centred box of the whole image clamped to the ratio range."""
    pairs = u[:, : 2 * CROP_TRIES].double().view(-1, CROP_TRIES, 2)  # (B, T, 2)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * pairs[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = (lo + (hi - lo) * pairs[..., 1]).exp()
    w = (area * aspect).sqrt().round().long()  # (B, T)
    h = (area / aspect).sqrt().round().long()
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = ok.long().argmax(1, keepdim=True)  # the first good attempt (0 where none)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    top = (u[:, -2].double() * (height - h + 1)).floor().long()
    left = (u[:, -1].double() * (width - w + 1)).floor().long()
    in_ratio = width / height
    if in_ratio < min(ratio):
        fw, fh = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        fw, fh = int(round(height * max(ratio))), height
    else:
        fw, fh = width, height
    none = ~ok.any(1)
    w, h = torch.where(none, fw, w), torch.where(none, fh, h)
    top = torch.where(none, (height - fh) // 2, top)
    left = torch.where(none, (width - fw) // 2, left)
    return torch.stack([top, left, h, w], 1)


def resized_crops(x: Tensor, boxes: Tensor) -> Tensor:
    """Each image's box (top, left, h, w) of x (B, C, H, W) resized to (H, W), bicubic with
    half-pixel centres (torchvision's `resized_crop` on a tensor; the box's own border pixels
    extend it)."""
    size = x.shape[-2:]
    out = [
        F.interpolate(
            img[None, :, t : t + h, left : left + w], size=size, mode="bicubic",
            align_corners=False,
        )
        for img, (t, left, h, w) in zip(x, boxes.tolist(), strict=True)
    ]  # fmt: skip
    return torch.cat(out) if out else x
