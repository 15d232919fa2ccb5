"""Wiring: what the engine hands from one unit to the next, checked in real tiny runs.

Each unit (FedAvg, the partitions, the sampler, the metrics) is tested on its own elsewhere with
inputs the test supplies. Here spies record what a real `run_cell` hands them (aggregation
weights, client ids, learning rates, seeds, numerics, which clients a metric counts), and the
expected values are computed independently: from the partition (re-made with the run's seed),
from the documented formulas, or by hand. Every test names the planted bug it was seen to catch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time

import numpy as np
import pytest
import torch

import fpbench.backbones.frozen_linear as frozen_linear
import fpbench.engine.executor as executor
import fpbench.engine.rounds as rounds
import fpbench.engine.task as task_module
from fpbench.backbones.recall import current
from fpbench.engine import cell as cell_module
from fpbench.engine.cell import sampling_schedule
from fpbench.engine.executor import derive_seed, train_clients
from fpbench.engine.metrics import domain_key
from fpbench.engine.observer import Observer
from fpbench.engine.runner import run_cell
from fpbench.engine.task import aggregation_sizes, load_dataset
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Method, Output, ServerState, Updates
from fpbench.methods.fedrep import FedRep
from fpbench.methods.fedvpt import FedVPT
from fpbench.partition import make_clients
from fpbench.store import Store
from fpbench.suites import expand_suite
from tests.conftest import tiny_config

SEED = 6  # not 0 (a seed dropped for 0 shows); its rounds sample clients out of id order


def _with(cfg, *, seed: int | None = None, runtime: dict | None = None):
    update = {}
    if seed is not None:
        update["seed"] = seed
    if runtime:
        update["runtime"] = cfg.runtime.model_copy(update=runtime)
    return cfg.model_copy(update=update)


def _clients(cfg, seed: int):
    """The run's partition, re-made outside the engine with `seed`."""
    return make_clients(cfg.partition.name, cfg.partition.args, load_dataset(cfg.dataset), seed)


def _clone(server: ServerState) -> ServerState:
    parts = (server.params, server.personal, server.buffers)
    return ServerState(*(copy.deepcopy(d) for d in parts))


class Spied:
    """What one spied run recorded."""

    def __init__(self) -> None:
        self.task = None
        self.method: Method | None = None
        self.calls: list[tuple[ServerState, Updates, ServerState]] = []  # aggregate: in, what, out
        self.lrs: list[float] = []  # make_optimizer's lr, in call order
        self.views: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (round, seeds, idx)
        self.observed: list[tuple] = []  # the observer's calls: (what, round, metrics)
        self.costs: list[dict] = []  # Store.record_cost's keyword arguments
        self.run = None  # the stored run record
        self.probed: list[tuple[ServerState, torch.Tensor]] = []  # round_metrics: server, labels
        self.elapsed = 0.0  # the whole run_cell call's time, seconds


class _Recorder(Observer):
    def __init__(self, seen: Spied) -> None:
        self.seen = seen

    def cell_start(self, cfg, start_round):
        self.seen.observed.append(("start", start_round, None))

    def round_end(self, cfg, round_idx, metrics):
        self.seen.observed.append(("round", round_idx, dict(metrics)))


def _per_test_under_mutmut(fixture_name: str, config) -> str:
    """Module scope, but one run per test under mutmut: it credits the code a module fixture
    runs to the first test only, and would then skip the other tests of a mutant it reaches."""
    return "function" if os.environ.get("MUTANT_UNDER_TEST") else "module"


@pytest.fixture(scope=_per_test_under_mutmut)
def spied(tmp_path_factory):
    """One fedvpt run (seed 6, 2 rounds, flips on, lr decay 0.5, only round 1 evaluated) with
    the engine's seams spied.

    The spies call through, so the run is the real one: its stored rows are checked as well.
    """
    tmp = tmp_path_factory.mktemp("wiring")
    cfg = tiny_config(
        "fedvpt", rounds=2, lr_decay=0.5, augment={"hflip": True}, eval_every=2, eval_last=0
    )
    cfg = _with(cfg, seed=SEED, runtime={"device": "cpu"})
    seen = Spied()
    aggregate, build_task = FedVPT.aggregate, cell_module.build_task
    make_optimizer, uniforms = executor.make_optimizer, executor.uniforms
    record_cost = Store.record_cost

    def spy_aggregate(self, server, updates):
        out = aggregate(self, server, updates)
        seen.method = self
        seen.calls.append((_clone(server), copy.deepcopy(updates), _clone(out)))
        return out

    def spy_optimizer(name, tensors, *, lr, **kw):
        seen.lrs.append(lr)
        return make_optimizer(name, tensors, lr=lr, **kw)

    def spy_uniforms(seeds, idx, n):
        seen.views.append((len(seen.calls), seeds.clone(), idx.clone()))
        return uniforms(seeds, idx, n)

    def spy_build_task(*args, **kwargs):
        seen.task = build_task(*args, **kwargs)
        return seen.task

    def spy_cost(self, run_id, **kwargs):
        seen.costs.append(kwargs)
        return record_cost(self, run_id, **kwargs)

    def probe(self, server, test):  # a round metric of the server it is handed
        _, labels = test(lambda x: x.flatten(1)[:, :1])
        seen.probed.append((_clone(server), labels.clone()))
        return {"probe": float(server.params["prompts"].double().sum())}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FedVPT, "aggregate", spy_aggregate)
        mp.setattr(executor, "make_optimizer", spy_optimizer)
        mp.setattr(executor, "uniforms", spy_uniforms)
        mp.setattr(cell_module, "build_task", spy_build_task)
        mp.setattr(Store, "record_cost", spy_cost)
        mp.setattr(FedVPT, "round_metrics", probe)
        with Store(f"sqlite:///{tmp / 'r.db'}") as store:
            observer = _Recorder(seen)
            start = time.perf_counter()
            assert run_cell(cfg, store, checkpoint_dir=tmp, observer=observer).status == "done"
            seen.elapsed = time.perf_counter() - start
            rows = store.metrics(aggregate_only=False)
            seen.run = store.find_run(cfg.run_key)
            per_round = store.rounds(seen.run.id)
    return cfg, seen, rows, per_round


def test_the_runs_seed_reaches_its_partition(spied):
    """Catches `task_of(..., seed=0)` (or any seed but the run's) in `build_task`."""
    cfg, seen, *_ = spied
    mine, other = _clients(cfg, SEED), _clients(cfg, SEED + 1)
    got = [c.train_idx.tolist() for c in seen.task.clients]
    assert got == [c.train_idx.tolist() for c in mine]
    assert got != [c.train_idx.tolist() for c in other]  # the check can tell seeds apart
    assert seen.task.heldout.tolist() == [c.heldout for c in mine]


def test_the_task_hands_on_float32_priors_and_weights(spied):
    """What methods and FedAvg receive from the task: (N, C) float32 priors, float32 weights
    and long indices. Catches a dtype dropped in `task_of` (float64 priors meet float32
    parameters; integer weights)."""
    _, seen, *_ = spied
    task = seen.task
    assert task.priors.dtype == task.train_sizes.dtype == torch.float32
    assert all(updates.weights.dtype == torch.float32 for _, updates, _ in seen.calls)
    assert {t.dtype for t in task.train_idx + task.test_idx} == {torch.long}


def test_each_round_aggregates_its_sampled_clients_with_their_train_sizes(spied):
    """FedAvg gets, row by row, the round's clients and their real train sizes.

    Catches: weights of ones or of the wrong clients (`aggregation_weights[:K]`), weights not
    in the order of `client_ids`, every round handed round 0's clients, the sampler seeded
    with anything but the run's seed, and held-out clients sampled.
    """
    cfg, seen, *_ = spied
    clients = _clients(cfg, SEED)
    trainable = [c.id for c in clients if not c.heldout]
    schedule = sampling_schedule(SEED, cfg.train.rounds, trainable, cfg.train.participation)
    assert schedule != sampling_schedule(SEED + 1, 2, trainable, cfg.train.participation)
    assert schedule[0] != schedule[1]  # round 1 handed round 0's clients would show
    assert all(ids != sorted(ids) for ids in schedule)  # so would weights in id order
    assert len(seen.calls) == cfg.train.rounds
    for r, (_, updates, _) in enumerate(seen.calls):
        ids = updates.client_ids.tolist()
        assert ids == schedule[r]
        assert len(ids) == math.floor(cfg.train.participation * len(trainable))
        assert not any(clients[c].heldout for c in ids)
        assert updates.weights.tolist() == [float(len(clients[c].train_idx)) for c in ids]
        assert {n: t.shape[0] for n, t in updates.params.items()} == dict.fromkeys(
            updates.params, len(ids)
        )


def test_round_zero_starts_from_the_seeded_init_and_each_round_from_the_last(spied):
    """Catches: the init generator seeded without the run's seed (or with another tag), and a
    round that aggregates onto the initial server instead of the previous round's result."""
    cfg, seen, *_ = spied
    method = seen.method
    want = method.init_server(torch.Generator().manual_seed(derive_seed(SEED, "init-params")))
    other = method.init_server(torch.Generator().manual_seed(derive_seed(SEED + 1, "init-params")))
    first = seen.calls[0][0]
    for name, t in want.params.items():
        assert torch.equal(first.params[name], t)
    assert not torch.equal(first.params["prompts"], other.params["prompts"])
    for (_, _, out), (nxt, _, _) in zip(seen.calls, seen.calls[1:], strict=False):
        for name, t in out.params.items():
            assert torch.equal(nxt.params[name], t)


def test_each_clients_row_is_what_it_trains_alone_in_that_round(spied):
    """Row k of the update is client k trained alone by the reference executor from the round's
    server, with the round's index, the run's seed and the round's lr.

    Catches: `round_idx=0` (or the run's seed dropped) in the call to `train_clients` (another
    batch order, another lr), and rows stacked in another order than `client_ids`.
    """
    cfg, seen, *_ = spied
    for r, (server, updates, _) in enumerate(seen.calls):
        for row, c in enumerate(updates.client_ids.tolist()):
            alone = train_clients(
                seen.method, server, seen.task, [c], cfg.train,
                round_idx=r, seed=SEED, executor="reference",
            )  # fmt: skip
            for name, t in alone.params.items():
                torch.testing.assert_close(updates.params[name][row], t[0], atol=1e-5, rtol=1e-4)


def test_the_optimiser_gets_each_rounds_scheduled_lr(spied):
    """lr * lr_decay**round, one optimiser per round (one lockstep pass, one phase).

    Catches: the round index not reaching `round_lr` (every round at 0.05), or the base lr
    handed over unscheduled."""
    cfg, seen, *_ = spied
    assert seen.lrs == pytest.approx([0.05, 0.025])


def test_augmented_views_are_drawn_from_each_clients_epoch_seed(spied):
    """A sample's flip draws come from derive_seed(run seed, round, its client, phase, epoch).

    Catches: views seeded without the round (same flips every round), without the client, from
    another row's seed (`seeds[0]` for every sample), or from a seed other than the run's.
    """
    cfg, seen, *_ = spied
    owner = {}
    for c in _clients(cfg, SEED):
        owner.update(dict.fromkeys(c.train_idx.tolist(), c.id))
    assert {r for r, *_ in seen.views} == {0, 1}
    for r, seeds, idx in seen.views:
        want = [derive_seed(SEED, r, owner[i], 0, 0) for i in idx.tolist()]
        assert seeds.tolist() == want


def test_stored_metrics_count_the_right_clients_with_the_right_values(spied):
    """The last round's rows, recomputed from the final server by a plain forward per client.

    Catches: held-out flags lost or inverted on the way to the counts (held-out clients then
    counted in `acc_local_mean`), a client's count stored under another client's id, and the
    aggregates taken over other clients than the stored per-client rows.
    """
    cfg, seen, rows, _ = spied
    task, method, server = seen.task, seen.method, seen.calls[-1][2]
    last = rows[rows["round"] == cfg.train.rounds - 1]
    acc = {}
    params = method.client_params(server, torch.tensor([0]), training=False)
    with torch.no_grad():
        for c, idx in enumerate(task.test_idx):
            x = method.backbone.preprocess(task.data.test_images[idx])
            rows_ = torch.zeros(len(idx), dtype=torch.long)
            pred = method.forward(params, x, rows_, Context(training=False)).argmax(-1)
            acc[c] = ((pred == task.data.test_labels[idx]).sum().item(), len(idx))
    held = {c.id for c in _clients(cfg, SEED) if c.heldout}
    assert len(held) == 1

    def stored(name):
        sel = last[last["name"] == name]
        return {
            int(c): (v, n)
            for c, v, n in zip(sel["client_id"], sel["value"], sel["count"], strict=True)
        }

    local, heldout = stored("acc_local"), stored("acc_heldout")
    assert set(heldout) == held and set(local) == set(acc) - held
    for c, (v, n) in {**local, **heldout}.items():
        assert (v, n) == (pytest.approx(acc[c][0] / acc[c][1]), acc[c][1])
    agg = last[last["client_id"].isna()].set_index("name")["value"]
    ratios = {c: k / n for c, (k, n) in acc.items()}
    assert agg["acc_local_mean"] == pytest.approx(np.mean([ratios[c] for c in local]))
    assert agg["acc_heldout_mean"] == pytest.approx(np.mean([ratios[c] for c in held]))
    pooled = sum(acc[c][0] for c in local) / sum(acc[c][1] for c in local)
    assert agg["acc_pooled"] == pytest.approx(pooled)


def test_rounds_store_the_bytes_of_their_participants(spied):
    """Up and down: each participant's global tensors, fp32. fedvpt on the test ViT: prompts
    (5, d), head (6, d) and (6,). Catches bytes counted once per round, not per participant."""
    cfg, seen, _, per_round = spied
    d = seen.method.backbone.embed_dim
    k = math.floor(cfg.train.participation * 3)
    assert per_round["bytes_up"].tolist() == [k * 4 * (5 * d + 6 * d + 6)] * cfg.train.rounds
    assert per_round["bytes_down"].tolist() == per_round["bytes_up"].tolist()


def test_the_observer_hears_each_round_and_its_evaluated_metrics(spied):
    """`cell_start` at round 0, then per round: nothing for an unevaluated round, an evaluated
    one's stored aggregates and its training loss.

    Catches a wrong start round, metrics handed for unevaluated rounds (or none for evaluated
    ones), and a metric or loss other than the stored one.
    """
    cfg, _, rows, per_round = spied
    assert [(what, r) for what, r, _ in spied[1].observed] == [
        ("start", 0),
        ("round", 0),
        ("round", 1),
    ]
    assert spied[1].observed[1][2] == {}
    last = rows[(rows["round"] == 1) & rows["client_id"].isna()].set_index("name")["value"]
    heard = spied[1].observed[2][2]
    assert heard["loss_train"] == per_round["loss_train"].tolist()[1] == last["loss_train"]
    names = set(heard) - {"loss_train"}
    assert {"acc_local_mean", "acc_pooled", "acc_heldout_mean"} <= names
    assert not any(n.endswith("_last10") for n in names)  # the summary is not a round's
    assert heard == pytest.approx({n: last[n] for n in names} | {"loss_train": last["loss_train"]})


def test_a_runs_time_and_cost_are_its_rounds(spied):
    """The run's stored `wall_s` is the sum of its rounds' (resumed or not); FLOPs are counted in
    round 0 only (the counter's overhead stays in one round), and the peak memory once at the end.
    The loss row counts the round's participants; only round 0 stores `params_trainable`.
    """
    cfg, seen, rows, per_round = spied
    assert per_round["round"].tolist() == [0, 1]
    assert seen.run.wall_s == pytest.approx(per_round["wall_s"].sum(), rel=1e-9)
    assert (per_round["wall_s"] > 0).all() and per_round["wall_s"].sum() < seen.elapsed
    assert [sorted(k for k, v in c.items() if v is not None) for c in seen.costs] == [
        ["owner", "round_flops"],
        ["owner", "peak_mem_bytes"],
    ]
    assert seen.costs[0]["round_flops"] > 0 and seen.costs[0]["round_flops"] == seen.run.round_flops
    loss = rows[rows["name"] == "loss_train"]
    k = math.floor(cfg.train.participation * 3)
    assert loss["count"].tolist() == [k, k]
    trainable = rows[rows["name"] == "params_trainable"]
    d = seen.method.backbone.embed_dim
    assert trainable["round"].tolist() == [0]
    assert trainable["value"].tolist() == [5 * d + 6 * d + 6]


def test_round_metrics_see_the_rounds_aggregate_and_the_test_labels(spied):
    """`Method.round_metrics` gets each round's aggregated server and the test split's labels;
    its values are stored unsuffixed (one population), every round, for no client.

    Catches the metrics computed on the round's incoming server, and a `@key` suffix on a
    homogeneous run's names."""
    _, seen, rows, _ = spied
    assert len(seen.probed) == len(seen.calls) == 2
    for (server, labels), (_, _, out) in zip(seen.probed, seen.calls, strict=True):
        assert torch.equal(server.params["prompts"], out.params["prompts"])
        assert torch.equal(labels, seen.task.data.test_labels)
    probe = rows[rows["name"] == "probe"]
    assert probe["round"].tolist() == [0, 1] and probe["client_id"].isna().all()
    want = [float(out.params["prompts"].double().sum()) for _, _, out in seen.calls]
    assert probe["value"].tolist() == pytest.approx(want, rel=1e-12)


def _domain_cell():
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "vit-test"},
            "train": {
                "rounds": 1,
                "participation": 1.0,
                "batch_size": 8,
                "aggregation_weights": "domain_size",
            },
            "dataset": {
                "num_classes": 4,
                "image_size": 16,
                "train_per_class": 8,
                "test_per_class": 4,
                "num_domains": 2,
            },
            "partition": {"num_clients": 4, "heldout_frac": 0.0},
            "runtime": {"device": "cpu"},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "domain-dirichlet", "clients_per_domain": 2, "min_size": 2}],
        "methods": [{"name": "fedvpt"}],
    }
    return expand_suite(raw, name="wiring").cells[0]


def test_domain_size_weights_reach_fedavg(tmp_path, monkeypatch):
    """`train.aggregation_weights = "domain_size"`: each client weighs its domain's full size
    over the domain's clients; domains of 100 and 30 samples, 2 clients each: 50, 50, 15, 15.

    Catches `build_task` dropping `cfg.train.aggregation_weights` (train sizes are used) and
    `Task.aggregation_weights` ignoring `aggregation_sizes`.
    """
    load = task_module.load_dataset

    def with_sizes(comp):
        data = load(comp)
        return dataclasses.replace(data, domain_train_sizes=torch.tensor([100, 30]))

    monkeypatch.setattr(task_module, "load_dataset", with_sizes)
    weights = []

    def spy(self, server, updates):
        weights.append(
            dict(zip(updates.client_ids.tolist(), updates.weights.tolist(), strict=True))
        )
        return Method.aggregate(self, server, updates)

    monkeypatch.setattr(FedVPT, "aggregate", spy)
    cell = _domain_cell()
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cell, store, checkpoint_dir=tmp_path).status == "done"
        rows = store.metrics(aggregate_only=False)
    assert weights == [{0: 50.0, 1: 50.0, 2: 15.0, 3: 15.0}]
    # the round loop hands each client's domain and the dataset's domain names to the metric
    local = rows[rows["name"] == "acc_local"].set_index("client_id")["value"]
    assert sorted(local.index.astype(int)) == [0, 1, 2, 3]
    names = [domain_key(n) for n in load_dataset(cell.dataset).domain_names]
    domain = {c.id: c.domain for c in _clients(cell, cell.seed)}
    assert sorted(domain.values()) == [0, 0, 1, 1]
    got = rows[rows["name"].str.startswith("acc_domain_")].set_index("name")["value"]
    want = {
        f"acc_domain_{name}": np.mean([local[c] for c in domain if domain[c] == d])
        for d, name in enumerate(names)
    }
    # one round: its summary over the last 10 rounds is that round's value
    assert got.to_dict() == pytest.approx(want | {f"{k}_last10": v for k, v in want.items()})


def test_domain_size_weights_refuse_what_they_cannot_weigh():
    """The two errors of `aggregation_sizes`, word for word: they say what to do."""
    data = load_dataset(_domain_cell().dataset)
    clients = make_clients("domain-dirichlet", {"num_clients": 4, "min_size": 2}, data, 0)
    with pytest.raises(FpbenchError) as info:
        aggregation_sizes("domain_size", data, clients)
    assert str(info.value) == (
        "train.aggregation_weights = 'domain_size' needs a dataset that records its domains' "
        f"full sizes; {data.name} does not (a file prepared before they were recorded: "
        "delete it and prepare again)"
    )
    sized = dataclasses.replace(data, domain_train_sizes=torch.tensor([100, 30]))
    no_domain = [dataclasses.replace(c, domain=None) for c in clients]
    with pytest.raises(FpbenchError) as info:
        aggregation_sizes("domain_size", sized, no_domain)
    assert str(info.value) == (
        "train.aggregation_weights = 'domain_size' needs a per-domain partition (domain, "
        "domain-dirichlet)"
    )
    assert aggregation_sizes("domain_size", sized, clients).dtype == torch.float32


def test_a_task_made_without_a_rule_weighs_by_train_size():
    """`task_of`'s default rule is "train_size" (`fpbench estimate` relies on it): no error on a
    dataset without domain sizes, and FedAvg weighs by the train sizes."""
    cfg = tiny_config("fedvpt")
    task = task_module.task_of(load_dataset(cfg.dataset), cfg.partition, 0, torch.device("cpu"))
    assert task.aggregation_sizes is None
    assert task.aggregation_weights.tolist() == [float(len(c.train_idx)) for c in task.clients]


def test_personal_metrics_count_every_client_sampled_so_far(tmp_path):
    """pFedPG, one of 3 clients a round: round r scores the clients sampled in rounds 0..r.

    Catches the round loop handing `mark_untrained` only this round's clients (a client trained
    in round 0 would drop out of round 1's metrics), or no rounds' at all.
    """
    cfg = _with(tiny_config("pfedpg", rounds=2, participation=0.34), runtime={"device": "cpu"})
    trainable = [c.id for c in _clients(cfg, cfg.seed) if not c.heldout]
    schedule = sampling_schedule(cfg.seed, 2, trainable, 0.34)
    assert len(trainable) == 3 and schedule[0] != schedule[1]  # else the check has no power
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        rows = store.metrics(aggregate_only=False)
    for r in (0, 1):
        this = rows[rows["round"] == r]
        so_far = sorted({c for ids in schedule[: r + 1] for c in ids})
        assert sorted(this[this["name"] == "acc_local"]["client_id"].astype(int)) == so_far
        untrained = this[this["name"] == "clients_untrained"]["value"].tolist()
        assert untrained == [float(3 - len(so_far))]


def test_phases_reach_the_forward_with_their_trainable_parameters(tiny):
    """FedRep's local schedule as its training forward sees it: `ctx.phase` is "head" while only
    the head requires grad (from cached final states), then "representation" with the prompts.

    Catches `ctx.phase` left unset (every step "eval"), the trainable set not following the phase
    (`requires_grad_(True)` for all), and the cached states not used in the head phase.
    """
    cfg, task, method = tiny("fedrep")
    steps = []
    forward = FedRep.forward

    def spy(self, params, x, client_index, ctx):
        grad = sorted(n for n, t in params.items() if t.requires_grad)
        out = forward(self, params, x, client_index, ctx)
        states = current(x).states  # the phase's kept hidden states, by call site
        steps.append((ctx.phase, tuple(grad), tuple(key[1] for key in states.caches)))
        return out

    FedRep.forward = spy
    try:
        server = method.init_server(torch.Generator().manual_seed(0))
        ids = task.trainable_clients()[:2]
        train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    finally:
        FedRep.forward = forward
    depth = method.backbone.depth
    head = [s for s in steps if s[0] == "head"]
    rep = [s for s in steps if s[0] == "representation"]
    assert head and rep and steps == head + rep
    assert set(head) == {("head", ("head_b", "head_w"), (depth,))}  # final states kept
    assert set(rep) == {("representation", ("prompts",), ())}  # prompts at block 0 train


def _autocast_cpu() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled()


@pytest.mark.parametrize(
    "runtime",
    [
        {"deterministic": True, "cpu_linear": "blas", "precision": "fp32", "threads": "more"},
        {"deterministic": False, "cpu_linear": "onednn", "precision": "bf16", "threads": None},
    ],
)
def test_a_cell_trains_and_evaluates_in_its_numerics(tmp_path, monkeypatch, runtime):
    """Training and evaluation inside `run_cell` see the cell's deterministic mode, thread
    count, CPU linear backend and precision (autocast on in the forward for bf16), and the
    process's own state comes back after.

    Catches: `cell_numerics` not entered by `run_cell` (or not passing `threads` or
    `cpu_linear`), and the precision not reaching `train_clients` or `evaluate`.

    The thread count is recorded, not applied: a real second OpenMP thread in this process
    would hang every process forked from it later (mutmut forks one per mutant).
    """
    own = torch.get_num_threads()
    count = [own]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: count.__setitem__(0, n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: count[0])
    runtime = {**runtime, "threads": own + 1 if runtime["threads"] else None, "device": "cpu"}
    cfg = _with(tiny_config("fedvpt", rounds=1), runtime=runtime)
    before = (torch.are_deterministic_algorithms_enabled(), frozen_linear._backend)
    seen = []

    def state(where, precision):
        det = torch.are_deterministic_algorithms_enabled()
        seen.append((where, det, torch.get_num_threads(), frozen_linear._backend, precision))

    def wrap(where, fn, precision_of):
        def spy(*args, **kwargs):
            state(where, precision_of(args, kwargs))
            return fn(*args, **kwargs)

        return spy

    train, evaluate, forward = rounds.train_clients, rounds.evaluate, FedVPT.forward
    monkeypatch.setattr(rounds, "train_clients", wrap("train", train, lambda a, k: k["precision"]))
    monkeypatch.setattr(rounds, "evaluate", wrap("eval", evaluate, lambda a, k: a[5]))

    def spy_forward(self, params, x, client_index, ctx):
        state(f"forward-{ctx.training}", _autocast_cpu())
        return forward(self, params, x, client_index, ctx)

    monkeypatch.setattr(FedVPT, "forward", spy_forward)
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    threads = runtime["threads"] or own
    det, linear, bf16 = runtime["deterministic"], runtime["cpu_linear"], runtime["precision"]
    want = {
        ("train", det, threads, linear, bf16),
        ("eval", det, threads, linear, bf16),
        ("forward-True", det, threads, linear, bf16 == "bf16"),
        ("forward-False", det, threads, linear, bf16 == "bf16"),
    }
    assert set(seen) == want
    assert (torch.are_deterministic_algorithms_enabled(), frozen_linear._backend) == before
    assert torch.get_num_threads() == own


def test_a_round_evaluates_with_the_runs_batch_size_inputs_and_label_space(tiny, monkeypatch):
    """`evaluate_populations` hands `evaluate` the population's method, the round's server, the
    run's eval batch size, the population's inputs, the precision and `local_label_space`.

    Catches `label_space` dropped (every run evaluated over all classes) and another batch size.
    """
    from fpbench.engine.build import build_populations
    from fpbench.testing.tiny import cell_of, seeded_server

    cfg, task, _ = tiny("fedvpt", rounds=1, local_label_space="client", eval_batch_size=5)
    (pop,) = build_populations(cfg, task, torch.device("cpu"))
    calls = []
    evaluate = rounds.evaluate

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(rounds, "evaluate", spy)
    server, rows, _ = rounds.play_round(
        cell_of(cfg, task, [pop], [1, 2]), seeded_server(pop.method), 0, []
    )
    ((args, kwargs),) = calls
    assert args[0] is pop.method and args[2] is task and args[4] is pop.inputs
    assert torch.equal(args[1].params["prompts"], server.params["prompts"])
    assert args[3:] == (5, pop.inputs, "fp32")
    assert kwargs == {"label_space": "client", "clients": None, "full_split": "all"}


def test_the_forwards_stats_reach_aggregate_summed_over_the_round(tiny, monkeypatch):
    """What the forwards record (`Output.stats`, per row) reaches `aggregate` as `Updates.stats`,
    summed over the round's steps: here each client's count of samples seen, which is its local
    epochs times its train size.

    Catches `play_round` building the updates without the stats (aggregate sees none)."""
    from fpbench.engine.build import build_populations
    from fpbench.testing.tiny import cell_of, seeded_server

    cfg, task, _ = tiny("fedvpt", rounds=1, local_epochs=2)
    (pop,) = build_populations(cfg, task, torch.device("cpu"))
    forward, aggregate, handed = FedVPT.forward, FedVPT.aggregate, []

    def counting(self, params, x, rows, ctx):
        if ctx.labels is None:  # evaluation
            return forward(self, params, x, rows, ctx)
        seen = torch.zeros(len(ctx.priors)).index_add_(0, rows, torch.ones(len(rows)))
        return Output(forward(self, params, x, rows, ctx), stats={"seen": seen})

    def spy(self, server, updates):
        handed.append(updates)
        return aggregate(self, server, updates)

    monkeypatch.setattr(FedVPT, "forward", counting)
    monkeypatch.setattr(FedVPT, "aggregate", spy)
    ids = [2, 0]
    rounds.play_round(cell_of(cfg, task, [pop], ids), seeded_server(pop.method), 0, [])
    (updates,) = handed
    assert updates.client_ids.tolist() == ids
    assert updates.stats["seen"].tolist() == [2.0 * len(task.train_idx[c]) for c in ids]


def test_a_round_scores_its_modes_sets_in_the_runs_precision(tiny, monkeypatch):
    """`evaluate_populations` hands `score_targets` the cell (whose precision it scores in,
    see test_eval_modes), the round's servers and the clients seen so far, and stores what it
    returns.

    Catches the scored sets not handed the cell or the seen clients."""
    from fpbench.engine.build import build_populations
    from fpbench.testing.tiny import cell_of, seeded_server

    cfg, task, _ = tiny("fedvpt", rounds=1)
    (pop,) = build_populations(cfg, task, torch.device("cpu"))
    servers, calls = {pop.key: seeded_server(pop.method)}, []

    def spy(*args):
        calls.append(args)
        return {"acc_probe": 0.25}

    monkeypatch.setattr(rounds, "score_targets", spy)
    cell = cell_of(cfg, task, [pop], [1, 2], "bf16")
    rows = rounds.evaluate_populations(cell, servers, [], 0, [0, 2])
    assert calls == [(cell, servers, [0, 2])]
    assert (None, "acc_probe", 0.25, None) in rows


def test_a_round_played_alone_counts_its_own_clients_as_the_trained_ones(tiny):
    """`play_round` of a cell whose schedule has only this round's clients (as the cost
    estimate plays it) scores a personal method's clients sampled in this round; the others
    are untrained.

    Catches the round's seen clients not read from the cell's schedule (none trained, or a
    crash)."""
    from fpbench.engine.build import build_populations
    from fpbench.testing.tiny import cell_of, seeded_server

    cfg, task, _ = tiny("pfedpg", rounds=1)
    (pop,) = build_populations(cfg, task, torch.device("cpu"))
    ids = task.trainable_clients()
    assert len(ids) == 3 and cfg.train.unseen_clients == "exclude"
    _, rows, _ = rounds.play_round(
        cell_of(cfg, task, [pop], ids[1:2]), seeded_server(pop.method), 0, []
    )
    assert [v for c, n, v, _ in rows if n == "clients_untrained"] == [2.0]
    assert [c for c, n, *_ in rows if n == "acc_local"] == [ids[1]]


def test_a_cells_lockstep_samples_cut_each_step_into_chunks_of_whole_clients(tmp_path, monkeypatch):
    """`runtime.lockstep_samples` reaches the executor: every training forward holds at most
    that many samples (or one client's batch), and the stored values equal the unchunked run's.

    Catches: the setting not passed by `rounds` (one forward over all clients), or a chunk's
    backward lost (the chunked run's values differ)."""
    forward, sizes = FedVPT.forward, []

    def spy(self, params, x, client_index, ctx):
        if ctx.training:
            sizes.append((len(x), len(set(client_index.tolist()))))
        return forward(self, params, x, client_index, ctx)

    monkeypatch.setattr(FedVPT, "forward", spy)
    values = []
    for limit in (None, 4):
        cfg = _with(tiny_config("fedvpt", rounds=1), runtime={"lockstep_samples": limit})
        sizes.clear()
        with Store(f"sqlite:///{tmp_path / f'{limit}.db'}") as store:
            assert run_cell(cfg, store, checkpoint_dir=tmp_path / str(limit)).status == "done"
            values.append(store.metrics()["value"].tolist())
        clients = max(n for _, n in sizes)
        if limit is None:
            assert clients > 1  # lockstep: every client of the step in one forward
            batch = cfg.train.batch_size
        else:
            assert clients == 1 and max(s for s, _ in sizes) <= max(limit, batch)
    assert values[1] == pytest.approx(values[0], abs=1e-6)
