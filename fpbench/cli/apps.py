"""The Typer apps of the `fpbench` command line: the root, and its `plot`, `db` and `data`
groups. Every command module decorates its commands onto one of these."""

from __future__ import annotations

from typing import Annotated

import typer

import fpbench
from fpbench.cli.common import console

# help as click writes it (rich_markup_mode=None): reflowed to the terminal's width (at most
# 80 columns), option names and defaults never cut, and `[low, high]` in a help text kept (Rich
# markup would eat it)
PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}
app = typer.Typer(
    help="Benchmark suite for federated prompt tuning.",
    add_completion=False,
    pretty_exceptions_enable=False,
    **PLAIN,
)
plot_app = typer.Typer(help="Draw plots from the results database.", **PLAIN)

db_app = typer.Typer(help="Maintain results databases (merge, check, diff).", **PLAIN)
data_app = typer.Typer(
    help="Real datasets: where they are (status) and preparing them once (prepare).",
    short_help="Real datasets: where they are (status), preparing them.",
    **PLAIN,
)
app.add_typer(plot_app, name="plot")
app.add_typer(db_app, name="db")
app.add_typer(data_app, name="data")


def _version(value: bool) -> None:
    if value:
        console.print(f"fpbench {fpbench.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Benchmark suite for federated prompt tuning of frozen pretrained models."""


def main() -> None:
    app()
