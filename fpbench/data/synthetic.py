"""Synthetic: a seeded, procedurally generated image-classification dataset (no files, no network).

Generative model (coordinates in [-1, 1]^2, intensities in [0, 1] before quantisation to uint8):

* **Coarse groups.** Class c belongs to coarse group ``c * num_coarse // num_classes``
  (contiguous, near-equal blocks; stored as ``coarse_of_class``). A group owns a low-frequency
  *base* (a mean colour plus three coloured plane waves of 0.3-1 cycles per unit) and a palette
  of ``PARTS`` stroke colours.
* **Fine classes.** Class c owns an arrangement of ``PARTS`` oriented strokes (elongated
  Gaussians): an offset from a common anchor and an angle per stroke. Stroke m of every class
  of a group has colour m of the group's palette, so classes of one group share base and
  colours and differ only in the geometry of their strokes (confusable by design).
* **Samples.** Each sample draws a translation of the arrangement (+-0.45) and of the base
  (+-0.3), a jitter per stroke (position sd 0.05, angle sd 0.2 rad), an amplitude per stroke
  (a stroke vanishes with probability 0.1), ``DISTRACTORS`` strokes of random colour, position
  and angle, a contrast and brightness jitter, and Gaussian pixel noise (sd ``noise``).
* **Domains.** Sample i of a class (in generation order) gets domain ``i % num_domains``, so
  every (class, domain) pair appears in both splits. Domain 0 is clean; domain d > 0 applies a
  style scaled by ``style_strength``: a 3x3 colour mix and bias, a contrast change, and a
  high-frequency grating overlay (period 3-6 px) with its own orientation and colour.

Layout ``pair`` (the offline smoke suite's): each image holds two smaller objects, the first
``PAIR_PARTS`` strokes of a class arrangement at +-0.22 around a centre in the left half and in
the right half, over a plain grey background with a faint random wave and tint. The label is the
left object; the right one is another random class. With ``cue = "random"`` (how `vit-smoke` is
pretrained) the label's side is random and the background tint says which, warm for left and
cool for right, with a random strength. A backbone pretrained that way reads the cued object
into its cls token; without the tint its cls mixes both objects, which a linear head cannot
undo but a learned prompt, standing in for the tint, can. That is what lets prompts beat
head-tuning offline: it is built into the data on purpose.

Difficulty (default config): raw-pixel nearest class mean gets the coarse group right ~99% of
the time but the fine class only ~30% (chance 5%); a 4-layer ViT (dim 96, patch 4) trained from
scratch on 300 images per class reaches ~80% test accuracy.

Randomness: class prototypes come from a generator seeded by (seed, 0), domain styles from
(seed, 3), train and test samples from (seed, 1) and (seed, 2) (their pixel noise from (seed, 11)
and (seed, 12)). A seed therefore always gives the same classes (for fixed shape knobs), and
different seeds give unrelated classes, which is how a small backbone is pretrained on classes
disjoint from a suite's. Outputs are bit-identical for any torch thread count.
"""

from __future__ import annotations

import math
import pathlib
from typing import Literal, TypeAlias

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.lazy import torch
from fpbench.registry import DATASETS

PARTS = 5  # class-specific strokes per image
DISTRACTORS = 3  # random strokes per image
BASE_WAVES = 3  # plane waves in a coarse group's base
STROKE_SIGMA = (0.2, 0.07)  # stroke extent along / across its orientation
SHIFT = 0.45  # max translation of the class arrangement
# layout "pair": two smaller objects, one per half, over a plain background
PAIR_PARTS = 4  # strokes per object (the first PAIR_PARTS of the class's arrangement)
PAIR_SPREAD = 0.22 / 0.45  # objects use the class offsets scaled to +-0.22
PAIR_SIGMA = (0.14, 0.06)
PAIR_CUE = (0.14, 0.0, -0.14)  # background tint of a left cue (warm); a right cue is its negative
_CHUNK_PIXELS = 2**20  # pixels per rendered chunk: bounds memory, few parallel regions

Params: TypeAlias = "dict[str, torch.Tensor]"


def _generator(seed: int, stream: int) -> torch.Generator:
    """A torch generator for one (seed, stream) pair, well mixed by numpy's SeedSequence."""
    state = np.random.SeedSequence([seed, stream]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) >> 1)


def _uniform(g: torch.Generator, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=g)


def _colour_vectors(g: torch.Generator, shape: tuple[int, ...], norm: float) -> torch.Tensor:
    """Random RGB offsets of a fixed length: (*shape, 3)."""
    v = torch.randn((*shape, 3), generator=g)
    return norm * v / v.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _unit_vectors(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    theta = _uniform(g, shape, 0.0, math.pi)
    return torch.stack([theta.cos(), theta.sin()], dim=-1)  # (*shape, 2)


def _prototypes(cfg: Synthetic.Config) -> Params:
    """Class and coarse-group parameters; depend only on the seed and the shape knobs."""
    g = _generator(cfg.seed, 0)
    C, G = cfg.num_classes, cfg.num_coarse
    return {
        "coarse": torch.arange(C) * G // C,  # (C,)
        "base_colour": _uniform(g, (G, 3), 0.3, 0.7),
        "wave_freq": 2 * math.pi * _uniform(g, (G, BASE_WAVES), 0.3, 1.0),
        "wave_dir": _unit_vectors(g, (G, BASE_WAVES)),  # (G, W, 2)
        "wave_phase": _uniform(g, (G, BASE_WAVES), 0.0, 2 * math.pi),
        "wave_colour": 0.08 * torch.randn((G, BASE_WAVES, 3), generator=g),
        "palette": _colour_vectors(g, (G, PARTS), 0.45),  # (G, P, 3)
        "offsets": _uniform(g, (C, PARTS, 2), -0.45, 0.45),
        "angles": _uniform(g, (C, PARTS), 0.0, math.pi),
    }


def _styles(cfg: Synthetic.Config) -> Params:
    """Per-domain style; domain 0 is the identity (clean)."""
    g, D, s = _generator(cfg.seed, 3), cfg.num_domains, cfg.style_strength
    on = (torch.arange(D) > 0).float()  # (D,)
    period_px = _uniform(g, (D,), 3.0, 6.0)
    return {
        "mix": torch.eye(3) + s * on[:, None, None] * 0.3 * torch.randn((D, 3, 3), generator=g),
        "bias": s * on[:, None] * 0.12 * torch.randn((D, 3), generator=g),
        "contrast": torch.exp(s * on * 0.3 * torch.randn((D,), generator=g)),
        "grating_freq": 2 * math.pi / (period_px * 2.0 / cfg.image_size),  # radians per unit
        "grating_dir": _unit_vectors(g, (D,)),  # (D, 2)
        "grating_colour": s * on[:, None] * _colour_vectors(g, (D,), 0.12),
    }


def _shuffled_labels(
    cfg: Synthetic.Config, per_class: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (n,) and domains (n,) of a split, `per_class` of each class, in random order."""
    C = cfg.num_classes
    perm = torch.randperm(C * per_class, generator=g)
    labels = torch.arange(C).repeat_interleave(per_class)[perm]
    domains = (torch.arange(per_class).repeat(C) % cfg.num_domains)[perm]
    return labels, domains


def _sample_params(cfg: Synthetic.Config, protos: Params, per_class: int, stream: int) -> Params:
    """Draw every per-sample nuisance of one split, in a fixed order."""
    g = _generator(cfg.seed, stream)
    labels, domains = _shuffled_labels(cfg, per_class, g)
    n = len(labels)
    shift = _uniform(g, (n, 1, 2), -SHIFT, SHIFT)
    keep = (torch.rand((n, PARTS), generator=g) > 0.1).float()
    parts_pos = protos["offsets"][labels] + shift + 0.05 * torch.randn((n, PARTS, 2), generator=g)
    parts_ang = protos["angles"][labels] + 0.2 * torch.randn((n, PARTS), generator=g)
    parts_amp = keep * _uniform(g, (n, PARTS), 0.6, 1.0)
    parts_col = protos["palette"][protos["coarse"][labels]]  # (n, P, 3)
    return {
        "labels": labels,
        "domains": domains,
        "pos": torch.cat([parts_pos, _uniform(g, (n, DISTRACTORS, 2), -1.0, 1.0)], 1),
        "ang": torch.cat([parts_ang, _uniform(g, (n, DISTRACTORS), 0.0, math.pi)], 1),
        "amp": torch.cat([parts_amp, _uniform(g, (n, DISTRACTORS), 0.3, 0.8)], 1),
        "col": torch.cat([parts_col, _colour_vectors(g, (n, DISTRACTORS), 0.45)], 1),
        "base_shift": _uniform(g, (n, 2), -0.3, 0.3),
        "contrast": _uniform(g, (n,), 0.8, 1.2),
        "brightness": 0.04 * torch.randn((n,), generator=g),
        "grating_phase": _uniform(g, (n,), 0.0, 2 * math.pi),
    }


def _pair_params(cfg: Synthetic.Config, protos: Params, per_class: int, stream: int) -> Params:
    """Per-sample draws of layout "pair": the labelled object, another class's object, a cue."""
    g, C = _generator(cfg.seed, stream), cfg.num_classes
    labels, domains = _shuffled_labels(cfg, per_class, g)
    n = len(labels)
    other = (labels + torch.randint(1, C, (n,), generator=g)) % C  # another class
    if cfg.cue == "random":  # +1: the label is on the left, -1: on the right; random strength
        side = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        strength = side * _uniform(g, (n,), 0.25, 1.0)
    else:  # the label is on the left and nothing says so
        side, strength = torch.ones(n, dtype=torch.long), torch.zeros(n)
    pair = torch.stack([torch.where(side > 0, labels, other), torch.where(side > 0, other, labels)])
    pair = pair.T  # (n, 2): the left and right objects' classes
    centre_x = torch.stack([_uniform(g, (n,), -0.62, -0.38), _uniform(g, (n,), 0.38, 0.62)], 1)
    centre = torch.stack([centre_x, _uniform(g, (n, 2), -0.4, 0.4)], -1)  # (n, 2, 2)
    k = PAIR_PARTS
    pos = PAIR_SPREAD * protos["offsets"][pair, :k] + centre[:, :, None]  # (n, 2, k, 2)
    pos = pos + 0.03 * torch.randn((n, 2, k, 2), generator=g)
    ang = protos["angles"][pair, :k] + 0.15 * torch.randn((n, 2, k), generator=g)
    amp = (torch.rand((n, 2, k), generator=g) > 0.1).float() * _uniform(g, (n, 2, k), 0.7, 1.0)
    col = protos["palette"][protos["coarse"][pair], :k]  # (n, 2, k, 3)
    tint = (
        0.5 + strength[:, None] * torch.tensor(PAIR_CUE) + 0.05 * torch.randn((n, 3), generator=g)
    )
    return {
        "labels": labels,
        "domains": domains,
        "pos": pos.flatten(1, 2),  # (n, 2k, 2)
        "ang": ang.flatten(1),
        "amp": amp.flatten(1),
        "col": col.flatten(1, 2),  # (n, 2k, 3)
        "tint": tint,  # (n, 3)
        "wave_dir": _unit_vectors(g, (n,)),  # (n, 2)
        "wave_freq": 2 * math.pi * _uniform(g, (n,), 0.2, 0.6),
        "wave_phase": _uniform(g, (n,), 0.0, 2 * math.pi),
        "wave_colour": _colour_vectors(g, (n,), 0.06),
        "grating_phase": _uniform(g, (n,), 0.0, 2 * math.pi),
    }


def _pair_background(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A plain tinted background with one faint random wave: (n, 3, H, W)."""
    d = p["wave_dir"]
    arg = p["wave_freq"][:, None, None] * (x * d[:, 0, None, None] + y * d[:, 1, None, None])
    wave = torch.cos(arg + p["wave_phase"][:, None, None])  # (n, H, W)
    return p["tint"][:, :, None, None] + wave[:, None] * p["wave_colour"][:, :, None, None]


def _grid(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = (torch.arange(size, dtype=torch.float32) + 0.5) * (2.0 / size) - 1.0
    y, x = torch.meshgrid(t, t, indexing="ij")
    return x, y  # (H, W) each


def _strokes(
    p: Params, x: torch.Tensor, y: torch.Tensor, sigma: tuple[float, float] = STROKE_SIGMA
) -> torch.Tensor:
    """Sum of coloured oriented Gaussian strokes: (n, 3, H, W)."""
    dx = x - p["pos"][..., 0, None, None]  # (n, S, H, W)
    dy = y - p["pos"][..., 1, None, None]
    cos, sin = p["ang"].cos()[..., None, None], p["ang"].sin()[..., None, None]
    u, v = dx * cos + dy * sin, dy * cos - dx * sin
    su, sv = sigma
    shape = p["amp"][..., None, None] * torch.exp(-0.5 * ((u / su) ** 2 + (v / sv) ** 2))
    out = torch.zeros(shape.shape[0], 3, *x.shape)
    for s in range(shape.shape[1]):  # few strokes: a loop keeps memory at (n, 3, H, W)
        out += shape[:, s, None] * p["col"][:, s, :, None, None]
    return out


def _base(p: Params, protos: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The coarse group's low-frequency base, translated per sample: (n, 3, H, W)."""
    grp = protos["coarse"][p["labels"]]  # (n,)
    xs = x + p["base_shift"][:, 0, None, None]  # (n, H, W)
    ys = y + p["base_shift"][:, 1, None, None]
    out = protos["base_colour"][grp][:, :, None, None].expand(-1, -1, *x.shape).clone()
    for w in range(BASE_WAVES):
        d = protos["wave_dir"][grp, w]  # (n, 2)
        arg = protos["wave_freq"][grp, w, None, None] * (
            xs * d[:, 0, None, None] + ys * d[:, 1, None, None]
        )
        wave = torch.cos(arg + protos["wave_phase"][grp, w, None, None])  # (n, H, W)
        out += wave[:, None] * protos["wave_colour"][grp, w][:, :, None, None]
    return out


def _stylise(
    img: torch.Tensor, p: Params, styles: Params, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Apply each sample's domain style to (n, 3, H, W) images."""
    d = p["domains"]
    mix, x0 = styles["mix"][d][..., None, None], img - 0.5  # (n, 3, 3, 1, 1), (n, 3, H, W)
    # an explicit 3-term sum (not a matmul) keeps the result bit-identical for any thread count
    centred = mix[:, :, 0] * x0[:, None, 0] + mix[:, :, 1] * x0[:, None, 1]
    centred = centred + mix[:, :, 2] * x0[:, None, 2]  # (n, 3, H, W)
    out = styles["contrast"][d, None, None, None] * centred + 0.5 + styles["bias"][d, :, None, None]
    gd = styles["grating_dir"][d]  # (n, 2)
    arg = styles["grating_freq"][d, None, None] * (
        x * gd[:, 0, None, None] + y * gd[:, 1, None, None]
    )
    grating = torch.cos(arg + p["grating_phase"][:, None, None])  # (n, H, W)
    return out + grating[:, None] * styles["grating_colour"][d][:, :, None, None]


def _render(
    cfg: Synthetic.Config, protos: Params, styles: Params, p: Params, g: torch.Generator
) -> torch.Tensor:
    """Render one chunk of samples to uint8 images (n, 3, H, W)."""
    x, y = _grid(cfg.image_size)
    if cfg.layout == "pair":
        img = _pair_background(p, x, y) + _strokes(p, x, y, PAIR_SIGMA)
    else:
        img = _base(p, protos, x, y) + _strokes(p, x, y)
        img = (img - 0.5) * p["contrast"][:, None, None, None] + 0.5
        img = img + p["brightness"][:, None, None, None]
    img = _stylise(img, p, styles, x, y)
    img = img + cfg.noise * torch.randn(img.shape, generator=g)
    return (img.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)


def _split(
    cfg: Synthetic.Config, protos: Params, styles: Params, per_class: int, stream: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate one split: (images (n, 3, H, W) uint8, labels (n,), domains (n,))."""
    draw = _pair_params if cfg.layout == "pair" else _sample_params
    p = draw(cfg, protos, per_class, stream)
    noise_gen = _generator(cfg.seed, stream + 10)
    n, step = p["labels"].shape[0], max(1, _CHUNK_PIXELS // cfg.image_size**2)
    chunks = []
    for start in range(0, n, step):  # the step depends on image_size only: output is fixed
        part = {k: v[start : start + step] for k, v in p.items()}
        chunks.append(_render(cfg, protos, styles, part, noise_gen))
    return torch.cat(chunks), p["labels"].to(torch.int64), p["domains"].to(torch.int64)


@DATASETS.register("synthetic")
class Synthetic:
    """Seeded synthetic classification with coarse groups and optional style domains."""

    name = "synthetic"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        num_classes: int = Field(20, ge=2, description="Number of fine classes.")
        image_size: int = Field(32, ge=8, le=1024, description="Image height and width (px).")
        train_per_class: int = Field(100, ge=1, description="Train images per class.")
        test_per_class: int = Field(40, ge=1, description="Test images per class.")
        num_coarse: int = Field(4, ge=1, description="Coarse groups (contiguous class blocks).")
        num_domains: int = Field(1, ge=1, description="Style domains; domain 0 is clean.")
        style_strength: float = Field(0.5, ge=0.0, le=2.0, description="Domain style scale.")
        noise: float = Field(0.06, ge=0.0, le=1.0, description="Pixel noise sd (0-1 scale).")
        seed: int = Field(0, ge=0, description="Generation seed; fixes the class prototypes.")
        layout: Literal["single", "pair"] = Field(
            "single",
            description="single: one object per image over its coarse group's base; pair: two "
            "smaller objects, the labelled one on the left, another class's on the right",
        )
        cue: Literal["none", "random"] = Field(
            "none",
            description="pair only. random: the labelled object's side is random and a "
            "background tint of random strength says which (warm: left); none: no tint",
        )

        @model_validator(mode="after")
        def _consistent(self) -> Synthetic.Config:
            if self.num_coarse > self.num_classes:
                raise ValueError(
                    f"num_coarse = {self.num_coarse} exceeds num_classes = {self.num_classes}"
                )
            if self.cue != "none" and self.layout != "pair":
                raise ValueError(f"cue = {self.cue!r} needs layout = 'pair'")
            low = min(self.train_per_class, self.test_per_class)
            if self.num_domains > low:
                raise ValueError(
                    f"num_domains = {self.num_domains} exceeds train/test_per_class = {low}; "
                    "every (class, domain) pair needs a sample in each split"
                )
            return self

    @staticmethod
    def info(cfg: Synthetic.Config) -> DatasetInfo:
        """Class/domain counts without generating anything."""
        return DatasetInfo(
            cfg.num_classes, cfg.num_domains, has_coarse=True,
            train_size=cfg.num_classes * cfg.train_per_class,
            test_size=cfg.num_classes * cfg.test_per_class,
            image_size=cfg.image_size,
        )  # fmt: skip

    @staticmethod
    def load(cfg: Synthetic.Config, root: pathlib.Path) -> ImageDataset:
        """Generate the dataset (`root` is unused: nothing is read or written)."""
        del root
        protos, styles = _prototypes(cfg), _styles(cfg)
        train_x, train_y, train_d = _split(cfg, protos, styles, cfg.train_per_class, 1)
        test_x, test_y, test_d = _split(cfg, protos, styles, cfg.test_per_class, 2)
        width = len(str(cfg.num_classes - 1))
        multi = cfg.num_domains > 1
        return ImageDataset(
            name=Synthetic.name,
            train_images=train_x,
            train_labels=train_y,
            test_images=test_x,
            test_labels=test_y,
            class_names=[f"c{c:0{width}d}" for c in range(cfg.num_classes)],
            train_domains=train_d if multi else None,
            test_domains=test_d if multi else None,
            domain_names=[f"d{d}" for d in range(cfg.num_domains)] if multi else None,
            coarse_of_class=protos["coarse"].to(torch.int64),
        )
