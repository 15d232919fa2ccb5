"""The reference rows: `train.centralized` (one client holding the union of the trainable
clients' train data) and `zero-shot`, from the pooled task to a suite run through the CLI."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fpbench.engine.rounds as rounds
from fpbench.cli import app
from fpbench.engine.build import build_populations
from fpbench.engine.executor import train_clients
from fpbench.engine.rounds import check_centralized, play_round, pooled
from fpbench.engine.task import build_task
from fpbench.errors import FpbenchError
from fpbench.testing.tiny import cell_of, seeded_server, tiny_config

CPU = torch.device("cpu")


def test_pooled_task_is_one_client_holding_the_trainable_clients_data(fpbench_cache):
    task = build_task(tiny_config("promptfl"), CPU)
    ids = task.trainable_clients()
    assert len(ids) == 3 and task.heldout.sum() == 1  # the held-out client's data stays out
    p = pooled(task)
    assert p.num_clients == 1 and p.trainable_clients() == [0]
    expected = torch.cat([task.train_idx[c] for c in ids])
    assert torch.equal(p.train_idx[0], expected)
    assert p.train_sizes.tolist() == [float(len(expected))]
    labels = task.data.train_labels[expected]
    prior = torch.bincount(labels, minlength=6).float() / len(labels)
    torch.testing.assert_close(p.priors[0], prior)
    assert p.aggregation_weights.tolist() == [float(len(expected))]
    some = pooled(task, ids[::-1][:2])  # a round's clients, in the round's order
    assert torch.equal(some.train_idx[0], torch.cat([task.train_idx[c] for c in ids[::-1][:2]]))
    # its one client: the union's indices and prior, the first client's local test set, no
    # domain, trainable; FedAvg weighs it by its train size even under domain-size weights
    (client,) = p.clients
    assert client.id == 0 and not client.heldout and p.heldout.tolist() == [False]
    assert client.train_idx.tolist() == expected.tolist()
    assert client.class_prior.dtype == np.float64
    np.testing.assert_allclose(client.class_prior, prior.double().numpy(), rtol=1e-6)
    first = ids[0]
    assert client.test_idx.tolist() == task.clients[first].test_idx.tolist()
    assert len(p.test_idx) == 1 and torch.equal(p.test_idx[0], task.test_idx[first])
    in_domains = dataclasses.replace(
        task,
        clients=[dataclasses.replace(c, domain=c.id % 2) for c in task.clients],
        aggregation_sizes=torch.tensor([5.0, 6.0, 7.0, 8.0]),
    )
    p = pooled(in_domains)
    assert p.clients[0].domain is None and p.aggregation_sizes is None
    assert p.aggregation_weights.tolist() == [float(len(expected))]


def test_a_centralized_round_trains_the_pooled_client_alone_and_scores_every_client(
    fpbench_cache,
):
    cfg = tiny_config("promptfl", centralized=True, participation=0.5)
    task = build_task(cfg, CPU)
    (pop,) = build_populations(cfg, task, CPU)
    server = seeded_server(pop.method)
    sampled = task.trainable_clients()[1:]  # the round's two clients (participation 0.5)
    new, rows, scalars = play_round(cell_of(cfg, task, [pop], sampled), server, 0, [])
    alone = train_clients(
        pop.method, server, pooled(task, sampled), [0], cfg.train, round_idx=0, seed=0
    )
    # FedAvg of one client is its parameters; that client holds the round's clients' data
    torch.testing.assert_close(new.params["ctx"], alone.params["ctx"][0])
    assert scalars["loss_train"] == pytest.approx(float(alone.loss[0]))
    assert scalars["bytes_up"] == scalars["bytes_down"] == 0
    scored = {c for c, name, _, _ in rows if c is not None and name == "acc_local"}
    assert scored == set(task.trainable_clients())  # every trainable client's test set
    (out,) = set(range(4)) - scored  # the held-out client: scored as held out
    assert any(c == out and name == "acc_heldout" for c, name, *_ in rows)


def test_a_centralized_step_cap_is_the_round_clients_budget(fpbench_cache, monkeypatch):
    """Under a step cap, the pooled client takes `max_local_steps` times the round's sampled
    clients' steps (their budget together), not the cap of one client; it trains with the
    population's inputs and the run's executor.

    Catches the sampled count not handed to `_train_population` (its default, one client's cap),
    the scaled train config lost, fresh inputs instead of the population's, and the executor
    dropped."""
    cfg = tiny_config("promptfl", centralized=True, participation=0.5, max_local_steps=1)
    cfg = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"executor": "reference"})}
    )
    task = build_task(cfg, CPU)
    (pop,) = build_populations(cfg, task, CPU)
    server = seeded_server(pop.method)
    sampled = task.trainable_clients()[1:]
    assert len(sampled) == 2
    handed, train = [], rounds.train_clients
    monkeypatch.setattr(
        rounds,
        "train_clients",
        lambda *a, **kw: handed.append((kw["inputs"], kw["executor"])) or train(*a, **kw),
    )
    new, _, _ = play_round(cell_of(cfg, task, [pop], sampled), server, 0, [])
    assert len(handed) == 1 and handed[0][0] is pop.inputs and handed[0][1] == "reference"
    pool = pooled(task, sampled)
    steps = {}
    for cap in (1, 2, 3):
        two = cfg.train.model_copy(update={"max_local_steps": cap})
        steps[cap] = train_clients(pop.method, server, pool, [0], two, round_idx=0, seed=0)
    assert not torch.equal(steps[1].params["ctx"], steps[2].params["ctx"])  # the check's power
    assert not torch.equal(steps[3].params["ctx"], steps[2].params["ctx"])
    torch.testing.assert_close(new.params["ctx"], steps[2].params["ctx"][0], rtol=0, atol=0)


def test_centralized_refuses_a_personal_method(fpbench_cache):
    cfg = tiny_config("coop-local", centralized=True)
    task = build_task(cfg, CPU)
    with pytest.raises(FpbenchError, match="global inference and no personal tensors"):
        check_centralized(cfg, build_populations(cfg, task, CPU))


def test_centralized_is_part_of_the_run_key_only_when_set():
    plain, central = tiny_config("promptfl"), tiny_config("promptfl", centralized=True)
    assert "centralized" not in plain.identity()["train"]
    assert central.identity()["train"]["centralized"] is True
    assert plain.run_key != central.run_key


SUITE = """
name = "reference-rows"
seeds = [0]
[defaults]
backbone = { name = "clip-test" }
dataset = { num_classes = 6, image_size = 16, train_per_class = 12, test_per_class = 6 }
partition = { num_clients = 4, heldout_frac = 0.0, shots = 4 }
train = { rounds = 2, batch_size = 8, lr = 0.01 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "pathological"
s = 3
[[methods]]
name = "zero-shot"
[[methods]]
name = "promptfl"
n_ctx = 4
[[methods]]
name = "promptfl"
label = "centralized"
n_ctx = 4
overrides = { train = { centralized = true } }
"""


def test_reference_rows_run_beside_a_federated_one_through_the_cli(tmp_path, fpbench_cache):
    (tmp_path / "s.toml").write_text(SUITE)
    db = tmp_path / "r.db"
    out = CliRunner().invoke(app, ["run", "--suite", str(tmp_path / "s.toml"), "--db", str(db)])
    assert out.exit_code == 0, out.output
    with sqlite3.connect(db) as con:
        runs = con.execute("select id, status, config_json from runs order by id").fetchall()
        assert [r[1] for r in runs] == ["done"] * 3
        acc = dict(
            con.execute(
                "select run_id, value from metrics where name = 'acc_global' and round = 1 "
                "and client_id is null"
            ).fetchall()
        )
        clients = con.execute(
            "select run_id, count(distinct client_id) from metrics where name = 'acc_local' "
            "group by run_id"
        ).fetchall()
        up = dict(con.execute("select run_id, sum(bytes_up) from rounds group by run_id"))
    assert set(acc) == {r[0] for r in runs}  # every row scored on the global test set
    assert {n for _, n in clients} == {4}  # and on each client's own test set
    zero, fed, central = (r[0] for r in runs)
    assert up[zero] == 0 and up[central] == 0 and up[fed] > 0


LEARNERS = (
    SUITE.replace('name = "reference-rows"', 'name = "clip-learners"').split("[[methods]]")[0]
    + '[[methods]]\nname = "kgcoop"\n[[methods]]\nname = "cocoop"\n[[methods]]\nname = "prograd"\n'
)


def test_cocoop_kgcoop_and_prograd_run_through_the_cli(tmp_path, fpbench_cache):
    (tmp_path / "s.toml").write_text(LEARNERS.replace("rounds = 2", "rounds = 1"))
    db = tmp_path / "r.db"
    out = CliRunner().invoke(app, ["run", "--suite", str(tmp_path / "s.toml"), "--db", str(db)])
    assert out.exit_code == 0, out.output
    with sqlite3.connect(db) as con:
        done = con.execute("select config_json from runs where status = 'done'").fetchall()
        scored = con.execute(
            "select count(*) from metrics where name = 'acc_global' and client_id is null"
        ).fetchone()[0]
        up = [r[0] for r in con.execute("select bytes_up from rounds")]
    assert sorted(json.loads(c)["method"]["name"] for (c,) in done) == [
        "cocoop", "kgcoop", "prograd"
    ]  # fmt: skip
    assert scored == 3 and all(u > 0 for u in up)  # each evaluated; each uploads what it trains


def test_centralized_refuses_model_het_and_any_non_global_or_personal_method():
    """`check_centralized`'s three refusals, word for word: model_het; a method that is not
    global though it keeps nothing personal; a global one that keeps personal tensors."""
    from types import SimpleNamespace

    central = SimpleNamespace(train=SimpleNamespace(centralized=True), model_het=None)
    with pytest.raises(FpbenchError) as info:
        check_centralized(SimpleNamespace(**{**vars(central), "model_het": object()}), [])
    assert str(info.value) == "train.centralized cannot be combined with model_het"

    def refused(inference, personal):
        pop = SimpleNamespace(
            method=SimpleNamespace(name="m", inference=inference, personal=personal)
        )
        with pytest.raises(FpbenchError) as info:
            check_centralized(central, [pop])
        return str(info.value)

    needs = "train.centralized needs a method with global inference and no personal tensors; m"
    assert refused("client-conditioned", {}) == f"{needs} has inference 'client-conditioned'"
    assert refused("global", {"head": 1, "bias": 2}) == (
        f"{needs} has inference 'global' and personal ['bias', 'head']"
    )
