"""`fpbench run` in this (fresh) process with one fault injected at a chosen point.

    python -m tests.fault_worker FAULT K -- RUN-ARGS...

FAULT (K: the round, or the training step for kill-at-step; ignored where not needed):
  none                  no fault
  kill-after-round      SIGKILL once round K is stored and checkpointed (between rounds)
  kill-at-step          SIGKILL at the K-th local training step (inside a round)
  kill-in-commit        SIGKILL inside the database commit of round K's rows
  kill-in-checkpoint    SIGKILL while round K's checkpoint is half written
  kill-in-finish        SIGKILL inside the commit that marks the cell done
  kill-in-create        SIGKILL while the new database file is being created
  ctrl-c                SIGINT (Ctrl-C) at the start of round K
  sigterm               SIGTERM (SLURM's time limit, scancel, timeout) at the start of round K
  disk-full-checkpoint  round K's checkpoint write fails: no space left on device
  disk-full-db          round K's database write fails: database or disk is full
  slow-rounds           every round starts K seconds late, in `--jobs` pool workers too (so a
                        signal sent once a cell has started finds it still running)
Used by tests/test_fault_campaign.py.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import sys
import tempfile
from pathlib import Path

from sqlalchemy import event


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_round_write(k: int, on_engine) -> None:
    """Call `on_engine(engine)` before the store writes round `k`."""
    from fpbench.store.repo import Store

    write = Store.write_round

    def write_round(self, run_id, round, **kw):
        if round == k:
            on_engine(self._engine)
        return write(self, run_id, round, **kw)

    Store.write_round = write_round


def _patch_checkpoint_save(k: int, then) -> None:
    """Round k's checkpoint: half its bytes reach the temporary file, then `then()`."""
    from fpbench.engine import checkpoint as ckpt_io

    save = ckpt_io.save

    def torn_save(path, ckpt, *bound):
        if ckpt.round != k:
            return save(path, ckpt, *bound)
        scratch = Path(tempfile.mkdtemp()) / path.name
        save(scratch, ckpt, *bound)
        whole = scratch.read_bytes()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".tmp"), "wb") as out:
            out.write(whole[: len(whole) // 2])
            out.flush()
            os.fsync(out.fileno())
        then()

    ckpt_io.save = torn_save


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def inject(fault: str, k: int) -> None:
    if fault == "none":
        return
    if fault == "kill-after-round":
        from fpbench.engine import checkpoint as ckpt_io

        save = ckpt_io.save

        def save_then_die(path, ckpt, *bound):
            save(path, ckpt, *bound)
            if ckpt.round == k:
                _die()

        ckpt_io.save = save_then_die
    elif fault == "kill-at-step":
        from fpbench.engine import executor

        step, calls = executor._step, [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                _die()
            return step(*args, **kwargs)

        executor._step = counted
    elif fault == "kill-in-commit":
        _arm_round_write(k, lambda engine: event.listen(engine, "commit", lambda conn: _die()))
    elif fault == "kill-in-checkpoint":
        _patch_checkpoint_save(k, _die)
    elif fault == "kill-in-finish":
        from fpbench.store.claims import ClaimMixin

        finish = ClaimMixin.finish_run

        def finish_run(self, run_id, owner, status, **kw):
            if status == "done":
                event.listen(self._engine, "commit", lambda conn: _die())
            return finish(self, run_id, owner, status, **kw)

        ClaimMixin.finish_run = finish_run
    elif fault == "kill-in-create":
        from fpbench.store import ownership

        ownership.os.link = lambda *a, **kw: _die()
    elif fault in ("ctrl-c", "sigterm"):
        from fpbench.engine import rounds

        play = rounds.play_round
        signum = signal.SIGINT if fault == "ctrl-c" else signal.SIGTERM

        def play_round(cell, server, r, *args, **kwargs):
            if r == k:
                os.kill(os.getpid(), signum)
            return play(cell, server, r, *args, **kwargs)

        rounds.play_round = play_round
    elif fault == "slow-rounds":
        import time

        from fpbench.engine import rounds

        play = rounds.play_round

        def late_round(*args, **kwargs):
            time.sleep(k)
            return play(*args, **kwargs)

        rounds.play_round = late_round
    elif fault == "disk-full-checkpoint":
        _patch_checkpoint_save(k, _disk_full)
    elif fault == "disk-full-db":

        def full(engine) -> None:
            def before(conn, cursor, statement, *args):
                if statement.lstrip().upper().startswith("INSERT INTO ROUNDS"):
                    raise sqlite3.OperationalError("database or disk is full")

            event.listen(engine, "before_cursor_execute", before)

        _arm_round_write(k, full)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


WORKER_FAULTS = {"slow-rounds"}
WORKER_FAULT_ENV = "FPBENCH_TEST_WORKER_FAULT"


def main() -> None:
    fault, k, sep, *args = sys.argv[1:]
    assert sep == "--", sys.argv
    # Ctrl-C as at a terminal, whatever the launching shell left (a background job ignores SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    inject(fault, int(k))
    if fault in WORKER_FAULTS:  # spawned pool workers import this module as __mp_main__
        os.environ[WORKER_FAULT_ENV] = f"{fault} {k}"
    from fpbench.cli import main as cli

    sys.argv = ["fpbench", "run", *args]
    os.chdir(Path.cwd())
    cli()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__" and WORKER_FAULT_ENV in os.environ:
    _fault, _k = os.environ[WORKER_FAULT_ENV].split()
    inject(_fault, int(_k))
