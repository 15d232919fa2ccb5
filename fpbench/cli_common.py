"""What every command module of the CLI shares: the consoles and the user-error wrapper."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from fpbench.errors import FpbenchError

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn an FpbenchError into one red line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FpbenchError as e:
            err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]
