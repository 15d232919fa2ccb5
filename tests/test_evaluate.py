"""`evaluate` against a plain reference: each scored client's own forward over its local test set
and over the full test split, one client and one batch at a time, on the tiny federation.

The engine batches (several clients per forward, test samples in `batch_size` slices); the
reference does not, so a sample scored with another client's row, a client scored that should
not be (or the reverse), or a count stored under another client's id shows as a difference.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import numpy as np
import pytest
import torch

import fpbench.engine.evaluate as evaluation
from fpbench.engine.evaluate import evaluate
from fpbench.engine.inputs import Inputs
from fpbench.engine.metrics import expected_calibration_error, macro_f1
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context
from fpbench.methods.fedvpt import VPTModel
from fpbench.methods.per_fedavg import PerFedAvg
from fpbench.testing.tiny import seeded_server, with_config


def _differing(method, server, seed: int = 1):
    """The server with each client's personal rows (or the global params) perturbed, so the
    clients predict differently and a swapped row shows."""
    gen = torch.Generator().manual_seed(seed)
    for part in (server.personal, server.params):
        for k, v in part.items():
            if v.is_floating_point():
                part[k] = v + 0.5 * torch.randn(v.shape, generator=gen)
    return server


def _logits(method, server, task, row: int, idx: torch.Tensor) -> torch.Tensor:
    """fp32 logits of test samples idx with client `row`'s parameters, context and priors."""
    ids = torch.tensor([row])
    params = method.client_params(server, ids, training=False)
    ctx = Context(training=False, priors=task.priors[ids], buffers=server.buffers)
    x = method.backbone.preprocess(task.data.test_images[idx])
    with torch.no_grad():
        out = method.forward(params, x, torch.zeros(len(idx), dtype=torch.long), ctx)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def _scores(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, float, float, float]:
    """Correct count, accuracy, ECE and macro F1 of fp32 logits (M, C) against labels (M,)."""
    pred = logits.argmax(-1)
    hit = pred == labels
    conf = logits.softmax(-1).amax(-1)
    ece = expected_calibration_error(conf.numpy(), hit.numpy())
    f1 = macro_f1(pred.numpy(), labels.numpy(), logits.shape[1])
    return int(hit.sum()), hit.float().mean().item(), ece, f1


def _spied(monkeypatch, method, server) -> tuple[list, list]:
    """Record what `evaluate` asks `start_params` (client ids, keyword arguments) and the
    context of each forward, checking that every forward's context is an evaluation one
    carrying the server's buffers (a marker buffer is added)."""
    asked, contexts = [], []
    start_params, forward = evaluation.start_params, type(method).forward
    server.buffers["mark"] = torch.ones(1)

    def spy(method, server, ids, *args, **kwargs):
        asked.append((ids, kwargs))
        return start_params(method, server, ids, *args, **kwargs)

    def spy_forward(self, params, x, rows, ctx):
        assert ctx.training is False and ctx.buffers["mark"] is server.buffers["mark"]
        contexts.append(ctx)
        return forward(self, params, x, rows, ctx)

    monkeypatch.setattr(evaluation, "start_params", spy)
    monkeypatch.setattr(type(method), "forward", spy_forward)
    return asked, contexts


@pytest.mark.parametrize(
    "name, heldout_scored",
    [("local", False), ("pep-fedpt", True), ("p-pt", True), ("pfedpg", False)],
)
@pytest.mark.parametrize("batch_size", [64, 160])  # 2 clients per forward; all 4 in one
def test_per_client_evaluation_is_each_clients_own_forward(
    tiny, monkeypatch, name, heldout_scored, batch_size
):
    """Personal ("local", pFedPG), client-conditioned (PEP-FedPT) and personal-deploys (P-PT)
    methods: every client's local count and ECE from its own row; held-out clients scored
    locally only where the method can score a new client; the full test split (accuracy, F1,
    ECE) scored by the participants only, each with its own row. Batches of 64 test samples
    cut the clients' local sets and the full split across forwards. pFedPG starts a client's
    training from generated prompts, not from the prompts it evaluates with."""
    _, task, method = tiny(name)
    server = _differing(method, seeded_server(method))
    asked, _ = _spied(monkeypatch, method, server)
    ev = evaluate(method, server, task, batch_size=batch_size)
    assert {(kwargs["training"], *sorted(kwargs)) for _, kwargs in asked} == {
        (False, "draws", "training")
    }
    labels, n = task.data.test_labels, task.num_clients
    held = task.heldout.numpy()
    assert held.sum() == 1  # one held-out client: the check of who is scored has power
    everything = torch.arange(len(labels))
    want_correct, want_ece_local = np.zeros(n, dtype=np.int64), np.full(n, np.nan)
    want_acc, want_f1, want_ece = (np.full(n, np.nan) for _ in range(3))
    for c in range(n):
        if held[c] and not heldout_scored:
            continue
        idx = task.test_idx[c]
        want_correct[c], _, want_ece_local[c], _ = _scores(
            _logits(method, server, task, c, idx), labels[idx]
        )
        if not held[c]:
            _, want_acc[c], want_ece[c], want_f1[c] = _scores(
                _logits(method, server, task, c, everything), labels
            )
    assert ev.correct_local.tolist() == want_correct.tolist()
    assert ev.correct_local.dtype == np.int64  # counts
    assert ev.total_local.tolist() == [len(i) for i in task.test_idx]
    assert ev.heldout.tolist() == held.tolist()
    assert ev.heldout_applicable is heldout_scored
    assert ev.global_total == len(labels) == 36
    np.testing.assert_allclose(ev.ece_local, want_ece_local, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ev.global_acc, want_acc, rtol=1e-6)
    np.testing.assert_allclose(ev.f1_global, want_f1, rtol=1e-6)
    np.testing.assert_allclose(ev.ece_global, want_ece, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(ev.global_acc[~held], 6))) > 1  # the rows differ: a swap shows


def test_only_the_clients_asked_for_are_scored_and_a_held_out_one_on_its_local_set(tiny):
    """`clients=[a participant, the held-out one]` for PEP-FedPT: those two are scored (the
    held-out one on its local set only), every other client counts zero with NaN scores."""
    _, task, method = tiny("pep-fedpt")
    server = _differing(method, seeded_server(method))
    held = task.heldout.numpy()
    (out,) = np.flatnonzero(held).tolist()
    last = int(np.flatnonzero(~held)[-1])
    ev = evaluate(method, server, task, batch_size=32, clients=[last, out])  # one a forward
    labels = task.data.test_labels
    for c in range(task.num_clients):
        if c in (out, last):
            idx = task.test_idx[c]
            correct, _, ece, _ = _scores(_logits(method, server, task, c, idx), labels[idx])
            assert (ev.correct_local[c], ev.ece_local[c]) == (correct, pytest.approx(ece))
        else:
            assert ev.correct_local[c] == 0 and np.isnan(ev.ece_local[c])
    assert (~np.isnan(ev.global_acc)).tolist() == [c == last for c in range(task.num_clients)]
    everything = torch.arange(len(labels))
    _, acc, ece, f1 = _scores(_logits(method, server, task, last, everything), labels)
    scored = (ev.global_acc[last], ev.ece_global[last], ev.f1_global[last])
    assert scored == pytest.approx((acc, ece, f1))


@pytest.mark.parametrize("label_space", ["all", "client"])
def test_global_evaluation_is_one_forward_over_the_test_split(tiny, monkeypatch, label_space):
    """A global model (fedvpt), test split in batches of 7: accuracy, F1 and ECE over all of it
    (one value), and each client's local count and ECE read off the same predictions (masked to
    its train classes for `label_space="client"`)."""
    _, task, method = tiny("fedvpt")
    server = _differing(method, seeded_server(method))
    asked, contexts = _spied(monkeypatch, method, server)
    ev = evaluate(method, server, task, batch_size=7, label_space=label_space)
    # one model, as client row 0's evaluation parameters (long client ids)
    ((ids, kwargs),) = asked
    assert (ids.tolist(), ids.dtype, sorted(kwargs)) == ([0], torch.long, ["draws", "training"])
    assert kwargs["training"] is False
    with pytest.raises(FpbenchError, match='inference is "global"'):  # one model: no client data
        kwargs["draws"](ExitStack())(1)
    assert len(contexts) == 6  # 36 test samples in batches of 7
    labels = task.data.test_labels
    logits = _logits(method, server, task, 0, torch.arange(len(labels)))
    _, acc, ece, f1 = _scores(logits, labels)
    assert ev.global_total == len(labels) == 36 and ev.heldout_applicable
    assert (ev.global_acc.tolist(), ev.f1_global.tolist()) == ([pytest.approx(acc)], [f1])
    assert ev.ece_global.tolist() == [pytest.approx(ece)]
    for c, idx in enumerate(task.test_idx):
        own = logits[idx]
        if label_space == "client":
            own = own.masked_fill(~(task.priors[c] > 0), float("-inf"))
        correct, _, ece_c, _ = _scores(own, labels[idx])
        assert (ev.correct_local[c], ev.ece_local[c]) == (correct, pytest.approx(ece_c))
    assert ev.total_local.tolist() == [len(i) for i in task.test_idx]
    assert ev.heldout.tolist() == task.heldout.tolist()


@pytest.mark.parametrize("batch_size, chunks", [(64, [[1, 2], [3]]), (16, [[1], [2], [3]])])
def test_an_adapting_method_is_scored_after_its_step_on_each_clients_seeded_draw(
    tiny, monkeypatch, batch_size, chunks
):
    """Per-FedAvg adapts in its evaluation `client_params`: `draw(n)` hands it, for the chunk's
    clients in order, the first batch of `client_batches(train_idx[c], n, derive_seed("adapt",
    c))` (the preprocessed train images, recalled as train samples idx, their labels, each
    sample's row), and the scores are those of the adapted parameters. Clients go
    `batch_size // 32` to a forward (at least one)."""
    _, task, method = tiny("per-fedavg")
    n_batch = 5  # below a client's train size: the draw is one batch of 5 of its samples
    method = with_config(method, adapt_batch=n_batch)
    server = seeded_server(method)
    drawn, adapted = [], {}
    client_params = PerFedAvg.client_params

    def spy(self, server, ids, training=True, draw=None):
        def recorded(n):
            out = draw(n)
            drawn.append((n, *out))
            return out

        assert training is False and draw is not None  # evaluation hands a draw
        out = client_params(self, server, ids, training, recorded)
        adapted[len(drawn)] = out
        return out

    monkeypatch.setattr(PerFedAvg, "client_params", spy)
    inputs = Inputs.of(method, task)
    recall = inputs.recall
    recalls = []

    def spy_recall(x, split, idx, *args):
        recalls.append((x, split, idx))
        return recall(x, split, idx, *args)

    monkeypatch.setattr(inputs, "recall", spy_recall)
    ev = evaluate(method, server, task, batch_size=batch_size, inputs=inputs)
    assert [c for c in range(task.num_clients) if not task.heldout[c]] == [1, 2, 3]
    assert len(drawn) == len(adapted) == len(chunks)
    train_recalls = [r for r in recalls if r[1] == "train"]
    assert len(train_recalls) == len(chunks)
    for (x, _, idx), (_, drawn_x, _, _) in zip(train_recalls, drawn, strict=True):
        assert x is drawn_x and len(idx) == len(x)
    for chunk, (n, x, y, rows) in zip(chunks, drawn, strict=True):
        idx = torch.cat(
            [client_batches(task.train_idx[c], n_batch, derive_seed("adapt", c))[0] for c in chunk]
        )
        assert n == n_batch and len(idx) == n_batch * len(chunk)
        assert torch.equal(idx, next(r[2] for r in train_recalls if r[0] is x))
        assert torch.equal(x, inputs.train(idx))
        assert torch.equal(y, task.data.train_labels[idx])
        assert rows.tolist() == [r for r in range(len(chunk)) for _ in range(n_batch)]
    labels = task.data.test_labels
    for k, chunk in enumerate(chunks, start=1):
        for row, c in enumerate(chunk):
            params = {p: v[row : row + 1] for p, v in adapted[k].items()}
            start = client_params(method, server, torch.tensor([c]), training=False)
            assert not torch.equal(params["prompts"], start["prompts"])  # the step moved them
            idx = task.test_idx[c]
            x = method.backbone.preprocess(task.data.test_images[idx])
            with torch.no_grad():
                logits = method.forward(
                    params, x, torch.zeros(len(idx), dtype=torch.long), Context(training=False)
                )
            assert ev.correct_local[c] == int((logits.argmax(-1) == labels[idx]).sum())


def test_the_draw_holds_gradients_and_the_evaluations_autocast_until_client_params_returns(
    tiny, monkeypatch
):
    """In bf16: client_params runs outside autocast and without gradients until it draws;
    from the draw on, gradients are on and the evaluation's autocast applies; once it
    returns, the test forwards run under that autocast again, without gradients."""
    from fpbench.backbones.frozen_linear import _cpu_autocast

    _, task, method = tiny("per-fedavg")
    server = seeded_server(method)
    # the forward of the model under Per-FedAvg: its step and its test forwards both reach it
    seen, client_params, forward = [], PerFedAvg.client_params, VPTModel.forward

    def spy(self, server, ids, training=True, draw=None):
        def recorded(n):
            seen.append(("before", torch.is_grad_enabled(), _cpu_autocast()))
            out = draw(n)
            seen.append(("drawn", torch.is_grad_enabled(), _cpu_autocast()))
            return out

        return client_params(self, server, ids, training, recorded)

    def spy_forward(self, params, x, rows, ctx):
        seen.append(("forward", torch.is_grad_enabled(), _cpu_autocast()))
        return forward(self, params, x, rows, ctx)

    monkeypatch.setattr(PerFedAvg, "client_params", spy)
    monkeypatch.setattr(VPTModel, "forward", spy_forward)
    with torch.no_grad():
        evaluate(method, server, task, batch_size=16, precision="bf16", clients=[1])
    # the draw; the step's forward; the test forwards: local set and full split
    assert seen[:3] == [("before", False, False), ("drawn", True, True), ("forward", True, True)]
    assert set(seen[3:]) == {("forward", False, True)} and len(seen) > 3


def test_a_method_that_does_not_draw_loads_no_train_data(tiny, monkeypatch):
    """The draw is lazy: a personal method that never calls it (pFedPG) is evaluated without a
    train image read or a draw seeded."""
    _, task, method = tiny("pfedpg")
    inputs = Inputs.of(method, task)

    def refuse(*args):
        raise AssertionError("train data drawn")

    monkeypatch.setattr(evaluation, "client_batches", refuse)
    monkeypatch.setattr(inputs, "train", refuse)
    ev = evaluate(method, seeded_server(method), task, batch_size=64, inputs=inputs)
    assert ev.total_local.sum() == sum(len(i) for i in task.test_idx)


def test_empty_predictions_are_empty_tensors_of_the_index_type():
    """No test sample to predict: an empty (0,) long tensor and an empty float one."""
    idx = torch.zeros(0, dtype=torch.long)
    pred, conf = evaluation.predict(evaluation.Predictor(None, {}, None, None, 8), idx, idx)
    assert (pred.shape, pred.dtype, conf.shape, conf.dtype) == (
        (0,),
        torch.long,
        (0,),
        torch.float32,
    )


def test_flat_concatenates_the_parts_and_numbers_each_elements_part():
    flat, rows = evaluation._flat(
        [torch.tensor([4, 2]), torch.tensor([], dtype=torch.long), torch.tensor([7])]
    )
    assert (flat.tolist(), rows.tolist()) == ([4, 2, 7], [0, 0, 2])


@pytest.mark.parametrize("label_space", ["all", "client"])
def test_an_empty_test_split_counts_nothing_in_either_label_space(tiny, label_space):
    """No test sample (a split left empty): zero counts, NaN accuracy, F1 and ECE, not an
    error, with or without the clients' label spaces."""
    _, task, method = tiny("fedvpt")
    data = dataclasses.replace(
        task.data, test_images=task.data.test_images[:0], test_labels=task.data.test_labels[:0]
    )
    empty = dataclasses.replace(task, data=data, test_idx=[i[:0] for i in task.test_idx])
    ev = evaluate(method, seeded_server(method), empty, 7, label_space=label_space)
    assert (ev.correct_local.tolist(), ev.total_local.tolist(), ev.global_total) == (
        [0] * 4,
        [0] * 4,
        0,
    )
    assert np.isnan(ev.global_acc).tolist() == [True] and np.isnan(ev.f1_global).tolist() == [True]
    assert np.isnan(ev.ece_global).tolist() == [True]
    assert np.isnan(ev.ece_local).tolist() == [True] * 4
