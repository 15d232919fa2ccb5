"""The synthetic dataset: shapes, determinism, coarse groups, domains, validation, difficulty."""

from __future__ import annotations

import pathlib
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fpbench.data.synthetic import Synthetic
from fpbench.registry import DATASETS

ROOT = pathlib.Path("unused")
SMALL = dict(num_classes=6, image_size=16, train_per_class=10, test_per_class=4, num_coarse=2)


def load(**kw) -> object:
    return Synthetic.load(Synthetic.Config(**kw), ROOT)


def test_registered() -> None:
    assert DATASETS.get("synthetic") is Synthetic
    assert Synthetic.name == "synthetic"


def test_shapes_dtypes_and_names() -> None:
    d = load(**SMALL)
    assert d.train_images.shape == (60, 3, 16, 16) and d.train_images.dtype == torch.uint8
    assert d.test_images.shape == (24, 3, 16, 16) and d.test_images.dtype == torch.uint8
    assert d.train_labels.dtype == torch.int64 and d.test_labels.dtype == torch.int64
    assert torch.bincount(d.train_labels).tolist() == [10] * 6
    assert torch.bincount(d.test_labels).tolist() == [4] * 6
    assert d.class_names == ["c0", "c1", "c2", "c3", "c4", "c5"]
    assert d.train_domains is None and d.test_domains is None and d.domain_names is None
    assert load(num_classes=20, train_per_class=1, test_per_class=1).class_names[7] == "c07"


def test_samples_are_shuffled_not_class_major() -> None:
    labels = load(**SMALL).train_labels
    assert not torch.equal(labels, torch.sort(labels).values)


def test_deterministic() -> None:
    a, b = load(**SMALL), load(**SMALL)
    for name in ("train_images", "train_labels", "test_images", "test_labels", "coarse_of_class"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_bit_identical_for_any_thread_count() -> None:
    cfg = {**SMALL, "num_domains": 2, "style_strength": 1.0}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = load(**cfg)
        torch.set_num_threads(max(2, threads))
        many = load(**cfg)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.train_images, many.train_images)
    assert torch.equal(one.test_images, many.test_images)


def test_different_seeds_give_different_classes() -> None:
    a, b = load(**SMALL, seed=0), load(**SMALL, seed=1)
    assert not torch.equal(a.train_images, b.train_images)
    # class means differ far more than two halves of one class's samples do
    ma = _class_means(a.train_images, a.train_labels, 6)
    mb = _class_means(b.train_images, b.train_labels, 6)
    assert (ma - mb).abs().mean() > 0.05


def test_prototypes_do_not_depend_on_split_sizes() -> None:
    """Train and test come from independent streams: more train data leaves test unchanged."""
    a, b = load(**SMALL), load(**{**SMALL, "train_per_class": 12})
    assert torch.equal(a.test_images, b.test_images)


def test_coarse_map_is_contiguous_blocks() -> None:
    d = load(num_classes=10, num_coarse=4, train_per_class=1, test_per_class=1)
    assert d.coarse_of_class.dtype == torch.int64
    assert d.coarse_of_class.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]


def test_classes_of_one_coarse_group_are_confusable() -> None:
    d = load(num_classes=8, num_coarse=2, train_per_class=40, test_per_class=1, image_size=16)
    means = _class_means(d.train_images, d.train_labels, 8).flatten(1)
    dist = torch.cdist(means, means)
    same = d.coarse_of_class[:, None] == d.coarse_of_class[None]
    off_diag = ~torch.eye(8, dtype=torch.bool)
    assert dist[same & off_diag].mean() * 3 < dist[~same].mean()


def test_hard_but_learnable_for_nearest_centroid() -> None:
    """Raw-pixel nearest class mean: coarse groups easy, fine classes far from solved."""
    d = load()
    means = _class_means(d.train_images, d.train_labels, 20).flatten(1)
    pred = torch.cdist(d.test_images.float().flatten(1) / 255, means).argmin(1)
    fine = (pred == d.test_labels).float().mean().item()
    coarse = (d.coarse_of_class[pred] == d.coarse_of_class[d.test_labels]).float().mean().item()
    assert coarse > 0.9
    assert 0.1 < fine < 0.6  # chance is 0.05


def test_domains_are_balanced_and_named() -> None:
    d = load(**{**SMALL, "num_domains": 2})
    assert d.domain_names == ["d0", "d1"]
    for labels, domains in ((d.train_labels, d.train_domains), (d.test_labels, d.test_domains)):
        assert domains.dtype == torch.int64
        pairs = torch.bincount(labels * 2 + domains, minlength=12)
        assert pairs.min() == pairs.max()  # every (class, domain) pair equally often


def test_domains_differ_in_style_and_strength_controls_it() -> None:
    def spread(strength: float) -> float:
        d = load(
            num_domains=3,
            style_strength=strength,
            train_per_class=30,
            test_per_class=3,
            image_size=16,
        )
        x = d.train_images.float() / 255
        m = torch.stack([x[d.train_domains == k].mean((0, 2, 3)) for k in range(3)])
        return torch.cdist(m, m).max().item()

    none, strong = spread(0.0), spread(1.0)
    assert none < 0.02
    assert strong > 0.1 and strong > 10 * none


def test_info_is_cheap_and_agrees_with_load() -> None:
    cfg = Synthetic.Config(**{**SMALL, "num_domains": 2})
    info, d = Synthetic.info(cfg), Synthetic.load(cfg, ROOT)
    assert (info.num_classes, info.num_domains, info.has_coarse) == (6, 2, True)
    assert (d.num_classes, d.num_domains, d.coarse_of_class is not None) == (6, 2, True)


@settings(max_examples=15, deadline=None)
@given(
    num_classes=st.integers(2, 6),
    num_coarse=st.integers(1, 6),
    image_size=st.integers(8, 12),
    per_class=st.integers(3, 5),
    num_domains=st.integers(1, 3),
    seed=st.integers(0, 2**40),
    layout=st.sampled_from([("single", "none"), ("pair", "none"), ("pair", "random")]),
)
def test_any_valid_config_generates_consistent_data(
    num_classes: int,
    num_coarse: int,
    image_size: int,
    per_class: int,
    num_domains: int,
    seed: int,
    layout: tuple[str, str],
) -> None:
    cfg = Synthetic.Config(
        layout=layout[0],
        cue=layout[1],
        num_classes=num_classes,
        num_coarse=min(num_coarse, num_classes),
        image_size=image_size,
        train_per_class=per_class,
        test_per_class=per_class,
        num_domains=num_domains,
        seed=seed,
    )
    d, info = Synthetic.load(cfg, ROOT), Synthetic.info(cfg)
    assert d.train_images.shape == (num_classes * per_class, 3, image_size, image_size)
    assert (d.num_classes, d.num_domains) == (info.num_classes, info.num_domains)
    assert d.coarse_of_class.shape == (num_classes,)
    assert set(d.coarse_of_class.tolist()) == set(range(cfg.num_coarse))
    assert d.train_labels.min() >= 0 and d.train_labels.max() < num_classes


@pytest.mark.parametrize(
    "bad",
    [
        {"num_classes": 1},
        {"image_size": 4},
        {"train_per_class": 0},
        {"test_per_class": 0},
        {"num_coarse": 0},
        {"num_coarse": 21},
        {"num_domains": 0},
        {"num_domains": 41},  # more domains than test images per class
        {"noise": -0.1},
        {"style_strength": -1.0},
        {"seed": -1},
        {"num_clases": 20},  # unknown key
    ],
)
def test_invalid_configs_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        Synthetic.Config(**bad)


def test_config_is_frozen() -> None:
    cfg = Synthetic.Config()
    with pytest.raises(ValidationError):
        cfg.num_classes = 3  # type: ignore[misc]


def test_default_config_is_fast() -> None:
    """Single-thread CPU time (robust to a busy machine): well under 2 s on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.process_time()
        load()
        assert time.process_time() - start < 2.0
    finally:
        torch.set_num_threads(threads)


def _class_means(images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    x = images.float() / 255
    return torch.stack([x[labels == c].mean(0) for c in range(num_classes)])  # (C, 3, H, W)


# ---------------------------------------------------------------- layout "pair" and its cue
PAIR = dict(num_classes=6, image_size=16, train_per_class=40, test_per_class=40, num_coarse=6)
PAIR.update(noise=0.0, layout="pair")


def _half_accuracy(centroids: torch.Tensor, images: torch.Tensor, labels, half: str) -> float:
    """Nearest-centroid accuracy of one image half against per-class half-image centroids."""
    s = images.shape[-1] // 2
    x = images[..., :s] if half == "left" else images[..., s:]
    pred = torch.cdist(x.float().flatten(1), centroids).argmin(1)
    return (pred == labels).float().mean().item()


def _left_centroids(data) -> torch.Tensor:
    s = data.train_images.shape[-1] // 2
    left = data.train_images[..., :s].float().flatten(1)
    return torch.stack([left[data.train_labels == c].mean(0) for c in range(PAIR["num_classes"])])


def test_pair_layout_puts_the_label_on_the_left() -> None:
    data = Synthetic.load(Synthetic.Config(**PAIR), ROOT)
    s = data.train_images.shape[-1] // 2
    right = data.train_images[..., s:].float().flatten(1)
    right_centroids = torch.stack([right[data.train_labels == c].mean(0) for c in range(6)])
    left_acc = _half_accuracy(_left_centroids(data), data.test_images, data.test_labels, "left")
    right_acc = _half_accuracy(right_centroids, data.test_images, data.test_labels, "right")
    assert left_acc > 0.45 and right_acc < 0.25  # chance 1/6: the right object is another class


def test_pair_cue_tint_says_which_side_holds_the_label() -> None:
    centroids = _left_centroids(Synthetic.load(Synthetic.Config(**PAIR), ROOT))  # same classes
    data = Synthetic.load(Synthetic.Config(**PAIR, cue="random"), ROOT)
    images, labels = data.test_images, data.test_labels
    warm = images[:, 0].float().mean((1, 2)) > images[:, 2].float().mean((1, 2))
    assert 0.3 < warm.float().mean() < 0.7  # both sides occur
    # an object looks the same in either half (the halves are a pure shift apart)
    left_w, right_w = (
        _half_accuracy(centroids, images[warm], labels[warm], h) for h in ("left", "right")
    )
    left_c, right_c = (
        _half_accuracy(centroids, images[~warm], labels[~warm], h) for h in ("left", "right")
    )
    assert left_w > right_w + 0.1 and right_c > left_c + 0.1


def test_cue_needs_the_pair_layout() -> None:
    with pytest.raises(ValidationError, match="layout"):
        Synthetic.Config(cue="random")
    assert Synthetic.Config(layout="pair", cue="random").cue == "random"
