"""`fpbench tune`: the carved validation split, search spaces, pruning, the shared budget, and
the search end to end on the tiny suite (synthetic data, test-sized ViT), offline."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.task import build_task, load_dataset, task_of
from fpbench.engine.validation import carve_validation, validation_indices
from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.registry import METHODS
from fpbench.report.sources import form_problems, text_problems
from fpbench.specs import Evaluation
from fpbench.suites import expand_suite, set_overrides
from fpbench.tune import best as best_mod
from fpbench.tune import study as study_mod
from fpbench.tune.space import SHIPPED, load_spaces, space_for
from fpbench.tune.study import Budget, _Pruned, _Pruning, best_trial, trial_cells
from tests.conftest import TINY_SUITE_TOML

runner = CliRunner()
SHARED = Path(__file__).parents[1].parent / "shared"
SPACE = """
[fedvpt]
"train.lr" = { low = 0.01, high = 0.1, log = true, source = 'silent: a test range' }
"method.args.prompt_len" = { choices = [1, 4], source = 'silent: a test range' }
[head-tune]
"train.lr" = { low = 0.01, high = 0.1, source = 'silent: a test range' }
"""


def _cell(validation: float = 0.0, seed: int = 0):
    raw = tomllib.loads(TINY_SUITE_TOML)
    sets = {"train.validation": validation} if validation else None
    return expand_suite(raw, name="tiny", sets=sets, methods=["fedvpt"]).cells[seed]


# -- the validation split ------------------------------------------------------------------------


def test_each_client_gives_a_rounded_fraction_and_keeps_one_sample():
    """min(floor(frac * n + 0.5), n - 1) of n: 10 -> 3 at 0.25, 1 -> 0, 2 -> 1 at 0.5."""
    cell = _cell()
    data = load_dataset(cell.dataset)
    clients = make_clients(cell.partition.name, cell.partition.args, data, seed=0)
    sized = [dataclasses.replace(clients[0], train_idx=clients[0].train_idx[:n]) for n in (10, 1)]
    assert [v.size for v in validation_indices(sized, 0.25, 0)] == [3, 0]
    two = [dataclasses.replace(clients[0], train_idx=clients[0].train_idx[:2])]
    assert [v.size for v in validation_indices(two, 0.5, 0)] == [1]


def test_validation_is_carved_from_each_clients_train_data_disjoint_and_seeded():
    cell = _cell()
    data = load_dataset(cell.dataset)
    clients = make_clients(cell.partition.name, cell.partition.args, data, seed=0)
    # a test split of its own kind: label -1 and white images; nothing of it may be scored
    poisoned = dataclasses.replace(
        data,
        test_images=torch.full_like(data.test_images, 255),
        test_labels=torch.full_like(data.test_labels, -1),
        identity=None,
    )
    val, carved = carve_validation(poisoned, clients, 0.25, seed=0)
    picked = validation_indices(clients, 0.25, 0)
    pool = np.concatenate(picked)
    assert (val.test_labels >= 0).all()  # no test-split sample
    assert torch.equal(val.test_images, data.train_images[torch.as_tensor(pool)])
    assert torch.equal(val.test_labels, data.train_labels[torch.as_tensor(pool)])
    assert torch.equal(val.train_images, data.train_images)  # train indices keep their meaning
    for before, after, mine in zip(clients, carved, picked, strict=True):
        assert not set(after.train_idx) & set(mine)  # disjoint
        assert sorted([*after.train_idx, *mine]) == sorted(before.train_idx)  # nothing lost
        assert np.array_equal(pool[after.test_idx], mine)  # its local set is its own samples
        assert mine.size == min(
            int(np.floor(0.25 * before.train_idx.size + 0.5)), before.train_idx.size - 1
        )
    assert len(set(pool)) == pool.size  # no sample in two clients' validation sets
    again = validation_indices(clients, 0.25, 0)
    other = validation_indices(clients, 0.25, 1)
    assert all(np.array_equal(a, b) for a, b in zip(picked, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(picked, other, strict=True))


def test_build_task_scores_the_carved_split_and_leaves_the_partition_draws_alone():
    cell = _cell(0.25)
    task = build_task(cell, torch.device("cpu"))
    plain = build_task(_cell(), torch.device("cpu"))
    data = load_dataset(cell.dataset)
    assert task.data.test_images.shape[0] == sum(len(i) for i in task.test_idx)
    assert task.data.test_images.shape[0] < data.train_images.shape[0]
    for c_val, c_plain in zip(task.clients, plain.clients, strict=True):
        assert set(c_val.train_idx) < set(c_plain.train_idx)  # the same partition, carved
    assert torch.equal(plain.data.test_images, data.test_images)  # off: the test split


def test_validation_off_leaves_run_keys_and_stored_configs_as_they_were():
    off, on = _cell(), _cell(0.25)
    assert "validation" not in off.model_dump(mode="json")["train"]
    assert "validation" not in off.identity()["train"]
    assert on.model_dump(mode="json")["train"]["validation"] == 0.25
    assert on.run_key != off.run_key
    assert _cell(0.0).run_key == off.run_key


def test_validation_with_an_evaluation_mode_is_refused():
    cell = _cell(0.25).model_copy(update={"evaluation": Evaluation(mode="base2novel")})
    with pytest.raises(FpbenchError, match="train.validation"):
        build_task(cell, torch.device("cpu"))


def test_no_shipped_cell_has_the_field_so_no_protocol_covers_it():
    """`train.validation` at 0 is left out of the stored config, the run key and the paths the
    paper protocols cover (`leaf_paths`): shipped suites never set it, only `fpbench tune`."""
    from fpbench.suites import list_suites, load_suite

    for name in list_suites():
        for cell in load_suite(name).cells:
            assert "validation" not in cell.model_dump(mode="json")["train"], name


def test_task_of_with_validation_zero_is_the_plain_task():
    cell = _cell()
    data = load_dataset(cell.dataset)
    a = task_of(data, cell.partition, 0, torch.device("cpu"))
    b = task_of(data, cell.partition, 0, torch.device("cpu"), validation=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a.train_idx, b.train_idx, strict=True))
    assert a.data.test_images is not None and torch.equal(a.data.test_images, b.data.test_images)


# -- search spaces -------------------------------------------------------------------------------


def test_every_shipped_space_is_a_registered_method_with_settable_sourced_ranges():
    spaces = load_spaces(SHIPPED)
    assert {"head-tune", "fedvpt", "local"} <= set(spaces)  # the smoke suite's methods
    for method, space in spaces.items():
        METHODS.get(method)
        assert space, method
        set_overrides({p.path: 1 for p in space})  # every path is one --set takes
        for p in space:
            assert not form_problems(p.source, unstated=True), (method, p.path)


@pytest.mark.skipif(not (SHARED / "papers").is_dir(), reason=f"needs the paper texts at {SHARED}")
def test_every_space_source_quotes_its_text():
    for method, space in load_spaces(SHIPPED).items():
        for p in space:
            if not p.source.startswith("silent:"):
                assert not text_problems(p.source, "", SHARED), (method, p.path, p.source)


@pytest.mark.parametrize(
    ("range_", "needle"),
    [
        ("{ low = 0.1, high = 0.1, source = 's' }", "low < high"),
        ("{ low = 0.1, high = 1.0 }", "needs a source"),
        ("{ choices = [], source = 's' }", "non-empty list"),
        ("{ low = 0.0, high = 1.0, log = true, source = 's' }", "low > 0"),
        ("{ low = 1, high = 5, step = 0, source = 's' }", "step"),
        ("{ low = 1, high = 5, by = 1, source = 's' }", "a range is a table"),
    ],
)
def test_a_malformed_range_is_one_clear_error(tmp_path, range_, needle):
    (tmp_path / "s.toml").write_text(f'[fedvpt]\n"train.lr" = {range_}\n')
    with pytest.raises(FpbenchError, match=needle):
        load_spaces(tmp_path / "s.toml")


def test_a_method_without_a_space_or_with_an_empty_one_is_an_error(tmp_path):
    (tmp_path / "s.toml").write_text("[fedvpt]\n")
    with pytest.raises(FpbenchError, match="empty"):
        space_for("fedvpt", tmp_path / "s.toml")
    with pytest.raises(FpbenchError, match="no search space for method 'sgpt'"):
        space_for("sgpt", tmp_path / "s.toml")


# -- pruning and the budget ----------------------------------------------------------------------


class _Trial:
    """An Optuna trial's report/should_prune, pruning once a value falls below `floor`."""

    def __init__(self, floor: float) -> None:
        self.floor, self.reports = floor, []

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.reports[-1][1] < self.floor


def test_pruning_reports_each_stored_round_once_at_its_cells_step_and_stops_the_cell(monkeypatch):
    cells = [_cell(), _cell().model_copy(update={"seed": 1})]
    curves = {cells[0].run_key: [(0, 0.5), (1, 0.6)], cells[1].run_key: [(0, 0.55), (1, 0.2)]}
    monkeypatch.setattr(study_mod, "stored_curve", lambda store, key, metric: curves[key])
    trial = _Trial(floor=0.3)
    watch = _Pruning(trial, "acc_global", cells, store=None)
    watch.round_end(cells[0], 1, {"acc_global": 0.6})
    watch.round_end(cells[0], 1, {"acc_global": 0.6})  # reported once
    watch.round_end(cells[1], 0, {})  # not evaluated: nothing read
    with pytest.raises(_Pruned):
        watch.cell_start(cells[1], 2)  # resumed: the stored rounds are fed
    rounds = cells[0].train.rounds
    assert trial.reports == [(0, 0.5), (1, 0.6), (rounds, 0.55), (rounds + 1, 0.2)]
    assert watch.pruned == rounds + 1


def test_every_method_gets_the_same_rounds_validation_and_seeds_under_a_name_of_its_own(workdir):
    budget = Budget(trials=3, rounds=1, validation=0.3)
    a = trial_cells("tiny", "fedvpt", {"train.lr": 0.02}, budget)
    b = trial_cells("tiny", "head-tune", {"train.lr": 0.02}, budget)
    for c in (*a, *b):
        assert (c.train.rounds, c.train.validation) == (1, 0.3)
        assert c.suite.startswith("tiny+tune-")
    assert [c.seed for c in a] == [c.seed for c in b] == [0]


@pytest.mark.parametrize(
    ("budget", "needle"),
    [
        (Budget(trials=0, rounds=2, validation=0.2), "--trials"),
        (Budget(trials=2, rounds=0, validation=0.2), "--rounds"),
        (Budget(trials=2, rounds=2, validation=1.0), "--validation"),
    ],
)
def test_a_bad_budget_is_an_error(budget, needle):
    with pytest.raises(FpbenchError, match=needle):
        budget.check()


def test_the_best_trial_is_judged_among_the_first_trials_only():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for value in (0.2, 0.5, 0.9):  # the third is a parallel worker's extra trial
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=value))
    assert best_trial(study, 2).number == 1
    assert best_trial(study, 3).number == 2


def test_a_tuned_suite_refuses_a_method_tuned_with_another_budget(workdir):
    first = best_mod.tuned_suite("tiny", {"fedvpt": {"train.lr": 0.02}}, "trials=2", None)
    both = best_mod.tuned_suite("tiny", {"head-tune": {"train.lr": 0.03}}, "trials=2", first)
    assert [e["label"] for e in both["methods"]] == ["fedvpt+tuned", "head-tune+tuned"]
    with pytest.raises(FpbenchError, match="another budget"):
        best_mod.tuned_suite("tiny", {"head-tune": {"train.lr": 0.03}}, "trials=3", first)


def test_the_tuned_entry_sets_args_and_overrides_and_reads_back(workdir):
    raw = best_mod.tuned_suite(
        "tiny", {"fedvpt": {"train.lr": 0.0123, "method.args.prompt_len": 4}}, "b", None
    )
    best_mod.write_toml(raw, workdir / "benchmarks" / "tiny+tuned.toml")
    back = tomllib.loads((workdir / "benchmarks" / "tiny+tuned.toml").read_text())
    assert back == raw
    (cell,) = expand_suite(back, name=back["name"]).cells
    assert (cell.suite, cell.method.label) == ("tiny+tuned", "fedvpt+tuned")
    assert (cell.train.lr, cell.method.args["prompt_len"], cell.train.validation) == (0.0123, 4, 0)


# -- the command ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--method", "sgpt"], "not in suite tiny"),
        (["--trials", "0"], "--trials"),
        (["--validation", "1.5"], "--validation"),
        (["--method", "fedvpt", "--space", "empty.toml"], "empty"),
        (["--method", "fedvpt", "--space", "badpath.toml"], "not a settable path"),
        (["--method", "fedvpt", "--space", "badvalue.toml"], "prompt_len"),
        (["--method", "head-tune"], "no search space for method 'head-tune'"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(workdir, args, needle):
    (workdir / "empty.toml").write_text("[fedvpt]\n")
    (workdir / "badpath.toml").write_text(
        "[fedvpt]\nlr = { low = 0.1, high = 1.0, source = 's' }\n"
    )
    bad = '"method.args.prompt_len" = { low = 0, high = 3, source = "s" }'
    (workdir / "badvalue.toml").write_text(f"[fedvpt]\n{bad}\n")
    (workdir / "fedvpt-only.toml").write_text(SPACE.split("[head-tune]")[0])
    if "head-tune" in args:
        args = [*args, "--space", "fedvpt-only.toml"]
    result = runner.invoke(app, ["tune", "--suite", "tiny", *args, "--db", "t.db"])
    assert result.exit_code == 2, result.output
    first, *rest = result.output.strip().splitlines()  # one message, wrapped to the width
    assert first.startswith("error: ") and all(line.startswith("  ") for line in rest)
    assert needle in " ".join(result.output.split())
    assert not (workdir / "t.db").exists()


def test_a_metric_the_runs_do_not_store_fails_the_search_once_with_exit_1(workdir):
    (workdir / "space.toml").write_text(SPACE)
    result = _tune("--metric", "acc_nonesuch", "--trials", "1")
    assert result.exit_code == 1 and "acc_nonesuch_last10" in result.output, result.output
    with sqlite3.connect(workdir / "t.db") as con:
        assert con.execute("select state from trials").fetchall() == [("FAIL",)]


def _tune(*extra: str):
    return runner.invoke(
        app,
        ["tune", "--suite", "tiny", "--method", "fedvpt", "--trials", "2", "--validation",
         "0.25", "--space", "space.toml", "--db", "t.db", "--threads", "1", *extra],
    )  # fmt: skip


def test_tune_end_to_end_then_the_best_entry_runs_as_a_suite_with_tuned_rows(workdir):
    (workdir / "space.toml").write_text(SPACE)
    result = _tune()
    assert result.exit_code == 0, result.output
    assert "fedvpt trial 0: " in result.output and "(1/2 done)" in result.output
    assert "fedvpt trial 1: " in result.output and "(2/2 done)" in result.output
    with sqlite3.connect(workdir / "t.db") as con:
        trial_runs = con.execute("select suite, config_json from runs").fetchall()
        states = [s for (s,) in con.execute("select state from trials order by number")]
        params = con.execute("select param_name from trial_params").fetchall()
    assert len(trial_runs) == 2 and states == ["COMPLETE", "COMPLETE"]
    assert {p for (p,) in params} == {"train.lr", "method.args.prompt_len"}
    assert all(s.startswith("tiny+tune-") for s, _ in trial_runs)
    assert [json.loads(c)["train"]["validation"] for _, c in trial_runs] == [0.25, 0.25]
    assert [json.loads(c)["runtime"]["threads"] for _, c in trial_runs] == [1, 1]
    tuned = tomllib.loads((workdir / "benchmarks" / "tiny+tuned.toml").read_text())
    assert [e["label"] for e in tuned["methods"]] == ["fedvpt+tuned"]
    ran = runner.invoke(app, ["run", "--suite", "tiny+tuned", "--db", "t.db"])
    assert ran.exit_code == 0, ran.output
    table = runner.invoke(app, ["table", "--suite", "tiny+tuned", "--db", "t.db"])
    assert "fedvpt+tuned" in table.output
    with sqlite3.connect(workdir / "t.db") as con:
        (config,) = con.execute(
            "select config_json from runs where suite = 'tiny+tuned'"
        ).fetchone()
    assert "validation" not in json.loads(config)["train"]  # it runs on the test split
    again = _tune()  # a finished study: nothing runs again
    assert again.exit_code == 0, again.output
    assert "fedvpt trial" not in again.output and "fedvpt: best trial" in again.output
    with sqlite3.connect(workdir / "t.db") as con:
        assert con.execute("select count(*) from trials").fetchone() == (2,)


def test_a_pruned_trial_is_stored_as_pruned_with_its_round_and_rule_not_as_ctrl_c(
    workdir, monkeypatch
):
    import optuna

    (workdir / "space.toml").write_text(SPACE)
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: self.number == 1)
    result = _tune()
    assert result.exit_code == 0, result.output
    with sqlite3.connect(workdir / "t.db") as con:
        runs = con.execute("select id, status, error from runs order by id").fetchall()
        states = [s for (s,) in con.execute("select state from trials order by number")]
        (pruned_at,) = con.execute(  # the round-0 validation metric of each trial's cell
            "select value from metrics where run_id = ? and name = 'acc_global' and round = 0",
            (runs[1][0],),
        ).fetchone()
        (median,) = con.execute(
            "select value from metrics where run_id = ? and name = 'acc_global' and round = 0",
            (runs[0][0],),
        ).fetchone()
        (attr,) = con.execute(
            "select value_json from trial_user_attributes where key = 'pruned'"
        ).fetchone()
    assert states == ["COMPLETE", "PRUNED"]
    assert [(status, error) for _, status, error in runs][0] == ("done", None)
    rule = (
        "the median rule (Optuna's MedianPruner, after 2 complete trials): at step 0 trial 1's "
        f"best acc_global so far was {pruned_at:.4g}, the median of 1 complete trial(s) there "
        f"{median:.4g}"
    )
    assert runs[1][1:] == (
        "interrupted",  # resumable: a later trial drawing these values resumes it
        f"pruned after round 1/2 by {rule}; not a failure: a trial with these values resumes it",
    )
    assert "Ctrl-C" not in runs[1][2]
    where = f"pruned after round 1/2 of fedvpt / synthetic / pathological / seed 0 by {rule}"
    assert json.loads(attr) == where
    assert f"-> {where} (2/2 done)" in " ".join(result.output.split())


@pytest.mark.slow
def test_a_killed_tune_continues_its_study_and_resumes_the_cell(workdir, monkeypatch):
    (workdir / "space.toml").write_text(SPACE)
    (workdir / "benchmarks" / "tiny.toml").write_text(
        TINY_SUITE_TOML.replace("rounds = 2", "rounds = 3")
    )
    real = _Pruning.round_end
    calls = {"n": 0}

    def ctrl_c_in_second_trial(self, cfg, round_idx, metrics):
        real(self, cfg, round_idx, metrics)
        calls["n"] += 1
        if calls["n"] == 5:  # the second trial's second round, stored
            raise KeyboardInterrupt

    monkeypatch.setattr(_Pruning, "round_end", ctrl_c_in_second_trial)
    assert _tune().exit_code == 130
    monkeypatch.setattr(_Pruning, "round_end", real)
    with sqlite3.connect(workdir / "t.db") as con:
        (stopped,) = con.execute("select id from runs where status = 'interrupted'").fetchone()
    result = _tune()
    assert result.exit_code == 0, result.output
    with sqlite3.connect(workdir / "t.db") as con:
        states = con.execute("select number, state from trials order by number").fetchall()
        rounds = con.execute("select round from rounds where run_id = ?", (stopped,)).fetchall()
        status = con.execute("select status from runs where id = ?", (stopped,)).fetchone()
        lrs = con.execute(
            "select trial_id, param_value from trial_params where param_name = 'train.lr' "
            "order by trial_id"
        ).fetchall()
    assert [s for _, s in states] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert lrs[1][1] == lrs[2][1]  # the retried trial has the interrupted one's values
    assert sorted(r for (r,) in rounds) == [0, 1, 2] and status == ("done",)  # resumed, no dupes


@pytest.mark.slow
def test_parallel_workers_share_one_study_on_postgresql(workdir, pg_url):
    """Two `fpbench tune` processes on one PostgreSQL database: one study, its trials shared
    (none run twice), and both write the same best entry."""
    import subprocess
    import sys

    import optuna

    (workdir / "space.toml").write_text(SPACE)
    args = ["tune", "--suite", "tiny", "--method", "fedvpt", "--trials", "4", "--validation",
            "0.25", "--space", "space.toml", "--db", pg_url]  # fmt: skip
    outs = [f"w{i}.toml" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "fpbench", *args, "--out", out, "--worker", str(i)],
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outs)
    ]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    (summary,) = optuna.get_all_study_summaries(pg_url)
    study = optuna.load_study(study_name=summary.study_name, storage=pg_url)
    trials = study.get_trials(deepcopy=False)
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) >= 4
    ran = [line for log in logs for line in log.splitlines() if line.startswith("fedvpt trial")]
    assert len(ran) == len(trials)  # each trial ran in one worker
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)  # drawn apart
    written = [tomllib.loads((workdir / out).read_text()) for out in outs]
    assert written[0] == written[1]
