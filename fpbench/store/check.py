"""`fpbench db check`: every run's rounds are contiguous, every done run has all its rounds and
metrics, and nothing is stuck. `db merge` refuses inputs with broken runs (`Problem.broken`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlalchemy import select

from fpbench.store.claims import CLAIM_TIMEOUT_S, stale_reason
from fpbench.store.models import Metric, Round, Run
from fpbench.store.repo import Store


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one run."""

    run_id: int
    run_key: str
    status: str
    message: str
    broken: bool = False  # stored rows are missing or out of place (not only unfinished)


def check(store: Store, *, claim_timeout: float = CLAIM_TIMEOUT_S) -> list[Problem]:
    """Problems of every run: incomplete done runs, failed runs, running runs without heartbeat."""
    if not store.has_schema():
        return []
    with store._session() as s:
        runs = s.execute(select(Run.id, Run.run_key, Run.status, Run.config_json, Run.error,
                                Run.owner, Run.heartbeat_at).order_by(Run.id)).all()  # fmt: skip
        rounds = _by_run(s.execute(select(Round.run_id, Round.round)).all())
        losses = _by_run(
            s.execute(
                select(Metric.run_id, Metric.round).where(
                    Metric.name == "loss_train", Metric.client_id.is_(None)
                )
            ).all()
        )
        evaluated = _by_run(
            s.execute(
                select(Metric.run_id, Metric.round)
                .where(Metric.client_id.is_(None), Metric.name != "loss_train")
                .distinct()
            ).all()
        )
    problems = []
    for run in runs:
        for message in _run_problems(run, rounds, losses, evaluated, claim_timeout):
            problems.append(Problem(run.id, run.run_key, run.status, message))
        problems += [
            Problem(run.id, run.run_key, run.status, message, broken=True)
            for message in _broken(run, rounds, losses, evaluated)
        ]
    return problems


def broken_runs(store: Store) -> list[Problem]:
    """Runs whose stored rows are wrong (gaps, missing or extra rounds), not merely unfinished."""
    return [p for p in check(store) if p.broken]


def _by_run(rows) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for run_id, round_ in rows:
        out.setdefault(run_id, set()).add(round_)
    return out


def _run_problems(run, rounds, losses, evaluated, claim_timeout: float) -> list[str]:
    if run.status == "failed":
        return [
            f"failed: {run.error or 'no error stored'}; `fpbench run --retry-failed` retries it"
        ]
    if run.status == "running":
        return _stale(run, claim_timeout)
    if run.status == "interrupted":
        return [f"{run.error or 'interrupted'}; rerun the suite to resume it"]
    return []


def _broken(run, rounds, losses, evaluated) -> list[str]:
    """What is wrong with a run's stored rounds: gaps at any status; a done run's completeness."""
    have, out = rounds.get(run.id, set()), []
    if run.status != "done":
        if have and (gaps := sorted(set(range(max(have))) - have)):
            out.append(f"rounds {_span(gaps)} are missing below stored round {max(have) + 1}")
        return out
    expected = set(range(int(json.loads(run.config_json)["train"]["rounds"])))
    if missing := sorted(expected - have):
        out.append(f"done but rounds {_span(missing)} are missing")
    if extra := sorted(have - expected):
        out.append(f"rounds {_span(extra)} lie beyond the configured {len(expected)}")
    if no_loss := sorted(have - losses.get(run.id, set())):
        out.append(f"rounds {_span(no_loss)} have no loss_train metric")
    if expected and max(expected) not in evaluated.get(run.id, set()):
        out.append(f"the final round {max(expected) + 1} has no evaluation metrics")
    return out


def _stale(run, claim_timeout: float) -> list[str]:
    why = stale_reason(run.status, run.owner, run.heartbeat_at, claim_timeout)
    if why is None:
        return []
    return [f"stale: running, but {why}; rerun the suite to take it over and resume it"]


def _span(rounds: list[int]) -> str:
    """Stored rounds as every view numbers them, from 1."""
    shown = ", ".join(str(r + 1) for r in rounds[:8])
    return shown + (f", ... ({len(rounds)} in all)" if len(rounds) > 8 else "")
