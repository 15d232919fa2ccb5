"""Five-dataset's `test_per_source`: each source's test split sampled to one size (SGPT Table 1's
Global = Local needs client test sets of equal size), with older run keys unchanged."""

from __future__ import annotations

import torch

from fpbench.data.five import FiveDataset
from fpbench.suites import load_suite
from tests.test_datasets import _fake_svhn, write_five_without_svhn


def test_each_source_keeps_test_per_source_of_its_own_test_images(tmp_path, monkeypatch):
    import fpbench.data.five as five

    write_five_without_svhn(tmp_path)
    monkeypatch.setattr(five, "read_svhn", _fake_svhn)
    full = FiveDataset.load(FiveDataset.Config(), tmp_path)
    assert torch.bincount(full.test_domains).tolist() == [10, 20, 10, 20, 20]
    cut = FiveDataset.load(FiveDataset.Config(test_per_source=4), tmp_path)
    assert torch.bincount(cut.test_domains).tolist() == [4] * 5
    assert torch.equal(cut.train_labels, full.train_labels)  # the train splits stay whole
    for d in range(5):  # a subset of the source's own test images, in their order
        ours = [(x.tolist(), int(y)) for x, y in zip(
            cut.test_images[cut.test_domains == d], cut.test_labels[cut.test_domains == d],
            strict=True)]  # fmt: skip
        theirs = [(x.tolist(), int(y)) for x, y in zip(
            full.test_images[full.test_domains == d], full.test_labels[full.test_domains == d],
            strict=True)]  # fmt: skip
        assert all(item in theirs for item in ours)
    again = FiveDataset.load(FiveDataset.Config(test_per_source=4), tmp_path)
    assert torch.equal(again.test_labels, cut.test_labels)  # seeded


def test_the_setting_is_left_out_of_the_config_at_none_so_older_run_keys_stay():
    assert "test_per_source" not in FiveDataset.Config().model_dump()
    assert FiveDataset.Config(test_per_source=1000).model_dump()["test_per_source"] == 1000
    cells = [c for c in load_suite("sgpt-table1").cells if c.dataset.name == "five-dataset"]
    assert cells and all(c.dataset.args["test_per_source"] == 1000 for c in cells)
    fgpt = [c for c in load_suite("fgpt-table1").cells if c.dataset.name == "five-dataset"]
    assert fgpt and all("test_per_source" not in c.dataset.args for c in fgpt)
