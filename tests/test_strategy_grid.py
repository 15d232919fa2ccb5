"""Strategies as a grid axis, end to end: the shipped `smoke-strategies` suite (three learners x
three strategies on the test-sized ViT) through `fpbench run`, `table` and `compare`; what a
suite may say about strategies, and the bad combinations refused at load (exit 2)."""

from __future__ import annotations

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.suites import expand_suite, load_suite

runner = CliRunner()
LEARNERS = ("fedvpt", "fedrep", "head-tune")
STRATEGIES = ("fedprox", "scaffold", "fedadam")


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grid")
    db = str(folder / "grid.db")
    result = runner.invoke(
        app, ["run", "--suite", "smoke-strategies", "--db", db, "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    return db


def _rounds(db: str) -> dict[str, list[tuple[int, float, int]]]:
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "select r.method, ro.round, ro.loss_train, ro.bytes_up from runs r "
            "join rounds ro on ro.run_id = r.id order by r.id, ro.round"
        ).fetchall()
    out: dict[str, list] = {}
    for method, rnd, loss, up in rows:
        out.setdefault(method, []).append((rnd, loss, up))
    return out


def test_every_learner_runs_with_every_strategy(ran):
    with sqlite3.connect(ran) as con:
        runs = dict(con.execute("select method, status from runs").fetchall())
        stored = {m: json.loads(c)["method"] for m, c in con.execute(
            "select method, config_json from runs")}  # fmt: skip
    assert runs == {f"{m}+{s}": "done" for m in LEARNERS for s in STRATEGIES}
    assert stored["fedvpt+fedprox"]["strategy"] == {"name": "fedprox", "args": {"mu": 0.1}}
    adam = stored["fedrep+fedadam"]["strategy"]["args"]
    assert adam == {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9,
                    "bias_correction": True}  # fmt: skip


def test_the_strategies_wires_in_the_round_loop(ran):
    rounds = _rounds(ran)
    for m in LEARNERS:
        adam = rounds[f"{m}+fedadam"]
        # round 1's local training is FedAvg's under SCAFFOLD (zero variates) and FedAdam
        # (a server step only): the same losses, bit for bit
        assert rounds[f"{m}+scaffold"][0][1] == adam[0][1]
        # SCAFFOLD sends its control variates beside the parameters: twice the bytes
        assert [r[2] for r in rounds[f"{m}+scaffold"]] == [2 * r[2] for r in adam]
        assert [r[2] for r in rounds[f"{m}+fedprox"]] == [r[2] for r in adam]


def test_table_and_compare_show_learner_and_strategy(ran):
    table = runner.invoke(app, ["table", "--suite", "smoke-strategies", "--db", ran])
    assert table.exit_code == 0, table.output
    lines = [line for line in table.output.splitlines() if line.startswith("|")]
    assert lines[0] == "| method | learner | strategy | global | local mean | local worst |"
    assert any(line.startswith("| fedrep+scaffold | fedrep | scaffold | ") for line in lines)
    compare = runner.invoke(
        app, ["compare", "head-tune+fedadam", "head-tune+fedprox", "--suite",
              "smoke-strategies", "--db", ran],
    )  # fmt: skip
    assert compare.exit_code == 0, compare.output
    assert "learner: A head-tune, B head-tune; strategy: A fedadam, B fedprox" in " ".join(
        compare.output.split()
    )


SUITE = {
    "defaults": {"backbone": {"name": "vit-test"}, "partition": {"num_clients": 4}},
    "datasets": [{"name": "synthetic"}],
    "partitions": [{"name": "iid"}],
}


def test_a_method_entry_names_its_strategy_and_fedavg_is_the_plain_cell():
    suite = expand_suite(
        {**SUITE, "methods": [
            {"name": "kgcoop", "label": "plain"},
            {"name": "kgcoop", "label": "avg", "strategy": {"name": "fedavg"}},
            {"name": "kgcoop", "label": "prox", "strategy": {"name": "fedprox", "mu": 0.5}},
        ]},
        name="t",
    )  # fmt: skip
    plain, avg, prox = suite.cells
    assert avg.method.strategy is None
    relabel = avg.model_copy(update={"method": avg.method.model_copy(update={"label": "plain"})})
    assert relabel.run_key == plain.run_key  # fedavg, said or not, is one cell
    assert prox.method.strategy.args == {"mu": 0.5}
    assert "strategy" not in plain.identity()["method"]


@pytest.mark.parametrize(
    ("methods", "strategies", "message"),
    [
        ([{"name": "sgpt", "strategy": {"name": "fedprox"}}], None,
         "method 'sgpt' federates by its own aggregate and takes only strategy 'fedavg'"),
        ([{"name": "fedvpt", "strategy": {"name": "fedsgd"}}], None, "unknown strategy 'fedsgd'"),
        ([{"name": "fedvpt", "strategy": {"name": "fedprox", "mu": -1}}], None,
         "method.strategy.mu: Input should be greater than or equal to 0"),
        ([{"name": "fedvpt", "strategy": {"name": "fedadam", "lr": 1}}], None,
         "method.strategy.lr: Extra inputs are not permitted"),
        ([{"name": "fedvpt", "strategy": 3}], None, "strategy must be a table with a name"),
        ([{"name": "fedvpt", "strategy": {"name": "fedprox"}}], [{"name": "scaffold"}],
         "names a strategy and the suite lists [[strategies]]"),
    ],
)  # fmt: skip
def test_bad_strategies_are_one_clear_line(methods, strategies, message):
    raw = {**SUITE, "methods": methods, **({"strategies": strategies} if strategies else {})}
    with pytest.raises(FpbenchError) as e:
        expand_suite(raw, name="t")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_strategy_exits_2_at_load(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        '[defaults]\nbackbone = { name = "vit-test" }\n[[datasets]]\nname = "synthetic"\n'
        '[[partitions]]\nname = "iid"\n[[methods]]\nname = "sgpt"\n'
        'strategy = { name = "scaffold" }\n'
    )
    result = runner.invoke(app, ["run", "--suite", str(path), "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 2
    assert "takes only strategy 'fedavg'" in result.output
    assert not (tmp_path / "x.db").exists()


def test_list_strategies():
    result = runner.invoke(app, ["list", "strategies"])
    assert result.exit_code == 0, result.output
    for name in ("fedavg", "fedavgm", "fedprox", "scaffold", "fedadam", "fedyogi", "fedadagrad",
                 "fedotp"):  # fmt: skip
        assert f"│ {name} " in result.output
    assert "FedProx" in result.output


def test_fedotp_strategy_on_a_several_prompt_learner():
    (cell,) = expand_suite(
        {**SUITE, "defaults": {**SUITE["defaults"], "backbone": {"name": "clip-test"}},
         "methods": [{"name": "plot", "strategy": {"name": "fedotp", "shared": 1}}]},
        name="t",
    ).cells  # fmt: skip
    assert cell.method.strategy.args == {"tensor": "ctx", "shared": 1}
    assert load_suite("smoke-strategies").cells[0].method.label == "fedvpt+fedprox"


@pytest.mark.slow
def test_fedotp_strategy_runs_plot_with_shared_and_personal_prompts(tmp_path):
    """PLOT's four prompts under FedOTP's aggregation with two shared: a personal method that
    sends half of what PLOT with FedAvg sends."""
    path = tmp_path / "otp.toml"
    path.write_text(
        '[defaults]\nbackbone = { name = "clip-test" }\n'
        "dataset = { num_classes = 6, image_size = 16, train_per_class = 12, test_per_class = 6 }\n"
        "partition = { num_clients = 4 }\n"
        "train = { rounds = 1, participation = 1.0, batch_size = 8, lr = 0.05 }\n"
        '[[datasets]]\nname = "synthetic"\n[[partitions]]\nname = "iid"\n'
        '[[methods]]\nname = "plot"\n[[strategies]]\nname = "fedavg"\n'
        '[[strategies]]\nname = "fedotp"\nshared = 2\n'
    )
    db = str(tmp_path / "otp.db")
    result = runner.invoke(app, ["run", "--suite", str(path), "--db", db, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    up = {m: rounds[0][2] for m, rounds in _rounds(db).items()}
    assert up["plot+fedotp"] * 2 == up["plot+fedavg"]
    with sqlite3.connect(db) as con:
        names = {n for (n,) in con.execute("select distinct name from metrics")}
    assert "acc_local_mean" in names
