"""What `fpbench run` prints when it ends: the suite's table and the commands to go on with."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any


def next_commands(suite: str, db: str) -> list[str]:
    """The table, plot, report and runs commands for `suite`'s results in `db`, ready to
    paste."""
    s, d = shlex.quote(suite), shlex.quote(db)
    stem = shlex.quote(f"results/{suite.rsplit('/', 1)[-1].removesuffix('.toml')}")
    return [
        f"fpbench table --suite {s} --db {d}",
        f"fpbench plot tradeoff --suite {s} --db {d} --out {stem}-tradeoff.png",
        f"fpbench report --suite {s} --db {d} --out {stem}-report",
        f"fpbench runs --suite {s} --db {d}",
    ]


def summary_text(db: str, suite: str, metrics: Sequence[str]) -> str | None:
    """The suite's summary table in the README's form (Markdown, headed `path-s4 global`), its
    legend and notes (how many seeds each cell averages, which unfinished runs are left out);
    None: no run is done. On a terminal `fpbench run` prints it fitted instead (`summary_table`
    through `fpbench.cli.results._print_term`)."""
    from fpbench.report.federation import table_index
    from fpbench.report.tables import summary_table

    frame, notes = finished_results(db, suite, metrics)
    if frame.empty:
        return None
    md, legend = readme_markdown(summary_table(frame, list(metrics), index=table_index(frame)))
    return md + "".join(f"{n}\n" for n in [legend, *notes] if n)


def readme_markdown(table: Any) -> tuple[str, str]:
    """(a summary table as Markdown in the README's form, `| method | path-s4 global | ...`,
    its legend line or ''), as `fpbench table` and the end of `fpbench run` print it."""
    from fpbench.report.tables import readable_parts

    index_names, headers, rows, legend = readable_parts(table)
    lines = [[*index_names, *headers], [":--"] * len(index_names) + ["--:"] * len(headers)]
    md = "".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in line) + " |\n" for line in [*lines, *rows]
    )
    return md, f"{legend} (%)" if legend else ""


def with_stored_federation(store: Any, frame: Any) -> Any:
    """`frame` with its runs' learner and strategy columns (`report.federation`)."""
    from fpbench.report.federation import with_federation

    if frame.empty:
        return frame
    ids = [int(i) for i in frame["run_id"].unique()]
    return with_federation(frame, {i: store.get_run(i).config for i in ids})


def finished_results(db: str, suite: str, metrics: Sequence[str]) -> tuple[Any, list[str]]:
    """The metric rows of the suite's done runs (maybe none) and the notes a table of them needs:
    how many seeds each cell averages, and which unfinished runs are left out; with the runs'
    learner and strategy where some run names a strategy (`fpbench.report.federation`)."""
    from fpbench.cli.common import open_store, suite_name
    from fpbench.report.tables import finished_only, seeds_note, unfinished_note

    name = suite_name(suite)
    with open_store(db, must_exist=True) as store:
        frame, left_out = finished_only(store.metrics(suite=name), store.runs(suite=name))
        frame = with_stored_federation(store, frame)
    notes = [seeds_note(frame, list(metrics))] if not frame.empty else []
    return frame, notes + ([unfinished] if (unfinished := unfinished_note(left_out)) else [])
