"""The README's main job: `fpbench run --suite smoke` from nothing, in a subprocess.

It pretrains `vit-smoke` into a temporary cache (about half a minute on 2 cores) and runs the
six cells, so it is marked slow: `pytest -m slow`.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def fpbench(*args: str, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fpbench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_smoke_suite_end_to_end(tmp_path):
    env = {**os.environ, "FPBENCH_CACHE": str(tmp_path / "cache")}
    first = fpbench("run", "--suite", "smoke", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    db = tmp_path / "results" / "fpbench.db"
    with sqlite3.connect(db) as con:
        statuses = [r[0] for r in con.execute("select status from runs")]
        sizes = [
            con.execute(f"select count(*) from {t}").fetchone()[0]
            for t in ("runs", "rounds", "metrics")
        ]
        final = dict(
            con.execute(
                "select runs.method || '/' || runs.partition || '/' || name, value from metrics "
                "join runs on runs.id = metrics.run_id and metrics.client_id is null "
                "where name in ('acc_global_last3', 'acc_local_mean_last3')"
            )
        )
    assert statuses == ["done"] * 6
    chance = 1 / 20
    for p in ("path-s4", "dir-0.3"):
        glob = {m: final[f"{m}/{p}/acc_global_last3"] for m in ("head-tune", "fedvpt", "local")}
        assert glob["fedvpt"] > 3 * chance, final
        assert glob["fedvpt"] > glob["head-tune"] + 0.01, final  # prompts make a difference
        local_mean = final[f"local/{p}/acc_local_mean_last3"]
        assert local_mean > glob["local"] + 0.1, final  # and so does personalisation

    again = fpbench("run", "--suite", "smoke", cwd=tmp_path, env=env)
    assert again.returncode == 0 and "6 already done" in again.stdout
    with sqlite3.connect(db) as con:
        assert sizes == [
            con.execute(f"select count(*) from {t}").fetchone()[0]
            for t in ("runs", "rounds", "metrics")
        ]

    table = fpbench("table", "--suite", "smoke", cwd=tmp_path, env=env)
    assert table.returncode == 0 and "fedvpt" in table.stdout
    plot = fpbench("plot", "tradeoff", "--suite", "smoke", "--out", "t.png", cwd=tmp_path, env=env)
    assert plot.returncode == 0 and (tmp_path / "t.png").stat().st_size > 0


def _rows(db) -> list[tuple]:
    """Every metric row of a database, keyed by run_key (ids differ between databases)."""
    with sqlite3.connect(db) as con:
        return sorted(
            con.execute(
                "select runs.run_key, round, coalesce(client_id, -1), name, value from metrics "
                "join runs on runs.id = metrics.run_id"
            )
        )


@pytest.mark.parametrize(
    "executor",
    [
        ["--jobs", "2"],
        ["--launcher", "submitit-local", "--jobs", "2"],
        ["--launcher", "ray", "--jobs", "2"],
    ],
)
def test_every_executor_runs_the_smoke_suite_like_a_serial_run(tmp_path_factory, executor):
    """Bit for bit, every process with PyTorch's default thread count: deterministic mode makes
    each worker compute with the driver's count (`pin_threads`), not its share of the cores."""
    if "submitit-local" in executor:
        pytest.importorskip("submitit")
    if "ray" in executor:
        pytest.importorskip("ray")
    serial = _serial_smoke(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("executor")
    env = {**_default_threads(), "FPBENCH_CACHE": str(serial.parent / "cache")}
    result = fpbench("run", "--suite", "smoke", *executor, "--db", "x.db", cwd=tmp, env=env)
    assert result.returncode == 0, result.stderr
    rows, want = _rows(tmp / "x.db"), _rows(serial)
    assert [r[:4] for r in rows] == [r[:4] for r in want]  # the same rows, none missing or extra
    diff = [(w[:4], w[4], r[4]) for r, w in zip(rows, want, strict=True) if r[4] != w[4]]
    assert not diff, f"{len(diff)} of {len(want)} values differ; first: {diff[:3]}"


_SERIAL: dict[str, object] = {}


def _default_threads() -> dict[str, str]:
    """This environment less any thread-count pin: every process uses PyTorch's default."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def _serial_smoke(tmp_path_factory):
    """The smoke suite run serially once per session (the reference for the executors)."""
    if "db" not in _SERIAL:
        tmp = tmp_path_factory.mktemp("serial-smoke")
        env = {**_default_threads(), "FPBENCH_CACHE": str(tmp / "cache")}
        result = fpbench("run", "--suite", "smoke", "--db", "s.db", cwd=tmp, env=env)
        assert result.returncode == 0, result.stderr
        _SERIAL["db"] = tmp / "s.db"
    return _SERIAL["db"]
