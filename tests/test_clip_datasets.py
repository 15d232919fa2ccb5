"""CLIP-side data and protocols: the CoOp few-shot datasets and Office31 / OfficeHome, read from
miniature native-format files; the disjoint-classes partition; the local-accuracy label space."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fpbench.data import coop_fewshot as coop
from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.office import Office31, OfficeHome
from fpbench.data.prepared import PREPARED_DIR
from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.registry import DATASETS

COOP = [
    coop.Caltech101,
    coop.OxfordPets,
    coop.StanfordCars,
    coop.Flowers102,
    coop.Food101,
    coop.SUN397,
    coop.DTD,
    coop.EuroSAT,
    coop.UCF101,
]
SPLITS = {"train": 3, "val": 1, "test": 2}  # images per class


def colour(k: int) -> tuple[int, int, int]:
    return (40 + 60 * k, 200 - 50 * k, 90)


def write_banded(path: Path, k: int, mode: str = "RGB") -> None:
    """A 24 x 12 image: black | class colour (the centred 12 x 12) | white."""
    path.parent.mkdir(parents=True, exist_ok=True)
    a = np.zeros((12, 24, 3), dtype=np.uint8)
    a[:, 6:18] = colour(k)
    a[:, 18:] = 255
    img = Image.fromarray(a)
    (img.convert("L") if mode == "L" else img).save(path, quality=95)


def raw_name(k: int) -> str:
    return f"kind_{k}__of_thing"  # CoOp names keep underscores (e.g. "american_bulldog")


def write_coop(root: Path, cls, classes: int = 3) -> dict[str, list]:
    """The split json and its images, in `cls`'s native layout; returns the split."""
    split: dict[str, list] = {}
    for s, n in SPLITS.items():
        rows = []
        for k in reversed(range(classes)):  # list order unrelated to label order
            for i in range(n):
                rel = f"{raw_name(k)}/{s}_{i}.jpg"
                if cls is coop.StanfordCars:  # paths relative to the dataset folder
                    rel = f"cars_{'test' if s == 'test' else 'train'}/{k:02d}{s}{i}.jpg"
                mode = "L" if (s, k, i) == ("train", 0, 0) else "RGB"
                write_banded(cls.images_root(root) / rel, k, mode)
                rows.append([rel, k, raw_name(k)])
        split[s] = rows
    (cls.raw_dir(root) / cls.split_file).write_text(json.dumps(split))
    return split


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean(dim=(2, 3))  # (N, 3); a square resize would mix in black and white


@pytest.mark.parametrize("cls", COOP, ids=lambda c: c.name)
def test_coop_dataset_reads_split_file_and_native_layout(cls, tmp_path) -> None:
    split = write_coop(tmp_path, cls)
    assert DATASETS.get(cls.name) is cls
    data = cls.load(cls.Config(image_size=8), tmp_path)
    assert data.class_names == ["kind 0 of thing", "kind 1 of thing", "kind 2 of thing"]
    assert data.train_images.shape == (9, 3, 8, 8) and data.test_images.shape == (6, 3, 8, 8)
    assert data.train_labels.tolist() == [y for _, y, _ in split["train"]]  # split-file order
    assert data.test_labels.tolist() == [2, 2, 1, 1, 0, 0]
    # shorter side to 8, centred crop: only the class-coloured middle band is left
    for x, y in ((data.train_images, data.train_labels), (data.test_images, data.test_labels)):
        want = torch.tensor([colour(int(k)) for k in y], dtype=torch.float32)
        got = _mean(x)
        grey = (got[:, 0] - got[:, 2]).abs() < 2  # the one greyscale file: R = G = B
        assert (got[~grey] - want[~grey]).abs().max() < 6
        assert grey.sum() <= 1
    assert len(list((tmp_path / PREPARED_DIR).glob(f"{cls.name}-*.pt"))) == 1
    assert cls.info(cls.Config()).num_classes == cls.num_classes  # the real split's count


def test_coop_val_in_train_and_cache_per_config(tmp_path) -> None:
    cls = coop.DTD
    write_coop(tmp_path, cls, classes=2)
    plain = cls.load(cls.Config(image_size=8), tmp_path)
    more = cls.load(cls.Config(image_size=8, val_in_train=True), tmp_path)
    assert len(plain.train_labels) == 6 and len(more.train_labels) == 8
    assert torch.equal(more.train_images[:6], plain.train_images)
    assert len(list((tmp_path / PREPARED_DIR).glob("dtd-*.pt"))) == 2


def test_coop_missing_data_names_split_file_and_source(tmp_path) -> None:
    cls = coop.Caltech101
    with pytest.raises(FpbenchError) as e:
        cls.load(cls.Config(), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "split_zhou_Caltech101.json" in msg and "CoOp" in msg
    assert "101_ObjectCategories" in msg and str(tmp_path) in msg
    assert not (tmp_path / PREPARED_DIR).exists()


def test_coop_missing_image_and_bad_labels_raise(tmp_path) -> None:
    cls = coop.EuroSAT
    split = write_coop(tmp_path, cls, classes=2)
    (cls.images_root(tmp_path) / split["test"][0][0]).unlink()
    with pytest.raises(FpbenchError, match="1 images of the test split are missing"):
        cls.load(cls.Config(image_size=8), tmp_path)
    path = cls.raw_dir(tmp_path) / cls.split_file
    bad = {**split, "test": split["train"][:1]}
    bad["train"] = [[r, 1 if y == 0 else y, n] for r, y, n in split["train"]]  # 0 renamed
    path.write_text(json.dumps(bad))
    with pytest.raises(FpbenchError, match="label 1 is named both"):
        cls.load(cls.Config(image_size=8), tmp_path)
    shifted = {s: [[r, y + 1, f"c{y}"] for r, y, _ in rows] for s, rows in split.items()}
    path.write_text(json.dumps(shifted))
    with pytest.raises(FpbenchError, match=r"0..C-1; missing \[0\]"):
        cls.load(cls.Config(image_size=8), tmp_path)


def test_data_status_lists_the_clip_datasets(tmp_path) -> None:
    from fpbench.cli.data import dataset_rows

    write_coop(tmp_path, coop.Flowers102, classes=1)
    rows = {name: (state, todo) for name, state, _, todo in dataset_rows(tmp_path)}
    assert rows["flowers102"][0] == "raw"
    for cls in [*COOP[:3], Office31, OfficeHome]:
        assert rows[cls.name][0] == "missing" and rows[cls.name][1] == cls.hint


# ---- Office31 / OfficeHome -------------------------------------------------------------------


def write_office(root: Path, cls, dirs: list[str], classes: int, per: int) -> None:
    """<folder>/<domain dir>/<class>/*.png in varying sizes; pixel colours encode (d, k)."""
    for d, domain in enumerate(dirs):
        for k, c in enumerate(cls.classes[:classes]):
            for i in range(per + d):
                path = root / domain / c / f"img{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (10 + i, 12), (50 * d + 5, 20 * k + 3, 100)).save(path)


@pytest.mark.parametrize(
    ("cls", "dirs"),
    [
        (Office31, ["office31/amazon/images", "office31/dslr/images", "office31/webcam/images"]),
        (
            OfficeHome,
            [
                f"OfficeHomeDataset_10072016/{d}"
                for d in ("Art", "Clipart", "Product", "Real World")
            ],
        ),
    ],
    ids=["office31", "officehome"],
)
def test_office_domains_from_raw_folders(cls, dirs, tmp_path) -> None:
    write_office(tmp_path, cls, dirs, classes=4, per=5)
    data = cls.load(cls.Config(image_size=8, test_fraction=0.2), tmp_path)
    assert data.domain_names == list(cls.domain_names) and data.num_classes == len(cls.classes)
    assert all("_" not in n for n in data.class_names)
    for d in range(len(dirs)):
        test = data.test_labels[data.test_domains == d]
        k = int(np.floor(0.2 * (5 + d) + 0.5))
        assert torch.bincount(test, minlength=4).tolist()[:4] == [k] * 4
        assert (data.train_domains == d).sum() == 4 * (5 + d - k)
    for split in ("train", "test"):
        x = getattr(data, f"{split}_images").float().mean(dim=(2, 3))  # (N, 3)
        d, y = getattr(data, f"{split}_domains"), getattr(data, f"{split}_labels")
        want = torch.stack([50 * d + 5, 20 * y + 3, torch.full_like(y, 100)], 1).float()
        assert (x - want).abs().max() < 1.5
    assert DatasetInfo.of(data) == cls.info(cls.Config())


def test_office_real_world_underscore_and_names(tmp_path) -> None:
    dirs = [f"office_home/{d}" for d in ("Art", "Clipart", "Product", "Real_World")]
    write_office(tmp_path, OfficeHome, dirs, classes=1, per=2)
    data = OfficeHome.load(OfficeHome.Config(image_size=8), tmp_path)
    assert data.class_names[0] == "Alarm Clock" and len(data.class_names) == 65
    assert Office31.info(Office31.Config()) == DatasetInfo(31, 3, False)


def test_office_unknown_class_folder_and_missing(tmp_path) -> None:
    with pytest.raises(FpbenchError, match="office31"):
        Office31.load(Office31.Config(), tmp_path)
    write_office(tmp_path, Office31, ["office31/amazon", "office31/dslr"], classes=1, per=1)
    assert Office31.status(tmp_path).state == "missing"  # webcam absent
    write_office(tmp_path, Office31, ["office31/webcam"], classes=1, per=1)
    (tmp_path / "office31/dslr/bicycle").mkdir()
    with pytest.raises(FpbenchError, match="'bicycle' is not one of the 31"):
        Office31.load(Office31.Config(image_size=8), tmp_path)


# ---- disjoint-classes partition --------------------------------------------------------------


def _labelled(train: list[int], test: list[int], classes: int) -> ImageDataset:
    z = lambda n: torch.zeros(n, 3, 2, 2, dtype=torch.uint8)  # noqa: E731
    return ImageDataset(
        name="toy",
        train_images=z(len(train)),
        train_labels=torch.tensor(train),
        test_images=z(len(test)),
        test_labels=torch.tensor(test),
        class_names=[str(k) for k in range(classes)],
    )


def test_disjoint_classes_few_shot() -> None:
    C = 11
    data = _labelled([k for k in range(C) for _ in range(6)], [k for k in range(C)] * 3, C)
    clients = make_clients("disjoint-classes", {"num_clients": 3, "shots": 4}, data, seed=1)
    y, y_test = data.train_labels.numpy(), data.test_labels.numpy()
    owned = [set(np.unique(y[c.train_idx]).tolist()) for c in clients]
    assert sorted(len(o) for o in owned) == [3, 4, 4]  # 11 classes over 3 clients
    assert set().union(*owned) == set(range(C)) and sum(map(len, owned)) == C  # disjoint
    for c, mine in zip(clients, owned, strict=True):
        assert (np.bincount(y[c.train_idx], minlength=C)[sorted(mine)] == 4).all()  # 4 shots
        assert sorted(c.test_idx.tolist()) == [i for i, k in enumerate(y_test) if k in mine]
    fixed = {"num_clients": 3, "class_seed": 2023}
    a = make_clients("disjoint-classes", fixed, data, seed=0)
    b = make_clients("disjoint-classes", fixed, data, seed=5)
    assert all(np.array_equal(p.test_idx, q.test_idx) for p, q in zip(a, b, strict=True))
    with pytest.raises(FpbenchError, match="at most 11 clients"):
        make_clients("disjoint-classes", {"num_clients": 12}, data, seed=0)


# ---- the label space of local accuracy -------------------------------------------------------

# Test sample i has label Y[i] and logits L[i]; client 0 trains on classes {0, 1}, client 1 on
# {2}; client 0 tests on samples 0, 1, 3 and client 1 on sample 2.
Y = [0, 1, 2, 0]
L = [[1.0, 0.0, 5.0], [0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 4.0, 1.0]]
# all classes:   argmax 2, 1, 0, 1 -> client 0 right on sample 1 only, client 1 wrong
# client's own:  client 0 over {0, 1}: 0, 1, -, 1 -> 2 right; client 1 over {2}: 2 -> right


class _TableMethod:
    """Logits read from L by test index, plus a per-client bias row (zero)."""

    def __init__(self, inference: str) -> None:
        self.inference = inference

    def client_params(self, server, ids, training=True, draw=None):
        return {"b": torch.zeros(len(ids), 3)}

    def forward(self, params, x, rows, ctx):
        return torch.tensor(L)[x] + params["b"][rows]  # (B, 3)


def _task():
    from fpbench.engine.task import Task
    from fpbench.partition.base import make_client

    data = _labelled([0, 1, 2], Y, 3)
    clients = [
        make_client(0, np.array([0, 1]), np.array([0, 1, 3]), np.array([0, 1, 2]), 3),
        make_client(1, np.array([2]), np.array([2]), np.array([0, 1, 2]), 3),
    ]
    return Task(
        data=data,
        clients=clients,
        train_idx=[torch.tensor(c.train_idx) for c in clients],
        test_idx=[torch.tensor(c.test_idx) for c in clients],
        priors=torch.tensor(np.stack([c.class_prior for c in clients]), dtype=torch.float32),
        train_sizes=torch.tensor([2.0, 1.0]),
        heldout=torch.tensor([False, False]),
    )


@pytest.mark.parametrize("inference", ["global", "personal"])
def test_local_label_space_masks_classes_without_train_data(inference) -> None:
    from fpbench.engine.evaluate import evaluate

    task = _task()
    inputs = SimpleNamespace(
        test=lambda idx: idx, recall=lambda *_: contextlib.nullcontext(), task=task
    )
    method = _TableMethod(inference)
    server = SimpleNamespace(buffers={})
    every = evaluate(method, server, task, 2, inputs, label_space="all")
    own = evaluate(method, server, task, 2, inputs, label_space="client")
    assert every.correct_local.tolist() == [1, 0] and own.correct_local.tolist() == [2, 1]
    assert every.total_local.tolist() == own.total_local.tolist() == [3, 1]
    assert np.allclose(every.global_acc, 0.25) and np.allclose(own.global_acc, 0.25)  # all C


def test_local_label_space_option_keeps_old_run_keys() -> None:
    from fpbench.specs import Component, RunConfig, TrainConfig

    comp = Component(name="synthetic", label="synthetic")
    base = RunConfig(suite="s", seed=0, dataset=comp, partition=comp, method=comp.model_dump())
    assert "local_label_space" not in base.identity()["train"]
    client = base.model_copy(update={"train": TrainConfig(local_label_space="client")})
    assert client.identity()["train"]["local_label_space"] == "client"
    assert client.run_key != base.run_key
    with pytest.raises(ValueError, match="local_label_space"):
        TrainConfig(local_label_space="mine")


def test_clip_run_on_coop_files_with_client_label_space(tmp_path, monkeypatch) -> None:
    """A CoOp-format dataset through a suite cell: one class per client, so with the client's
    own label space every local prediction is right; with all classes the cells still run."""
    from fpbench.engine import task
    from fpbench.engine.runner import run_suite
    from fpbench.store import Store
    from fpbench.suites import expand_suite

    write_coop(tmp_path / "data", coop.Caltech101, classes=4)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    raw = {
        "defaults": {
            "backbone": {"name": "clip-test"},
            "dataset": {"image_size": 16},
            "partition": {"num_clients": 4, "shots": 2},
            "train": {"rounds": 1, "batch_size": 8, "eval_last": 1, "summary_window": 1},
        },
        "datasets": [{"name": "caltech101"}],
        "partitions": [{"name": "disjoint-classes", "label": "few-shot"}],
        "grids": [
            {
                "defaults": {"train": {"local_label_space": space}},
                "methods": [
                    {"name": m, "label": f"{m}@{space}", "n_ctx": 2}
                    for m in ("promptfl", "coop-local")  # global and personal inference
                ],
            }
            for space in ("client", "all")
        ],
    }
    cells = [
        c.model_copy(update={"runtime": c.runtime.model_copy(update={"device": "cpu"})})
        for c in expand_suite(raw, name="clip-mini").cells
    ]
    task._load.cache_clear()
    store = Store(Store.url_from_path_or_url(str(tmp_path / "r.db")))
    results = run_suite(cells, store, checkpoint_dir=tmp_path / "ck")
    assert [r.status for r in results] == ["done"] * 4, [r.error for r in results]
    frame = store.metrics(suite="clip-mini", names=["acc_local"], aggregate_only=False)
    local = frame[frame["client_id"].notna()]
    by_space = local.groupby(local["method"].str.split("@").str[1])["value"]
    assert by_space.min()["client"] == 1.0 and by_space.count()["client"] == 2 * 4
    assert by_space.count()["all"] == 2 * 4 and by_space.mean()["all"] < 1.0  # (random tiny CLIP)
    task._load.cache_clear()


# ---- named suites ----------------------------------------------------------------------------

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
CLIP_SUITES = ("clip-fewshot", "clip-single-domain", "clip-multi-domain", "clip-dirichlet")


def test_clip_suites_hold_every_cell_their_paper_tables_ask_for() -> None:
    """Each table of benchmarks/papers that names a clip-* suite finds its cells in it."""
    import tomllib

    from fpbench.suites import load_suite

    cells = {name: load_suite(str(BENCH / f"{name}.toml")).cells for name in CLIP_SUITES}
    have = {
        (n, c.dataset.label, c.partition.label, c.method.label, c.backbone.name)
        for n, suite in cells.items()
        for c in suite
    }
    checked = set()
    for paper in ("tpfl", "sdfed"):
        for table in tomllib.loads((BENCH / "papers" / f"{paper}.toml").read_text())["tables"]:
            if table.get("suite") not in CLIP_SUITES:
                continue
            for col in table["columns"]:
                backbone = col.get("config", {}).get("backbone", {}).get("name")
                for row in table["rows"]:
                    if "dataset" not in col or "method" not in row:  # reference-only cells
                        continue
                    want = (table["suite"], col["dataset"], col["partition"], row["method"])
                    assert any(h[:4] == want and backbone in (None, h[4]) for h in have), want
            checked.add(table["suite"])
    assert checked == set(CLIP_SUITES)


def test_clip_suites_protocol_numbers() -> None:
    from fpbench.suites import load_suite

    few = load_suite(str(BENCH / "clip-fewshot.toml")).cells
    assert {(c.partition.args["num_clients"], c.partition.args["shots"]) for c in few} == {(10, 4)}
    assert {(c.train.optimizer, c.train.lr, c.train.lr_schedule) for c in few} == {
        ("adam", 0.001, "cosine")
    }
    single = load_suite(str(BENCH / "clip-single-domain.toml")).cells
    assert {c.partition.args["shots"] for c in single} == {16}
    multi = load_suite(str(BENCH / "clip-multi-domain.toml")).cells
    clients = {c.dataset.name: c.partition.args["num_clients"] for c in multi}
    assert clients == {"officehome": 8, "office31": 6}  # two clients per domain
    assert {c.partition.args["alpha"] for c in multi} == {0.3}
    dirichlet = load_suite(str(BENCH / "clip-dirichlet.toml")).cells
    assert {(c.partition.args["num_clients"], c.train.rounds) for c in dirichlet} == {(100, 25)}
    for c in (*few, *single, *multi, *dirichlet):
        assert c.train.local_label_space == "all" and c.backbone.name.startswith("clip-")
    smoke = load_suite(str(BENCH / "smoke-clip.toml"))
    assert smoke.name == "smoke-clip" and not (BENCH / "clip-smoke.toml").exists()
