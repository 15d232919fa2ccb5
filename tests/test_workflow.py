"""The research workflow around a run: `--set` overrides, `fpbench runs` (and later export,
compare), through the real CLI on the tiny suite or on small hand-made databases."""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
import struct
from pathlib import Path

import pandas as pd
import pytest
import tomllib
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.cli.common import parse_sets
from fpbench.engine.artifacts import load_params, params_path, read_npz, rescore
from fpbench.engine.task import load_dataset
from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.report.compare import compare_methods, paired_test
from fpbench.report.tables import t_interval
from fpbench.store import Store
from fpbench.suites import expand_suite, load_suite, set_overrides, sets_name
from tests.conftest import TINY_SUITE_TOML

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def fake_config(rounds: int) -> dict:
    """What `db check` (and so `db merge`) reads of a run's config."""
    return {"train": {"rounds": rounds}}


def fake_db(path: Path, values: dict[tuple[str, int], list[float]], suite: str = "s") -> str:
    """A database of done runs: (method, seed) -> acc_global per round (rounds 0, 1, ...),
    with acc_local_mean = acc_global / 2 and client 0's acc_local = the same value."""
    url = f"sqlite:///{path}"
    with Store(url) as store:
        for i, ((method, seed), accs) in enumerate(values.items()):
            run = store.create_run(
                run_key=f"{i:04d}abcd", suite=suite, method=method, dataset="d", partition="p",
                seed=seed, config=fake_config(len(accs)), fpbench_version="0", torch_version="0",
                device="cpu",
            )  # fmt: skip
            for rnd, acc in enumerate(accs):
                rows = [
                    (None, "loss_train", 1.0 / (rnd + 1), None),
                    (None, "acc_global", acc, None),
                    (None, "acc_local_mean", acc / 2, None),
                    (0, "acc_local", acc, 10),
                ]
                store.write_round(
                    run.id, rnd, loss_train=1.0 / (rnd + 1), wall_s=2.0, bytes_up=10,
                    bytes_down=20, metrics=rows,
                )  # fmt: skip
            assert store.claim_run(run.id, "me")
            assert store.finish_run(run.id, "me", "done", wall_s=3.0)
    return url


# -- --set ------------------------------------------------------------------------------------


def test_parse_sets_reads_values_as_a_suite_file_does():
    got = parse_sets(
        ["train.rounds=2", "train.lr=1e-3", "a.b=true", 'c.d="x"', "e.f=adam", "g.h=[1, 2]"]
        + ["i.j=null", "k.l={ hflip = true }"]
    )
    assert got == {
        "train.rounds": 2, "train.lr": 0.001, "a.b": True, "c.d": "x", "e.f": "adam",
        "g.h": [1, 2], "i.j": None, "k.l": {"hflip": True},
    }  # fmt: skip
    assert type(got["train.rounds"]) is int
    with pytest.raises(FpbenchError, match="KEY=VALUE"):
        parse_sets(["train.rounds"])
    with pytest.raises(FpbenchError, match="given twice"):
        parse_sets(["train.rounds=2", "train.rounds=3"])


def test_set_overrides_nest_paths_and_refuse_others():
    assert set_overrides({"train.rounds": 2, "method.args.prompt_len": 5}) == {
        "train": {"rounds": 2},
        "method": {"args": {"prompt_len": 5}},
    }
    for bad in ("seed", "suite", "method.name", "method.prompt_len", "rounds", "train."):
        with pytest.raises(FpbenchError, match="not a settable path"):
            set_overrides({bad: 1})
    with pytest.raises(FpbenchError, match="train.augment"):
        set_overrides({"train.augment": True, "train.augment.hflip": True})


def test_sets_name():
    assert (
        sets_name("tiny", {"train.rounds": 2, "train.lr": 0.1})
        == "tiny+train.rounds=2,train.lr=0.1"
    )
    assert sets_name("tiny", {"runtime.device": "cpu"}) == "tiny"  # not part of results
    hashed = sets_name("tiny", {"backbone.weights": "/w/x.pth"})  # no '/' in a suite name
    assert hashed.startswith("tiny+set-") and len(hashed) == len("tiny+set-") + 8


def test_sets_change_cells_and_keys_exactly_like_the_file():
    raw = tomllib.loads(TINY_SUITE_TOML)
    plain = expand_suite(raw, name="tiny").cells
    forced = expand_suite(raw, name="tiny", sets={"train.rounds": 5, "train.lr": 0.2}).cells
    in_file = tomllib.loads(TINY_SUITE_TOML.replace("rounds = 2", "rounds = 5").replace(
        "lr = 0.05", "lr = 0.2"))  # fmt: skip
    assert [c.run_key for c in forced] == [
        c.run_key for c in expand_suite(in_file, name="tiny").cells
    ]
    assert {c.train.rounds for c in forced} == {5}
    assert not {c.run_key for c in forced} & {c.run_key for c in plain}
    runtime = expand_suite(raw, name="tiny", sets={"runtime.device": "cpu"}).cells
    assert [c.run_key for c in runtime] == [c.run_key for c in plain]
    assert {c.runtime.device for c in runtime} == {"cpu"}


def test_method_args_set_only_on_the_chosen_methods(workdir):
    with pytest.raises(FpbenchError, match=r"head-tune.*with --set: method.prompt_len"):
        load_suite("tiny", {"method.args.prompt_len": 3})
    suite = load_suite("tiny", {"method.args.prompt_len": 3}, methods=["fedvpt"])
    assert suite.name == "tiny+method.args.prompt_len=3"
    assert [(c.method.name, c.method.args["prompt_len"]) for c in suite.cells] == [("fedvpt", 3)]


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["train.rounds=0"],
            "with --set: train.rounds: Input should be greater than or equal to 1",
        ),
        (["train.roundz=2"], "train.roundz: Extra inputs are not permitted"),
        (["train.optimizer=adamw"], "train.optimizer: Input should be 'sgd' or 'adam'"),
        (["seed=3"], "--set seed: not a settable path"),
    ],
)
def test_bad_sets_exit_2_and_write_nothing(workdir, sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    for command in (["run"], ["estimate", "--dry"]):
        result = invoke(*command, "--suite", "tiny", *args)
        assert result.exit_code == 2, result.output
        assert needle in " ".join(result.output.split())  # the error wrapped to the width
        assert "Traceback" not in result.output
    assert not (workdir / "results").exists()


def test_estimate_takes_sets(workdir):
    args = ["estimate", "--suite", "tiny", "--dry", "--json", "e.json"]
    result = invoke(*args, "--set", "train.rounds=7", "--method", "fedvpt")
    assert result.exit_code == 0, result.output
    assert "tiny+train.rounds=7" in result.output
    shapes = json.loads((workdir / "e.json").read_text())
    assert [(s["label"], s["shape"]["rounds"]) for s in shapes] == [("fedvpt", 7)]


def test_run_with_set_stores_its_own_cells_and_runs_lists_them(workdir):
    result = invoke("run", "--suite", "tiny", "--method", "head-tune", "--set", "train.rounds=1")
    assert result.exit_code == 0, result.output
    assert "fpbench table --suite tiny+train.rounds=1 " in result.output
    assert "1 cell ran, 0 already done, 0 failed" in result.output
    expected = load_suite("tiny", {"train.rounds": 1}).cells
    with sqlite3.connect(workdir / "results" / "fpbench.db") as con:
        rows = con.execute("select run_key, suite, config_json from runs").fetchall()
        rounds = con.execute("select count(*) from rounds").fetchone()[0]
    head = next(c for c in expected if c.method.name == "head-tune")
    assert [(r[0], r[1]) for r in rows] == [(head.run_key, "tiny+train.rounds=1")]
    assert '"rounds": 1' in rows[0][2] and rounds == 1
    listed = invoke("runs")
    assert listed.exit_code == 0, listed.output
    assert head.run_key[:8] in listed.output and "tiny+train.rounds=1" in listed.output
    assert "1 run in" in listed.output


def test_runs_lists_filters_and_headline_percent(workdir):
    fake_db(
        workdir / "r.db",
        {("sgpt", 0): [0.1, 0.5], ("sgpt", 1): [0.2, 0.7], ("fedavg", 0): [0.3, 0.25]},
    )
    result = invoke("runs", "--db", "r.db")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "abcd" in line]
    assert len(lines) == 3
    assert "50.00" in lines[0] and "25.00" in lines[0]  # global and local-mean of the last round
    assert "70.00" in lines[1] and "35.00" in lines[1]
    assert "25.00" in lines[2] and "12.50" in lines[2]
    assert all(re.search(r" done +2 ", line) for line in lines)  # rounds 0-1: 2 rounds
    only = invoke("runs", "--db", "r.db", "--method", "fedavg", "--status", "done")
    assert only.exit_code == 0 and "1 run in" in only.output and "sgpt" not in only.output
    none = invoke("runs", "--db", "r.db", "--status", "failed")
    assert none.exit_code == 0 and "no runs in r.db match" in none.output
    missing = invoke("runs", "--db", "nope.db")
    assert missing.exit_code == 2 and "no results database" in missing.output


def test_missing_run_points_to_fpbench_runs(workdir):
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1]})
    result = invoke("show", "12345", "--db", "r.db")
    assert result.exit_code == 2 and "see `fpbench runs`" in result.output


# -- export -----------------------------------------------------------------------------------


def test_export_csv_holds_every_round_and_client_value(workdir):
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1, 0.5], ("fedavg", 1): [0.3, 0.25, 0.75]})
    result = invoke("export", "out", "--db", "r.db")
    assert result.exit_code == 0, result.output
    assert "out/rounds.csv (5 rows)" in result.output
    runs = pd.read_csv(workdir / "out" / "runs.csv")
    rounds = pd.read_csv(workdir / "out" / "rounds.csv")
    clients = pd.read_csv(workdir / "out" / "clients.csv")
    assert list(runs["method"]) == ["sgpt", "fedavg"] and list(runs["last_round"]) == [1, 2]
    assert json.loads(runs["config_json"][0]) == fake_config(2)
    assert list(rounds.columns) == [
        "run_id", "run_key", "suite", "method", "dataset", "partition", "seed", "round",
        "loss_train", "wall_s", "bytes_up", "bytes_down", "acc_global", "acc_local_mean",
    ]  # fmt: skip
    assert rounds[["method", "seed", "round"]].values.tolist() == [
        ["sgpt", 0, 0], ["sgpt", 0, 1], ["fedavg", 1, 0], ["fedavg", 1, 1], ["fedavg", 1, 2],
    ]  # fmt: skip
    assert list(rounds["acc_global"]) == [0.1, 0.5, 0.3, 0.25, 0.75]
    assert list(rounds["acc_local_mean"]) == [0.05, 0.25, 0.15, 0.125, 0.375]
    assert list(rounds["loss_train"]) == pytest.approx([1, 1 / 2, 1, 1 / 2, 1 / 3])
    assert list(clients.columns[-4:]) == ["round", "client_id", "acc_local", "acc_local_count"]
    assert list(clients["acc_local"]) == [0.1, 0.5, 0.3, 0.25, 0.75]
    assert set(clients["acc_local_count"]) == {10} and set(clients["client_id"]) == {0}
    again = invoke("export", "out", "--db", "r.db")
    assert again.exit_code == 2 and "--force overwrites" in " ".join(again.output.split())
    only = invoke("export", "out", "--db", "r.db", "--method", "fedavg", "--force")
    assert only.exit_code == 0, only.output
    assert set(pd.read_csv(workdir / "out" / "rounds.csv")["method"]) == {"fedavg"}
    by_run = invoke("export", "one", "--db", "r.db", "--run", "0000ab")
    assert by_run.exit_code == 0 and "one/rounds.csv (2 rows)" in by_run.output
    none = invoke("export", "none", "--db", "r.db", "--status", "failed")
    assert none.exit_code == 2 and "no runs" in none.output and not (workdir / "none").exists()


def test_export_parquet_reads_back_as_the_csv(workdir):
    pytest.importorskip("pyarrow")
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1, 0.5], ("fedavg", 1): [0.3, 0.25, 0.75]})
    for fmt in ("csv", "parquet"):
        result = invoke("export", fmt, "--db", "r.db", "--format", fmt)
        assert result.exit_code == 0, result.output
    for table in ("runs", "rounds", "clients"):
        parquet = pd.read_parquet(workdir / "parquet" / f"{table}.parquet")
        csv = pd.read_csv(workdir / "csv" / f"{table}.csv")
        assert list(parquet.columns) == list(csv.columns)
        same = ["id", "run_key", "wall_s"] if table == "runs" else list(csv.columns)
        pd.testing.assert_frame_equal(
            parquet[same].astype(object), csv[same].astype(object), check_dtype=False
        )
    rounds = pd.read_parquet(workdir / "parquet" / "rounds.parquet")
    assert list(rounds["acc_global"]) == [0.1, 0.5, 0.3, 0.25, 0.75]


def test_export_parquet_without_pyarrow_names_the_extra(workdir, monkeypatch):
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1]})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    result = invoke("export", "out", "--db", "r.db", "--format", "parquet")
    assert result.exit_code == 2 and "pip install 'fpbench[parquet]'" in result.output
    assert not (workdir / "out").exists()


# -- statistics -------------------------------------------------------------------------------


def test_t_interval_by_hand():
    # mean 0.6, sample std 0.1, 3 seeds: 0.6 ± t(0.975, 2) 4.3027 * 0.1 / sqrt(3) = 0.6 ± 0.248414
    assert t_interval(0.6, 0.1, 3) == pytest.approx((0.351586, 0.848414), abs=1e-6)
    assert t_interval(0.6, 0.1, 1) is None


def test_paired_test_by_hand():
    # differences 0.01, 0.02, 0.03: mean 0.02, sd 0.01, t = 0.02 / (0.01 / sqrt 3) = 3.4641,
    # two-sided p with 2 df = 1 - t / sqrt(t^2 + 2) = 0.07418; interval 0.02 ± 4.3027 * 0.005774
    got = paired_test([0.1, 0.2, 0.3], [0.11, 0.22, 0.33])
    assert got["mean_diff"] == pytest.approx(0.02) and got["std_diff"] == pytest.approx(0.01)
    assert got["t"] == pytest.approx(3.4641, abs=1e-4)
    assert got["p"] == pytest.approx(0.07418, abs=1e-5)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((-0.0048414, 0.0448414), abs=1e-7)
    assert got["verdict"] == "within seed noise"
    # differences 0.05, 0.06, 0.07: t = 10.392, p = 1 - t / sqrt(t^2 + 2) = 0.00913
    got = paired_test([0.1, 0.2, 0.3], [0.15, 0.26, 0.37])
    assert got["p"] == pytest.approx(0.00913, abs=1e-5)
    assert got["verdict"] == "exceeds seed noise" and got["ci_low"] > 0
    same = paired_test([0.1, 0.2], [0.2, 0.3])  # equal differences: no spread at all
    assert (same["p"], same["verdict"]) == (0.0, "exceeds seed noise")
    assert paired_test([0.1, 0.2], [0.1, 0.2])["verdict"] == "within seed noise"
    assert paired_test([0.1], [0.3])["verdict"] == "one seed: no test"


def test_compare_pairs_by_seed_and_prints_the_test(workdir):
    fake_db(
        workdir / "r.db",
        {
            **{("fedavg", s): [0.0, v] for s, v in enumerate([0.1, 0.2, 0.3, 0.9])},
            **{("sgpt", s + 1): [0.0, v] for s, v in enumerate([0.25, 0.36, 0.97, 0.5])},
        },
    )
    found = compare_methods(Store("sqlite:///r.db").metrics(), "fedavg", "sgpt", ["acc_global"])
    row = found.iloc[0]
    assert row["seeds"] == [1, 2, 3]  # seeds 0 and 4 have no partner
    assert row["diffs"] == pytest.approx([0.05, 0.06, 0.07])
    assert row["p"] == pytest.approx(0.00913, abs=1e-5)
    result = invoke("compare", "fedavg", "sgpt", "--suite", "s", "--db", "r.db")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "  global  " in line)
    assert line.split()[3:8] == ["global", "3", "46.67", "52.67", "+6.00"]  # 3 seeds paired
    assert "0.00913" in line and "exceeds" in line
    said = " ".join(result.output.split())
    assert "B - A per seed: d / p global: 1: +5.00, 2: +6.00, 3: +7.00" in said
    assert "d / p local mean: 1: +2.50, 2: +3.00, 3: +3.50" in said  # half the global values
    bad = invoke("compare", "fedavg", "nope", "--suite", "s", "--db", "r.db")
    assert bad.exit_code == 2 and "no runs of method 'nope'" in bad.output
    same = invoke("compare", "sgpt", "sgpt", "--suite", "s", "--db", "r.db")
    assert same.exit_code == 2 and "two different methods" in same.output
    alpha = invoke("compare", "fedavg", "sgpt", "--suite", "s", "--db", "r.db", "--alpha", "1.5")
    assert alpha.exit_code == 2 and "--alpha must be between 0 and 1" in alpha.output


def test_table_ci_and_term_format(workdir):
    fake_db(workdir / "r.db", {("sgpt", s): [v] for s, v in enumerate([0.5, 0.6, 0.7])})
    plain = invoke("table", "--suite", "s", "--db", "r.db", "--metric", "acc_global")
    assert plain.exit_code == 0 and "| sgpt | 60.00 ± 10.00 |" in plain.output
    ci = invoke("table", "--suite", "s", "--db", "r.db", "--metric", "acc_global", "--ci")
    assert "| sgpt | 60.00 ± 10.00 [35.16, 84.84] |" in ci.output
    term = invoke("table", "--suite", "s", "--db", "r.db", "--format", "term", "--ci")
    assert term.exit_code == 0, term.output
    assert "60.00 ± 10.00 [35.16, 84.84]" in term.output and "30.00 ± 5.00" in term.output


# -- one numbering, one unit; help and messages -------------------------------------------------


def test_show_numbers_rounds_from_one_in_percent(workdir):
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1, 0.5, 0.625]})
    result = invoke("show", "1", "--db", "r.db")
    assert result.exit_code == 0, result.output
    assert "aggregates at round 3" in result.output  # database rounds 0, 1, 2
    assert "62.50%" in result.output and "31.25%" in result.output
    assert "0.6250" not in result.output


def test_report_runs_table_counts_rounds_and_plots_write_pdfs(workdir):
    fake_db(workdir / "r.db", {("sgpt", 0): [0.1, 0.5, 0.625]})
    result = invoke("report", "--suite", "s", "--db", "r.db", "--out", "rep")
    assert result.exit_code == 0, result.output
    page = (workdir / "rep" / "index.html").read_text()
    assert "<th>rounds</th>" in page and "<td>3</td>" in page and "last_round" not in page
    assert "1 run (1 done)" in page
    for kind, *more in (("tradeoff", "--y", "acc_local_mean"), ("curves",)):
        out = workdir / f"{kind}.png"
        result = invoke("plot", kind, "--suite", "s", "--db", "r.db", "--out", str(out), *more)
        assert result.exit_code == 0, result.output
        assert out.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"


def test_paper_table_without_database_says_so(workdir):
    result = invoke("table", "--paper", "sgpt", "--table", "1", "--db", "none.db")
    assert result.exit_code == 0, result.output
    assert "no results database at none.db: the paper's values only" in result.output
    assert not (workdir / "none.db").exists()


def test_shortened_names_suggest_what_they_begin():
    from fpbench.registry import PARTITIONS

    with pytest.raises(FpbenchError, match=r"'patho'\. Did you mean pathological, pachinko\?"):
        PARTITIONS.get("patho")


def test_missing_database_driver_names_the_extra(workdir):
    pytest.importorskip("sqlalchemy")
    try:
        import pg8000  # noqa: F401

        pytest.skip("pg8000 is installed here")
    except ImportError:
        pass
    result = invoke("runs", "--db", "postgresql+pg8000://u@localhost/x")
    assert result.exit_code == 2
    said = " ".join(result.output.split())  # the error wrapped to the width
    assert "No module named 'pg8000'" in said
    assert "pip install 'fpbench[postgres]'" in said
    assert "postgresql+psycopg://" in said


def test_list_suites_says_what_each_needs(workdir):
    from fpbench.cli.results import suite_row

    assert suite_row("tiny") == ("2", "[green]offline[/]", "")
    assert suite_row("smoke")[1] == "[green]offline[/]"
    cells, needs, description = suite_row("fgpt-table7")
    assert (cells, needs) == ("14", "data cifar100; weights vit-b16-in21k")
    assert description.startswith("FGPT Table 7")
    result = invoke("list", "suites")
    assert result.exit_code == 0 and "offline" in result.output and "cells" in result.output


# -- trained state: kept, exported, re-scored ---------------------------------------------------


def test_params_path_beside_the_database():
    ck = Path("/c")
    assert params_path("sqlite:////r/x.db", ck, "k") == Path("/r/x-params/k.pt")
    assert params_path("postgresql+psycopg://u@h/db", ck, "k") == Path("/c/params/k.pt")


def test_kept_state_exports_and_rescores_to_the_stored_numbers(workdir):
    suite = TINY_SUITE_TOML.replace('name = "head-tune"', 'name = "fedrep"')
    (workdir / "benchmarks" / "tiny.toml").write_text(suite)
    result = invoke("run", "--suite", "tiny", "--set", "train.rounds=1")
    assert result.exit_code == 0, result.output
    assert not list((workdir / "results" / "checkpoints").glob("*.pt"))  # moved, not left
    kept = sorted(p.name for p in (workdir / "results" / "fpbench-params").iterdir())
    keys = sorted(f"{c.run_key}.pt" for c in load_suite("tiny", {"train.rounds": 1}).cells)
    assert kept == keys
    for run in ("1", "2"):  # fedrep (personal heads), fedvpt (global)
        again = invoke("evaluate", run)
        assert again.exit_code == 0, again.output
        assert re.search(r"(\d+) of \1 stored values .* all\s+equal", again.output), again.output
        # every client's local (and held-out) accuracy and the aggregates over them
        assert int(re.search(r"(\d+) of", again.output)[1]) >= 10
    on_train = invoke("evaluate", "1", "--split", "train")
    assert on_train.exit_code == 0 and "(train split)" in on_train.output
    assert "stored" not in on_train.output
    cells = load_suite("tiny", {"train.rounds": 1}).cells
    cfg = next(c for c in cells if c.method.name == "fedrep")
    cpu, url = torch.device("cpu"), "sqlite:///results/fpbench.db"
    state = load_params(url, Path("results/checkpoints"), cfg.run_key, cpu)
    rows = rescore(cfg, state, cpu, "train")  # each client scored on its own train samples
    clients = make_clients(cfg.partition.name, cfg.partition.args, load_dataset(cfg.dataset), 0)
    local = {c: n for c, name, _, n in rows if name == "acc_local"}
    assert local and local == {c.id: len(c.train_idx) for c in clients if c.id in local}
    other = invoke("evaluate", "1", "--set", "dataset.args.seed=1")
    assert other.exit_code == 0 and "stored" not in other.output and "re-scored" in other.output
    out = workdir / "fedrep.npz"
    exported = invoke("export-params", "1", "--out", str(out))
    assert exported.exit_code == 0, exported.output
    state, meta = read_npz(out)
    assert meta["format"] == "fpbench-params-1" and meta["round"] == 0
    assert meta["config"]["method"]["name"] == "fedrep"
    assert sorted(state.personal) == ["head_b", "head_w"] and sorted(state.params) == ["prompts"]
    assert state.personal["head_w"].shape == (4, 6, 32)  # a head per client, 6 classes
    kept_state = torch.load(
        workdir / "results" / "fpbench-params" / f"{meta['run_key']}.pt", weights_only=True
    )["server"]
    assert torch.equal(state.personal["head_w"], kept_state["personal"]["head_w"])
    assert torch.equal(state.params["prompts"], kept_state["params"]["prompts"])
    again = invoke("export-params", "1", "--out", str(out))
    assert again.exit_code == 2 and "--force overwrites" in " ".join(again.output.split())
    wrong = invoke("evaluate", "1", "--dataset", "cifar10")
    assert wrong.exit_code == 2 and "cifar10 has 10 classes, the run's 6" in wrong.output
    (workdir / "results" / "fpbench-params" / kept[0]).unlink()
    (workdir / "results" / "fpbench-params" / kept[1]).unlink()
    gone = invoke("evaluate", "1")
    assert gone.exit_code == 2 and "has no trained state" in gone.output


def test_db_merge_copies_kept_states_along(workdir):
    fake_db(workdir / "a.db", {("sgpt", 0): [0.1]})
    (workdir / "a-params").mkdir()
    (workdir / "a-params" / "0000abcd.pt").write_bytes(b"state")
    (workdir / "out-params").mkdir()
    (workdir / "out-params" / "ffff.pt").write_bytes(b"mine")
    result = invoke("db", "merge", "out.db", "a.db")
    assert result.exit_code == 0, result.output
    assert "1 trained state(s) copied" in result.output
    assert (workdir / "out-params" / "0000abcd.pt").read_bytes() == b"state"
    assert (workdir / "out-params" / "ffff.pt").read_bytes() == b"mine"
    again = invoke("db", "merge", "out.db", "a.db")
    assert again.exit_code == 0 and "copied" not in again.output


# -- trackers -----------------------------------------------------------------------------------


def test_tensorboard_events_read_back_as_the_stored_rounds(workdir):
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    args = ["run", "--suite", "tiny", "--method", "head-tune", "--log", "tensorboard"]
    result = invoke(*args, "--log-dir", "logs")
    assert result.exit_code == 0, result.output
    (folder,) = (workdir / "logs" / "tiny").iterdir()
    cfg = next(c for c in load_suite("tiny").cells if c.method.name == "head-tune")
    assert folder.name == f"head-tune-synthetic-pathological-s0-{cfg.run_key[:8]}"
    events = tb.EventAccumulator(str(folder))
    events.Reload()
    with Store("sqlite:///results/fpbench.db") as store:
        stored = store.metrics(names=["acc_global", "loss_train"])
    for name, scale in (("acc_global", 100.0), ("loss_train", 1.0)):
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        rows = stored[stored["name"] == name]
        pairs = zip(rows["round"], rows["value"], strict=True)
        expected = [(int(r) + 1, scale * v) for r, v in pairs]
        assert [s for s, _ in logged] == [1, 2] == [s for s, _ in expected]  # rounds from 1
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_missing_tracker_package_names_the_extra(workdir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    result = invoke("run", "--suite", "tiny", "--log", "wandb")
    assert result.exit_code == 2 and "pip install 'fpbench[wandb]'" in result.output
    assert not (workdir / "results").exists()
    bad = invoke("run", "--suite", "tiny", "--log", "neptune")
    assert bad.exit_code == 2 and "unknown tracker 'neptune'" in bad.output


def _stored_percent(name: str) -> list[tuple[int, float]]:
    """(round from 1, value in percent) of the only run's aggregate `name`."""
    with Store("sqlite:///results/fpbench.db") as store:
        rows = store.metrics(names=[name])
    return [(int(r) + 1, 100 * v) for r, v in zip(rows["round"], rows["value"], strict=True)]


def test_mlflow_file_store_reads_back_as_the_stored_rounds(workdir, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    args = ["run", "--suite", "tiny", "--method", "head-tune", "--set", "train.lr=0.03"]
    result = invoke(*args, "--log", "mlflow", "--log-dir", "logs")
    assert result.exit_code == 0, result.output
    client = mlflow.MlflowClient((workdir / "logs" / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("fpbench/tiny+train.lr=0.03")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name.startswith("head-tune-synthetic")
    assert run.data.params["train.lr"] == "0.03" and run.data.params["seed"] == "0"
    logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "acc_global")]
    expected = _stored_percent("acc_global")
    assert [s for s, _ in logged] == [1, 2] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-12)


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B offline `.wandb` file (a LevelDB-style log: 32 KiB
    blocks of records, each a crc32, a length, a type (full, first, middle, last) and data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, head = path.read_bytes(), 32768, 7
    pos, parts, records = 7, b"", []  # after the file's own header, ":W&B" magic version
    while pos + head <= len(raw):
        if block - pos % block < head:
            pos += block - pos % block  # the rest of a block too short for a header is padding
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos : pos + head])
        data, pos = raw[pos + head : pos + head + n], pos + head + n
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


@pytest.mark.slow  # starts W&B's own service process (about 30 s here)
def test_wandb_offline_run_holds_the_stored_rounds(workdir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = ["run", "--suite", "tiny", "--method", "head-tune", "--log", "wandb"]
    result = invoke(*args, "--log-dir", "logs")
    assert result.exit_code == 0, result.output
    (path,) = (workdir / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name.startswith("head-tune-synthetic") and run.run_group == "tiny"
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [(h["_step"], h["acc_global"]) for h in history]
    expected = _stored_percent("acc_global")
    assert [s for s, _ in logged] == [1, 2] == [s for s, _ in expected]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-12)
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]


def test_a_failing_tracker_is_dropped_and_the_run_goes_on(caplog):
    from types import SimpleNamespace

    from fpbench.cli.trackers import TrackingObserver
    from fpbench.engine.rounds import Observer

    class Broken:
        logged: list = []

        def start(self, cfg):
            pass

        def log(self, cfg, step, metrics):
            raise OSError("disk full")

        def end(self, cfg, status):
            raise AssertionError("a dropped tracker is not called again")

    class Keeps(Broken):
        def log(self, cfg, step, metrics):
            self.logged.append((step, metrics))

        def end(self, cfg, status):
            self.logged.append(status)

    keeps = Keeps()
    keeps.logged = []
    observer = TrackingObserver(Observer(), [Broken(), keeps])
    cfg = SimpleNamespace(run_key="k")
    observer.cell_start(cfg, 0)
    observer.round_end(cfg, 0, {"acc_global": 0.25, "loss_train": 2.0})
    observer.round_end(cfg, 1, {})  # not evaluated: nothing logged
    observer.cell_end(SimpleNamespace(cfg=cfg, status="done"))
    assert keeps.logged == [(1, {"acc_global": 25.0, "loss_train": 2.0}), "done"]
    assert "stopped logging to Broken: OSError: disk full" in caplog.text
