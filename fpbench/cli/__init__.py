"""The `fpbench` command line: thin commands that parse, call one library function and print.

`fpbench.cli.apps` holds the Typer apps; each command module decorates its commands onto them,
and importing the modules here (in `--help` order) registers the commands. Nothing heavy is
imported before a command runs, so `fpbench --help` stays free of torch.
"""

from fpbench.cli import run, results, workflow, trained, paper, report  # noqa: F401, I001
from fpbench.cli import measure, db, data, cache  # noqa: F401, I001
from fpbench.cli import tune  # noqa: F401, I001  (fpbench tune)
from fpbench.cli.apps import app, main

__all__ = ["app", "main"]
