"""Bad input as a corpus, and cells that fail: exit code 2 with one clear line and nothing
half-written, or a failed run with its error and traceback stored and `--retry-failed`."""

from __future__ import annotations

import dataclasses
import re
import shutil
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine import build, rounds, runner
from fpbench.engine.checkpoint import checkpoint_path
from fpbench.store import Store
from fpbench.store.schema import SCHEMA_VERSION, stored_version
from fpbench.suites import MAX_CELLS, load_suite
from tests.conftest import TINY_SUITE_TOML, error_messages

SUITE = TINY_SUITE_TOML.replace("seeds = [0]", "seeds = [0, 1]") + '[[methods]]\nname = "local"\n'
PROGRESS = re.compile(r"\d+/\d+\s+\d+:\d\d:\d\d$")  # a rich progress bar's last line


def _edit(old: str, new: str) -> str:
    assert old in SUITE, old
    return SUITE.replace(old, new, 1)


def _huge_grid() -> str:
    """50 x 50 x 50 x 1 = 125,000 cells, above MAX_CELLS."""
    axes = {"datasets": "synthetic", "partitions": "iid", "methods": "fedvpt"}
    text = 'name = "huge"\nseeds = [0]\n'
    for axis, name in axes.items():
        text += "".join(f'[[{axis}]]\nname = "{name}"\nlabel = "{name}-{i}"\n' for i in range(50))
    return text


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _run(db: str = "results/x.db", *extra: str) -> tuple[int, str, str]:
    return _cli("run", "--suite", "benchmarks/tiny.toml", "--db", db, "--seed", "0", *extra)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "tiny.toml").write_text(SUITE)
    return tmp_path


def _assert_one_error_line(stderr: str, expected: str) -> None:
    """One `error:` message (wrapped to the width: its later lines indented), else progress."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = error_messages(stderr)
    assert len(errors) == 1, stderr
    assert expected in errors[0], stderr
    assert "Traceback" not in stderr
    first = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    rest = [line for line in lines[first + 1 :] if not line.startswith("  ")]
    assert all(PROGRESS.search(line) for line in [*lines[:first], *rest]), stderr


def _runs_in(path: Path) -> int:
    with sqlite3.connect(path) as con:
        return con.execute("SELECT count(*) FROM runs").fetchone()[0]


def _assert_nothing_written(workdir: Path) -> None:
    db = workdir / "results" / "x.db"
    assert not db.exists()  # nothing is created before a run writes its first row
    assert not list(workdir.rglob("*.pt")), list(workdir.rglob("*.pt"))
    assert not (workdir / "results" / "jobs").exists()


# -- the corpus: (suite text, extra CLI args, expected words in the error line) --------------

CIFAR = _edit("num_classes = 6, image_size = 16, train_per_class = 12, test_per_class = 6", "")
CIFAR = CIFAR.replace('"synthetic"', '"cifar10"').replace("num_clients = 4", "num_clients = 10")
CORPUS = [
    pytest.param("name = \n[[methods", (), "malformed suite file", id="malformed-toml"),
    pytest.param(b"\xff\xfe\x00garbage", (), "malformed suite file", id="binary-suite-file"),
    pytest.param(_edit("rounds = 2", 'rounds = "two"'), (), "train.rounds", id="str-for-int"),
    pytest.param(_edit("seeds = [0, 1]", "seeds = 0"), (), "seeds must be", id="seeds-not-list"),
    pytest.param(_edit("seeds = [0, 1]", "seeds = [true]"), (), "seeds must be", id="seed-bool"),
    pytest.param(_edit("seeds = [0, 1]", "seeds = [-1]"), (), "non-negative", id="seed-negative"),
    pytest.param(_edit("[defaults]", "defaults = 3\n[x]"), (), "unknown top-level", id="defs-int"),
    pytest.param(
        _edit("dataset = {", "dataset = 5\ndatasetx = {"), (), "defaults.dataset", id="axis-int"
    ),
    pytest.param(SUITE + "overrides = 5\n", (), "overrides must be a table", id="overrides-int"),
    pytest.param("grids = 5\n" + SUITE, (), "grids must be a list", id="grids-int"),
    pytest.param(_edit('name = "tiny"', "name = 5"), (), "suite name 5", id="name-int"),
    pytest.param(
        _edit('name = "tiny"', 'name = "t"\ndescription = []'),
        (),
        "description",
        id="description-list",
    ),
    pytest.param(SUITE + "[extra]\n", (), "unknown top-level key(s) ['extra']", id="unknown-top"),
    pytest.param(_edit("rounds = 2", "rounds = 2, roundz = 4"), (), "train.roundz", id="typo-key"),
    pytest.param(SUITE + "bogus = 1\n", (), "method.bogus", id="unknown-method-arg"),
    pytest.param(_huge_grid(), (), f"more than the limit of {MAX_CELLS:,}", id="huge-grid"),
    pytest.param(
        _edit('name = "tiny"', 'name = "../../x"'), (), "suite name '../../x'", id="suite-name-path"
    ),
    pytest.param(
        SUITE + 'label = "../../../etc/x"\n', (), "label '../../../etc/x'", id="label-path"
    ),
    pytest.param(SUITE + 'label = ".."\n', (), "label '..'", id="label-dotdot"),
    pytest.param(SUITE + 'label = "a\\nb"\n', (), "not allowed", id="label-newline"),
    pytest.param(SUITE + 'label = "a\\\\b"\n', (), "not allowed", id="label-backslash"),
    pytest.param(_edit('"fedvpt"', '"fedvpt2"'), (), "unknown method 'fedvpt2'", id="method"),
    pytest.param(_edit('"synthetic"', '"mnist"'), (), "unknown dataset 'mnist'", id="dataset"),
    pytest.param(_edit('"pathological"', '"zipf"'), (), "unknown partition 'zipf'", id="part"),
    pytest.param(_edit('"vit-test"', '"vit-huge"'), (), "unknown backbone", id="backbone"),
    pytest.param(_edit("\ns = 3", "\ns = 30"), (), "partition.s = 30", id="s-above-classes"),
    pytest.param(
        _edit("participation = 0.75", "participation = 0"),
        (),
        "participation",
        id="participation-0",
    ),
    pytest.param(_edit("lr = 0.05", "lr = inf"), (), "train.lr", id="lr-inf"),
    pytest.param(_edit("lr = 0.05", "lr = nan"), (), "train.lr", id="lr-nan"),
    pytest.param(
        _edit("heldout_frac = 0.25", "heldout_frac = 1.0"), (), "heldout_frac", id="all-heldout"
    ),
    pytest.param(
        _edit("num_clients = 4", "num_clients = 200"),
        (),
        "0 train samples",
        id="more-clients-than-samples",
    ),
    pytest.param(
        _edit('"vit-test" }', '"vit-test", weights = "no/such.pth" }'),
        (),
        "no/such.pth",
        id="missing-weights-file",
    ),
    pytest.param(SUITE, ("--device", "tpu"), "invalid device 'tpu'", id="device"),
    pytest.param(SUITE, ("--client-executor", "fast"), "--client-executor", id="executor"),
    pytest.param(CIFAR, ("--data-root", "nowhere"), "cifar10", id="missing-data-root"),
    pytest.param(
        SUITE, ("--suite", "benchmarks/nope.toml"), "suite file not found", id="missing-suite-file"
    ),
    pytest.param(SUITE, ("--suite", "nope"), "unknown suite 'nope'", id="unknown-suite-name"),
    pytest.param(
        SUITE,
        ("--db", "postgresql+psycopg://u:p@127.0.0.1:9/x"),
        "cannot open results database",
        id="unreachable-db",
    ),
    pytest.param(
        SUITE,
        ("--db", "sqlite:////proc/fpbench/x.db"),
        "cannot open results database",
        id="db-in-unwritable-place",
    ),
    pytest.param(
        SUITE,
        ("--db", "nosuchdialect://x"),
        "cannot open results database",
        id="db-unknown-dialect",
    ),
]


@pytest.mark.parametrize("suite, args, expected", CORPUS)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(workdir, suite, args, expected):
    path = workdir / "benchmarks" / "tiny.toml"
    path.write_bytes(suite if isinstance(suite, bytes) else suite.encode())
    code, _, stderr = _run("results/x.db", *args)
    assert code == 2, stderr
    _assert_one_error_line(stderr, expected)
    _assert_nothing_written(workdir)


def test_labels_never_reach_file_paths(workdir):
    """Only run keys (hex hashes) name files; every label and suite name is checked anyway."""
    suite = load_suite("benchmarks/tiny.toml")
    for cfg in suite.cells:
        assert re.fullmatch(r"[0-9a-f]{16}", cfg.run_key)
        path = checkpoint_path(workdir / "ck", cfg.run_key)
        assert path.resolve().parent == (workdir / "ck").resolve()


# -- database files: corrupt, newer and older schema versions --------------------------------


def _make_db(path: Path) -> None:
    with Store(f"sqlite:///{path}") as store:
        fields = dict(suite="s", method="m", dataset="d", partition="p", seed=0)
        versions = dict(fpbench_version="0", torch_version="0", device="cpu")
        store.create_run(run_key="k" * 16, config={"train": {"rounds": 1}}, **fields, **versions)


def test_a_corrupt_database_file_is_a_user_error_and_left_alone(workdir):
    db = workdir / "results" / "x.db"
    db.parent.mkdir()
    db.write_bytes(b"this is not a database" * 100)
    before = db.read_bytes()
    code, _, stderr = _run("results/x.db")
    assert code == 2
    _assert_one_error_line(stderr, "cannot open results database")
    assert db.read_bytes() == before


def test_a_newer_schema_version_is_refused_before_anything_is_written(workdir):
    db = workdir / "results" / "x.db"
    db.parent.mkdir()
    _make_db(db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    before = db.read_bytes()
    for args in (["run", "--suite", "benchmarks/tiny.toml"], ["show", "1"], ["db", "check"]):
        db_args = ["results/x.db"] if args[0] == "db" else ["--db", "results/x.db"]
        code, _, stderr = _cli(*args, *db_args)
        assert code == 2, (args, stderr)
        expected = f"schema version {SCHEMA_VERSION + 1} is newer than this fpbench's"
        _assert_one_error_line(stderr, expected)
        assert "pip install -U fpbench" in error_messages(stderr)[0]
    code, _, stderr = _cli("db", "merge", "merged.db", "results/x.db")
    assert code == 2 and "is newer than this fpbench's" in " ".join(stderr.split())
    assert not (workdir / "merged.db").exists()  # the output is not created
    assert db.read_bytes() == before and _runs_in(db) == 1


def test_an_older_schema_is_upgraded_in_place_keeping_its_runs(workdir):
    db = workdir / "old.db"
    _make_db(db)
    with sqlite3.connect(db) as con:  # what version 1 looked like: no claims, no traceback, no meta
        for column in ("owner", "heartbeat_at", "traceback"):
            con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
        con.execute("DROP TABLE meta")
    with sqlite3.connect(db) as con:
        assert "traceback" not in {r[1] for r in con.execute("PRAGMA table_info(runs)")}
    code, stdout, stderr = _cli("show", "1", "--db", str(db))  # reads it: nothing written
    assert code == 0, stderr
    assert "k" * 16 in stdout
    with sqlite3.connect(db) as con:
        assert "meta" not in {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    Store(f"sqlite:///{db}").close()  # a writer upgrades it in place
    with sqlite3.connect(db) as con:
        columns = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
        version = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    assert {"owner", "heartbeat_at", "traceback"} <= columns
    assert version == (str(SCHEMA_VERSION),)
    with Store(f"sqlite:///{db}") as store:  # opening again changes nothing and still works
        assert stored_version(store._engine) == SCHEMA_VERSION
        assert store.find_run("k" * 16).traceback is None


# -- failing cells: NaN loss, a crash while building, --retry-failed, corrupt checkpoints -----


def _poison(monkeypatch) -> None:
    """fedvpt's loss turns NaN in round 1; `local` crashes while it is built (as OOM would)."""
    train, build_method_ = rounds.train_clients, build.build_method

    def train_clients(method, server, task, client_ids, cfg, *, round_idx, **kw):
        out = train(method, server, task, client_ids, cfg, round_idx=round_idx, **kw)
        if method.name == "fedvpt" and round_idx == 1:
            out = dataclasses.replace(out, loss=torch.full_like(out.loss, float("nan")))
        return out

    def build_method(cfg, task, device, *args, **kw):
        if cfg.method.name == "local":
            raise RuntimeError("CUDA out of memory (simulated)")
        return build_method_(cfg, task, device, *args, **kw)

    monkeypatch.setattr(rounds, "train_clients", train_clients)
    monkeypatch.setattr(build, "build_method", build_method)


@pytest.fixture(scope="module")
def failed_suite(tmp_path_factory) -> Path:
    """A folder holding a run of the tiny suite's seed 0 in which fedvpt and local failed."""
    folder = tmp_path_factory.mktemp("failed")
    (folder / "benchmarks").mkdir()
    (folder / "benchmarks" / "tiny.toml").write_text(SUITE)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        _poison(mp)
        code, stdout, stderr = _run("results/f.db")
    assert code == 1, stderr
    assert "1 cell ran, 0 already done, 2 failed" in stdout
    assert re.search(r"failed: fedvpt .*NonFiniteLoss: training loss is nan", stderr), stderr
    assert "RuntimeError: CUDA out of memory (simulated)" in stderr
    return folder


@pytest.fixture
def failed(failed_suite, tmp_path, monkeypatch) -> Path:
    """A private copy of `failed_suite` as the working directory."""
    work = tmp_path / "w"
    shutil.copytree(failed_suite, work)
    monkeypatch.chdir(work)
    return work


def _by_method(db: Path) -> pd.DataFrame:
    with Store(f"sqlite:///{db}") as store:
        return store.runs().set_index("method")


def _fedvpt_rows(db: Path) -> pd.DataFrame:
    with Store(f"sqlite:///{db}") as store:
        run_id = int(store.runs().set_index("method").loc["fedvpt", "id"])
        metrics = store.metrics(run_ids=[run_id], aggregate_only=False).drop(columns="run_id")
        return metrics.sort_values(["round", "client_id", "name"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def uninterrupted_fedvpt(tmp_path_factory) -> pd.DataFrame:
    folder = tmp_path_factory.mktemp("whole")
    (folder / "tiny.toml").write_text(SUITE)
    cfg = next(c for c in load_suite(str(folder / "tiny.toml")).cells if c.method.name == "fedvpt")
    with Store(f"sqlite:///{folder / 'u.db'}") as store:
        assert runner.run_cell(cfg, store, checkpoint_dir=folder / "ck").status == "done"
    return _fedvpt_rows(folder / "u.db")


def test_failed_cells_store_error_and_traceback_and_the_suite_goes_on(failed):
    db = failed / "results" / "f.db"
    runs = _by_method(db)
    assert dict(runs["status"]) == {"head-tune": "done", "fedvpt": "failed", "local": "failed"}
    assert runs.loc["fedvpt", "last_round"] == 0  # the NaN round was not stored
    assert runs.loc["fedvpt", "error"] == (
        "NonFiniteLoss: training loss is nan (not finite) after local training in round 1; "
        "lower train.lr or set train.grad_clip"
    )
    with Store(f"sqlite:///{db}") as store:
        nan = store.get_run(int(runs.loc["fedvpt", "id"]))
        oom = store.get_run(int(runs.loc["local", "id"]))
    assert nan.traceback.startswith("Traceback (most recent call last)")
    assert "in play_round" in nan.traceback and nan.traceback.rstrip().endswith(nan.error)
    assert "in build_method" in oom.traceback and "CUDA out of memory" in oom.error
    code, _, stderr = _cli("show", str(nan.id), "--db", str(db))
    assert code == 0 and "Traceback (most recent call last)" in stderr and "in play_round" in stderr
    code, stdout, _ = _cli("db", "check", str(db))
    assert code == 1 and stdout.count("--retry-failed") == 2


def test_retry_failed_reruns_only_failed_cells_resuming_from_checkpoints(
    failed, uninterrupted_fedvpt
):
    db = failed / "results" / "f.db"
    before = _by_method(db)
    with Store(f"sqlite:///{db}") as store:
        round0 = store.rounds(int(before.loc["fedvpt", "id"])).iloc[0].to_dict()
    code, stdout, stderr = _cli("run", "--suite", "tiny", "--db", str(db), "--retry-failed")
    assert code == 0, stderr
    assert "retrying 2 failed cell(s) of suite tiny; 4 skipped" in stdout  # 6 cells: 2 seeds
    assert "2 cells ran, 0 already done, 0 failed" in stdout
    after = _by_method(db)
    assert len(after) == 3  # seed 1 was never run and still is not
    assert set(after["status"]) == {"done"} and after["error"].isna().all()
    assert after.loc["head-tune", "finished_at"] == before.loc["head-tune", "finished_at"]
    with Store(f"sqlite:///{db}") as store:
        rounds = store.rounds(int(after.loc["fedvpt", "id"]))
        assert store.get_run(int(after.loc["fedvpt", "id"])).traceback is None
    assert rounds["round"].tolist() == [0, 1]
    assert rounds.iloc[0].to_dict() == round0  # resumed after round 0, not restarted
    pd.testing.assert_frame_equal(_fedvpt_rows(db), uninterrupted_fedvpt)
    code, stdout, _ = _cli("run", "--suite", "tiny", "--db", str(db), "--retry-failed")
    assert code == 0 and "no failed cells to retry (6 skipped)" in stdout


def test_retry_failed_without_a_database_creates_none(workdir):
    code, stdout, stderr = _run("results/none.db", "--retry-failed")
    assert code == 0, stderr
    assert "no failed cells to retry (3 skipped)" in stdout
    assert not (workdir / "results").exists()


def test_a_corrupt_checkpoint_is_ignored_with_a_warning_and_the_cell_restarts(
    failed, uninterrupted_fedvpt, caplog
):
    db = failed / "results" / "f.db"
    fedvpt = _by_method(db).loc["fedvpt"]
    with Store(f"sqlite:///{db}") as store:  # checkpoints live under their database's identity
        folder = failed / "results" / "checkpoints" / store.database_id
    checkpoint = checkpoint_path(folder, fedvpt["run_key"])
    assert checkpoint.is_file()
    checkpoint.write_bytes(b"\x00truncated by a full disk")
    with Store(f"sqlite:///{db}") as store:
        wall0 = store.rounds(int(fedvpt["id"]))["wall_s"].iloc[0]
    args = ("run", "--suite", "tiny", "--db", str(db), "--retry-failed", "--method", "fedvpt")
    code, stdout, stderr = _cli(*args)
    assert code == 0, stderr
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"ignoring unreadable checkpoint {checkpoint} (UnpicklingError); the run restarts"
    ]
    assert _by_method(db).loc["fedvpt", "status"] == "done"
    with Store(f"sqlite:///{db}") as store:
        rounds = store.rounds(int(fedvpt["id"]))
    assert rounds["round"].tolist() == [0, 1] and rounds["wall_s"].iloc[0] != wall0
    pd.testing.assert_frame_equal(_fedvpt_rows(db), uninterrupted_fedvpt)
    assert not checkpoint.exists()  # a done cell's checkpoint is removed
