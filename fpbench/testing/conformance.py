"""The checks every method passes, as functions of the `tiny` fixture and a method name, and
`MethodConformance`, a test class that runs them all on one method."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fpbench.engine.executor import LocalResult, train_clients
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.engine.numerics import cell_numerics
from fpbench.methods.base import Updates
from fpbench.testing.tiny import seeded_server

Tiny = Callable  # the `tiny` fixture: tiny(method, **train) -> (cfg, task, method)


def _round(method, task, cfg, executor: str, server=None, lockstep_samples=None) -> tuple:
    """One round of local training in the cell's numerics, as the runner computes it (without
    them, CPU matmuls may round differently from one call to the next)."""
    server = server or seeded_server(method)
    ids = task.trainable_clients()
    with cell_numerics(cfg):
        local = train_clients(
            method, server, task, ids, cfg.train, round_idx=0, seed=cfg.seed, executor=executor,
            lockstep_samples=lockstep_samples,
        )  # fmt: skip
    return server, local


def check_executors_agree(tiny: Tiny, name: str) -> None:
    """The reference executor (one client at a time) and the lockstep one (all clients of the
    round in one pass, or in chunks of whole clients: `lockstep_samples`) give the same
    parameters, losses and statistics."""
    cfg, task, method = tiny(name, local_epochs=2, weight_decay=1e-3, grad_clip=1.0)
    server, ref = _round(method, task, cfg, "reference")
    _, lock = _round(method, task, cfg, "lockstep", server)
    _, chunked = _round(method, task, cfg, "lockstep", server, lockstep_samples=1)
    for other in (lock, chunked):  # chunked: every client's batch a forward of its own
        assert ref.client_ids.tolist() == other.client_ids.tolist()
        for k in ref.params:
            torch.testing.assert_close(other.params[k], ref.params[k], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(other.loss, ref.loss, atol=1e-5, rtol=1e-5)
        assert ref.stats.keys() == other.stats.keys()
    for k in lock.stats:  # both lockstep: every client's statistics in the one round's sums
        torch.testing.assert_close(chunked.stats[k], lock.stats[k], atol=1e-5, rtol=1e-5)


def check_recalled_equals_recomputed(tiny: Tiny, name: str) -> None:
    """What the backbone recalls (run-level frozen work from the store, a phase's kept hidden
    states) changes nothing: one round with both trains the same parameters as one that
    recomputes everything at every step, and evaluation predicts the same.

    Up to float rounding: kept values were computed in other batches (the store's canonical
    units, the phase's first epoch) than the recomputing run's, and a matrix product's last bit
    may depend on its batch. A run with the same store gives the same bits every time.
    """
    from fpbench.engine.evaluate import evaluate

    cfg, task, method = tiny(name, local_epochs=2, weight_decay=1e-3, grad_clip=1.0)
    server = seeded_server(method)
    ids = task.trainable_clients()
    recalled = Inputs.of(method, task, FeatureCache(), batch_size=16)
    runs = [
        train_clients(
            method, server, task, ids, cfg.train, round_idx=0, seed=0, inputs=inputs,
            reuse_frozen=reuse,
        )
        for inputs, reuse in ((Inputs.of(method, task), False), (recalled, True))
    ]  # fmt: skip
    for k in runs[0].params:
        torch.testing.assert_close(runs[1].params[k], runs[0].params[k], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runs[1].loss, runs[0].loss, atol=1e-5, rtol=1e-5)
    assert runs[1].stats.keys() == runs[0].stats.keys()
    for k in runs[0].stats:
        torch.testing.assert_close(runs[1].stats[k], runs[0].stats[k])
    counts = [
        evaluate(method, server, task, 16, inputs)
        for inputs in (Inputs.of(method, task, batch_size=16), recalled)
    ]
    assert (counts[1].correct_local == counts[0].correct_local).all()


def check_round(tiny: Tiny, name: str) -> LocalResult:
    """One lockstep round trains exactly the tensors its phases name, leaves the backbone
    untouched and is deterministic; `aggregate` keeps the server state's shapes."""
    cfg, task, method = tiny(name)
    before = {k: v.clone() for k, v in method.backbone.state_dict().items()}
    server, local = _round(method, task, cfg, "lockstep")
    for k, v in method.backbone.state_dict().items():
        assert torch.equal(v, before[k]), f"backbone tensor {k} changed"
    assert torch.isfinite(local.loss).all()
    start = method.client_params(server, local.client_ids)
    trainable = {n for phase in method.phases(cfg.train.local_epochs, tuple(start))
                 for n in phase.trainable}  # fmt: skip
    assert trainable or not start, "no phase trains anything"  # zero-shot has nothing to train
    for k in start:  # each tensor a phase trains moves; every other one stays put
        moved = not torch.equal(start[k], local.params[k])
        assert moved == (k in trainable), f"{k}: trainable={k in trainable}, moved={moved}"
    _, again = _round(method, task, cfg, "lockstep", server)  # same seed, same result
    for k in local.params:
        assert torch.equal(again.params[k], local.params[k])
    weights = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, weights, local.stats))
    for part in ("params", "personal", "buffers"):
        old, cur = getattr(server, part), getattr(new, part)
        assert {k: v.shape for k, v in old.items()} == {k: v.shape for k, v in cur.items()}
    return local


def check_only_declared_tensors_are_communicated(tiny: Tiny, name: str) -> None:
    """`communication` sends only server state or shared trained tensors, never personal ones."""
    _, _, method = tiny(name)
    server = seeded_server(method)
    down, up = method.communication(server)
    # server state, or a non-personal tensor a client trains (e.g. generated prompts, their deltas)
    trained = method.client_params(server, torch.tensor([0]))
    declared = set(server.params) | set(server.buffers) | (set(trained) - method.personal)
    assert set(down) <= declared and set(up) <= declared
    assert not (set(down) | set(up)) & (set(server.personal) | method.personal)


class MethodConformance:
    """Every conformance check on the registered method `method`: subclass it as `Test...` in a
    test module and set `method`; the `tiny` fixture comes from `fpbench.testing` (see there)."""

    method: str

    def test_executors_agree(self, tiny: Tiny) -> None:
        check_executors_agree(tiny, self.method)

    def test_recalled_equals_recomputed(self, tiny: Tiny) -> None:
        check_recalled_equals_recomputed(tiny, self.method)

    def test_a_round_trains_is_deterministic_and_keeps_the_backbone(self, tiny: Tiny) -> None:
        check_round(tiny, self.method)

    def test_only_declared_tensors_are_communicated(self, tiny: Tiny) -> None:
        check_only_declared_tensors_are_communicated(tiny, self.method)
