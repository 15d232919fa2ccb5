import pytest

from fpbench.errors import FpbenchError
from fpbench.specs import expand_suite, load_suite


def suite(**over):
    raw = {
        "seeds": [0, 1],
        "defaults": {
            "backbone": {"name": "vit-test"},
            "train": {"rounds": 2},
            "dataset": {"num_classes": 6},
            "partition": {"num_clients": 3},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "dirichlet", "alpha": 0.5}, {"name": "iid"}],
        "methods": [{"name": "fedvpt", "overrides": {"train": {"lr": 0.1}}}, {"name": "head-tune"}],
    }
    raw.update(over)
    return expand_suite(raw, name="t")


def test_grid_expands_and_merges():
    s = suite()
    assert len(s.cells) == 1 * 2 * 2 * 2
    fedvpt = [c for c in s.cells if c.method.name == "fedvpt"]
    assert all(c.train.lr == 0.1 for c in fedvpt)
    assert all(c.train.rounds == 2 for c in s.cells)
    # defaults merge into every entry; component defaults are filled in
    c = fedvpt[0]
    assert c.partition.args["num_clients"] == 3 and c.partition.args["alpha"] == 0.5
    assert c.method.args == {"prompt_len": 5}
    assert c.dataset.args["num_classes"] == 6 and "image_size" in c.dataset.args


def test_run_key_is_stable_and_ignores_runtime():
    a, b = suite().cells[0], suite().cells[0]
    assert a.run_key == b.run_key and len(a.run_key) == 16
    moved = a.model_copy(update={"runtime": a.runtime.model_copy(update={"device": "cuda"})})
    assert moved.run_key == a.run_key
    other = a.model_copy(update={"seed": 7})
    assert other.run_key != a.run_key
    keys = [c.run_key for c in suite().cells]
    assert len(set(keys)) == len(keys)


def test_default_args_written_explicitly_hash_the_same():
    implicit = suite().cells[0]
    explicit = suite(
        methods=[{"name": "fedvpt", "prompt_len": 5, "overrides": {"train": {"lr": 0.1}}}]
    ).cells[0]
    assert implicit.run_key == explicit.run_key


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"methods": [{"name": "nope"}]}, "unknown method 'nope'"),
        ({"datasets": [{"name": "cifar1000"}]}, "unknown dataset"),
        ({"defaults": {"backbone": {"name": "vit-huge"}}}, "unknown backbone"),
        ({"defaults": {"train": {"rounds": 0}}}, "train.rounds"),
        ({"defaults": {"train": {"participation": 1.5}}}, "train.participation"),
        ({"defaults": {"train": {"participation": 0}}}, "train.participation"),
        ({"partitions": [{"name": "pathological", "s": 30}]}, "s"),
        ({"methods": [{"name": "fedvpt", "prompt_len": 0}]}, "method.prompt_len"),
        ({"methods": [{"name": "fedvpt", "typo": 1}]}, "method.typo"),
        ({"seeds": []}, "seeds"),
        ({"methods": []}, "[[methods]]"),
        ({"methods": [{"name": "fedvpt"}, {"name": "fedvpt"}]}, "label"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_input_names_the_problem(over, needle):
    with pytest.raises(FpbenchError, match=None) as e:
        suite(**over)
    assert needle in str(e.value)


def test_malformed_toml_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seeds = [0]\n[defaults\nx = 1\n")
    with pytest.raises(FpbenchError) as e:
        load_suite(str(path))
    assert "bad.toml" in str(e.value) and "line 2" in str(e.value)


def test_unknown_suite_lists_valid_names():
    with pytest.raises(FpbenchError) as e:
        load_suite("no-such-suite")
    assert "smoke" in str(e.value)


def test_smoke_suite_is_valid():
    s = load_suite("smoke")
    assert {c.method.name for c in s.cells} == {"head-tune", "fedvpt", "local"}
    assert {c.partition.name for c in s.cells} == {"pathological", "dirichlet"}
    assert all(c.backbone.name == "vit-smoke" for c in s.cells)


def test_suite_name_is_not_shadowed_by_a_folder_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()
    assert load_suite("smoke").name == "smoke"
    with pytest.raises(FpbenchError, match="suite file not found"):
        load_suite("missing.toml")
