"""What every command module of the CLI shares: consoles, the user-error wrapper, the store."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fpbench.errors import FpbenchError

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn an FpbenchError into one red `error:` message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FpbenchError as e:
            print_error(str(e))
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def print_error(message: str) -> None:
    """`error: MESSAGE` on stderr, wrapped to its width at spaces (a URL or path is never split),
    the lines after the first indented by two spaces."""
    from rich.text import Text

    for i, line in enumerate(wrap(message, err.width, "  ", first="error: ")):
        text = Text.assemble(("error:", "red"), line[len("error:") :]) if i == 0 else Text(line)
        err.print(text, highlight=False, soft_wrap=True)


DEFAULT_DB = "results/fpbench.db"
DEFAULT_METRICS = ["acc_global", "acc_local_mean", "acc_local_worst"]  # the summary table's
DbOpt = Annotated[str, typer.Option("--db", help="results database: a path or SQLAlchemy URL")]
SuiteOpt = Annotated[str, typer.Option("--suite", "-s", help="suite name or path to a .toml")]
PlotOutOpt = Annotated[
    Path, typer.Option(help="output image (.png also writes a .pdf beside it; .pdf, .svg)")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="PATH=VALUE",
        help="set a config path in every cell, e.g. train.rounds=2 or method.args.prompt_len=5 "
        "(repeatable; VALUE as in a suite file; part of the run key, except runtime.*)",
    ),
]


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """PATH=VALUE pairs. VALUE is read as a TOML value, as in a suite file (2, 0.1, true,
    "x", [1, 2], { a = 1 }), else as JSON (null), else taken as a bare string (adam)."""
    import tomllib

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise FpbenchError(f"--set expects KEY=VALUE, got {item!r}")
        if key in out:
            raise FpbenchError(f"--set {key} given twice")
        try:
            out[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            try:
                out[key] = json.loads(text)
            except json.JSONDecodeError:
                out[key] = text
    return out


def fit_table(title: str | None = None, **kwargs: Any):
    """A rich Table shaped for a narrow screen: a rule under the header, no outer frame, one
    space between columns. Numbers belong in `no_wrap` columns (never cut); text columns
    fold, so the table fits the width (the terminal's, else $COLUMNS, else 80)."""
    from rich import box
    from rich.table import Table

    width = min(len(title or ""), console.width)  # a title wider than the columns: one line
    return Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        min_width=width,
        **kwargs,
    )


def wrap(text: str, width: int, indent: str = "", first: str | None = None) -> list[str]:
    """`text` in lines of at most `width` (where its words allow), broken only at spaces: a URL,
    path or hyphenated name is never split, a word wider than the room stands on its own line.
    Lines of the text stay lines; `first` (default `indent`) starts the first, `indent` the rest."""
    import textwrap

    lead = indent if first is None else first
    out: list[str] = []
    for line in text.splitlines() or [""]:
        out += textwrap.wrap(
            line,
            width=max(width, len(lead) + 1, len(indent) + 1),
            initial_indent=lead if not out else indent,
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        ) or [lead if not out else indent]
    return out


def plural(n: int, noun: str) -> str:
    """'1 cell', '5 cells' (nouns whose plural adds an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def sqlite_missing(db: str) -> bool:
    """Whether `db` names a SQLite file that does not exist yet."""
    from fpbench.store import Store

    url = Store.url_from_path_or_url(db)
    return url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).exists()


def open_store(db: str, *, must_exist: bool = False, read_only: bool | None = None):
    """The results store; with `must_exist`, a missing SQLite file is an error, not created.

    `read_only` (default: `must_exist`, which every command that only reads passes): opened
    without writing a byte, so a database in a read-only folder opens (`Store`)."""
    from fpbench.store import Store

    if must_exist and sqlite_missing(db):
        raise FpbenchError(f"no results database at {db}; run `fpbench run` first or pass --db")
    read_only = must_exist if read_only is None else read_only
    return Store(Store.url_from_path_or_url(db), read_only=read_only)


def suite_name(suite: str) -> str:
    """The name runs were stored under: a suite file's `name` or its stem."""
    from fpbench.suites import find_suite

    try:
        import tomllib

        path = find_suite(suite)
        return tomllib.loads(path.read_text()).get("name", path.stem)
    except (FpbenchError, ValueError):
        return suite


def save_figure(fig: Any, out: Path, *, pdf_beside: bool = False) -> None:
    """Write `fig` to `out` (and, with `pdf_beside`, a .pdf next to a .png) and say so."""
    paths = [out]
    if pdf_beside and out.suffix.lower() == ".png":
        paths.append(out.with_suffix(".pdf"))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150, bbox_inches="tight")
        console.print(f"wrote {path}")


def write_or_print(text: str, out: Path | None) -> None:
    """Write `text` to `out` and say so, or print it to stdout when there is no `out`."""
    if out is None:
        print(text)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"wrote {out}")


def load_cells(
    suite: str,
    sets: list[str] | None,
    methods: list[str] | None,
    seeds: list[int] | None = None,
    datasets: list[str] | None = None,
    partitions: list[str] | None = None,
) -> tuple[Any, list]:
    """The suite (with `--set`s applied) and its cells of these methods and seeds.

    With both sets and methods, only those methods' cells take the sets (a path only they
    have, such as `method.args.prompt_len`, would not validate on the others).
    """
    from fpbench.suites import load_suite

    values = parse_sets(sets)
    if values and methods:
        select_cells(load_suite(suite), methods)  # an unknown method is named as without sets
    loaded = load_suite(suite, values, methods if values else None)
    return loaded, select_cells(loaded, methods, seeds, datasets, partitions)


def select_cells(
    suite,
    methods: list[str] | None,
    seeds: list[int] | None = None,
    datasets: list[str] | None = None,
    partitions: list[str] | None = None,
) -> list:
    """The suite's cells of these methods, datasets and partitions (names or labels) and seeds;
    a filter not given keeps all."""
    cells = list(suite.cells)
    for what, wanted in (("dataset", datasets), ("partition", partitions)):
        if wanted:
            known = sorted(
                {getattr(c, what).label for c in cells} | {getattr(c, what).name for c in cells}
            )
            if unknown := [w for w in wanted if w not in known]:
                raise FpbenchError(
                    f"{what}(s) {unknown} not in suite {suite.name}; valid: {', '.join(known)}"
                )
            cells = [
                c for c in cells if {getattr(c, what).label, getattr(c, what).name} & set(wanted)
            ]
    if methods:
        known = sorted({c.method.label for c in cells} | {c.method.name for c in cells})
        unknown = [m for m in methods if m not in known]
        if unknown:
            raise FpbenchError(
                f"method(s) {unknown} not in suite {suite.name}; valid: {', '.join(known)}"
            )
        cells = [c for c in cells if c.method.label in methods or c.method.name in methods]
    if seeds:
        cells = [c for c in cells if c.seed in seeds]
    if not cells:
        raise FpbenchError(f"no cells of suite {suite.name} match the filters")
    return cells
