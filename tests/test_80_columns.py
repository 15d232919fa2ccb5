"""Every help screen and table reads at 80 columns, off a terminal (COLUMNS=80) as on one: no line
longer than 80, nothing cut with an ellipsis, Rich markup in help texts kept (`[low, high]`),
each group's command summaries whole, every `list` with its names whole, `data status` and the
`estimate` plan as blocks where a table would fold them, and errors wrapped at spaces."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.report.tables import SHORT_METRICS
from tests.conftest import TINY_SUITE_TOML
from tests.test_help_readme import ALL
from tests.test_workflow import fake_db

WIDTH = 80


def render(*args: str):
    return CliRunner().invoke(app, list(args), terminal_width=WIDTH, env={"COLUMNS": str(WIDTH)})


def check_fits(result) -> None:
    text = result.stdout + result.stderr
    too_long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_long, "\n".join(too_long)
    assert "…" not in text, text


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "fpbench")
def test_every_help_screen_fits_80_columns(path):
    result = render(*path, "--help")
    assert result.exit_code == 0, result.output
    check_fits(result)
    for param in dict(ALL)[path].params:  # every option named whole
        if param.param_type_name == "option" and not param.hidden:
            assert param.opts[-1] in result.stdout, (path, param.opts)


def test_help_keeps_brackets_that_rich_would_eat():
    result = render("table", "--help")
    assert "[low, high]" in " ".join(result.stdout.split())


@pytest.fixture
def db(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    methods = ("fedavg-prompt-long-name", "fedvpt")
    values = {
        (m, s): [0.123456 * (s + 1), 0.1512 * (s + 1) + 0.01 * i]
        for i, m in enumerate(methods)
        for s in (0, 1, 2)
    }
    fake_db(tmp_path / "r.db", values, suite="a-suite-with-a-long-name")
    return "r.db"


VIEWS = {
    "runs": ["runs"],
    "show": ["show", "1"],
    "table term": ["table", "--suite", "a-suite-with-a-long-name", "--format", "term", "--ci"],
    "compare": [
        "compare",
        "fedvpt",
        "fedavg-prompt-long-name",
        "--suite",
        "a-suite-with-a-long-name",
    ],
    "db check": ["db", "check"],
    "db diff": ["db", "diff", "r.db"],
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_every_view_fits_80_columns_with_its_numbers_whole(db, name):
    args = VIEWS[name]
    args = [*args, db] if name.startswith("db ") else [*args, "--db", db]
    result = render(*args)
    assert result.exit_code in (0, 1), result.output  # db check: 1 = problems found
    check_fits(result)
    whole = {"runs": "45.36", "table term": "30.24 ± 15.12", "compare": "31.24"}.get(name)
    assert whole is None or whole in " ".join(result.stdout.split()), result.stdout


def test_runs_headers_are_explained(db):
    result = render("runs", "--db", db)
    said = " ".join(result.stdout.split())
    assert "glob mean worst" in said
    assert (
        "glob / mean / worst: the run's final global, local-mean and local-worst accuracy" in said
    )


def test_table_headers_tell_local_mean_from_local_worst():
    """The README's form: shared header levels left out (named in the legend), short names."""
    import pandas as pd

    from fpbench.report.tables import readable_parts

    columns = [
        (d, p, m) for d in ["synthetic"] for p in ("path-s4", "dir-0.3") for m in SHORT_METRICS
    ]
    table = pd.DataFrame([["1"] * 6], columns=pd.MultiIndex.from_tuples(columns))
    table.index = pd.Index(["fedvpt"], name="method")
    index, headers, rows, legend = readable_parts(table)
    assert (index, rows) == (["method"], [["fedvpt", *["1"] * 6]])
    assert headers == [
        "path-s4 global", "path-s4 local mean", "path-s4 local worst",
        "dir-0.3 global", "dir-0.3 local mean", "dir-0.3 local worst",
    ]  # fmt: skip
    assert legend == (
        "all columns: synthetic; global = acc_global; local mean = acc_local_mean; "
        "local worst = acc_local_worst"
    )


def test_dry_run_fits_80_columns(db):
    result = render("run", "--suite", "tiny.toml", "--dry-run", "--db", "new.db")
    assert result.exit_code == 0, result.output
    check_fits(result)


GROUPS = [p for p, c in ALL if hasattr(c, "commands")]


def listed_summaries(help_text: str) -> dict[str, str]:
    """Each command's summary in a help screen's Commands section, wrapped lines joined."""
    said: dict[str, str] = {}
    name = None
    for line in help_text.split("Commands:\n", 1)[1].splitlines():
        if line[:2] == "  " and line[2:3] != " ":
            name, _, rest = line.strip().partition(" ")
            said[name] = rest.strip()
        elif line.strip() and name:
            said[name] += " " + line.strip()
    return said


@pytest.mark.parametrize("path", GROUPS, ids=lambda p: " ".join(p) or "fpbench")
def test_every_group_lists_each_command_summary_whole(path):
    """Click cuts a first sentence longer than the room left with '...' (and a sentence with
    'Fig. 1' in it at the dot): each listed summary is its short_help or first paragraph, whole."""
    result = render(*path, "--help")
    assert result.exit_code == 0, result.output
    group = dict(ALL)[path]
    said = listed_summaries(result.stdout)
    assert sorted(said) == sorted(n for n, c in group.commands.items() if not c.hidden)
    for name, summary in said.items():
        command = group.commands[name]
        whole = command.short_help or (command.help or "").strip().split("\n\n")[0]
        assert summary == " ".join(whole.split()), (name, summary)
        assert not summary.endswith("..."), (name, summary)


LISTS = ["suites", "methods", "datasets", "partitions", "backbones", "strategies"]


@pytest.mark.parametrize("what", LISTS)
def test_every_list_fits_80_columns_with_names_whole(what):
    from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, STRATEGIES
    from fpbench.suites import list_suites

    result = render("list", what)
    assert result.exit_code == 0, result.output
    check_fits(result)
    names = (
        list_suites()
        if what == "suites"
        else {"methods": METHODS, "datasets": DATASETS, "partitions": PARTITIONS,
              "backbones": BACKBONES, "strategies": STRATEGIES}[what].names()
    )  # fmt: skip
    first_cells = {line.split("│")[1].strip() for line in result.stdout.splitlines() if "│" in line}
    assert set(names) <= first_cells, sorted(set(names) - first_cells)  # each on one line, whole


def test_list_descriptions_are_whole_paragraphs():
    """A docstring's first line can stop mid-sentence; the listed description does not."""
    result = render("list", "datasets", "imagenet")
    said = " ".join(result.stdout.replace("│", " ").split())
    assert "the 50,000 val images as test." in said, result.stdout


def test_list_suites_says_what_each_needs_under_its_description_at_80():
    result = render("list", "suites", "fgpt-table7")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.replace("│", " ").split())
    assert "FGPT Table 7" in said and "needs: data cifar100; weights vit-b16-in21k" in said


def test_data_status_on_an_empty_folder_reads_at_80(tmp_path, monkeypatch):
    """A block per dataset, its instruction wrapped at spaces: a URL or path is never split (one
    longer than the room stands alone on its line, whole)."""
    from fpbench.cli.data import dataset_rows

    monkeypatch.chdir(tmp_path)
    result = render("data", "status", "--root", "data")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout
    too_long = [line.strip() for line in lines if len(line) > WIDTH]
    assert all(" " not in word and "/" in word for word in too_long), too_long
    said = " ".join(result.stdout.split())
    words = set(result.stdout.split())
    for name, state, where, todo in dataset_rows(Path("data")):
        assert f"{name} {state} {where}" in said  # one line: name, state, where
        assert " ".join(todo.split()) in said, todo  # the instruction whole, in order
        assert all(word in words for word in todo.split()), todo  # no word broken
    assert lines[0] == "datasets under data"


def test_data_status_keeps_its_table_where_it_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["data", "status", "--root", "data"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "what to do" in result.stdout
    row = next(line for line in result.stdout.splitlines() if "│ cifar100 " in line)
    assert "missing" in row and "data/cifar-100-python" in row


def test_estimate_plan_of_a_paper_suite_reads_at_80(monkeypatch):
    """sgpt-table1's shapes are numbered in the table and each described whole below it."""
    from fpbench.cli.measure import describe
    from fpbench.measure.estimate import estimate
    from fpbench.suites import load_suite

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = render("estimate", "--suite", "sgpt-table1", "--dry")
    assert result.exit_code == 0, result.output
    check_fits(result)
    found = estimate(load_suite("sgpt-table1"), None, "auto", 2, None, lambda *a: None)
    listed = result.stdout.split("shapes:\n", 1)[1].split("assumptions:", 1)[0]
    said = " ".join(listed.split())
    for i, e in enumerate(found, 1):
        assert f" {i} {describe(e)} " in f" {said} ", describe(e)
    rows = [line.split("│")[1:3] for line in result.stdout.splitlines() if "│" in line]
    assert [(n.strip(), c.strip()) for n, c in rows] == [
        (str(i), str(e.cells)) for i, e in enumerate(found, 1)
    ]


def test_estimate_keeps_a_shape_in_its_row_where_that_fits(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["estimate", "--suite", "sgpt-table1", "--dry"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "shapes:" not in result.stdout
    assert "│ head-tune | vit-b16-in21k | cifar100 32px 50,000/10,000 | 5/100 clients |" in (
        result.stdout
    )


def test_wrap_shape_breaks_after_a_bar():
    from fpbench.cli.measure import wrap_shape

    text = "a-method | a-backbone | data 32px 1/2 | 5/100 clients | b40 x 5 ep | 60 rounds"
    assert wrap_shape(text, 40, "  1  ", "     ") == [
        "  1  a-method | a-backbone |",
        "     data 32px 1/2 | 5/100 clients |",
        "     b40 x 5 ep | 60 rounds",
    ]
    assert wrap_shape("one part much wider than the room", 16, "  1  ", "     ") == [
        "  1  one part",
        "     much wider",
        "     than the",
        "     room",
    ]


def test_a_long_error_wraps_to_80_columns_at_spaces():
    """`unknown suite 'sgpt'. Valid: <every suite>` was one line of about 1,000 characters."""
    from fpbench.errors import FpbenchError
    from fpbench.suites import find_suite
    from tests.conftest import error_messages

    with pytest.raises(FpbenchError) as raised:
        find_suite("sgpt")
    result = render("estimate", "--suite", "sgpt", "--dry")
    assert result.exit_code == 2
    check_fits(result)
    first, *rest = result.stderr.splitlines()
    assert first.startswith("error: unknown suite 'sgpt'. Valid: ") and len(rest) > 5
    assert all(line.startswith("  ") and not line.startswith("   ") for line in rest)
    assert error_messages(result.stderr) == [f"error: {raised.value}"]  # the same text, whole


def test_wrap_breaks_only_at_spaces_and_keeps_lines():
    from fpbench.cli.common import wrap

    url = "https://example.org/a-very-long/path-that-is/wider-than-the-room.tar.gz"
    assert wrap(f"get {url} and unpack it", 30, "  ", first="error: ") == [
        "error: get",
        f"  {url}",
        "  and unpack it",
    ]
    assert wrap("one two\nthree", 80, "  ") == ["  one two", "  three"]
