"""`fpbench cache info|clear`: fpbench's cache folder (frozen values, self-made weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fpbench.cli.apps import PLAIN, app
from fpbench.cli.common import console, user_errors

cache_app = typer.Typer(
    help="fpbench's cache folder: frozen features and queries, self-made weights (info, clear).",
    short_help="fpbench's cache folder: what it holds (info), clearing it.",
    **PLAIN,
)
app.add_typer(cache_app, name="cache")

FrozenDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--frozen-dir",
        help="a suite's runtime.feature_cache_dir, where it is not the cache folder's `frozen`",
    ),
]


@cache_app.command("info")
@user_errors
def info(frozen_dir: FrozenDirOpt = None) -> None:
    """The cache folder, and its files and size per kind."""
    from fpbench.cache import cache_dir, usage
    from fpbench.units import human_bytes

    root = cache_dir()
    console.print(f"cache folder: {root}" + ("" if root.is_dir() else " (not made yet)"))
    if frozen_dir is not None:
        console.print(f"frozen values: {frozen_dir}")
    found = usage(root, frozen_dir)
    table = Table(title="fpbench cache")
    table.add_column("kind")
    table.add_column("files", justify="right")
    table.add_column("size", justify="right")
    for u in found:
        table.add_row(u.kind, f"{u.files:,}", human_bytes(u.bytes))
    ours = [u for u in found if not u.kind.startswith("not fpbench")]
    table.add_row(
        "fpbench's, in all",
        f"{sum(u.files for u in ours):,}",
        human_bytes(sum(u.bytes for u in ours)),
    )
    console.print(table)


@cache_app.command("clear", short_help="Remove fpbench's own files from its cache folder.")
@user_errors
def clear(
    frozen_only: Annotated[
        bool, typer.Option("--frozen-only", help="remove only the frozen features and queries")
    ] = False,
    frozen_dir: FrozenDirOpt = None,
) -> None:
    """Remove the files fpbench made in its cache folder (nothing else there is touched)."""
    from fpbench.cache import cache_dir
    from fpbench.cache import clear as clear_cache
    from fpbench.units import human_bytes

    root = cache_dir()
    removed = clear_cache(root, frozen_dir, only_frozen=frozen_only)
    what = "frozen values" if frozen_only else "files"
    console.print(f"removed {removed.files:,} {what} ({human_bytes(removed.bytes)}) from {root}")
