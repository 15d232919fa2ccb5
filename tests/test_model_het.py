"""Model heterogeneity (SDFed appendix B): client profiles, per-backbone populations, step caps."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fpbench.backbones.clip import CLIP_MEAN, CLIP_STD
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.build import build_populations
from fpbench.engine.executor import client_batches, derive_seed, train_clients
from fpbench.engine.metrics import EvalCounts
from fpbench.engine.populations import (
    Cohort,
    client_profiles,
    merge_counts,
    pack,
    participants,
    share,
    start_shared,
    unpack,
)
from fpbench.engine.rounds import play_round
from fpbench.engine.runner import run_cell
from fpbench.engine.task import build_task
from fpbench.errors import FpbenchError
from fpbench.methods.base import ServerState
from fpbench.specs import TrainConfig
from fpbench.store import Store
from fpbench.suites import expand_suite
from fpbench.testing.tiny import cell_of

CPU = torch.device("cpu")
SDFED = {"name": "sdfed", "global_len": 4, "local_len": 4}


def _suite(method: str = "promptfl", model_het: dict | None = None, **train) -> dict:
    defaults = {
        "backbone": {"name": "clip-test"},
        "dataset": {"num_classes": 10, "image_size": 16, "train_per_class": 8, "test_per_class": 4},
        "partition": {"num_clients": 5, "heldout_frac": 0.0, "shots": 4},
        "train": {"rounds": 2, "batch_size": 4, "lr": 0.01, "eval_batch_size": 64, **train},
    }
    if model_het is not None:
        defaults["model_het"] = model_het
    return {
        "seeds": [0],
        "defaults": defaults,
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "pathological", "s": 2}],
        "methods": [{"name": method, "n_ctx": 4} if method != "sdfed" else SDFED],
    }


def _cell(*args, **kw):
    return expand_suite(_suite(*args, **kw), name="het").cells[0]


def _profiles(second_backbone: dict, **strong_train) -> dict:
    return {
        "profiles": [
            {"name": "strong", "clients": 2, "train": strong_train},
            {"name": "weak", "clients": 3, "backbone": second_backbone},
        ]
    }


# a second reference to the same model: a separate group that must behave exactly like the first
SAME_MODEL = {"name": "clip-test", "mean": list(CLIP_MEAN), "std": list(CLIP_STD)}


# -- config ----------------------------------------------------------------------------------


def test_run_keys_without_model_het_are_unchanged():
    cfg = _cell()
    assert "model_het" not in cfg.identity()
    assert "max_local_steps" not in cfg.identity()["train"]
    het = _cell(model_het=_profiles({"name": "clip-test-rn"}))
    assert het.run_key != cfg.run_key and het.identity()["model_het"]["share"] == "shared"


@pytest.mark.parametrize(
    ("model_het", "message"),
    [
        (_profiles({"name": "clip-test-rn"}, rounds=3), "cannot vary per client"),
        (_profiles({"name": "no-such-backbone"}), "no-such-backbone"),
        (_profiles({"name": "clip-test-rn"}, batch_size=0), "batch_size"),
        ({"profiles": [{"name": "a", "clients": 4}]}, "4 clients in all but partition"),
        ({"profiles": [{"name": "a", "clients": 2}, {"name": "a", "clients": 3}]}, "unique"),
    ],
)
def test_bad_profiles_are_rejected_with_the_field(model_het, message):
    with pytest.raises(FpbenchError, match=message):
        _cell(model_het=model_het)


def test_profile_train_overrides_only_its_own_keys():
    cfg = _cell(model_het=_profiles(SAME_MODEL, batch_size=8, local_epochs=2))
    strong, weak = (cfg.profile_train(p) for p in cfg.model_het.profiles)
    assert (strong.batch_size, strong.local_epochs, strong.lr) == (8, 2, 0.01)
    assert (weak.batch_size, weak.local_epochs) == (4, 1)
    assert client_profiles(cfg.model_het) == [0, 0, 1, 1, 1]


# -- step cap --------------------------------------------------------------------------------


def test_step_cap_equals_stopping_after_that_many_batches(tiny):
    """Two epochs capped at one epoch's batches = one epoch; lockstep = reference with caps."""
    cfg, task, method = tiny("fedvpt", local_epochs=2)
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = [0, 1]
    steps = len(client_batches(task.train_idx[0], cfg.train.batch_size, derive_seed(0, 0, 0, 0, 0)))
    one_epoch = cfg.train.model_copy(update={"local_epochs": 1})
    capped = cfg.train.model_copy(update={"max_local_steps": steps})
    kw = dict(round_idx=0, seed=0)
    a = train_clients(method, server, task, ids[:1], one_epoch, **kw)
    b = train_clients(method, server, task, ids[:1], capped, **kw)
    for name in a.params:
        torch.testing.assert_close(a.params[name], b.params[name], rtol=0, atol=0)
    c = train_clients(method, server, task, ids, capped, executor="lockstep", **kw)
    d = train_clients(method, server, task, ids, capped, executor="reference", **kw)
    for name in c.params:
        torch.testing.assert_close(c.params[name], d.params[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.loss, d.loss)


# -- populations -------------------------------------------------------------------------------


def test_share_is_fedavg_over_all_participants():
    a = ServerState({"p": torch.tensor([1.0, 2.0]), "w": torch.ones(3)}, {"own": torch.zeros(2)})
    b = ServerState({"p": torch.tensor([4.0, 8.0]), "w": torch.ones(4)})
    out = share({"a": a, "b": b}, {"a": 1.0, "b": 3.0})
    expected = torch.tensor([(1 + 3 * 4) / 4, (2 + 3 * 8) / 4])
    assert torch.equal(out["a"].params["p"], expected) and torch.equal(
        out["b"].params["p"], expected
    )
    assert out["a"].params["w"].shape == (3,) and out["b"].params["w"].shape == (4,)  # not shared
    assert share({"a": a, "b": b}, {"a": 0.0, "b": 0.0})["a"].params["p"].tolist() == [1.0, 2.0]
    only_b = share({"a": a, "b": b}, {"a": 0.0, "b": 2.0})
    assert only_b["a"].params["p"].tolist() == [4.0, 8.0]


def test_pack_and_unpack_are_inverse():
    servers = {
        "0-x": ServerState({"p": torch.ones(2)}, {"own": torch.zeros(3, 2)}, {"b": torch.ones(1)}),
        "1-y": ServerState({"p": torch.zeros(2)}),
    }
    back = unpack(pack(servers), list(servers))
    for key, s in servers.items():
        for part in ("params", "personal", "buffers"):
            got, want = getattr(back[key], part), getattr(s, part)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert unpack(pack({"": servers["0-x"]}), [""])[""] is servers["0-x"]


def test_merge_counts_takes_each_clients_counts_from_its_group():
    def counts(correct, glob):
        return EvalCounts(
            correct_local=np.array(correct),
            total_local=np.array([4, 4, 4]),
            heldout=np.zeros(3, dtype=bool),
            global_acc=np.array(glob, dtype=float),
            global_total=10,
        )

    merged = merge_counts([(counts([1, 2, 3], [0.5]), [0, 2]), (counts([0, 4, 0], [0.25]), [1])])
    assert merged.correct_local.tolist() == [1, 4, 3]
    assert merged.global_acc.tolist() == [0.5, 0.25, 0.5]


def test_groups_follow_backbones_and_cohorts_follow_profiles():
    cfg = _cell(model_het=_profiles({"name": "clip-test-rn"}, batch_size=8))
    pops = build_populations(cfg, build_task(cfg, CPU), CPU)
    assert [p.key for p in pops] == ["0-clip-test", "1-clip-test-rn"]
    assert [p.clients for p in pops] == [[0, 1], [2, 3, 4]]
    assert [c.train.batch_size for p in pops for c in p.cohorts] == [8, 4]
    assert pops[0].method.backbone is not pops[1].method.backbone


def _metrics(store: Store) -> pd.DataFrame:
    m = store.metrics(aggregate_only=False)
    m = m[~m["name"].str.startswith("acc_profile_")]
    return m.sort_values(["round", "client_id", "name"], na_position="first").reset_index(drop=True)


@pytest.mark.parametrize("method", ["promptfl", "sdfed", "tpfl", "fedotp"])
def test_two_groups_of_one_model_equal_one_homogeneous_run(tmp_path, method):
    """Shared parameters averaged across groups = FedAvg over everyone (global and personal).

    Methods whose server keeps cross-client buffers (Powder's prompt pool, UOPP's prototypes)
    keep one per backbone, so they are not expected to match a homogeneous run.
    """
    plain = _cell(method, participation=0.8)
    het = _cell(method, model_het=_profiles(SAME_MODEL), participation=0.8)
    stores = [Store(f"sqlite:///{tmp_path / f'{i}.db'}") for i in range(2)]
    for cfg, store in zip((plain, het), stores, strict=True):
        assert run_cell(cfg, store, checkpoint_dir=tmp_path / "ck").status == "done"
    a, b = (_metrics(s).drop(columns="run_id") for s in stores)
    if method in ("promptfl", "tpfl"):  # per-client acc/ece_global rows: the group's global model
        per_client = b["name"].isin(["acc_global", "ece_global"]) & b["client_id"].notna()
        b = b[~per_client].reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, rtol=1e-4, atol=1e-5)


def test_heterogeneous_backbones_train_share_text_prompts_and_resume(tmp_path):
    cfg = _cell(
        "sdfed",
        model_het={
            "profiles": [
                {"name": "strong", "clients": 2, "train": {"batch_size": 8, "local_epochs": 2}},
                {"name": "weak", "clients": 3, "backbone": {"name": "clip-test-rn"},
                 "train": {"max_local_steps": 1}},
            ]
        },
        rounds=3,
    )  # fmt: skip
    store = Store(f"sqlite:///{tmp_path / 'h.db'}")
    folder = tmp_path / "ck"

    class Stop(Exception):
        pass

    class CrashAfterRound1:
        def cell_start(self, cfg, start):
            pass

        def round_end(self, cfg, r, metrics):
            if r == 1:
                server = ckpt_io.load(
                    ckpt_io.checkpoint_path(
                        ckpt_io.folder_for(folder, store.database_id), cfg.run_key
                    ),
                    cfg.run_key,
                    CPU,
                )
                groups = unpack(server.server, ["0-clip-test", "1-clip-test-rn"])
                vit, rn = groups["0-clip-test"], groups["1-clip-test-rn"]
                assert torch.equal(vit.params["global_prompt"], rn.params["global_prompt"])
                assert not torch.equal(vit.personal["local_prompt"], rn.personal["local_prompt"])
                raise Stop

        def cell_end(self, result):
            pass

    with pytest.raises(Stop):
        run_cell(cfg, store, checkpoint_dir=folder, observer=CrashAfterRound1())
    assert run_cell(cfg, store, checkpoint_dir=folder).status == "done"
    m = store.metrics(aggregate_only=False)
    last = m[(m["round"] == 2) & m["client_id"].isna()].set_index("name")["value"]
    assert {"acc_profile_strong", "acc_profile_weak", "acc_local_mean", "acc_global"} <= set(
        last.index
    )
    local = m[(m["round"] == 2) & (m["name"] == "acc_local")].set_index("client_id")["value"]
    assert last["acc_profile_weak"] == pytest.approx(local.loc[[2, 3, 4]].mean())
    assert sorted(store.rounds(store.find_run(cfg.run_key).id)["round"]) == [0, 1, 2]


def test_a_group_without_participants_keeps_its_server_state(tmp_path):
    cfg = _cell(model_het=_profiles({"name": "clip-test-rn"}), participation=0.2)
    store = Store(f"sqlite:///{tmp_path / 'p.db'}")
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"  # 1 client per round
    loss = store.metrics().query("name == 'loss_train'")
    assert len(loss) == 2 and (loss["count"] == 1).all()


def test_a_round_shares_only_its_participants_and_names_each_groups_round_metrics(
    fpbench_cache,
):
    """Only the second group trains this round: the first weighs 0 in the sharing, so both end
    with the second group's own aggregate; each group's `round_metrics` gets the test split and
    is stored as `<name>@<group>`.

    Catches a group without participants weighing 1 (the untrained prompts mixed in), and the
    group suffix dropped or given only from three groups on (two groups' values under one name),
    and `round_metrics` handed no test split."""
    cfg = _cell(model_het=_profiles(SAME_MODEL))
    task = build_task(cfg, CPU)
    pops = build_populations(cfg, task, CPU)
    keys = [p.key for p in pops]
    assert [p.clients for p in pops] == [[0, 1], [2, 3, 4]]
    servers = start_shared(
        {p.key: p.method.init_server(torch.Generator().manual_seed(0)) for p in pops}
    )
    seen = []
    for i, pop in enumerate(pops):

        def probe(server, test, i=i):
            out, labels = test(lambda x: x.flatten(1)[:, :1])
            seen.append((i, len(out), labels))
            return {"probe": 10.0 + i}

        pop.method.round_metrics = probe
    new, rows, _ = play_round(cell_of(cfg, task, pops, [3, 4]), pack(servers), 0, [])
    alone_cell = cell_of(cfg, task, pops[1:], [3, 4])
    alone, _, _ = play_round(alone_cell, pack({keys[1]: servers[keys[1]]}), 0, [])
    want = unpack(alone, keys[1:])[keys[1]].params["ctx"]
    assert not torch.equal(want, servers[keys[1]].params["ctx"])  # it trained
    for key, state in unpack(new, keys).items():
        assert torch.equal(state.params["ctx"], want), key
    probes = [(name, v) for c, name, v, _ in rows if name.startswith("probe")]
    assert probes == [(f"probe@{keys[0]}", 10.0), (f"probe@{keys[1]}", 11.0)]
    n = len(task.data.test_labels)
    assert [(i, m) for i, m, _ in seen[:2]] == [(0, n), (1, n)]
    assert all(torch.equal(labels, task.data.test_labels) for *_, labels in seen)


def test_merge_counts_keeps_the_runs_sizes_and_each_clients_f1():
    """A personal population (per-client values) beside a global one (one value each) and one
    without F1: each client's F1 and accuracy on the test split come from its own population,
    NaN where its population has no F1; sizes, held-out flags and applicability are the run's.
    One population's counts are handed on as they are."""
    total, held = np.array([4, 5, 6, 7]), np.array([False, False, True, False])

    def counts(correct, glob, f1):
        return EvalCounts(
            correct_local=np.array(correct),
            total_local=total,
            heldout=held,
            global_acc=np.array(glob, dtype=float),
            global_total=12,
            heldout_applicable=False,
            f1_global=None if f1 is None else np.array(f1, dtype=float),
        )

    personal = counts([1, 0, 3, 0], [0.1, np.nan, 0.3, np.nan], [0.2, np.nan, 0.4, np.nan])
    merged = merge_counts(
        [
            (personal, [0, 2]),
            (counts([0, 2, 0, 0], [0.25], [0.5]), [1]),
            (counts([0, 0, 0, 6], [0.75], None), [3]),
        ]
    )
    assert merged.correct_local.tolist() == [1, 2, 3, 6]
    assert merged.correct_local.dtype == np.int64  # counts, as every population's
    np.testing.assert_array_equal(merged.global_acc, [0.1, 0.25, 0.3, 0.75])
    np.testing.assert_array_equal(merged.f1_global, [0.2, 0.5, 0.4, np.nan])
    assert merged.total_local.tolist() == total.tolist()
    assert merged.heldout.tolist() == held.tolist()
    assert (merged.global_total, merged.heldout_applicable, merged.untrained) == (12, False, None)
    assert merge_counts([(personal, [0, 1, 2, 3])]) is personal


def test_shared_parameters_start_from_the_first_populations_values():
    """Every population starts with population 0's values of the parameters all of them share
    (same name, same shape), copies not views; the rest (and personal state) stay their own."""
    a = ServerState({"p": torch.tensor([1.0, 2.0]), "w": torch.ones(3)}, {"own": torch.zeros(2)})
    b = ServerState({"p": torch.tensor([4.0, 8.0]), "w": torch.zeros(4)}, {"own": torch.ones(2)})
    c = ServerState({"p": torch.tensor([5.0, 6.0])})
    out = start_shared({"0-x": a, "1-y": b, "2-z": c})
    assert [s.params["p"].tolist() for s in out.values()] == [[1.0, 2.0]] * 3
    assert out["1-y"].params["w"].tolist() == [0.0] * 4
    assert out["1-y"].personal["own"].tolist() == [1.0, 1.0]
    out["1-y"].params["p"].add_(1)
    assert out["0-x"].params["p"].tolist() == [1.0, 2.0]
    assert start_shared({"0-x": a}) == {"0-x": a}  # one population shares nothing


def test_participants_are_the_rounds_clients_of_the_cohort_in_round_order():
    cohort = Cohort("small", (1, 4, 6), TrainConfig())
    assert participants(cohort, [6, 0, 4, 5]) == [6, 4]
    assert participants(cohort, [0, 2]) == []


def test_share_keeps_each_populations_own_state_and_ignores_the_weightless():
    """Personal rows and buffers stay each population's own; a population of weight 0 adds
    nothing to the mean, not even a NaN it holds."""
    a = ServerState({"p": torch.tensor([1.0, 2.0])}, {"own": torch.zeros(2)}, {"b": torch.ones(1)})
    b = ServerState({"p": torch.tensor([float("nan"), 8.0])}, {}, {"b": torch.zeros(1)})
    c = ServerState({"p": torch.tensor([3.0, 4.0])})
    out = share({"a": a, "b": b, "c": c}, {"a": 1.0, "b": 0.0, "c": 1.0})
    assert [s.params["p"].tolist() for s in out.values()] == [[2.0, 3.0]] * 3
    assert out["a"].personal["own"].tolist() == [0.0, 0.0] and out["b"].personal == {}
    assert out["a"].buffers["b"].tolist() == [1.0] and out["b"].buffers["b"].tolist() == [0.0]
    assert out["c"].buffers == {}


def test_a_phase_that_trains_nothing_takes_none_of_the_step_cap(tiny):
    """`max_local_steps` caps optimiser steps: a scoring phase before the training one scores
    all its batches and leaves the whole cap to training (lockstep and reference alike)."""
    from fpbench.methods.base import Phase

    cfg, task, method = tiny("fedvpt", local_epochs=2)
    server = method.init_server(torch.Generator().manual_seed(0))
    steps = len(client_batches(task.train_idx[0], cfg.train.batch_size, derive_seed(0, 0, 0, 0, 0)))
    capped = cfg.train.model_copy(update={"max_local_steps": steps})
    train = type(method).phases.__get__(method)
    batches = {"score": 0, "local": 0}

    def phases(local_epochs, names):
        return [Phase("score", (), local_epochs), *train(local_epochs, names)]

    def forward(params, x, client_index, ctx):
        batches[ctx.phase] += 1
        return type(method).forward(method, params, x, client_index, ctx)

    method.phases, method.forward = phases, forward
    got = {}
    for executor in ("lockstep", "reference"):
        batches.update(score=0, local=0)
        got[executor] = train_clients(
            method, server, task, [0, 1], capped, executor=executor, round_idx=0, seed=0
        )
        per_pass = 1 if executor == "lockstep" else 2  # the reference trains one client a pass
        # both epochs scored, uncapped; the training phase stops at the cap (one epoch)
        assert batches == {"score": 2 * steps * per_pass, "local": steps * per_pass}
    for name in got["lockstep"].params:
        torch.testing.assert_close(
            got["lockstep"].params[name], got["reference"].params[name], rtol=1e-5, atol=1e-6
        )
