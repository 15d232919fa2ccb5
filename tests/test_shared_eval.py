"""Shared work once per evaluation (`fpbench.backbones.recall.SharedStates`): a personal or
client-conditioned method's clients scored on the full test split reuse, per test sample, the
backbone states their models compute alike, and the scores are exactly those computed without.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

import fpbench.backbones.vit as vit_module
from fpbench.backbones.recall import SharedStates
from fpbench.engine.evaluate import evaluate
from fpbench.testing.tiny import seeded_server, with_config


def _perturbed(server, names: tuple[str, ...], seed: int = 1):
    """The server with its personal tensors `names` perturbed per client (the rest shared)."""
    gen = torch.Generator().manual_seed(seed)
    for k in names:
        v = server.personal[k]
        server.personal[k] = v + 0.5 * torch.randn(v.shape, generator=gen)
    return server


def _without_sharing(monkeypatch, method, server, task, batch_size: int):
    with monkeypatch.context() as m:
        m.setattr(vit_module, "shared_site", lambda tokens: None)
        return evaluate(method, server, task, batch_size=batch_size)


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=f.name)  # bit for bit, NaN where NaN
        else:
            assert x == y, f.name


def _block_items(monkeypatch, method) -> list[int]:
    """Per block of the backbone, the items it computes (a list filled as blocks run)."""
    seen = [0] * method.backbone.depth
    for layer, block in enumerate(method.backbone.vit.blocks):
        block.register_forward_hook(
            lambda mod, args, out, k=layer: seen.__setitem__(k, seen[k] + args[0].shape[0])
        )
    return seen


@pytest.mark.parametrize(
    "name, differ",
    [
        ("fedrep", ("head_w", "head_b")),
        ("pep-fedpt", ("class_prompts", "head_w", "head_b")),
        ("fedem", ("pi", "head_w", "head_b")),
        ("pfedhn", ()),
        ("local", ("prompts", "head_w", "head_b")),
        ("p-pt", ()),
        ("per-fedavg", ()),
    ],
)
@pytest.mark.parametrize("batch_size", [16, 64])
def test_shared_scores_are_bit_identical_to_each_clients_own(
    tiny, monkeypatch, name, differ, batch_size
):
    """Every field of the evaluation, with and without shared states, equal bit for bit, for
    clients that share everything but their personal tensors (perturbed per client) and for
    methods whose clients share little (pFedHN's generated prompts, Per-FedAvg's adapted ones,
    local's own prompts)."""
    _, task, method = tiny(name)
    server = _perturbed(seeded_server(method), tuple(k for k in differ if k in method.personal))
    got = evaluate(method, server, task, batch_size=batch_size)
    _same(got, _without_sharing(monkeypatch, method, server, task, batch_size))
    assert np.isfinite(got.global_acc[~task.heldout.numpy()]).all()


def test_fedrep_runs_each_block_once_per_test_sample_on_the_full_split(tiny, monkeypatch):
    """FedRep's clients share the prompts and differ in their heads: on the full split every
    block computes each test sample once (then one head per client), where without sharing it
    computes it once per participant; the local sets cost the same either way."""
    _, task, method = tiny("fedrep")
    server = _perturbed(seeded_server(method), ("head_w", "head_b"))
    participants = int((~task.heldout).sum())
    local = sum(len(task.test_idx[c]) for c in range(task.num_clients) if not task.heldout[c])
    m = len(task.data.test_labels)
    seen = _block_items(monkeypatch, method)
    evaluate(method, server, task, batch_size=16)
    assert seen == [local + m] * method.backbone.depth
    seen[:] = [0] * len(seen)
    _without_sharing(monkeypatch, method, server, task, 16)
    assert seen == [local + participants * m] * method.backbone.depth


def test_pep_fedpt_shares_the_blocks_below_its_class_conditioned_prompts(tiny, monkeypatch):
    """PEP-FedPT: the blocks below its first class-conditioned prompt compute each test sample
    once on the full split; from that block on, each participant's own (its priors mix the
    class prompts differently)."""
    _, task, method = tiny("pep-fedpt")
    method = with_config(method, ccmp_layers=[method.backbone.depth - 1])
    server = seeded_server(method)
    first = min(method.layers)
    assert 0 < first < method.backbone.depth
    participants = int((~task.heldout).sum())
    local = sum(len(i) for i in task.test_idx)  # client-conditioned: the held-out one too
    m = len(task.data.test_labels)
    seen = _block_items(monkeypatch, method)
    evaluate(method, server, task, batch_size=16)
    want = [local + (m if k < first else participants * m) for k in range(len(seen))]
    assert seen == want


def test_fedem_shares_its_components_before_the_clients_mixture(tiny, monkeypatch):
    """FedEM: the M shared components' forwards are computed once per test sample (M items a
    sample), each client mixing them with its own weights."""
    _, task, method = tiny("fedem")
    server = _perturbed(seeded_server(method), ("pi",))
    local = sum(len(task.test_idx[c]) for c in range(task.num_clients) if not task.heldout[c])
    m = len(task.data.test_labels)
    seen = _block_items(monkeypatch, method)
    evaluate(method, server, task, batch_size=16)
    assert method.cfg.learners == 3
    assert seen == [3 * (local + m)] * method.backbone.depth


def test_slots_of_a_block_and_of_repeated_items():
    """Slots: a sample's place in the block, -1 outside it; a batch holding each sample q times
    in a row (a mixture's learners) gets q slots a sample; a batch of no multiple gets None."""
    shared = SharedStates(torch.tensor([4, 1, 7]), 9)
    assert shared.slots(torch.tensor([1, 7, 0]), 3).tolist() == [1, 2, -1]
    assert shared.slots(torch.tensor([7, 0]), 4).tolist() == [4, 5, -1, -1]
    assert shared.slots(torch.tensor([7, 0]), 3) is None


def test_a_site_stores_the_first_item_of_each_slot_and_reuses_only_equal_values():
    """`map`: the first item of each new slot is computed and stored; a later item of a stored
    slot takes the stored value only where its input is exactly equal, else it is computed."""
    shared = SharedStates(torch.arange(3), 3)
    site = shared.site((1, 1))
    calls: list[int] = []

    def fn(x):
        calls.append(len(x))
        return x * 2

    x = torch.tensor([[1.0], [2.0], [1.0]])
    slots = torch.tensor([0, 1, 0])
    assert site.map(x, slots, fn).tolist() == [[2.0], [4.0], [2.0]]
    assert calls == [3] and site.filled.tolist() == [True, True, False]
    y = torch.tensor([[1.0], [5.0], [0.0]])
    assert site.map(y, torch.tensor([0, 1, 2]), fn).tolist() == [[2.0], [10.0], [0.0]]
    assert calls == [3, 2]  # slot 0 reused; slot 1 differs; slot 2 new (and stored)
    assert site.get("in", torch.tensor([1, 2])).tolist() == [[2.0], [0.0]]


@pytest.mark.parametrize("name", ["fedrep", "pep-fedpt"])
def test_full_split_clients_changes_only_the_full_split_metrics(tiny, name):
    """`train.full_split_clients`: "none" scores no client on the full split, 2 a seeded sample of
    two participants (the same at every call), "all" every participant; the local counts and ECE
    stay bit for bit those of "all", and a sampled client's full-split scores are its own."""
    _, task, method = tiny(name)
    server = _perturbed(seeded_server(method), tuple({"head_w", "head_b"} & method.personal))
    every = evaluate(method, server, task, batch_size=16)
    participants = np.flatnonzero(~task.heldout.numpy())
    assert np.isfinite(every.global_acc[participants]).all() and len(participants) == 3
    for setting, scored in (("none", 0), (2, 2), (5, 3)):
        got = evaluate(method, server, task, batch_size=16, full_split=setting)
        for f in ("correct_local", "total_local", "ece_local", "heldout"):
            np.testing.assert_array_equal(getattr(got, f), getattr(every, f), err_msg=f)
        done = np.flatnonzero(np.isfinite(got.global_acc))
        assert len(done) == scored and set(done) <= set(participants)
        for f in ("global_acc", "f1_global", "ece_global"):
            np.testing.assert_array_equal(getattr(got, f)[done], getattr(every, f)[done])
            assert np.isnan(np.delete(getattr(got, f), done)).all()
        if setting == 2:
            sample = done
    again = evaluate(method, server, task, batch_size=16, full_split=2)
    assert np.flatnonzero(np.isfinite(again.global_acc)).tolist() == sample.tolist()


def test_the_field_at_its_default_leaves_run_keys_as_they_were():
    """At its default the field is left out of the run identity (the keys of stored runs stay);
    set, it is part of it; 0 or another word is refused."""
    from pydantic import ValidationError

    from fpbench.specs import TrainConfig
    from fpbench.testing.tiny import tiny_config

    cfg = tiny_config("fedrep")
    assert cfg.train.full_split_clients == "all"
    assert "full_split_clients" not in cfg.identity()["train"]
    other = cfg.model_copy(update={"train": cfg.train.model_copy(update={"full_split_clients": 4})})
    assert other.identity()["train"]["full_split_clients"] == 4
    assert cfg.run_key != other.run_key
    for bad in (0, "some"):
        with pytest.raises(ValidationError):
            TrainConfig(full_split_clients=bad)


@pytest.mark.slow
def test_a_run_with_full_split_clients_none_stores_no_full_split_metric(tmp_path):
    """The wire from the config to the evaluation: a FedRep run with `full_split_clients =
    "none"` stores no acc_global / f1_macro_global / ece_global (per client or aggregate) and
    the same local metrics as the run that computes them."""
    from fpbench.engine.runner import run_cell
    from fpbench.store import Store
    from fpbench.testing.tiny import tiny_config

    full = {"acc_global", "f1_macro_global", "ece_global"}
    values = {}
    for setting in ("all", "none"):
        cfg = tiny_config("fedrep", rounds=1, full_split_clients=setting)
        with Store(f"sqlite:///{tmp_path / f'{setting}.db'}") as store:
            assert run_cell(cfg, store, checkpoint_dir=tmp_path / setting).status == "done"
            rows = store.metrics(aggregate_only=False)
        values[setting] = {
            (r.name, None if pd.isna(r.client_id) else int(r.client_id), r.round): r.value
            for r in rows.itertuples()
        }
    names = {k[0] for k in values["all"]}
    assert full <= names and not full & {k[0] for k in values["none"]}
    kept = {k: v for k, v in values["all"].items() if not k[0].startswith(tuple(full))}
    assert values["none"] == kept
