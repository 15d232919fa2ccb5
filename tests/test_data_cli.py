"""`fpbench data status` and `fpbench data prepare` through Typer's runner on miniature files."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fpbench.cli.data import data_app, dataset_rows
from fpbench.data.prepared import PREPARED_DIR
from tests.test_datasets import write_cifar10, write_cifar100

runner = CliRunner()


def _state(root, name: str) -> str:
    return {row[0]: row[1] for row in dataset_rows(root)}[name]


def test_status_reports_missing_raw_prepared(tmp_path) -> None:
    assert _state(tmp_path, "cifar10") == "missing"
    assert _state(tmp_path, "synthetic") == "built-in"
    write_cifar10(tmp_path)
    assert _state(tmp_path, "cifar10") == "raw"
    result = runner.invoke(data_app, ["prepare", "cifar10", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "prepared cifar10" in result.output
    assert _state(tmp_path, "cifar10") == "prepared"
    assert len(list((tmp_path / PREPARED_DIR).glob("cifar10-*.pt"))) == 1


def test_status_command_lists_every_dataset_and_where(tmp_path) -> None:
    result = runner.invoke(data_app, ["status", "--root", str(tmp_path)], terminal_width=300)
    assert result.exit_code == 0, result.output
    for name in ("cifar10", "cifar100", "tiny-imagenet", "five-dataset", "cifar100-c"):
        assert name in result.output
    assert "cifar-100-python" in result.output and "missing" in result.output


def test_status_uses_the_environment_root(tmp_path, monkeypatch) -> None:
    write_cifar100(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path))
    result = runner.invoke(data_app, ["status"], terminal_width=300)
    assert result.exit_code == 0
    line = next(ln for ln in result.output.splitlines() if "cifar100 " in ln)
    assert "raw" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prepare", "cifar10"], "download cifar-10-python.tar.gz"),
        (["prepare", "cifar1000"], "unknown dataset"),
        (["prepare", "synthetic"], "nothing to prepare"),
        (["prepare", "cifar100-c", "--set", "per_domain"], "KEY=VALUE"),
        (["prepare", "cifar100-c", "--set", "per_domain=0"], "per_domain"),
    ],
)
def test_prepare_user_errors_exit_2_with_one_line(tmp_path, args, message) -> None:
    result = runner.invoke(data_app, [*args, "--root", str(tmp_path)], terminal_width=400)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_prepare_with_config_values(tmp_path) -> None:
    from tests.test_datasets import write_cifar100c

    write_cifar100c(tmp_path)
    args = ["prepare", "cifar100-c", "--root", str(tmp_path), "--set", "per_domain=10"]
    result = runner.invoke(data_app, [*args, "--set", "severities=[5]"])
    assert result.exit_code == 0, result.output
    from fpbench.data.cifar100c import Cifar100C

    data = Cifar100C.load(Cifar100C.Config(per_domain=10, severities=(5,)), tmp_path)
    assert data.train_images.shape[0] + data.test_images.shape[0] == 100
    assert (data.train_images[:, 1, 0, 0] == 5).all()  # severity 5 only


def test_require_present_fails_fast_for_a_suite(tmp_path) -> None:
    from fpbench.data.prepared import dataset_state, require_present
    from fpbench.errors import FpbenchError

    write_cifar10(tmp_path)
    require_present(["synthetic", "cifar10", "cifar10"], tmp_path)  # generated or raw: fine
    assert dataset_state("cifar10", tmp_path) == "raw"
    with pytest.raises(FpbenchError, match="cifar100.*cifar-100-python"):
        require_present(["cifar10", "cifar100"], tmp_path)
