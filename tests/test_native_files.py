"""Native dataset files as they really come: Python 3 pickles, and malformed files named."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.data.cifar import Cifar10, Cifar100
from fpbench.data.prepared import pickle_field
from fpbench.errors import FpbenchError
from tests.conftest import error_messages
from tests.test_datasets import write_cifar10, write_cifar100


def _as_python3(path: Path) -> None:
    """Rewrite a pickled dict as a Python 3 converter does: str keys, str names."""
    record = pickle.loads(path.read_bytes(), encoding="bytes")
    fixed = {
        k.decode(): [v.decode() for v in val] if isinstance(val, list) and val and
        isinstance(val[0], bytes) else val
        for k, val in record.items()
    }  # fmt: skip
    path.write_bytes(pickle.dumps(fixed, protocol=4))


def test_cifar100_with_str_keys_reads_as_the_bytes_original(tmp_path):
    write_cifar100(tmp_path / "bytes")
    write_cifar100(tmp_path / "str")
    for name in ("train", "test", "meta"):
        _as_python3(tmp_path / "str" / "cifar-100-python" / name)
    assert b"fine_labels" not in pickle.loads(
        (tmp_path / "str" / "cifar-100-python" / "train").read_bytes()
    )
    a = Cifar100.load(Cifar100.Config(), tmp_path / "bytes")
    b = Cifar100.load(Cifar100.Config(), tmp_path / "str")
    assert torch.equal(a.train_images, b.train_images) and torch.equal(a.test_labels, b.test_labels)
    assert torch.equal(a.coarse_of_class, b.coarse_of_class)
    assert b.class_names[:2] == ["fine0", "fine1"] == a.class_names[:2]


def test_cifar10_with_str_keys(tmp_path):
    write_cifar10(tmp_path)
    for f in (tmp_path / "cifar-10-batches-py").iterdir():
        _as_python3(f)
    data = Cifar10.load(Cifar10.Config(), tmp_path)
    assert data.train_labels[:12].tolist() == [*range(10), 0, 1]
    assert data.class_names == [f"name{k}" for k in range(10)]


def test_pickle_field_takes_either_key_kind_and_names_what_is_there(tmp_path):
    where = tmp_path / "f"
    assert pickle_field({b"labels": 1}, "labels", where) == 1
    assert pickle_field({"labels": 2}, "labels", where) == 2
    with pytest.raises(FpbenchError, match=r"no 'labels' entry \(it has: batch_label, data\)"):
        pickle_field({b"data": 0, "batch_label": 1}, "labels", where)
    with pytest.raises(FpbenchError, match="expected a pickled dict, got list"):
        pickle_field([1, 2], "labels", where)


def _break(root: Path, name: str, how: str) -> Path:
    path = root / "cifar-100-python" / name
    record = pickle.loads(path.read_bytes(), encoding="bytes")
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how == "no-fine":
        del record[b"fine_labels"]
        path.write_bytes(pickle.dumps(record))
    elif how == "short-labels":
        record[b"fine_labels"] = record[b"fine_labels"][:-1]
        path.write_bytes(pickle.dumps(record))
    elif how == "data-shape":
        record[b"data"] = np.zeros((4, 10), np.uint8)
        path.write_bytes(pickle.dumps(record))
    elif how == "text":
        path.write_text("not a pickle")
    return path


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "not a readable pickle"),
        ("text", "not a readable pickle"),
        ("no-fine", r"no 'fine_labels' entry \(it has: coarse_labels, data\)"),
        (
            "short-labels",
            r"'fine_labels' should be 200 integer labels, got int64 of shape \(199,\)",
        ),
        ("data-shape", r"expected CIFAR data of shape \(N, 3072\), got \(4, 10\)"),
    ],
)
def test_malformed_cifar_file_fails_naming_file_and_fault(tmp_path, how, message):
    write_cifar100(tmp_path)
    path = _break(tmp_path, "train", how)
    with pytest.raises(FpbenchError, match=f"malformed dataset file {path}: {message}"):
        Cifar100.load(Cifar100.Config(), tmp_path)


def test_malformed_file_is_one_line_and_exit_2_from_the_cli(tmp_path):
    write_cifar100(tmp_path)
    path = _break(tmp_path, "test", "no-fine")
    result = CliRunner().invoke(app, ["data", "prepare", "cifar100", "--root", str(tmp_path)])
    assert result.exit_code == 2
    (message,) = error_messages(result.output)
    assert message.startswith(f"error: malformed dataset file {path}: no 'fine_labels' entry")
    assert "Traceback" not in result.output


def test_any_reader_fault_names_the_dataset_folder(tmp_path, monkeypatch):
    write_cifar10(tmp_path)

    def build(cfg, root, progress):
        raise KeyError("wnid")

    monkeypatch.setattr(Cifar10, "build", build)
    folder = tmp_path / "cifar-10-batches-py"
    with pytest.raises(FpbenchError, match=f"malformed cifar10 files under {folder}: KeyError"):
        Cifar10.prepare(Cifar10.Config(), tmp_path)
