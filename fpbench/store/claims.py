"""Atomic cell claims: status + owner + heartbeat on the `runs` row.

A driver (or worker process) claims a run with one conditional UPDATE, so two drivers never run
the same cell. A claim stays valid while its owner keeps the heartbeat fresh; a claim whose
heartbeat is older than the timeout, or whose owner is a dead process on this host, is taken over.
Every round is written only while the claim still holds (`Store.write_round(..., owner=...)`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from fpbench.store.models import Run

CLAIM_TIMEOUT_S = 600.0  # a claim without a heartbeat for this long is taken over


class ClaimLost(RuntimeError):
    """Another driver took over this run's claim; the current one must stop writing."""


def new_owner() -> str:
    """A claim owner id unique to this process: 'host:pid:random[:job=SLURM job[:restart=N]]'
    (N: SLURM_RESTART_COUNT, how often the job was requeued; absent the first time)."""
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    job = _slurm_job()
    if not job:
        return owner
    restart = _slurm_restart()
    return f"{owner}:job={job}" + (f":restart={restart}" if restart else "")


def _slurm_job() -> str | None:
    """This SLURM (array) job's id; a requeued job keeps it."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID', '')}"
    return env.get("SLURM_JOB_ID")


def _slurm_restart() -> int:
    """How often SLURM restarted (requeued) this job: SLURM_RESTART_COUNT, 0 when unset."""
    count = os.environ.get("SLURM_RESTART_COUNT", "").strip()
    return int(count) if count.isdigit() else 0


def _owner_job(owner: str) -> tuple[str, int] | None:
    """(SLURM job, restart count) named in a claim owner id, if any."""
    _, found, tag = owner.partition(":job=")
    if not found:
        return None
    job, _, rest = tag.partition(":restart=")
    return job, int(rest) if rest.isdigit() else 0


def owner_is_gone(owner: str | None) -> bool:
    """Whether `owner` is a dead process of this host, or an earlier run of this SLURM job.

    An earlier run of this job: the same job (array task) id with a smaller restart count, the
    incarnation SLURM requeued this one after (preemption, time limit, node failure), which is
    gone wherever it ran. A process of this same incarnation (another task of an `srun`, a shell
    attached with `srun --jobid`) is judged as any other: by its pid on this host.
    """
    if not owner:
        return False
    job, theirs = _slurm_job(), _owner_job(owner)
    if job and theirs is not None and theirs[0] == job and theirs[1] < _slurm_restart():
        return True  # preempted and requeued: the previous incarnation is gone
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(int(pid))


def _is_zombie(pid: int) -> bool:
    """A killed child not yet reaped by its parent still answers kill(pid, 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def claim_is_live(record: Any, timeout_s: float = CLAIM_TIMEOUT_S) -> bool:
    """Whether a run record (`RunRecord`) is held by a live claim of some other driver."""
    if record.status != "running" or record.heartbeat_at is None:
        return False
    fresh = record.heartbeat_at >= _now() - dt.timedelta(seconds=timeout_s)
    return fresh and not owner_is_gone(record.owner)


def stale_reason(
    status: str, owner: str | None, heartbeat_at: dt.datetime | None, timeout_s: float
) -> str | None:
    """Why a 'running' run is stale (its process died, or its heartbeat stopped), else None."""
    if status != "running":
        return None
    if owner_is_gone(owner):
        return f"its process ({owner}) is gone"
    if heartbeat_at is None:
        return "it never sent a heartbeat"
    age = (_now() - heartbeat_at).total_seconds()
    if age > timeout_s:
        return f"its last heartbeat was {age:.0f} s ago"
    return None


def shown_status(
    status: str, owner: str | None, heartbeat_at: dt.datetime | None, timeout_s: float = 0.0
) -> str:
    """A run's status as views show it: 'stale' for a 'running' run whose owner is gone."""
    timeout_s = timeout_s or CLAIM_TIMEOUT_S
    return "stale" if stale_reason(status, owner, heartbeat_at, timeout_s) else status


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class ClaimMixin:
    """Claim methods of `Store` (which provides `_session`, `create_run` and `find_run`)."""

    _session: sessionmaker[Session]

    def has_schema(self, *, create_now: bool = False) -> bool: ...  # `Store.has_schema`

    def ensure_run(self, **fields: Any) -> Any:
        """`create_run(**fields)`, or the existing run when another driver created it first."""
        try:
            return self.create_run(**fields)  # type: ignore[attr-defined]
        except Exception as exc:
            if not isinstance(exc.__cause__, IntegrityError):
                raise
            record = self.find_run(fields["run_key"])  # type: ignore[attr-defined]
            if record is None:
                raise
            return record

    def claim_run(self, run_id: int, owner: str, *, timeout_s: float = CLAIM_TIMEOUT_S) -> bool:
        """Atomically mark a run 'running' for `owner`; False if someone else holds it.

        Claimable: pending, failed or interrupted runs, running runs whose heartbeat is older than
        `timeout_s` (or missing), and running runs whose owner is gone (`owner_is_gone`).
        A done run is never claimed; `owner` re-claiming its own run succeeds.
        """
        if not self.has_schema():
            return False
        now = _now()
        stale = or_(
            Run.status.in_(("pending", "failed", "interrupted")),
            Run.heartbeat_at.is_(None),
            Run.heartbeat_at < now - dt.timedelta(seconds=timeout_s),
            Run.owner == owner,
        )
        if self._claim_where(run_id, owner, now, stale):
            return True
        with self._session() as s:
            row = s.execute(
                select(Run.status, Run.owner, Run.heartbeat_at).where(Run.id == run_id)
            ).one_or_none()
        if row is None or row.status != "running" or not owner_is_gone(row.owner):
            return False
        return self._claim_where(run_id, owner, now, Run.owner == row.owner)

    def _claim_where(self, run_id: int, owner: str, now: dt.datetime, condition: Any) -> bool:
        stmt = (
            update(Run)
            .where(Run.id == run_id, Run.status != "done", condition)
            .values(
                status="running",
                owner=owner,
                heartbeat_at=now,
                error=None,
                traceback=None,
                finished_at=None,
            )
        )
        with self._session.begin() as s:
            return s.execute(stmt).rowcount == 1

    def heartbeat(self, run_id: int, owner: str) -> bool:
        """Refresh the claim's heartbeat; False if `owner` no longer holds the claim."""
        if not self.has_schema():
            return False
        with self._session.begin() as s:
            return _touch(s, run_id, owner)

    def finish_run(
        self,
        run_id: int,
        owner: str,
        status: str,
        *,
        error: str | None = None,
        wall_s: float | None = None,
        traceback: str | None = None,
    ) -> bool:
        """End `owner`'s claim with a final status ('done'/'failed'); False if it was lost."""
        if not self.has_schema():
            return False
        values: dict[str, Any] = {
            "status": status,
            "error": error,
            "traceback": traceback,
            "finished_at": _now(),
        }
        if wall_s is not None:
            values["wall_s"] = float(wall_s)
        stmt = update(Run).where(*_held(run_id, owner)).values(**values)
        with self._session.begin() as s:
            return s.execute(stmt).rowcount == 1

    @contextlib.contextmanager
    def keep_alive(self, run_id: int, owner: str, interval_s: float) -> Iterator[None]:
        """Refresh the heartbeat from a background thread while the block runs (long rounds)."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval_s):
                with contextlib.suppress(SQLAlchemyError):
                    if not self.heartbeat(run_id, owner):
                        return

        thread = threading.Thread(target=beat, name=f"fpbench-heartbeat-{run_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _held(run_id: int, owner: str) -> tuple[Any, ...]:
    return (Run.id == run_id, Run.owner == owner, Run.status == "running")


def _touch(s: Session, run_id: int, owner: str) -> bool:
    """Refresh the heartbeat inside the caller's transaction; False if the claim is gone."""
    stmt = update(Run).where(*_held(run_id, owner)).values(heartbeat_at=_now())
    return s.execute(stmt).rowcount == 1


def touch_or_raise(s: Session, run_id: int, owner: str) -> None:
    """Inside a write transaction: prove the claim still holds, or abort the transaction."""
    if not _touch(s, run_id, owner):
        raise ClaimLost(f"run {run_id}: claim of {owner} was taken over by another driver")
