import pytest

from fpbench.errors import FpbenchError
from fpbench.suites import expand_suite, load_suite


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


def test_backbone_normalisation_override_changes_run_key_and_preprocessing():
    import torch

    from fpbench.engine.build import build_method
    from fpbench.engine.task import build_task

    plain = suite().cells[0]
    backbone = {"name": "vit-test", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
    raw_defaults = {
        "backbone": backbone,
        "train": {"rounds": 2},
        "dataset": {"num_classes": 6},
        "partition": {"num_clients": 3},
    }
    unit = suite(defaults=raw_defaults).cells[0]
    assert "mean" not in plain.identity()["backbone"]  # run keys made before the option stay
    assert unit.run_key != plain.run_key
    cpu = torch.device("cpu")
    method = build_method(unit, build_task(unit, cpu), cpu)
    images = torch.full((1, 3, 16, 16), 255, dtype=torch.uint8)
    assert torch.allclose(method.backbone.preprocess(images), torch.ones(1, 3, 16, 16))


def test_backbone_mean_without_std_is_rejected():
    with pytest.raises(FpbenchError, match="mean and backbone.std go together"):
        suite(
            defaults={
                "backbone": {"name": "vit-test", "mean": [0.5, 0.5, 0.5]},
                "dataset": {"num_classes": 6},
                "partition": {"num_clients": 3},
            }
        )


def test_sweep_expands_an_entry_into_one_per_combination():
    s = suite(
        seeds=[0],
        partitions=[{"name": "iid"}],
        methods=[
            {"name": "fedvpt", "sweep": {"prompt_len": [1, 7]}},
            {"name": "sgpt", "label": "s-{num_groups}-{prompt_len}", "sweep": {
                "num_groups": [2, 3], "prompt_len": [1, 2]}},
        ],
    )  # fmt: skip
    got = {c.method.label: c.method.args for c in s.cells}
    assert got["fedvpt-prompt_len=1"]["prompt_len"] == 1
    assert got["fedvpt-prompt_len=7"]["prompt_len"] == 7
    sgpt = {k: (v["num_groups"], v["prompt_len"]) for k, v in got.items() if k.startswith("s-")}
    assert sgpt == {"s-2-1": (2, 1), "s-2-2": (2, 2), "s-3-1": (3, 1), "s-3-2": (3, 2)}


def test_sweep_of_lists_labels_values_joined_by_x():
    s = suite(seeds=[0], partitions=[{"name": "iid"}], methods=[
        {"name": "sdfed", "label": "len-{local_lengths}",
         "sweep": {"local_lengths": [[4, 8], [16, 16]]}}],
        defaults={"backbone": {"name": "clip-test"}, "partition": {"num_clients": 2}},
    )  # fmt: skip
    assert sorted(c.method.label for c in s.cells) == ["len-16x16", "len-4x8"]


@pytest.mark.parametrize(
    ("sweep", "label", "needle"),
    [
        ([1, 2], "x", "sweep must be a table of non-empty lists"),
        ({"prompt_len": []}, "x", "sweep must be a table of non-empty lists"),
        ({"prompt_len": [1]}, "p-{nope}", "names a placeholder that is not swept"),
        ({"prompt_len": [0]}, "p", "prompt_len"),
    ],
)
def test_bad_sweeps_are_rejected(sweep, label, needle):
    with pytest.raises(FpbenchError, match=needle):
        suite(methods=[{"name": "fedvpt", "label": label, "sweep": sweep}])
