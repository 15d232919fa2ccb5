"""UOPP: class sums, the dual head and the prototypes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.uopp import class_sums, dual_head

from ..conftest import seeded_server
from .common import features_as_images


def test_class_sums_by_hand():
    feats = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [1.0, 1.0]])
    labels, rows = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 0])
    sums, counts = class_sums(feats, labels, rows, rows=2, num_classes=2)
    assert sums.tolist() == [[[1.0, 0.0], [1.0, 3.0]], [[3.0, 3.0], [0.0, 0.0]]]
    assert counts.tolist() == [[1.0, 2.0], [1.0, 0.0]]


def test_dual_head_takes_the_more_confident_head_per_sample():
    prompt = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    proto = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.0, 5.0, 0.0]])  # row 2: a tie
    out = dual_head(prompt, proto)
    assert torch.equal(out, torch.stack([prompt[0], proto[1], prompt[2]]))


def test_uopp_prototypes_are_count_weighted_and_added_once(tiny):
    _, task, method = tiny("uopp")
    server = seeded_server(method)
    c, e = task.data.num_classes, method.backbone.embed_dim
    sums = torch.zeros(2, c, e)
    sums[0, 0, 0], sums[1, 0, 1], sums[1, 2, 2] = 3.0, 1.0, 2.0  # class 0 from both clients
    counts = torch.zeros(2, c)
    counts[0, 0], counts[1, 0], counts[1, 2] = 3.0, 1.0, 2.0
    trained = {"ctx": torch.stack([torch.full_like(server.params["ctx"], v) for v in (1.0, 4.0)])}
    stats = {"proto_sum": sums, "proto_count": counts}
    ids = torch.tensor([0, 2])
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0]), stats))
    torch.testing.assert_close(new.params["ctx"], torch.full_like(server.params["ctx"], 1.75))
    proto = new.buffers["prototypes"]
    torch.testing.assert_close(proto[0, :2], F.normalize(torch.tensor([3.0, 1.0]) / 4, dim=0))
    torch.testing.assert_close(proto[2, 2], torch.tensor(1.0))
    assert proto[1].abs().sum() == 0 and new.buffers["proto_seen"].tolist() == [1, 0, 1, 0]
    again = method.aggregate(new, Updates(trained, ids, torch.tensor([30.0, 10.0]), stats))
    assert torch.equal(again.buffers["proto_count"], new.buffers["proto_count"])  # not re-added
    down, up = method.communication(again)
    assert set(down) == {"ctx", "prototypes"} and set(up) == {"ctx", "proto_sum", "proto_count"}


def test_uopp_eval_uses_the_prototype_head_where_confident(tiny, monkeypatch):
    _, task, method = tiny("uopp")
    features_as_images(monkeypatch, method)
    server = seeded_server(method)
    feats = torch.randn(5, method.backbone.embed_dim, generator=torch.Generator().manual_seed(1))
    protos = F.normalize(feats[:3], dim=-1)  # samples 0..2 are their own class prototype
    server.buffers["prototypes"] = torch.cat([protos, torch.zeros(task.data.num_classes - 3, 32)])
    params = method.client_params(server, torch.tensor([0]), training=False)
    rows = torch.zeros(5, dtype=torch.long)
    train_logits = method.forward(params, feats, rows, Context(training=True))
    logits = method.forward(params, feats, rows, Context(training=False, buffers=server.buffers))
    proto_logits = (
        method.backbone.logit_scale * F.normalize(feats, dim=-1) @ server.buffers["prototypes"].T
    )
    valid = torch.arange(task.data.num_classes) < 3  # classes with a prototype
    torch.testing.assert_close(logits, dual_head(train_logits, proto_logits, valid))
    y = torch.arange(5) % 3
    out = method.forward(params, feats, rows, Context(training=True, labels=y))
    torch.testing.assert_close(out.logits, train_logits)  # the prompt head alone
    loss, stats = training_loss(out, y)
    torch.testing.assert_close(loss, F.cross_entropy(train_logits, y, reduction="none"))
    c = task.data.num_classes
    sums, counts = class_sums(F.normalize(feats, dim=-1), y, rows, 1, c)
    torch.testing.assert_close(stats["proto_sum"], sums)  # the forward returns what it records
    assert torch.equal(stats["proto_count"], counts)
