"""Real datasets, read by their real loaders from miniature files written in each native format."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fpbench.data.cifar import Cifar10, Cifar100
from fpbench.data.cifar100c import CORRUPTIONS, Cifar100C
from fpbench.data.fedbn import DomainNet10, OfficeCaltech10
from fpbench.data.five import FiveDataset
from fpbench.data.inat import INaturalistUser120k
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import PREPARED_DIR, data_root, load_prepared
from fpbench.data.tiny_imagenet import TinyImageNet
from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.registry import DATASETS

# ---- native-format writers (shared with tests/test_data_cli.py) ------------------------------


def cifar_rows(n: int, offset: int) -> np.ndarray:
    """(n, 3072) uint8 rows whose values encode (row, position): the layout can be checked."""
    return ((np.arange(n)[:, None] * 7 + offset + np.arange(3072)[None]) % 256).astype(np.uint8)


def _dump(obj: object, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(root: Path, train_per_class: int = 2, test_per_class: int = 2) -> None:
    """The five train batches, the test batch and batches.meta, as the CIFAR-10 archive has them."""
    folder = root / "cifar-10-batches-py"
    for b in range(1, 6):
        labels = list(np.arange(10 * train_per_class) % 10)
        rows = cifar_rows(len(labels), offset=b)
        _dump({b"data": rows, b"labels": labels, b"batch_label": b"x"}, folder / f"data_batch_{b}")
    labels = list(np.arange(10 * test_per_class) % 10)
    _dump({b"data": cifar_rows(len(labels), 100), b"labels": labels}, folder / "test_batch")
    names = [f"name{k}".encode() for k in range(10)]
    _dump({b"label_names": names, b"num_cases_per_batch": 10}, folder / "batches.meta")


def coarse_of(fine: np.ndarray) -> np.ndarray:
    return (fine * 7) % 20  # a fixed fine -> coarse map, not contiguous blocks


def write_cifar100(root: Path, train_per_class: int = 2, test_per_class: int = 2) -> None:
    folder = root / "cifar-100-python"
    for split, per in (("train", train_per_class), ("test", test_per_class)):
        fine = np.arange(100 * per) % 100
        _dump(
            {
                b"data": cifar_rows(fine.size, 3),
                b"fine_labels": list(fine),
                b"coarse_labels": list(coarse_of(fine)),
            },
            folder / split,
        )
    meta = {
        b"fine_label_names": [f"fine{k}".encode() for k in range(100)],
        b"coarse_label_names": [f"coarse{k}".encode() for k in range(20)],
    }
    _dump(meta, folder / "meta")


def write_image(path: Path, colour: tuple[int, int, int], size: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", (size, size), colour)
    (img.convert("L") if mode == "L" else img).save(path)


def class_colour(c: int) -> tuple[int, int, int]:
    return (c * 37 % 256, c * 91 % 256, c * 53 % 256)


def write_tiny_imagenet(root: Path, classes: int = 200, train_per_class: int = 2) -> list[str]:
    """wnids.txt, words.txt, train/<wnid>/images/*.JPEG, val/images + val_annotations.txt."""
    folder = root / "tiny-imagenet-200"
    wnids = [f"n{10000000 + 17 * c:08d}" for c in range(classes)]
    folder.mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(wnids) + "\n")
    words = [f"{w}\tthing{c}, other name" for c, w in enumerate(wnids)]
    (folder / "words.txt").write_text("\n".join(["n00000001\tunused", *words]) + "\n")
    for c, w in enumerate(wnids):
        for i in range(train_per_class):
            mode = "L" if (c, i) == (0, 0) else "RGB"  # Tiny-ImageNet has greyscale JPEGs
            write_image(
                folder / "train" / w / "images" / f"{w}_{i}.JPEG", class_colour(c), 64, mode
            )
    lines = []
    for j, c in enumerate(reversed(range(classes))):  # val order unrelated to class order
        name = f"val_{j}.JPEG"
        write_image(folder / "val" / "images" / name, class_colour(c), 64)
        lines.append(f"{name}\t{wnids[c]}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return wnids


def write_cifar100c(root: Path, rows_per_severity: int = 20, corruptions: int = 10) -> None:
    """<corruption>.npy (5 * n, 32, 32, 3) and labels.npy; pixel (0, 0) encodes the row."""
    folder = root / "CIFAR-100-C"
    folder.mkdir(parents=True)
    n = 5 * rows_per_severity
    labels = np.arange(n) % 100
    np.save(folder / "labels.npy", labels.astype(np.uint8))
    for d, name in enumerate(CORRUPTIONS[:corruptions]):
        x = np.zeros((n, 32, 32, 3), dtype=np.uint8)
        x[:, 0, 0, 0] = np.arange(n)  # row
        x[:, 0, 0, 1] = np.arange(n) // rows_per_severity + 1  # severity
        x[:, 0, 0, 2] = d  # domain
        np.save(folder / f"{name}.npy", x)


def _idx(path: Path, array: np.ndarray) -> None:
    """An MNIST idx file (big-endian header: magic 0x08 = ubyte, ndim; dims)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_mnist_like(root: Path, folder: str, per_class: int = 2, value: int = 200) -> None:
    for prefix, n in (("train", 10 * per_class), ("t10k", 10 * per_class)):
        x = np.zeros((n, 28, 28), dtype=np.uint8)
        x[:, 10:18, 10:18] = value
        _idx(root / folder / "raw" / f"{prefix}-images-idx3-ubyte", x)
        _idx(root / folder / "raw" / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)


def write_notmnist(root: Path, per_letter: int = 5) -> None:
    for k, letter in enumerate("ABCDEFGHIJ"):
        for i in range(per_letter):
            path = root / "notMNIST_small" / letter / f"img{i}.png"
            write_image(path, (10 * k + i,) * 3, 28, "L")
    (root / "notMNIST_small" / "A" / "broken.png").write_bytes(b"")  # the archive has these


# ---- registry and the shared machinery -------------------------------------------------------


def test_registered_and_info_without_data() -> None:
    for name, cls in {
        "cifar10": Cifar10,
        "cifar100": Cifar100,
        "tiny-imagenet": TinyImageNet,
        "five-dataset": FiveDataset,
        "cifar100-c": Cifar100C,
    }.items():
        assert DATASETS.get(name) is cls
    assert Cifar100.info(Cifar100.Config()) == DatasetInfo(100, 1, True)
    assert Cifar100C.info(Cifar100C.Config()) == DatasetInfo(100, 10, False)
    assert FiveDataset.info(FiveDataset.Config()).num_classes == 50


def test_data_root_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("FPBENCH_DATA", raising=False)
    assert data_root() == Path("data")
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path))
    assert data_root() == tmp_path
    assert data_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.parametrize("cls", [Cifar10, Cifar100, TinyImageNet, Cifar100C, FiveDataset])
def test_missing_dataset_is_one_clear_line(cls, tmp_path) -> None:
    with pytest.raises(FpbenchError) as e:
        cls.load(cls.Config(), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path) in msg and cls.name in msg
    assert not (tmp_path / PREPARED_DIR).exists()  # nothing pretends to be prepared


def test_run_without_data_fails_fast(monkeypatch, tmp_path) -> None:
    from fpbench.engine import task
    from fpbench.specs import Component

    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path))
    task._load.cache_clear()
    with pytest.raises(FpbenchError, match="cifar-100-python"):
        task.load_dataset(Component(name="cifar100", label="cifar100"))


# ---- CIFAR -----------------------------------------------------------------------------------


def test_cifar10_reads_pickles_prepares_once_and_memory_maps(tmp_path) -> None:
    write_cifar10(tmp_path)
    data = Cifar10.load(Cifar10.Config(), tmp_path)
    assert data.train_images.shape == (100, 3, 32, 32) and data.test_images.shape == (20, 3, 32, 32)
    assert data.train_images.dtype == torch.uint8 and data.train_labels.dtype == torch.int64
    assert data.class_names == [f"name{k}" for k in range(10)]
    # channel-major rows: pixel (c, h, w) of image i of batch 1 is row[c * 1024 + h * 32 + w]
    row = cifar_rows(20, offset=1)[3]
    assert data.train_images[3, 2, 5, 7] == row[2 * 1024 + 5 * 32 + 7]
    assert data.train_images[20 + 3, 0, 0, 0] == cifar_rows(20, offset=2)[3, 0]  # batch 2 next
    assert data.train_labels[:12].tolist() == [*range(10), 0, 1]
    assert data.coarse_of_class is None and data.train_domains is None
    cached = list((tmp_path / PREPARED_DIR).glob("cifar10-*.pt"))
    assert len(cached) == 1
    # the raw files are no longer needed: the prepared file alone loads, identically
    for f in (tmp_path / "cifar-10-batches-py").iterdir():
        f.unlink()
    again = Cifar10.load(Cifar10.Config(), tmp_path)
    assert torch.equal(again.train_images, data.train_images)
    assert again.fingerprint() == data.fingerprint()


def test_cifar100_keeps_coarse_labels(tmp_path) -> None:
    write_cifar100(tmp_path)
    data = Cifar100.load(Cifar100.Config(), tmp_path)
    assert data.num_classes == 100 and data.class_names[7] == "fine7"
    assert data.coarse_of_class.tolist() == coarse_of(np.arange(100)).tolist()
    assert DatasetInfo.of(data) == Cifar100.info(Cifar100.Config())


def test_cifar100_inconsistent_coarse_labels_raise(tmp_path) -> None:
    write_cifar100(tmp_path)
    path = tmp_path / "cifar-100-python" / "train"
    batch = pickle.loads(path.read_bytes())
    batch[b"coarse_labels"][100] = (batch[b"coarse_labels"][100] + 1) % 20  # class 0 twice
    _dump(batch, path)
    with pytest.raises(FpbenchError, match="inconsistent"):
        Cifar100.load(Cifar100.Config(), tmp_path)


def test_prepared_file_with_old_format_is_rejected(tmp_path) -> None:
    write_cifar10(tmp_path)
    path = Cifar10.prepare(Cifar10.Config(), tmp_path)
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "format": -1}, path)
    with pytest.raises(FpbenchError, match="delete it"):
        load_prepared(path)


def test_pathological_s10_on_cifar100_protocol(tmp_path) -> None:
    """SGPT's protocol: 100 clients x 10 classes; every class over 10 clients; local tests."""
    write_cifar100(tmp_path, train_per_class=20, test_per_class=20)
    data = Cifar100.load(Cifar100.Config(), tmp_path)
    clients = make_clients("pathological", {"num_clients": 100, "s": 10}, data, seed=0)
    y, y_test = data.train_labels.numpy(), data.test_labels.numpy()
    holders = np.zeros(100, dtype=np.int64)
    for c in clients:
        classes = np.unique(y[c.train_idx])
        assert classes.size == 10
        holders[classes] += 1
        # local test = floor(n_test_k * p) per dealt class, train = floor(n_train_k * p); with
        # 20 train and 20 test images per class both counts are equal, class by class
        train_counts = np.bincount(y[c.train_idx], minlength=100)
        assert (np.bincount(y_test[c.test_idx], minlength=100) == train_counts).all()
    assert (holders == 10).all()
    train = np.concatenate([c.train_idx for c in clients])
    assert np.unique(train).size == train.size  # disjoint


# ---- Tiny-ImageNet ---------------------------------------------------------------------------


def test_tiny_imagenet_tree_and_val_annotations(tmp_path) -> None:
    wnids = write_tiny_imagenet(tmp_path)
    data = TinyImageNet.load(TinyImageNet.Config(), tmp_path)
    assert data.train_images.shape == (400, 3, 64, 64)
    assert data.test_images.shape == (200, 3, 64, 64)
    assert data.class_names[3] == "thing3" and len(wnids) == data.num_classes == 200
    assert data.train_labels.tolist() == [c for c in range(200) for _ in range(2)]
    assert data.test_labels.tolist() == list(reversed(range(200)))  # from val_annotations.txt
    # each image's colour is its class's (JPEG: within a few levels); greyscale became RGB
    for split in ("train", "test"):
        x, y = getattr(data, f"{split}_images"), getattr(data, f"{split}_labels")
        mean = x.float().mean(dim=(2, 3))  # (N, 3)
        want = torch.tensor([class_colour(int(c)) for c in y], dtype=torch.float32)
        grey = mean[0].std() < 1 if split == "train" else False
        assert grey or (mean[0] - want[0]).abs().max() < 4
        assert (mean[1:] - want[1:]).abs().max() < 4


def test_tiny_imagenet_unknown_wnid_in_val_raises(tmp_path) -> None:
    write_tiny_imagenet(tmp_path, classes=3, train_per_class=1)
    ann = tmp_path / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text() + "val_x.JPEG\tn99999999\t0\t0\t1\t1\n")
    with pytest.raises(FpbenchError, match="n99999999"):
        TinyImageNet.load(TinyImageNet.Config(), tmp_path)


# ---- CIFAR-100-C -----------------------------------------------------------------------------


def test_cifar100c_samples_per_domain_from_chosen_severities(tmp_path) -> None:
    write_cifar100c(tmp_path)
    write_cifar100(tmp_path)  # only for the class names
    cfg = Cifar100C.Config(per_domain=30, severities=(2, 5), test_fraction=0.2, seed=1)
    data = Cifar100C.load(cfg, tmp_path)
    assert data.domain_names == list(CORRUPTIONS[:10]) and data.class_names[5] == "fine5"
    assert data.train_images.shape[0] == 10 * 24 and data.test_images.shape[0] == 10 * 6
    for split in ("train", "test"):
        x, y = getattr(data, f"{split}_images"), getattr(data, f"{split}_labels")
        d = getattr(data, f"{split}_domains")
        row, sev, dom = (x[:, c, 0, 0].long() for c in range(3))
        assert torch.equal(dom, d)  # each image came from its domain's file
        assert set(sev.tolist()) <= {2, 5}
        assert torch.equal(y, row % 100)  # labels.npy row matches the image row
    both = torch.cat([data.train_images, data.test_images])[:, :, 0, 0].long()
    keys = (both[:, 2] * 1000 + both[:, 0]).tolist()
    assert len(set(keys)) == len(keys)  # sampled without replacement, train/test disjoint
    other = Cifar100C.load(cfg.model_copy(update={"seed": 2}), tmp_path)
    assert not torch.equal(other.train_images, data.train_images)


def test_cifar100c_rejects_unknown_corruption() -> None:
    with pytest.raises(ValueError, match="corruptions"):
        Cifar100C.Config(corruptions=("gaussian_noise", "rain"))


# ---- Five-dataset ----------------------------------------------------------------------------


def _fake_svhn(root: Path, split: str):
    n = 30 if split == "train" else 10
    x = torch.full((n, 3, 32, 32), 77, dtype=torch.uint8)
    return x, torch.arange(n) % 10


def write_five_without_svhn(root: Path) -> None:
    write_cifar10(root)
    write_notmnist(root)
    write_mnist_like(root, "FashionMNIST", value=150)
    write_mnist_like(root, "MNIST", value=250)
    (root / "svhn").mkdir()
    for split in ("train", "test"):
        (root / "svhn" / f"{split}_32x32.mat").write_bytes(b"")


def test_five_dataset_disjoint_label_spaces_as_domains(tmp_path, monkeypatch) -> None:
    import fpbench.data.five as five

    write_five_without_svhn(tmp_path)
    monkeypatch.setattr(five, "read_svhn", _fake_svhn)  # the .mat reader needs scipy
    data = FiveDataset.load(FiveDataset.Config(), tmp_path)
    assert data.num_classes == 50 and data.domain_names == list(five.SOURCES)
    for split in ("train", "test"):
        y, d = getattr(data, f"{split}_labels"), getattr(data, f"{split}_domains")
        assert torch.equal(y // 10, d)  # source d owns classes 10d .. 10d + 9
    counts = torch.bincount(data.train_domains, minlength=5).tolist()
    assert counts[0] == 30 and counts[1] == 100 and counts[3] == counts[4] == 20
    assert counts[2] == 40  # notMNIST: 5 per letter (the empty file skipped), 10 % to test
    mnist = data.train_images[data.train_domains == 4]
    assert mnist.shape[1:] == (3, 32, 32)
    assert (mnist[:, :, :2] == 0).all() and (mnist[:, :, 12:20, 12:20] == 250).all()  # padded
    assert data.coarse_of_class.tolist() == [k // 10 for k in range(50)]


def test_five_dataset_fgpt_sampling(tmp_path, monkeypatch) -> None:
    import fpbench.data.five as five

    write_five_without_svhn(tmp_path)
    monkeypatch.setattr(five, "read_svhn", _fake_svhn)
    data = FiveDataset.load(FiveDataset.Config(per_domain=20, test_fraction=0.25), tmp_path)
    assert torch.bincount(data.train_domains).tolist() == [15] * 5
    assert torch.bincount(data.test_domains).tolist() == [5] * 5


def test_five_dataset_names_what_is_missing(tmp_path) -> None:
    write_cifar10(tmp_path)
    with pytest.raises(FpbenchError, match="svhn, notmnist, fashion-mnist, mnist"):
        FiveDataset.load(FiveDataset.Config(), tmp_path)


def test_svhn_mat_reader(tmp_path) -> None:
    scipy_io = pytest.importorskip("scipy.io")
    from fpbench.data.five import read_svhn

    x = np.zeros((32, 32, 3, 4), dtype=np.uint8)
    x[0, 0, 0, :] = [1, 2, 3, 4]
    (tmp_path / "svhn").mkdir()
    scipy_io.savemat(tmp_path / "svhn" / "train_32x32.mat", {"X": x, "y": [[10], [1], [2], [9]]})
    images, labels = read_svhn(tmp_path, "train")
    assert images.shape == (4, 3, 32, 32) and images[:, 0, 0, 0].tolist() == [1, 2, 3, 4]
    assert labels.tolist() == [0, 1, 2, 9]


def test_prepared_cache_is_keyed_by_config(tmp_path) -> None:
    write_cifar100c(tmp_path)
    a = Cifar100C.prepare(Cifar100C.Config(per_domain=10), tmp_path)
    b = Cifar100C.prepare(Cifar100C.Config(per_domain=20), tmp_path)
    assert a != b and a.is_file() and b.is_file()
    stored = json.loads(torch.load(b, weights_only=True)["config"])
    assert stored["per_domain"] == 20


# ---- Office-Caltech10 and DomainNet (FedBN pickles, raw folders) ------------------------------


def dc_colour(d: int, k: int) -> tuple[int, int, int]:
    return (40 * d + 5, 20 * k + 3, 100)


def write_domain_folders(root: Path, cls, per_class: int, classes: int = 10) -> dict:
    """<root>/<folder>/<domain>/<class>/img*.png, in varying sizes; returns {domain: [(rel, k)]}."""
    items = {}
    for d, domain in enumerate(cls.domains):
        items[domain] = []
        for k, c in enumerate(cls.classes[:classes]):
            for i in range(per_class + d):  # domains differ in size
                rel = f"{cls.folder}/{domain}/{c}/img{i}.png"
                size = 20 + 3 * i + k
                mode = "L" if i == 1 and d == 0 else "RGB"
                write_image(root / rel, dc_colour(d, k), size, mode)
                items[domain].append((rel, k))
    return items


def write_fedbn_pickles(root: Path, cls, items: dict, test_every: int = 3) -> None:
    """<domain>_{train,test}.pkl holding (paths, text labels), FedBN-style, paths from <root>."""
    for domain, rows in items.items():
        test = [r for j, r in enumerate(rows) if j % test_every == 0]
        train = [r for j, r in enumerate(rows) if j % test_every != 0]
        for split, part in (("train", train), ("test", test)):
            paths = np.array(
                [("../data/" if j == 0 else "") + rel for j, (rel, _) in enumerate(part)]
            )
            labels = np.array([cls.classes[k] for _, k in part])
            _dump((paths, labels), root / cls.folder / f"{domain}_{split}.pkl")


def _check_colours(data) -> None:
    for split in ("train", "test"):
        x = getattr(data, f"{split}_images").float().mean(dim=(2, 3))  # (N, 3)
        y, d = getattr(data, f"{split}_labels"), getattr(data, f"{split}_domains")
        want = torch.tensor(
            [dc_colour(int(a), int(b)) for a, b in zip(d, y, strict=True)], dtype=torch.float32
        )
        grey = (x[:, 0] - x[:, 1]).abs() < 1  # the greyscale files: R = G = B
        assert (x[~grey] - want[~grey]).abs().max() < 1.5


@pytest.mark.parametrize("cls", [OfficeCaltech10, DomainNet10])
def test_fedbn_pickles(tmp_path, cls) -> None:
    items = write_domain_folders(tmp_path, cls, per_class=2, classes=4)
    write_fedbn_pickles(tmp_path, cls, items)
    data = cls.load(cls.Config(image_size=16), tmp_path)
    assert data.domain_names == list(cls.domains) and data.class_names == list(cls.classes)
    assert data.train_images.shape[1:] == (3, 16, 16)
    n = [len(items[dom]) for dom in cls.domains]
    n_test = [len(range(0, k, 3)) for k in n]
    assert torch.bincount(data.test_domains).tolist() == n_test
    assert torch.bincount(data.train_domains).tolist() == [
        a - b for a, b in zip(n, n_test, strict=True)
    ]
    _check_colours(data)
    assert DatasetInfo.of(data) == cls.info(cls.Config())


def test_fedbn_sgpt_subset_takes_first_items(tmp_path) -> None:
    cls = OfficeCaltech10
    items = write_domain_folders(tmp_path, cls, per_class=2, classes=3)
    write_fedbn_pickles(tmp_path, cls, items)
    data = cls.load(cls.Config(image_size=16, sgpt_subset=True), tmp_path)
    m = min(len(items[d]) - len(range(0, len(items[d]), 3)) for d in cls.domains)  # 4 train / dom
    keep = m // 2
    assert torch.bincount(data.train_domains).tolist() == [keep] * 4
    first = [k for j, (_, k) in enumerate(items["amazon"]) if j % 3 != 0][:keep]
    assert data.train_labels[data.train_domains == 0].tolist() == first  # list order kept
    full = [len(items[d]) - len(range(0, len(items[d]), 3)) for d in cls.domains]
    assert data.domain_train_sizes.tolist() == full  # the whole lists (SGPT's FedAvg weights)


def test_fedbn_unknown_text_label_raises(tmp_path) -> None:
    cls = OfficeCaltech10
    items = write_domain_folders(tmp_path, cls, per_class=1, classes=2)
    write_fedbn_pickles(tmp_path, cls, items)
    _dump((np.array(["x.png"]), np.array(["bicycle"])), tmp_path / cls.folder / "dslr_test.pkl")
    with pytest.raises(FpbenchError, match="bicycle"):
        cls.load(cls.Config(image_size=16), tmp_path)


def test_office_raw_folders_split_per_class(tmp_path) -> None:
    cls = OfficeCaltech10
    write_domain_folders(tmp_path, cls, per_class=5)
    data = cls.load(cls.Config(image_size=16, test_fraction=0.2, layout="raw"), tmp_path)
    for d in range(4):
        test = data.test_labels[data.test_domains == d]
        k = int(np.floor(0.2 * (5 + d) + 0.5))  # per class, 5 + d images each
        assert torch.bincount(test, minlength=10).tolist() == [k] * 10
        assert (data.train_domains == d).sum() == 10 * (5 + d - k)
    _check_colours(data)


def test_domainnet_raw_with_split_files_keeps_ten_classes(tmp_path) -> None:
    cls = DomainNet10
    items = write_domain_folders(tmp_path, cls, per_class=2, classes=3)
    base = tmp_path / cls.folder
    for domain, rows in items.items():
        rels = [rel.split("/", 1)[1] for rel, _ in rows]  # relative to <root>/DomainNet
        other = f"{domain}/aircraft_carrier/{domain}_001.jpg"  # a class outside the subset
        lines = [f"{r} {7 * j}" for j, r in enumerate(rels)]
        (base / f"{domain}_train.txt").write_text("\n".join([other + " 0", *lines[1:]]) + "\n")
        (base / f"{domain}_test.txt").write_text(lines[0] + "\n")
    data = cls.load(cls.Config(image_size=16), tmp_path)
    assert data.test_images.shape[0] == 6
    assert data.train_images.shape[0] == sum(len(r) - 1 for r in items.values())
    assert set(data.train_labels.tolist()) == {0, 1, 2}
    _check_colours(data)


def test_domainnet_missing_image_is_named(tmp_path) -> None:
    cls = DomainNet10
    items = write_domain_folders(tmp_path, cls, per_class=1, classes=1)
    write_fedbn_pickles(tmp_path, cls, items)
    (tmp_path / items["sketch"][0][0]).unlink()
    with pytest.raises(FpbenchError, match="sketch"):
        cls.load(cls.Config(image_size=16), tmp_path)


# ---- iNaturalist-User-120k -------------------------------------------------------------------


def write_inat(root: Path, users: dict[str, list[int]], test_classes: list[int]) -> None:
    """The split csvs (user_id,image_id,class,label; image_id,class) and the image tree."""
    base = root / "inaturalist"
    split = base / "inaturalist-user-120k"
    split.mkdir(parents=True)
    rows, j = ["user_id,image_id,class,label"], 0
    for user, classes in users.items():
        for k in classes:
            image_id = f"{j:032x}"
            path = base / "train_val_images" / "Plantae" / f"Species {k}" / f"{image_id}.jpg"
            write_image(path, (k * 5 % 256, 200, 30), 40 + j)  # sizes differ
            rows.append(f"{user},{image_id},{k},Species {k}")
            j += 1
    (split / "federated_train_user_120k.csv").write_text("\n".join(rows) + "\n")
    test = ["image_id,class"]
    for k in test_classes:
        image_id = f"{j:032x}"
        write_image(base / "train_val_images" / "Aves" / f"s{k}" / f"{image_id}.jpg", (0, 0, 0), 50)
        test.append(f"{image_id},{k}")
        j += 1
    (split / "test.csv").write_text("\n".join(test) + "\n")


def test_inat_users_from_split_file(tmp_path) -> None:
    write_inat(tmp_path, {"u9": [3, 3, 1202], "u2": [5], "u4": [7, 8]}, test_classes=[3, 5, 0])
    cls = INaturalistUser120k
    data = cls.load(cls.Config(min_user_samples=2, image_size=16), tmp_path)
    assert data.num_classes == 1203 and data.class_names[1202] == "Species 1202"
    assert data.train_labels.tolist() == [3, 3, 1202, 7, 8]  # user u2 (1 image) dropped
    assert data.train_users.tolist() == [0, 0, 0, 1, 1]
    assert data.test_labels.tolist() == [3, 5, 0] and data.test_images.shape == (3, 3, 16, 16)
    red = data.train_images[:, 0].float().mean(dim=(1, 2))
    assert (red - torch.tensor([15.0, 15, 1202 * 5 % 256, 35, 40])).abs().max() < 4
    path = next((tmp_path / "prepared").glob("inat-user-120k-*.pt"))
    assert torch.equal(load_prepared(path).train_users, data.train_users)


def test_inat_missing_images_are_reported(tmp_path) -> None:
    write_inat(tmp_path, {"a": [1, 2]}, test_classes=[1])
    for p in (tmp_path / "inaturalist" / "train_val_images" / "Aves").rglob("*.jpg"):
        p.unlink()
    with pytest.raises(FpbenchError, match="1 images of test.csv"):
        INaturalistUser120k.load(
            INaturalistUser120k.Config(image_size=16, min_user_samples=1), tmp_path
        )


# ---- named suites ----------------------------------------------------------------------------

SUITE_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
# Components the real suites name that other issues are still adding; entries naming one of them
# are left out until it is registered (then the whole suite is checked). Any other unknown name
# (a typo) fails the test.
PLANNED = {
    "methods": {
        "sgpt",
        "fgpt",
        "fgpt-u",
        "pep-fedpt",
        "fedpr",
        "fedmix",
        "fedmoon",
        "fed-dualprompt",
        "pfedpg",
        "pfedhn",
        "fedem",
        "per-fedavg",
        "p-pt",
    },
    "partitions": set(),
    "datasets": set(),
}
REGISTRY = {"methods": "METHODS", "partitions": "PARTITIONS", "datasets": "DATASETS"}


def _registered(axis: str, name: str) -> bool:
    import fpbench.registry as registry

    return name in getattr(registry, REGISTRY[axis])


def _available(raw: dict) -> tuple[dict, set[str]]:
    """The suite without entries naming planned-but-unregistered components, and those names."""
    waiting: set[str] = set()
    grids = []
    for grid in raw.get("grids") or [{}]:
        kept = dict(grid)
        for axis in REGISTRY:
            entries = grid.get(axis, raw.get(axis, []))
            for e in entries:
                if not _registered(axis, e["name"]):
                    assert e["name"] in PLANNED[axis], f"unknown {axis[:-1]} {e['name']!r}"
                    waiting.add(e["name"])
            kept[axis] = [e for e in entries if _registered(axis, e["name"])]
        if all(kept[axis] for axis in REGISTRY):
            grids.append(kept)
    top = {k: v for k, v in raw.items() if k not in (*REGISTRY, "grids")}
    return {**top, "grids": grids}, waiting


@pytest.mark.parametrize("path", sorted(SUITE_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_suite_expands(path) -> None:
    import tomllib

    from fpbench.suites import expand_suite, load_suite

    raw = tomllib.loads(path.read_text())
    assert raw.get("description"), f"{path.name}: say which paper table the suite feeds"
    available, waiting = _available(raw)
    if not waiting:
        suite = load_suite(str(path))
        assert suite.cells and len({c.run_key for c in suite.cells}) == len(suite.cells)
        return
    if not available["grids"]:
        pytest.skip(f"every cell waits for {sorted(waiting)}")
    suite = expand_suite(available, name=raw["name"], path=str(path))
    assert suite.cells


def test_grids_union_and_own_axes() -> None:
    from fpbench.suites import expand_suite

    base = {
        "defaults": {"backbone": {"name": "vit-test"}, "partition": {"num_clients": 4}},
        "methods": [{"name": "head-tune"}, {"name": "fedvpt"}],
        "grids": [
            {"datasets": [{"name": "cifar10"}], "partitions": [{"name": "iid"}]},
            {
                "defaults": {"partition": {"num_clients": 6}},
                "datasets": [{"name": "cifar100"}],
                "partitions": [{"name": "pachinko"}],
                "methods": [{"name": "fedvpt"}],
            },
        ],
    }
    cells = expand_suite(base, name="g").cells
    got = [(c.dataset.name, c.partition.name, c.method.name) for c in cells]
    assert got == [
        ("cifar10", "iid", "head-tune"),
        ("cifar10", "iid", "fedvpt"),
        ("cifar100", "pachinko", "fedvpt"),
    ]
    assert [c.partition.args["num_clients"] for c in cells] == [4, 4, 6]
    with pytest.raises(FpbenchError, match="grids"):
        expand_suite({**base, "grids": [{"dataset": []}]}, name="g")


def test_real_suites_protocols() -> None:
    """Spot checks of the papers' numbers in the named suites (cells that expand today)."""
    import tomllib

    from fpbench.suites import expand_suite

    raw = tomllib.loads((SUITE_DIR / "label-het.toml").read_text())
    cells = expand_suite(_available(raw)[0], name="label-het").cells
    by = {(c.dataset.label, c.partition.label): c for c in cells}
    c = by[("cifar100", "path-s10")]
    assert (c.partition.args["num_clients"], c.partition.args["s"]) == (100, 10)
    assert c.train.participation == 0.05 and c.train.local_epochs == 5
    t = by[("tiny-imagenet", "dir-0.3")]
    assert t.partition.args["num_clients"] == 200 and t.train.participation == 0.025
    f = by[("five-dataset", "per-dataset")]
    assert f.partition.args["clients_per_domain"] == 4 and f.train.participation == 0.1
    assert f.dataset.args["test_per_source"] == 1000  # equal client test sets (SGPT Table 1)
    cc = by[("cifar100-c", "path-s2")]
    assert cc.partition.args["num_clients"] == 50 and cc.dataset.args["per_domain"] == 1000


# ---- end to end: a suite cell on a real dataset read from the data root ------------------------


def test_suite_cell_runs_on_real_cifar10(tmp_path, monkeypatch) -> None:
    from fpbench.engine import task
    from fpbench.engine.runner import run_suite
    from fpbench.store import Store
    from fpbench.suites import expand_suite

    raw = {
        "defaults": {
            "backbone": {"name": "vit-test"},
            "partition": {"num_clients": 4},
            "train": {"rounds": 2, "participation": 1.0, "batch_size": 16, "eval_last": 1},
        },
        "datasets": [{"name": "cifar10"}],
        "partitions": [{"name": "dirichlet", "alpha": 0.5, "min_size": 5}],
        "methods": [{"name": "head-tune"}],
    }
    cells = list(expand_suite(raw, name="real-mini").cells)
    cells = [
        c.model_copy(update={"runtime": c.runtime.model_copy(update={"device": "cpu"})})
        for c in cells
    ]
    store = Store(Store.url_from_path_or_url(str(tmp_path / "r.db")))
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    task._load.cache_clear()
    with pytest.raises(FpbenchError, match="cifar-10-batches-py"):  # no data: fails fast
        run_suite(cells, store, checkpoint_dir=tmp_path / "ck")
    write_cifar10(tmp_path / "data", train_per_class=2, test_per_class=3)
    task._load.cache_clear()
    [result] = run_suite(cells, store, checkpoint_dir=tmp_path / "ck")
    assert result.status == "done", result.error
    assert list((tmp_path / "data" / PREPARED_DIR).glob("cifar10-*.pt"))
    frame = store.metrics(suite="real-mini")
    acc = frame[frame["name"] == "acc_global"]["value"]
    tested = 10 * 3  # the full test split: 10 classes x 3 images
    assert len(acc) > 0 and ((acc * tested).round() - acc * tested).abs().max() < 1e-5
    task._load.cache_clear()


def test_download_only_when_asked(tmp_path, monkeypatch) -> None:
    import fpbench.data.tiny_imagenet as tiny

    calls = []

    def fake_download(url: str, root: Path, md5: str | None = None) -> None:
        calls.append((url, md5))
        write_tiny_imagenet(root, classes=2, train_per_class=1)  # what the archive extracts to

    monkeypatch.setattr(tiny, "download_archive", fake_download)
    with pytest.raises(FpbenchError, match="--download"):
        TinyImageNet.prepare(TinyImageNet.Config(), tmp_path)
    assert calls == []
    TinyImageNet.prepare(TinyImageNet.Config(), tmp_path, download=True)
    assert calls == [(tiny.URL, tiny.MD5)]
    assert TinyImageNet.load(TinyImageNet.Config(), tmp_path).train_images.shape[0] == 2
    with pytest.raises(FpbenchError, match="cannot be downloaded"):
        OfficeCaltech10.prepare(OfficeCaltech10.Config(), tmp_path, download=True)
