"""Issue 48's missing pieces: run filters by dataset and partition, deleting runs, the git commit
stored with each run, `runs` as CSV / JSON, the config flattened by `export`, the live view's
accuracies and loss."""

from __future__ import annotations

import io
import json
import re
import sqlite3
import subprocess
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.cli.run import _ProgressObserver
from fpbench.store import Store
from fpbench.store.provenance import git_commit
from tests.conftest import TINY_SUITE_TOML
from tests.test_workflow import fake_db

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_run_filters_cells_by_dataset_and_partition(here):
    two = TINY_SUITE_TOML.replace(
        '[[partitions]]\nname = "pathological"\ns = 3\n',
        '[[partitions]]\nname = "pathological"\ns = 3\n[[partitions]]\nname = "iid"\n',
    )
    (here / "two.toml").write_text(two)
    every = invoke("run", "--suite", "two.toml", "--dry-run", "--db", "x.db")
    assert every.exit_code == 0 and "4 cells" in every.stdout, every.output
    iid = invoke("run", "--suite", "two.toml", "--dry-run", "--partition", "iid", "--db", "x.db")
    assert iid.exit_code == 0 and "2 cells" in iid.stdout, iid.output
    rows = [line for line in iid.stdout.splitlines() if "synthetic" in line]
    assert len(rows) == 2 and all(" iid " in r and "patho" not in r for r in rows), iid.stdout
    both = invoke(
        "run", "--suite", "two.toml", "--dry-run", "--dataset", "synthetic", "--method", "fedvpt"
    )
    assert both.exit_code == 0 and "2 cells" in both.stdout
    bad = invoke("run", "--suite", "two.toml", "--dry-run", "--dataset", "cifar10")
    assert bad.exit_code == 2
    assert "dataset(s) ['cifar10'] not in suite" in " ".join(bad.stderr.split())


def test_db_delete_lists_then_deletes_a_run_and_its_rows(here):
    fake_db(here / "r.db", {("a", 0): [0.5, 0.6], ("b", 0): [0.4]})
    listed = invoke("db", "delete", "1", "--db", "r.db")
    assert listed.exit_code == 0, listed.output
    assert "would delete run 1 0000abcd (s: a / d / p / seed 0, done)" in listed.stdout
    assert "nothing deleted: add --yes" in listed.stdout
    gone = invoke("db", "delete", "0000", "--db", "r.db", "--yes")
    assert gone.exit_code == 0 and "deleted run 1 0000abcd" in gone.stdout, gone.output
    with sqlite3.connect(here / "r.db") as con:
        left = [
            con.execute(f"select count(*) from {t} where run_id = 1").fetchone()[0]
            for t in ("rounds", "metrics")
        ]
        runs = con.execute("select id from runs").fetchall()
    assert left == [0, 0] and runs == [(2,)]
    missing = invoke("db", "delete", "9", "--db", "r.db")
    assert missing.exit_code == 2


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def test_git_commit_names_the_source_and_marks_a_dirty_tree(tmp_path):
    assert git_commit.__wrapped__(tmp_path) is None  # no git checkout
    (tmp_path / "fpbench").mkdir()
    (tmp_path / "fpbench" / "x.py").write_text("a = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert git_commit.__wrapped__(tmp_path) == head and len(head) == 40
    (tmp_path / "fpbench" / "x.py").write_text("a = 2\n")
    assert git_commit.__wrapped__(tmp_path) == f"{head}-dirty"


def test_each_run_stores_the_commit_and_an_old_database_gains_the_column(tmp_path):
    url = fake_db(tmp_path / "r.db", {("a", 0): [0.5]})
    with Store(url) as store:
        assert store.get_run(1).git_commit == git_commit()
    with sqlite3.connect(tmp_path / "r.db") as con:  # as a database from before the column
        con.execute("alter table runs drop column git_commit")
    con.close()
    with Store(url) as store:
        assert store.get_run(1).git_commit is None  # older runs: unknown, nothing invented
        key = store.get_run(1).run_key
    assert key == "0000abcd"  # the key is the config's, never the commit's
    shown = invoke("show", "1", "--db", str(tmp_path / "r.db"))
    assert "git=-" in shown.stdout


def test_runs_as_csv_and_json(here):
    fake_db(here / "r.db", {("a", 0): [0.5, 0.6], ("b", 1): [0.4]})
    csv = invoke("runs", "--db", "r.db", "--format", "csv")
    assert csv.exit_code == 0, csv.output
    frame = pd.read_csv(io.StringIO(csv.stdout))
    assert frame["method"].tolist() == ["a", "b"] and frame["rounds"].tolist() == [2, 1]
    assert frame["acc_global"].tolist() == pytest.approx([0.6, 0.4])  # fractions, as stored
    records = json.loads(invoke("runs", "--db", "r.db", "--format", "json", "--method", "b").stdout)
    assert [(r["id"], r["seed"], r["status"]) for r in records] == [(2, 1, "done")]
    bad = invoke("runs", "--db", "r.db", "--format", "xml")
    assert bad.exit_code == 2 and "--format must be term, csv or json" in bad.stderr


def test_export_flattens_the_config_into_columns(here):
    fake_db(here / "r.db", {("a", 0): [0.5, 0.6]})
    done = invoke("export", "out", "--db", "r.db")
    assert done.exit_code == 0, done.output
    runs = pd.read_csv(here / "out" / "runs.csv")
    assert runs["config.train.rounds"].tolist() == [2]  # fake_config: {"train": {"rounds": 2}}
    assert json.loads(runs["config_json"][0]) == {"train": {"rounds": 2}}


def test_the_live_view_shows_accuracy_and_loss_beside_the_bar():
    progress = Progress(console=Console(file=io.StringIO(), force_terminal=True))
    observer = _ProgressObserver(progress, 1)
    cfg = SimpleNamespace(
        run_key="k",
        train=SimpleNamespace(rounds=4),
        method=SimpleNamespace(label="fedvpt"),
        dataset=SimpleNamespace(label="d"),
        partition=SimpleNamespace(label="p"),
        seed=0,
    )
    observer.cell_start(cfg, 0)
    observer.round_end(cfg, 0, {})  # not evaluated: nothing shown yet
    bar = progress.tasks[1]
    assert bar.fields["shown"] == "" and bar.completed == 1
    observer.round_end(cfg, 1, {"acc_global": 0.2189, "acc_local_worst": 0.05, "loss_train": 1.5})
    assert bar.fields["shown"] == "global 21.89%  worst 5.00%  loss 1.5" and bar.completed == 2


def test_every_missing_dataset_is_named_at_once(here):
    suite = (
        'name = "real"\nseeds = [0]\n[defaults]\nbackbone = { name = "vit-test" }\n'
        'train = { rounds = 1 }\n[[datasets]]\nname = "cifar10"\n[[datasets]]\nname = "dtd"\n'
        '[[partitions]]\nname = "iid"\n[[methods]]\nname = "fedvpt"\n'
    )
    (here / "real.toml").write_text(suite)
    (here / "empty").mkdir()
    got = invoke("run", "--suite", "real.toml", "--data-root", "empty", "--db", "x.db")
    assert got.exit_code == 2, got.output
    said = " ".join(got.stderr.split())
    assert said.startswith("error: 2 inputs are missing: dataset 'cifar10' not found under")
    assert "; dataset 'dtd' not found under" in said
    assert not (here / "x.db").exists()


def test_the_report_runs_table_has_each_runs_final_accuracies(here):
    from fpbench.report.html import build_report

    url = fake_db(here / "r.db", {("a", 0): [0.5, 0.6], ("b", 0): [0.4, 0.25]})
    with Store(url) as store:
        page = build_report(store.metrics(suite="s"), store.runs(suite="s"), "s").html
    table = page[page.index('<table class="dataframe runs">') :]
    table = table[: table.index("</table>")]
    heads = re.findall(r"<th>(.*?)</th>", table)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in table.split("<tr>")[1:]]
    column = {h: [r[i] for r in rows] for i, h in enumerate(heads)}
    assert column["global %"] == ["60.00", "25.00"]  # the last round's (a 2-round run)
    assert column["local mean %"] == ["30.00", "12.50"]
    assert "local worst %" not in column  # not stored: no empty column
    assert "table.runs { font-size: 0.8rem; display: block; max-width: 100%" in page
