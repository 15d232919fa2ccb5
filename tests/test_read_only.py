"""A finished database in a read-only folder (an archive, a shared mount): every command that only
reads opens it without writing a byte; every command that writes fails before storing anything,
saying the folder is read-only. Run by a user who cannot write there (as root: `setpriv` to
nobody, since root writes through permission bits)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import TINY_SUITE_TOML
from tests.test_workflow import fake_db

NOBODY = 65534
pytestmark = pytest.mark.slow  # each case is a fresh `fpbench` process


def _reader_prefix() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user to whom a folder is read-only")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def place():
    """A folder any user can read: `ro/` (read-only, holding `s.db`) and `rw/` (writable)."""
    root = Path(tempfile.mkdtemp(prefix="fpbench-ro-"))
    (root / "ro").mkdir()
    (root / "rw").mkdir()
    url = fake_db(root / "ro" / "s.db", {("a", 0): [0.5, 0.6], ("b", 0): [0.4, 0.7]})
    assert url.endswith("s.db")
    (root / "rw" / "tiny.toml").write_text(TINY_SUITE_TOML)
    fake_db(root / "rw" / "other.db", {("c", 0): [0.1, 0.2]})
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "rw").chmod(0o777)
    yield root
    (root / "ro").chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def _freeze(root: Path) -> str:
    (root / "ro").chmod(0o555)
    (root / "ro" / "s.db").chmod(0o444)
    return _digest(root / "ro")


def _digest(folder: Path) -> str:
    """Every file of the folder, names and bytes (a -wal or -shm left behind changes it)."""
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def fpbench(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(root / "rw"),
        "COLUMNS": "200",
        "PYTHONPATH": str(Path(__file__).parents[1]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [*_reader_prefix(), sys.executable, "-m", "fpbench", *args],
        cwd=root / "rw",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


READS = {
    "runs": (["runs"], "2 runs in"),
    "show": (["show", "1"], "status=done"),
    "table": (["table", "--suite", "s"], "60.00"),
    "compare": (["compare", "a", "b", "--suite", "s"], "acc_global"),
    "export": (["export", "out"], "runs.csv"),
    "report": (["report", "--suite", "s", "--out", "page.html"], "page.html"),
    "db check": (["db", "check"], "2 runs"),
    "db diff": (["db", "diff", "../ro/s.db"], "values different: 0"),
}


@pytest.mark.parametrize("name", list(READS))
def test_reading_commands_open_a_database_in_a_read_only_folder(place, name):
    args, said = READS[name]
    before = _freeze(place)
    db = ["../ro/s.db"] if name.startswith("db ") else ["--db", "../ro/s.db"]
    done = fpbench(place, *args, *db)
    assert done.returncode == 0, done.stdout + done.stderr
    assert said in done.stdout + done.stderr
    assert _digest(place / "ro") == before  # not a byte written, no -wal nor -shm left


def test_an_older_database_in_a_read_only_folder_is_read_through_an_upgraded_copy(place):
    with sqlite3.connect(place / "ro" / "s.db") as con:  # as a database from before round_flops
        con.execute("alter table runs drop column round_flops")
    con.close()
    before = _freeze(place)
    done = fpbench(place, "runs", "--db", "../ro/s.db")
    assert done.returncode == 0 and "2 runs in" in done.stdout, done.stdout + done.stderr
    assert _digest(place / "ro") == before


def test_writing_commands_refuse_a_read_only_folder_before_storing_anything(place):
    before = _freeze(place)
    for args in (
        ["run", "--suite", "tiny.toml", "--db", "../ro/s.db"],
        ["db", "merge", "../ro/s.db", "other.db"],
    ):
        done = fpbench(place, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        line = " ".join(done.stderr.split())
        assert f"its folder {place / 'ro'} is read-only" in line, line
        assert "copy it to a writable folder" in line and "Traceback" not in line
    assert _digest(place / "ro") == before


def test_a_read_only_checkpoint_dir_is_found_before_any_run_row_is_stored(place):
    _freeze(place)
    done = fpbench(
        place, "run", "--suite", "tiny.toml", "--db", "new.db", "--checkpoint-dir", "../ro/ck"
    )
    assert done.returncode == 2, done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert f"--checkpoint-dir ../ro/ck: {place / 'ro'} is read-only" in line, line
    assert not (place / "rw" / "new.db").exists()
