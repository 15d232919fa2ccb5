"""`fpbench db diff`: whether two results databases hold the same values, bit for bit.

Runs are matched by run key. Of each matched pair every stored result is compared exactly (a
float by its 64 bits, so 0.0 and -0.0 differ): the run's status, each round's `loss_train`,
`bytes_up` and `bytes_down`, and each metric row's value and count (by round, client and name).
A row one database has and the other lacks is a difference. What a run cost (times, peak
memory, FLOPs) and where it ran are not results and are not compared.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from fpbench.store.models import Metric, Round, Run
from fpbench.store.repo import Store

ROUND_FIELDS = ("loss_train", "bytes_up", "bytes_down")


@dataclass(frozen=True)
class Difference:
    """One value that differs between the two databases, each side as `repr` shows it
    (`(missing)`: that database lacks the row)."""

    run_key: str
    what: str  # e.g. "round 3 metric acc client 2 value"
    a: str
    b: str


@dataclass
class Diff:
    """What `diff` found."""

    runs_a: int = 0
    runs_b: int = 0
    matched: int = 0
    only_a: list[str] = field(default_factory=list)  # run keys
    only_b: list[str] = field(default_factory=list)
    compared: int = 0
    different: int = 0
    first: list[Difference] = field(default_factory=list)  # the first `keep` differences

    @property
    def same(self) -> bool:
        return not (self.only_a or self.only_b or self.different)


def values(store: Store) -> dict[str, dict[tuple[Any, ...], Any]]:
    """Every stored result of every run, by run key, then by what it is (see the module
    docstring)."""
    if not store.has_schema():
        return {}
    with store._session() as s:
        keys = dict(s.execute(select(Run.id, Run.run_key)).all())
        out: dict[str, dict[tuple[Any, ...], Any]] = {key: {} for key in keys.values()}
        for run_id, status in s.execute(select(Run.id, Run.status)):
            out[keys[run_id]][("status",)] = status
        columns = [getattr(Round, name) for name in ROUND_FIELDS]
        for run_id, round_, *row in s.execute(select(Round.run_id, Round.round, *columns)):
            for name, value in zip(ROUND_FIELDS, row, strict=True):
                out[keys[run_id]][("round", round_, name)] = value
        rows = select(
            Metric.run_id, Metric.round, Metric.client_id, Metric.name, Metric.value, Metric.count
        )
        for run_id, round_, client, name, value, count in s.execute(rows):
            where = ("round", round_, "metric", name, client)
            out[keys[run_id]][(*where, "value")] = value
            out[keys[run_id]][(*where, "count")] = count
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Whether two stored values are identical: floats by their 64 bits, others by `==`."""
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        return struct.pack("<d", float(a)) == struct.pack("<d", float(b))
    return type(a) is type(b) and a == b


def describe(what: tuple[Any, ...]) -> str:
    """A value's place in words, e.g. ('round', 3, 'metric', 'acc', 2, 'value') ->
    'round 3 metric acc client 2 value'."""
    if what[0] == "round" and len(what) == 6:
        _, round_, _, name, client, part = what
        who = "aggregate" if client is None else f"client {client}"
        return f"round {round_} metric {name} {who} {part}"
    return " ".join(str(w) for w in what)


def _order(what: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(f"{w:012d}" if isinstance(w, int) else str(w) for w in what)


def diff(a: Store, b: Store, keep: int = 20) -> Diff:
    """Compare every stored result of the runs the two databases share (see the module
    docstring); the first `keep` differences are listed."""
    va, vb = values(a), values(b)
    out = Diff(runs_a=len(va), runs_b=len(vb))
    out.only_a = sorted(set(va) - set(vb))
    out.only_b = sorted(set(vb) - set(va))
    for key in sorted(set(va) & set(vb)):
        out.matched += 1
        _compare(out, key, va[key], vb[key], keep)
    return out


def _compare(
    out: Diff, key: str, a: dict[tuple[Any, ...], Any], b: dict[tuple[Any, ...], Any], keep: int
) -> None:
    missing = object()
    for what in sorted(set(a) | set(b), key=_order):
        x, y = a.get(what, missing), b.get(what, missing)
        out.compared += 1
        if x is not missing and y is not missing and same_bits(x, y):
            continue
        out.different += 1
        if len(out.first) < keep:
            shown = ["(missing)" if v is missing else repr(v) for v in (x, y)]
            out.first.append(Difference(key, describe(what), *shown))
