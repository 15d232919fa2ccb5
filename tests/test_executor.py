"""Local training (`fpbench.engine.executor`) checked directly, on a fake method with one
parameter per client (loss w * x on inputs x = index + 1, so its gradient is x): which batches
each client gets (from its own seed), what context and rows a step hands the method, the
updates and mean losses that come back (hand-computed), the step budget, a phase that trains
nothing, and the statistics recorded. The tiny federation's lockstep = reference equality is
in tests/methods/."""

from __future__ import annotations

import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from fpbench.engine.augment import uniforms
from fpbench.engine.executor import (
    LocalResult,
    chunk_rows,
    concat_results,
    epoch_factor,
    phase_optimizer,
    record,
    round_lr,
    train_clients,
)
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.methods.base import Output, Phase, ServerState
from fpbench.specs import TrainConfig


class _Inputs:
    """x = index + 1, one feature; records the indices asked and the recalls."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []
        self.recalls: list[tuple] = []

    def train(self, idx, augmentation=None):
        self.asked.append(idx.tolist())
        return (idx.float() + 1)[:, None]

    def recall(self, x, split, idx, rows, hidden):
        self.recalls.append((split, idx.tolist(), rows.tolist(), hidden, x))
        return nullcontext()


class _Method:
    """w: one scalar per client (personal), its forward's training loss w * x + b
    (`Output.loss`, no logits); optional second phase and stats."""

    def __init__(self, phases=None, stats: bool = False) -> None:
        self.calls: list[dict] = []
        self._phases = phases
        self.stats = stats

    def client_params(self, server, ids, training=True):
        return {"w": server.personal["w"][ids].clone(), "b": server.params["b"].expand(len(ids))}

    def phases(self, local_epochs, names):
        return self._phases or [Phase("local", ("w",), local_epochs)]

    def forward(self, params, x, rows, ctx):
        self.calls.append(
            {
                "x": x[:, 0].tolist(),
                "images": x,
                "labels": ctx.labels.tolist(),
                "rows": rows.tolist(),
                "ctx": ctx,
                "w": params["w"].detach().clone(),
                "grad": {n: p.requires_grad for n, p in params.items()},
                "autocast": torch.get_autocast_dtype("cpu")
                if torch.is_autocast_enabled("cpu")
                else None,
            }
        )
        loss = params["w"][rows] * x[:, 0] + params["b"][rows]  # the forward's training loss
        if self.stats:
            pair = torch.stack([x[:, 0].sum(), torch.tensor(1.0)])[None]  # (1, 2)
            return Output(None, stats={"seen": torch.ones(1) * len(rows),
                          "max_x": x[:, 0].max()[None], "pair": pair}, loss=loss)  # fmt: skip
        return Output(None, loss=loss)


def _task(train_idx: list[list[int]], n: int = 10):
    k = len(train_idx)
    return SimpleNamespace(
        priors=torch.arange(k * 2, dtype=torch.float).view(k, 2),
        train_idx=[torch.tensor(i, dtype=torch.long) for i in train_idx],
        data=SimpleNamespace(train_labels=torch.arange(n) % 2),
    )


def _server(k: int) -> ServerState:
    return ServerState(
        {"b": torch.tensor(0.0)},
        {"w": torch.arange(1, k + 1, dtype=torch.float)},
        {"m": torch.ones(2)},
    )


def _cfg(**kw) -> TrainConfig:
    base = {"batch_size": 2, "lr": 0.1, "momentum": 0.0, "rounds": 4, "local_epochs": 1}
    return TrainConfig(**{**base, **kw})


def _batches(idx: list[int], seed: int, rnd: int, c: int, phase: int, epoch: int, bs: int = 2):
    return [
        b.tolist()
        for b in client_batches(torch.tensor(idx), bs, derive_seed(seed, rnd, c, phase, epoch))
    ]


@pytest.mark.parametrize("executor", ["lockstep", "reference"])
def test_each_client_trains_on_its_own_seeded_batches_with_sgd(executor):
    """Clients 2 and 0 (in that order) of 3; client 2 has 3 samples, client 0 has 4."""
    task = _task([[0, 1, 2, 3], [4], [5, 6, 7]])
    method, inputs = _Method(), _Inputs()
    result = train_clients(
        method, _server(3), task, [2, 0], _cfg(), round_idx=1, seed=7,
        executor=executor, inputs=inputs, reuse_frozen=False,
    )  # fmt: skip
    b2, b0 = _batches([5, 6, 7], 7, 1, 2, 0, 0), _batches([0, 1, 2, 3], 7, 1, 0, 0, 0)
    assert [len(b) for b in b2] == [2, 1] and [len(b) for b in b0] == [2, 2]
    if executor == "lockstep":
        assert inputs.asked == [b2[0] + b0[0], b2[1] + b0[1]]
        assert [c["rows"] for c in method.calls] == [[0, 0, 1, 1], [0, 1, 1]]
    else:
        assert inputs.asked == [*b2, *b0]
        assert [c["rows"] for c in method.calls] == [[0, 0], [0], [0, 0], [0, 0]]
    assert result.client_ids.tolist() == [2, 0]
    # SGD on w with gradient mean(x) of each batch, x = index + 1: w -= 0.1 * mean per step
    want = {
        2: 3.0 - 0.1 * sum(sum(i + 1 for i in b) / len(b) for b in b2),
        0: 1.0 - 0.1 * sum(sum(i + 1 for i in b) / len(b) for b in b0),
    }
    assert result.params["w"].tolist() == pytest.approx([want[2], want[0]])
    assert result.params["b"].tolist() == [0.0, 0.0]  # not trained in the phase
    # the mean loss over a client's steps, each w * mean(x) with the w of that step
    w2, w0 = 3.0, 1.0
    losses2, losses0 = [], []
    for b in b2:
        losses2.append(w2 * sum(i + 1 for i in b) / len(b))
        w2 -= 0.1 * sum(i + 1 for i in b) / len(b)
    for b in b0:
        losses0.append(w0 * sum(i + 1 for i in b) / len(b))
        w0 -= 0.1 * sum(i + 1 for i in b) / len(b)
    assert result.loss.tolist() == pytest.approx([sum(losses2) / 2, sum(losses0) / 2])
    assert [c["labels"] for c in method.calls] == [[i % 2 for i in a] for a in inputs.asked]


def test_a_step_hands_the_method_its_context_labels_and_rows():
    task = _task([[0, 1], [2, 3, 4]])
    method, inputs = _Method(), _Inputs()
    server = _server(2)
    result = train_clients(
        method, server, task, [1, 0], _cfg(batch_size=4), round_idx=0, seed=0, inputs=inputs
    )
    (call,) = method.calls
    idx = inputs.asked[0]
    assert sorted(idx[:3]) == [2, 3, 4] and sorted(idx[3:]) == [0, 1]
    assert call["labels"] == [i % 2 for i in idx] and call["rows"] == [0, 0, 0, 1, 1]
    ctx = call["ctx"]
    assert (ctx.training, ctx.phase) == (True, "local")
    assert ctx.priors.tolist() == [[2.0, 3.0], [0.0, 1.0]]  # the rows' clients' priors
    assert dict(ctx.buffers) == {"m": server.buffers["m"]} and dict(ctx.earlier) == {}
    assert ctx.labels.tolist() == call["labels"]
    assert call["grad"] == {"w": True, "b": False}
    assert inputs.recalls[0][:3] == ("train", idx, [0, 0, 0, 1, 1])
    assert call["autocast"] is None and inputs.recalls[0][4] is call["images"]  # its batch
    # one step each: client 1 (w 2, x 3, 4, 5) 2 * 4 = 8, client 0 (w 1, x 1, 2) 1.5
    assert result.loss.tolist() == [8.0, 1.5]


def test_bf16_trains_under_autocast_on_the_tasks_device():
    method = _Method()
    train_clients(method, _server(1), _task([[0]]), [0], _cfg(), round_idx=0, seed=0,
                  inputs=_Inputs(), precision="bf16")  # fmt: skip
    assert method.calls[0]["autocast"] == torch.bfloat16


class _AugInputs(_Inputs):
    def train(self, idx, augmentation=None):
        self.augmentation = augmentation
        return super().train(idx)


def test_augmentation_gives_each_sample_its_view_from_its_clients_epoch_seed():
    """Views are drawn from (the row's epoch seed, the sample's index); no frozen work is
    recalled (an augmented image is not the stored one)."""
    task = _task([[0, 1], [2, 3]])
    aug = {"hflip": True}
    method, inputs = _Method(), _AugInputs()
    train_clients(method, _server(2), task, [1, 0], _cfg(batch_size=2, augment=aug),
                  round_idx=2, seed=5, inputs=inputs)  # fmt: skip
    cfg, draws = inputs.augmentation
    assert cfg == _cfg(augment=aug).augment and inputs.recalls == []
    (call,) = method.calls
    assert call["ctx"].training and call["ctx"].phase == "local"
    assert call["labels"] == [i % 2 for i in inputs.asked[0]] and call["rows"] == [0, 0, 1, 1]
    seeds = [derive_seed(5, 2, c, 0, 0) for c in (1, 0)]
    idx = torch.tensor(inputs.asked[0])
    rows = torch.tensor([0, 0, 1, 1])
    assert torch.equal(draws, uniforms(torch.tensor(seeds)[rows], idx, 2))


def test_without_reuse_or_with_augmentation_no_hidden_states_are_kept():
    task = _task([[0, 1], [2, 3]])
    inputs = _Inputs()
    train_clients(_Method(), _server(2), task, [0, 1], _cfg(), round_idx=0, seed=0, inputs=inputs)
    assert inputs.recalls[0][3] is not None  # reuse_frozen: the phase's states
    states = inputs.recalls[0][3]
    assert states.slot.tolist() == [[0, 1] + [-1] * 8, [-1, -1, 2, 3] + [-1] * 6]
    inputs = _Inputs()
    train_clients(
        _Method(), _server(2), task, [0, 1], _cfg(), round_idx=0, seed=0, inputs=inputs,
        reuse_frozen=False,
    )  # fmt: skip
    assert inputs.recalls[0][3] is None


def test_the_reference_executor_hands_each_client_the_earlier_clients_stats():
    task = _task([[0], [1], [2]])
    method = _Method(stats=True)
    result = train_clients(
        method, _server(3), task, [0, 1, 2], _cfg(), round_idx=0, seed=0,
        executor="reference", inputs=_Inputs(),
    )  # fmt: skip
    earlier = [{k: v.tolist() for k, v in c["ctx"].earlier.items()} for c in method.calls]
    assert earlier == [
        {},
        {"seen": 1.0, "max_x": 1.0, "pair": [1.0, 1.0]},
        {"seen": 2.0, "max_x": 3.0, "pair": [3.0, 2.0]},
    ]  # summed over the clients before, each statistic keeping its own shape
    assert result.stats["seen"].tolist() == [1.0, 1.0, 1.0]
    assert result.stats["max_x"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="^unknown executor 'serial'$"):
        train_clients(method, _server(3), task, [0], _cfg(), round_idx=0, seed=0,
                      executor="serial", inputs=_Inputs())  # fmt: skip


def test_the_step_budget_spans_the_epochs():
    """Client 0 has 4 samples (2 batches an epoch), client 1 has 2 (1 batch); a cap of 3 steps
    over 2 epochs: client 0 takes 2 then 1, client 1 takes 1 then 1."""
    task = _task([[0, 1, 2, 3], [4, 5]])
    method, inputs = _Method(), _Inputs()
    result = train_clients(
        method, _server(2), task, [0, 1], _cfg(max_local_steps=3, local_epochs=2),
        round_idx=0, seed=3, inputs=inputs,
    )  # fmt: skip
    assert [c["rows"] for c in method.calls] == [[0, 0, 1, 1], [0, 0], [0, 0, 1, 1]]
    e0 = _batches([0, 1, 2, 3], 3, 0, 0, 0, 0)
    e1 = _batches([0, 1, 2, 3], 3, 0, 0, 0, 1)
    assert inputs.asked[0][:2] == e0[0] and inputs.asked[1] == e0[1]
    assert inputs.asked[2][:2] == e1[0]
    assert result.params["w"][0].item() == pytest.approx(
        1.0 - 0.1 * sum(sum(i + 1 for i in b) / 2 for b in [*e0, e1[0]])
    )
    assert result.params["w"][1].item() == pytest.approx(2.0 - 0.1 * 5.5 * 2)
    assert result.loss[1].item() == pytest.approx((2.0 * 5.5 + 1.45 * 5.5) / 2)  # its 2 steps


def test_a_phase_that_trains_nothing_scores_its_batches_and_counts_their_loss():
    """Client 1 ([4, 5], x = 5, 6): a train step at w = 2 (loss 11, w -> 2 - 0.1 * 5.5 =
    1.45), then a scoring step at w = 1.45 (loss 7.975): mean loss 9.4875, w stays 1.45."""
    task = _task([[0, 1], [4, 5]])
    phases = [Phase("local", ("w",), 1), Phase("score", (), 1)]
    method = _Method(phases=phases)
    result = train_clients(
        method, _server(2), task, [1], _cfg(batch_size=4), round_idx=0, seed=3, inputs=_Inputs()
    )
    assert [c["ctx"].phase for c in method.calls] == ["local", "score"]
    assert [c["grad"] for c in method.calls] == [{"w": True, "b": False}, {"w": False, "b": False}]
    assert method.calls[1]["w"].tolist() == pytest.approx([1.45])
    assert result.params["w"].tolist() == pytest.approx([1.45])
    assert result.loss.tolist() == pytest.approx([9.4875])


def test_cosine_local_scales_each_epochs_lr():
    """Two epochs of one batch: lr 0.1 then 0.1 * (1 + cos(pi / 2)) / 2 = 0.05."""
    task = _task([[0]])
    result = train_clients(
        _Method(), _server(1), task, [0], _cfg(lr_schedule="cosine-local", local_epochs=2),
        round_idx=3, seed=0, inputs=_Inputs(),
    )  # fmt: skip
    assert result.params["w"].tolist() == pytest.approx([1.0 - 0.1 - 0.05])


def test_round_lr_and_epoch_factor():
    assert round_lr(_cfg(lr_decay=0.5), 3) == pytest.approx(0.1 * 0.125)
    assert round_lr(_cfg(lr_schedule="cosine", rounds=4), 1) == pytest.approx(
        0.1 * 0.5 * (1 + math.cos(math.pi / 4))
    )
    assert round_lr(_cfg(lr_schedule="cosine-local", lr_decay=0.5), 3) == 0.1
    assert epoch_factor(_cfg(lr_schedule="cosine-local"), 1, 3) == pytest.approx(0.75)
    assert epoch_factor(_cfg(lr_schedule="cosine"), 1, 3) == 1.0


def test_a_tensors_own_optimizer_follows_the_rounds_lr_factor():
    cfg = _cfg(momentum=0.5, weight_decay=0.01, grad_clip=2.0)
    a, b = torch.zeros(2, 1), torch.zeros(2, 1)
    own = {"b": {"optimizer": "adam", "lr": 4.0, "momentum": 0.8, "weight_decay": 0.2}}
    group = phase_optimizer(cfg, [a, b], Phase("p", ("a", "b"), 1, own), lr=0.025)
    shared, mine = group.optimizers
    assert type(shared).__name__ == "StackedSGD" and shared.params == [a]
    assert (shared.lr, shared.momentum, shared.weight_decay, shared.grad_clip) == (
        0.025, 0.5, 0.01, 2.0,
    )  # fmt: skip
    assert type(mine).__name__ == "StackedAdam" and mine.params == [b]
    assert mine.lr == pytest.approx(1.0) and mine.betas == (0.8, 0.999)
    assert (mine.weight_decay, mine.grad_clip) == (0.2, 2.0)
    plain = {"b": {"optimizer": "sgd", "lr": 1.0}}
    (only,) = phase_optimizer(cfg, [b], Phase("p", ("b",), 1, plain), lr=0.1).optimizers
    assert (only.params, only.lr, only.momentum, only.weight_decay) == ([b], 1.0, 0.0, 0.0)


def test_concat_results_keeps_the_passes_order():
    one = LocalResult(torch.tensor([2]), {"w": torch.tensor([[1.0]])}, {"s": torch.tensor([[3.0]])},
                      torch.tensor([0.5]))  # fmt: skip
    two = LocalResult(torch.tensor([0, 1]), {"w": torch.tensor([[4.0], [5.0]])},
                      {"s": torch.tensor([[6.0], [7.0]])}, torch.tensor([0.25, 0.75]))  # fmt: skip
    both = concat_results([one, two])
    assert both.client_ids.tolist() == [2, 0, 1]
    assert both.params["w"].tolist() == [[1.0], [4.0], [5.0]]
    assert both.stats["s"].tolist() == [[3.0], [6.0], [7.0]]
    assert both.loss.tolist() == [0.5, 0.25, 0.75]
    assert concat_results([one]) is one


def test_record_sums_statistics_and_maximises_max_ones():
    stats: dict = {}
    record(stats, {"n": torch.tensor([1.0, 2.0]), "max_v": torch.tensor([3.0, 1.0])})
    record(stats, {"n": torch.tensor([1.0, 1.0]), "max_v": torch.tensor([2.0, 5.0])})
    assert stats["n"].tolist() == [2.0, 3.0] and stats["max_v"].tolist() == [3.0, 5.0]


def test_chunk_rows_cuts_whole_clients_up_to_the_limit():
    def b(*sizes):
        return [torch.arange(n) for n in sizes]

    batches = [b(3, 3), b(2), b(5, 1), [], b(4, 4)]  # rows' batch sizes per step; row 3 has none
    assert chunk_rows(batches, 0, None) == [[0, 1, 2, 4]]
    assert chunk_rows(batches, 0, 5) == [[0, 1], [2], [4]]  # 3 + 2, then 5, then 4
    assert chunk_rows(batches, 0, 4) == [[0], [1], [2], [4]]  # row 2's 5 samples alone
    assert chunk_rows(batches, 1, 5) == [[0, 2], [4]]  # step 1: rows 0, 2 and 4 (3 + 1, 4)
    assert chunk_rows(batches, 1, 100) == [[0, 2, 4]]
