"""`init_params` gives the trainable tensors or a whole `ServerState` (issue #32 folds the
`init_server` hook into it): the rule that makes either the server's state before round 1, and a
real run starting from it."""

from __future__ import annotations

import pytest
import torch

from fpbench.engine.runner import run_cell
from fpbench.engine.seeding import derive_seed
from fpbench.methods.base import Method, MethodConfig, ServerState, TaskInfo
from fpbench.methods.fedrep import FedRep
from fpbench.store import Store
from tests.conftest import tiny_config


class _Given(Method):
    """Returns the `start` it is given; `row` is kept per client."""

    name = "given"
    personal = frozenset({"row"})
    start: dict[str, torch.Tensor] | ServerState

    def init_params(self, gen: torch.Generator) -> dict[str, torch.Tensor] | ServerState:
        return self.start


def _given(start: dict[str, torch.Tensor] | ServerState, clients: int = 3) -> _Given:
    task = TaskInfo(2, clients, torch.full((clients, 2), 0.5), torch.ones(clients))
    method = _Given(MethodConfig(), None, task)
    method.start = start
    return method


def test_a_dict_is_split_into_global_params_and_one_row_per_client():
    shared, row = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    state = _given({"shared": shared, "row": row}).init_server(torch.Generator())
    assert list(state.params) == ["shared"] and state.params["shared"] is shared
    assert torch.equal(state.personal["row"], torch.tensor([[3.0, 4.0]] * 3))
    assert state.buffers == {}
    state.personal["row"][0] = 0.0  # each row its own memory, the initial tensor untouched
    assert state.personal["row"][1].tolist() == [3.0, 4.0] and row.tolist() == [3.0, 4.0]


def test_a_server_state_keeps_its_rows_and_buffers_and_copies_personal_params_into_rows():
    shared, row = torch.tensor([1.0]), torch.tensor([5.0, 6.0])
    own, buffer = torch.arange(3.0).view(3, 1), torch.tensor([7.0])
    start = ServerState({"shared": shared, "row": row}, {"own": own}, {"buffer": buffer})
    state = _given(start).init_server(torch.Generator())
    assert list(state.params) == ["shared"] and state.params["shared"] is shared
    assert list(state.personal) == ["own", "row"] and state.personal["own"] is own
    assert torch.equal(state.personal["row"], torch.tensor([[5.0, 6.0]] * 3))
    assert list(state.buffers) == ["buffer"] and state.buffers["buffer"] is buffer


def test_a_personal_tensor_given_both_as_param_and_as_rows_is_refused():
    start = ServerState({"row": torch.zeros(2)}, {"row": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"given\.init_params: \['row'\] given both as params"):
        _given(start).init_server(torch.Generator())


def test_a_run_starts_from_the_server_state_init_params_returns(tmp_path, monkeypatch):
    """FedRep's init_params, returned inside a `ServerState` with a buffer: round 0 aggregates
    onto its head rows (one per client) and prompts, and the buffer reaches the stored
    metrics through `round_metrics`."""
    plain = FedRep.init_params
    monkeypatch.setattr(
        FedRep,
        "init_params",
        lambda self, gen: ServerState(plain(self, gen), buffers={"mark": torch.tensor(7.5)}),
    )
    monkeypatch.setattr(
        FedRep,
        "round_metrics",
        lambda self, server, test=None: {"mark": float(server.buffers["mark"])},
    )
    aggregate, seen = FedRep.aggregate, []

    def spy(self, server, updates):
        seen.append((self, server))
        return aggregate(self, server, updates)

    monkeypatch.setattr(FedRep, "aggregate", spy)
    cfg = tiny_config("fedrep", rounds=2).model_copy(update={"seed": 3})
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        marks = store.metrics(names=["mark"], aggregate_only=False)
    assert marks["round"].tolist() == [0, 1] and marks["value"].tolist() == [7.5, 7.5]
    method, first = seen[0]
    want = plain(method, torch.Generator().manual_seed(derive_seed(3, "init-params")))
    n = method.task.num_clients
    assert set(first.params) == {"prompts"} and set(first.personal) == {"head_w", "head_b"}
    assert torch.equal(first.params["prompts"], want["prompts"])
    assert torch.equal(first.personal["head_w"], want["head_w"].expand(n, -1, -1))
    assert torch.equal(first.personal["head_b"], want["head_b"].expand(n, -1))
    assert torch.equal(first.buffers["mark"], torch.tensor(7.5))
