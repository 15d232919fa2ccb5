"""Method conformance: every registered method, picked up automatically (the checks are
`fpbench.testing`'s, which plugin authors run on their own methods)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fpbench.engine.inputs import FeatureCache, Inputs, owners
from fpbench.methods.base import (
    Context,
    Method,
    Output,
    Phase,
    ServerState,
    Updates,
    as_logits,
    training_loss,
)
from fpbench.methods.helpers import per_client_linear, weighted_mean
from fpbench.registry import METHODS
from fpbench.testing import (
    check_executors_agree,
    check_only_declared_tensors_are_communicated,
    check_recalled_equals_recomputed,
    check_round,
    seeded_server,
)

ALL = METHODS.names()


@pytest.mark.parametrize("name", ALL)
def test_reference_and_lockstep_executors_agree(tiny, name):
    check_executors_agree(tiny, name)


@pytest.mark.parametrize("name", ALL)
def test_recalled_equals_recomputed(tiny, name):
    check_recalled_equals_recomputed(tiny, name)


@pytest.mark.parametrize("name", ALL)
def test_a_round_trains_is_deterministic_and_keeps_the_backbone(tiny, name):
    check_round(tiny, name)


@pytest.mark.parametrize("name", ALL)
def test_only_declared_tensors_are_communicated(tiny, name):
    check_only_declared_tensors_are_communicated(tiny, name)


def test_fedavg_is_sample_weighted_mean(tiny):
    _, _, method = tiny("fedvpt")
    server = seeded_server(method)
    trained = {
        k: torch.stack([torch.full_like(v, 1.0), torch.full_like(v, 4.0)])
        for k, v in server.params.items()
    }
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]), {})
    )
    for v in new.params.values():  # (30 * 1 + 10 * 4) / 40 = 1.75
        torch.testing.assert_close(v, torch.full_like(v, 1.75))


def test_local_writes_back_personal_rows_only(tiny):
    _, task, method = tiny("local")
    server = seeded_server(method)
    assert server.params == {}
    rows = {k: torch.stack([torch.full_like(v[0], 7.0)]) for k, v in server.personal.items()}
    new = method.aggregate(server, Updates(rows, torch.tensor([1]), torch.tensor([5.0]), {}))
    for k, v in new.personal.items():
        assert torch.equal(v[1], torch.full_like(v[1], 7.0))
        assert torch.equal(v[0], server.personal[k][0])
    assert method.communication(new) == ({}, {})


def test_per_client_linear_gathers_each_samples_head():
    feats = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.stack([torch.eye(2), 2 * torch.eye(2)])  # (K=2, C=2, d=2)
    b = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    out = per_client_linear(feats, w, b, torch.tensor([1, 0]))
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0], [3.0, 5.0]]))


def test_weighted_mean():
    stacked = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    torch.testing.assert_close(
        weighted_mean(stacked, torch.tensor([0.25, 0.75])), torch.tensor([2.5, 5.0])
    )


def test_head_tune_is_a_linear_head_on_recalled_frozen_cls(tiny):
    _, task, method = tiny("head-tune")
    server = seeded_server(method)
    assert set(server.params) == {"head_w", "head_b"}
    idx = torch.arange(3)
    inputs = Inputs.of(method, task, FeatureCache(), batch_size=2)
    x = inputs.train(idx)
    cls = method.backbone.forward_features(x).cls  # outside a batch: computed
    params = method.client_params(server, torch.tensor([0]))
    rows, ctx = torch.zeros(3, dtype=torch.long), Context(training=True)
    with inputs.recall(x, "train", idx):
        logits = method.forward(params, x, rows, ctx)
    assert [s.what for s in inputs.frozen_splits()] == ["cls (train)"]  # found, not declared
    stored = inputs.frozen_splits()[0]
    owner = owners(len(task.data.train_labels), task.train_idx)
    units = owner[idx].unique()  # the owner clients' canonical units, each computed once
    assert stored.computed == int(torch.isin(owner, units).sum())
    torch.testing.assert_close(stored[idx], cls)
    torch.testing.assert_close(logits, cls @ server.params["head_w"].T + server.params["head_b"])
    with inputs.recall(x.clone(), "train", idx):  # not the engine's tensor: nothing recalled
        method.forward(params, x, rows, ctx)
    assert stored.computed == int(torch.isin(owner, units).sum())


def test_feature_cache_computes_once_and_persists(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return torch.arange(6.0).view(3, 2)

    cache = FeatureCache(tmp_path)
    a = cache.get("k", compute, torch.device("cpu"))
    b = cache.get("k", compute, torch.device("cpu"))
    c = FeatureCache(tmp_path).get("k", compute, torch.device("cpu"))  # a new process: from disk
    assert len(calls) == 1 and torch.equal(a, b) and torch.equal(a, c)


def test_server_state_round_trips():
    s = ServerState({"a": torch.ones(2)}, {"b": torch.zeros(3, 2)}, {"c": torch.arange(3)})
    t = ServerState.from_state_dict(s.state_dict())
    assert torch.equal(t.params["a"], s.params["a"]) and torch.equal(t.buffers["c"], s.buffers["c"])


class _TwoLogits(Method):
    name = "two-logits"

    def forward(self, params, x, client_index, ctx):
        logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        return Output(logits, torch.tensor([0.5, 1.5])) if ctx.training else logits


def test_default_loss_is_cross_entropy_plus_the_forwards_aux_loss():
    method = _TwoLogits.__new__(_TwoLogits)  # its forward needs no backbone
    y, rows = torch.tensor([0, 0]), torch.zeros(2, dtype=torch.long)
    ce = torch.tensor([math.log(1 + math.exp(-2.0)), math.log(1 + math.exp(1.0))])
    train = method.forward({}, torch.empty(2), rows, Context(training=True, labels=y))
    loss, stats = training_loss(train, y)
    torch.testing.assert_close(loss, ce + torch.tensor([0.5, 1.5]))
    assert stats == {}
    test = method.forward({}, torch.empty(2), rows, Context(training=False))
    torch.testing.assert_close(training_loss(test, y)[0], ce)  # bare logits: cross-entropy
    assert torch.equal(as_logits(train), train.logits)


def test_a_forwards_own_loss_replaces_cross_entropy_and_keeps_its_stats():
    y = torch.tensor([0, 1])
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    counts = {"seen": torch.tensor([2.0])}
    loss, stats = training_loss(Output(logits, stats=counts, loss=torch.tensor([3.0, 4.0])), y)
    assert loss.tolist() == [3.0, 4.0] and stats is counts
    loss, _ = training_loss(Output(None, loss=torch.tensor([0.0, 7.0])), y)  # no logits needed
    assert loss.tolist() == [0.0, 7.0]


def test_a_forwards_loss_is_refused_beside_aux_loss_or_in_another_shape():
    y, logits = torch.tensor([0, 1]), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="both `loss` and `aux_loss`"):
        training_loss(Output(logits, torch.ones(2), loss=torch.ones(2)), y)
    with pytest.raises(ValueError, match=re.escape("per sample, shape (2,); got ()")):
        training_loss(Output(logits, loss=torch.tensor(1.0)), y)
    with pytest.raises(ValueError, match="neither logits nor a training loss"):
        training_loss(Output(None), y)
    with pytest.raises(ValueError, match="no logits"):
        as_logits(Output(None, loss=torch.ones(2)))


def test_every_method_declares_its_backbone_family():
    families = {name: METHODS.get(name).backbone_family for name in ALL}
    assert Method.backbone_family == "vit"
    assert set(families.values()) <= {"vit", "clip"}
    assert families["promptfl"] == families["coop-local"] == "clip" and families["fedvpt"] == "vit"


def test_a_phase_checks_its_own_optimisers():
    Phase("local", ("a",), 1, {"a": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}})
    with pytest.raises(ValueError, match="takes optimizer and lr"):
        Phase("local", ("a",), 1, {"a": {"optimizer": "sgd"}})
    with pytest.raises(ValueError, match="takes optimizer and lr"):
        Phase("local", ("a",), 1, {"a": {"optimizer": "sgd", "lr": 0.1, "betas": (0.9, 0.99)}})
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        Phase("local", ("a",), 1, {"a": {"optimizer": "rmsprop", "lr": 0.1}})


def test_a_client_params_override_must_take_the_draw():
    """Evaluation hands `client_params` a `draw`: an override without it is refused when its
    class is made, not at the first evaluation; one taking it (or **kwargs) is accepted."""
    with pytest.raises(TypeError, match=re.escape("Old.client_params must take `draw=None`")):
        type("Old", (Method,), {"client_params": lambda self, server, ids, training=True: {}})
    for ok in (lambda self, s, i, training=True, draw=None: {}, lambda self, s, i, **kw: {}):
        type("New", (Method,), {"client_params": ok})


def test_a_config_with_presets_applies_them_and_must_declare_the_field():
    from typing import ClassVar

    from fpbench.methods.base import MethodConfig

    class Rows(MethodConfig):
        PRESETS: ClassVar[dict[str, dict[str, int]]] = {"table2": {"a": 3, "b": 4}}
        preset: str | None = None
        a: int = 1
        b: int = 2

    assert Rows(preset="table2", b=5).model_dump() == {"preset": "table2", "a": 3, "b": 5}
    assert Rows().model_dump() == {"preset": None, "a": 1, "b": 2}
    with pytest.raises(ValueError, match="unknown preset 'table9'; valid: table2"):
        Rows(preset="table9")
    with pytest.raises(TypeError, match=re.escape("declare `preset: str | None = None`")):

        class NoField(MethodConfig):  # noqa: F841
            PRESETS: ClassVar[dict[str, dict[str, int]]] = {"table2": {"a": 3}}
            a: int = 1
