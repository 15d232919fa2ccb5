"""Shared fixtures: the tiny federation of `fpbench.testing` (synthetic data, test-sized ViT),
the kit that ships with fpbench; its names are re-exported here for the tests that import them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
import typer.testing

pytest.register_assert_rewrite("fpbench.testing")  # its checks' asserts explain themselves

from fpbench.testing import (  # noqa: E402, F401  (names the test modules import from here)
    OFFLINE_ARGS,
    TINY,
    TINY_SUITE_TOML,
    seeded_server,
    tiny_config,
    with_config,
)

pytest_plugins = ["fpbench.testing"]  # the fixtures `tiny` and `fpbench_cache`

_COMMANDS: dict[int, tuple[typer.Typer, object]] = {}


def _command_of(app: typer.Typer) -> object:
    """The click command of a Typer app, built once: `CliRunner.invoke` rebuilds the whole
    tree from the app's functions on every call (~0.05 s, hundreds of calls), though it
    depends only on the app, which no test changes; each invoke still runs in a fresh context."""
    built = _COMMANDS.get(id(app))
    if built is None or built[0] is not app:
        built = _COMMANDS[id(app)] = (app, typer.main.get_command(app))
    return built[1]


typer.testing._get_command = _command_of  # typer.testing's `get_command`, the one invoke calls


def error_messages(text: str) -> list[str]:
    """Each `error: ...` message in a command's output, the lines it is wrapped over (indented
    by two spaces) joined by a space, as it reads unwrapped."""
    out: list[str] = []
    joining = False
    for line in text.splitlines():
        if line.startswith("error: "):
            out.append(line)
            joining = True
        elif joining and line.startswith("  "):
            out[-1] += " " + line[2:]
        else:
            joining = False
    return out


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's folder as the working directory, with `TINY_SUITE_TOML` as the suite "tiny"
    (benchmarks/tiny.toml); a test module may define its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "tiny.toml").write_text(TINY_SUITE_TOML)
    return tmp_path


@pytest.fixture(scope="session")
def _seeded_clip_weights(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The test-sized CLIPs' seeded weight files (`clip-test`, `clip-test-rn`), made once: a
    fresh cache would make them again in each test (a random init and a save, ~0.05 s each)."""
    from fpbench.backbones.catalog import CLIP_SPECS, _register_tiny_configs

    folder = tmp_path_factory.mktemp("seeded-clip")
    _register_tiny_configs(folder)
    return [spec._seeded_file(folder) for spec in CLIP_SPECS if spec.pretrained == "seeded"]


@pytest.fixture(autouse=True)
def _own_cache_folder(fpbench_cache: Path, _seeded_clip_weights: list[Path]) -> Path:
    """Every test gets its own fpbench cache folder (see `fpbench.testing.fpbench_cache`),
    with the seeded CLIP weights linked in as the fixture links the vit-smoke ones (the same
    bytes the test would make: the file name holds the config, seed and open_clip version)."""
    for weights in _seeded_clip_weights:
        (fpbench_cache / weights.name).symlink_to(weights)
    return fpbench_cache


PG_URL = os.environ.get("FPBENCH_TEST_PG_URL")


@pytest.fixture
def pg_database() -> Iterator[tuple[str, str]]:
    """(URL, name) of a fresh, empty PostgreSQL database on the server of FPBENCH_TEST_PG_URL,
    dropped after the test; skips where that is not set (.ci/run starts a server and sets it)."""
    if not PG_URL:
        pytest.skip("FPBENCH_TEST_PG_URL is not set (.ci/run starts a PostgreSQL server)")
    pytest.importorskip("psycopg")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"fpbench_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as con:
        con.execute(text(f"CREATE DATABASE {name}"))
    yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False), name
    with admin.connect() as con:
        con.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture
def pg_url(pg_database: tuple[str, str]) -> str:
    """The URL of a fresh, empty PostgreSQL database (see `pg_database`)."""
    return pg_database[0]


class Crash(Exception):
    """What `CrashAfter` raises."""


class CrashAfter:
    """A run observer that stops the run after round `round_idx` is stored (as a crash would)."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def cell_start(self, cfg, start_round):
        pass

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.round_idx:
            raise Crash()
