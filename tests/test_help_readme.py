"""Help and README agree with the tool: every command's --help works, and every `fpbench`
command line in the README's bash blocks parses (command path, options, choices, argument
counts) against the real command line, without running it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fpbench.cli import app

try:  # typer vendors click from 0.2x on
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_errors

README = Path(__file__).resolve().parents[1] / "README.md"
ROOT = typer.main.get_command(app)


def is_group(command) -> bool:
    return hasattr(command, "commands")


def commands(group=ROOT, path: tuple[str, ...] = ()):
    """(path, command) for the root, every group and every command under it."""
    yield path, group
    if is_group(group):
        for name, sub in sorted(group.commands.items()):
            yield from commands(sub, (*path, name))


ALL = list(commands())


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "fpbench")
def test_every_help_works_and_lists_every_option(path):
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    command = dict(ALL)[path]
    for param in command.params:
        if param.param_type_name == "option" and not param.hidden:
            assert param.opts[0] in result.output, (path, param.opts[0])


def readme_commands() -> list[str]:
    """Every `fpbench ...` line of the README's bash blocks, continuations joined, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            for part in re.split(r"\s*&&\s*", line):
                if part.startswith("fpbench "):
                    lines.append(part)
    return lines


def test_readme_has_the_workflow_commands():
    found = {tuple(shlex.split(line)[1:2]) for line in readme_commands()}
    for name in ("run", "runs", "export", "compare", "table", "show", "list", "report"):
        assert (name,) in found, f"README shows no `fpbench {name}` command"


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_parses(line):
    args = shlex.split(line)[1:]
    command, path = ROOT, []
    while is_group(command) and args and args[0] in command.commands:
        path.append(args[0])
        command = command.commands[args.pop(0)]
    assert not is_group(command), f"{line}: no such command"
    try:
        command.make_context(" ".join(["fpbench", *path]), list(args), resilient_parsing=False)
    except click_errors.UsageError as e:
        pytest.fail(f"README line `{line}` does not parse: {e.format_message()}")


def runnable(line: str) -> bool:
    """README lines that run here in seconds, offline, writing nothing: listings, dry runs and
    the papers' tables."""
    args = shlex.split(line)[1:]
    return (
        args[:1] == ["list"]
        or args[:2] == ["data", "status"]
        or "--dry-run" in args
        or "--dry" in args
        or (args[:1] == ["table"] and "--paper" in args)
    )


@pytest.mark.parametrize("line", [line for line in readme_commands() if runnable(line)])
def test_readme_command_runs(line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    result = CliRunner().invoke(app, shlex.split(line)[1:])
    assert result.exit_code == 0, result.output
    assert not list(tmp_path.iterdir())  # writes nothing


@pytest.mark.parametrize("path", [p for p, _ in ALL if p], ids=" ".join)
def test_every_command_summary_is_one_line(path):
    """The first paragraph is what `fpbench --help` lists: one line, not a wrapped sentence."""
    summary = (dict(ALL)[path].help or "").strip().split("\n\n")[0]
    assert summary and "\n" not in summary, (path, summary)
