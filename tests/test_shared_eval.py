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

import fpbench.backbones.clip as clip_module
import fpbench.backbones.vit as vit_module
import fpbench.methods.helpers as helpers_module
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
        m.setattr(vit_module, "shared_forward", lambda x, key: None)
        m.setattr(helpers_module, "last_call", lambda key, inputs, fn: fn())
        m.setattr(clip_module, "last_call", lambda key, inputs, fn: fn())
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


@pytest.mark.parametrize(
    "name", ["coop-local", "fedotp", "fedpgp", "pfedmoap", "promptfolio", "powder", "sdfed"]
)
def test_clip_personal_scores_are_bit_identical_to_each_clients_own(tiny, monkeypatch, name):
    """The CLIP field's personal and client-conditioned methods, every personal tensor
    perturbed per client: the evaluation with its kept last calls equals the one without."""
    _, task, method = tiny(name)
    server = seeded_server(method)
    floats = tuple(k for k in method.personal if server.personal[k].is_floating_point())
    server = _perturbed(server, floats)
    got = evaluate(method, server, task, batch_size=64)
    _same(got, _without_sharing(monkeypatch, method, server, task, 64))
    assert np.isfinite(got.global_acc[~task.heldout.numpy()]).all()


def test_fedrep_runs_each_block_once_per_test_sample_on_the_full_split(tiny, monkeypatch):
    """FedRep's clients share the prompts and differ in their heads: on the full split every
    block computes each test sample once (then one head per client), where without sharing it
    computes it once per participant; a participant's local samples are read from its full
    split, so they cost nothing more (held-out clients have no personal head: not scored)."""
    _, task, method = tiny("fedrep")
    server = _perturbed(seeded_server(method), ("head_w", "head_b"))
    participants = int((~task.heldout).sum())
    m = len(task.data.test_labels)
    seen = _block_items(monkeypatch, method)
    evaluate(method, server, task, batch_size=16)
    assert seen == [m] * method.backbone.depth
    seen[:] = [0] * len(seen)
    _without_sharing(monkeypatch, method, server, task, 16)
    assert seen == [participants * m] * method.backbone.depth


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
    # client-conditioned: the held-out client scores its local samples alone
    local = sum(len(i) for i, held in zip(task.test_idx, task.heldout, strict=True) if held)
    assert local > 0
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
    m = len(task.data.test_labels)
    seen = _block_items(monkeypatch, method)
    evaluate(method, server, task, batch_size=16)
    assert method.cfg.learners == 3
    assert seen == [3 * m] * method.backbone.depth


def test_slots_of_a_block_and_of_repeated_items():
    """Slots: a sample's place in the block, -1 outside it; a batch holding each sample q times
    in a row (a mixture's learners) gets q slots a sample; a batch of no multiple gets None."""
    shared = SharedStates(torch.tensor([4, 1, 7]), 9)
    assert shared.slots(torch.tensor([1, 7, 0]), 3).tolist() == [1, 2, -1]
    assert shared.slots(torch.tensor([7, 0]), 4).tolist() == [4, 5, -1, -1]
    assert shared.slots(torch.tensor([7, 0]), 3) is None


def test_a_site_stores_the_first_item_of_each_slot_and_reuses_only_equal_values():
    """`begin` marks the first item of each new slot to store and the items of stored slots;
    `same` is true only where a known item's value equals the stored one exactly; `get` reads
    consecutive slots as a view of the stored values, others as a copy."""
    shared = SharedStates(torch.arange(3), 3)
    site = shared.site(1, 1)
    slots = torch.tensor([0, 1, 0])
    fill, known = site.begin(slots)
    assert fill.tolist() == [True, True, False] and known.tolist() == [False] * 3
    assert site.store("in", slots[fill], torch.tensor([[1.0], [2.0]]))
    site.filled[slots[fill]] = True
    fill, known = site.begin(torch.tensor([0, 1, 2]))
    assert fill.tolist() == [False, False, True] and known.tolist() == [True, True, False]
    y = torch.tensor([[1.0], [5.0], [0.0]])
    assert site.same("in", torch.tensor([0, 1, 2]), y, known).tolist() == [True, False, False]
    both = torch.tensor([True, True])
    assert site.same("in", torch.tensor([0, 1]), y[:2], both).tolist() == [True, False]
    assert site.same("in", torch.tensor([0, 1]), torch.tensor([[1.0], [2.0]]), both).all()
    assert not site.store("in", torch.tensor([2]), torch.tensor([[1.0, 2.0]]))  # other shape
    view = site.get("in", torch.tensor([0, 1]))
    assert view.tolist() == [[1.0], [2.0]] and view.data_ptr() == site.values["in"].data_ptr()
    assert site.get("in", torch.tensor([1, 0])).tolist() == [[2.0], [1.0]]


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


def test_fedrep_embeds_each_test_sample_once_and_local_scores_come_from_the_full_split(
    tiny, monkeypatch
):
    """A forward whose prompts equal those stored for its samples is taken whole from the
    first client's (not even the patch embedding runs again); each participant's local counts
    and ECE equal a separate local pass's (`full_split="none"` scores the local sets alone)."""
    _, task, method = tiny("fedrep")
    server = _perturbed(seeded_server(method), ("head_w", "head_b"))
    embedded = [0]
    method.backbone.vit.patch_embed.register_forward_hook(
        lambda mod, args, out: embedded.__setitem__(0, embedded[0] + args[0].shape[0])
    )
    got = evaluate(method, server, task, batch_size=16)
    assert embedded == [len(task.data.test_labels)]
    alone = evaluate(method, server, task, batch_size=16, full_split="none")
    for f in ("correct_local", "ece_local"):
        np.testing.assert_array_equal(getattr(got, f), getattr(alone, f), err_msg=f)


def test_clip_text_features_run_once_per_chunk_and_block(tiny, monkeypatch):
    """CLIP's text encoder keeps its last call within an evaluation: the clients of a chunk
    (stacked contexts) scored on a block of the full split encode their prompts once, not once
    per client, and the scores are bit for bit those computed without (`last_call` off)."""
    import fpbench.backbones.clip as clip_module

    _, task, method = tiny("coop-local")
    server = _perturbed(seeded_server(method), ("ctx",))
    calls = [0]
    inner = type(method.backbone)._encode_prompts

    def counted(self, *args):
        calls[0] += 1
        return inner(self, *args)

    monkeypatch.setattr(type(method.backbone), "_encode_prompts", counted)
    got = evaluate(method, server, task, batch_size=64)
    participants = int((~task.heldout).sum())
    assert len(task.data.test_labels) <= 64 and participants == 3  # one block, chunks of 2
    assert calls == [2]
    with monkeypatch.context() as m:
        m.setattr(clip_module, "last_call", lambda key, inputs, fn: fn())
        calls[0] = 0
        _same(got, evaluate(method, server, task, batch_size=64))
    assert calls == [participants]


def test_one_row_expanded_is_compared_once_and_stays_exact():
    """A site stored from one row expanded (stride 0) compares a later expanded value by that
    row alone; a store of any other rows drops the shortcut, so comparisons stay per item."""
    shared = SharedStates(torch.arange(4), 4)
    site = shared.site(1, 1)
    row = torch.tensor([[1.0, 2.0]])
    assert site.store("p", torch.tensor([0, 1]), row.expand(2, 2))
    site.filled[:2] = True
    assert torch.equal(site.uniform["p"], row[0])
    known = torch.tensor([True, True])
    assert site.same("p", torch.tensor([0, 1]), row.expand(2, 2), known).tolist() == [True] * 2
    other = torch.tensor([[1.0, 3.0]]).expand(2, 2)
    assert site.same("p", torch.tensor([0, 1]), other, known).tolist() == [False] * 2
    assert site.store("p", torch.tensor([2]), torch.tensor([[1.0, 2.0]]))  # a copy, not a view
    assert "p" not in site.uniform
    site.filled[2] = True
    three = torch.tensor([True] * 3)
    assert site.same("p", torch.tensor([0, 1, 2]), row.expand(3, 2), three).all()


def test_rows_of_expands_one_clients_row_only_without_gradients():
    from fpbench.methods.helpers import rows_of

    t = torch.arange(12.0).view(3, 4)
    same = torch.tensor([2, 2, 2])
    with torch.no_grad():
        one = rows_of(t, same)
        assert one.stride(0) == 0 and torch.equal(one, t[same])
        mixed = rows_of(t, torch.tensor([2, 0, 2]))
        assert mixed.stride(0) == 4 and torch.equal(mixed, t[torch.tensor([2, 0, 2])])
    assert rows_of(t, same).stride(0) == 4  # training: a gather (its backward a scatter)


def test_last_call_reuses_only_equal_inputs_within_an_evaluation_without_gradients():
    from fpbench.backbones.recall import evaluating, last_call

    calls: list[float] = []

    def fn(x):
        calls.append(float(x.sum()))
        return x * 2

    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])
    with torch.no_grad():
        last_call("k", (a,), lambda: fn(a))
        last_call("k", (a,), lambda: fn(a))
        assert calls == [3.0, 3.0]  # no evaluation: computed every time
        with evaluating():
            first = last_call("k", (a,), lambda: fn(a))
            again = last_call("k", (a.clone(),), lambda: fn(a))
            assert again is first and calls == [3.0, 3.0, 3.0]
            last_call("k", (b,), lambda: fn(b))  # other values
            last_call("k", (a.double(),), lambda: fn(a))  # other dtype
            last_call("j", (a.double(),), lambda: fn(a))  # other key
            assert calls == [3.0] * 3 + [4.0, 3.0, 3.0]
            a.add_(1.0)  # the kept inputs are copies: an in-place change is seen
            last_call("k", (a,), lambda: fn(a))
            assert calls[-1] == 5.0
    with evaluating():
        last_call("k", (a,), lambda: fn(a))
        last_call("k", (a,), lambda: fn(a))
    assert calls[-2:] == [5.0, 5.0]  # with gradients: computed
