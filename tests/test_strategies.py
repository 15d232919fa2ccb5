"""Federation strategies (`fpbench.strategies`): each server step and client term on tiny tensors
with values worked out by hand, then side by side with Flower's strategies and its SCAFFOLD /
FedProx baseline code (loaded by path from ../peer/flower; skipped without it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fpbench.errors import FpbenchError
from fpbench.methods.base import Method, MethodConfig, ServerState, Updates
from fpbench.registry import METHODS, STRATEGIES
from fpbench.specs import StrategyRef
from fpbench.strategies import build_strategy, own_aggregate

FLOWER = Path(__file__).parents[1] / ".." / "peer" / "flower"
D = torch.float64


class Learner(Method):
    """A learner that keeps the default aggregate (FedAvg by the weights, personal rows kept)."""

    name = "tiny-learner"
    personal = frozenset({"head"})


def learner(num_clients: int = 4) -> Learner:
    return Learner(MethodConfig(), None, SimpleNamespace(num_clients=num_clients))


def strategy(name: str, **args):
    return build_strategy(StrategyRef(name=name, args=args))


def updates(ys: list[list[float]], ids: list[int], weights: list[float], **more) -> Updates:
    params = {"w": torch.tensor(ys, dtype=D), **more}
    return Updates(params, torch.tensor(ids), torch.tensor(weights, dtype=D))


def test_list_of_strategies():
    assert STRATEGIES.names() == [
        "fedadagrad", "fedadam", "fedavg", "fedavgm", "fedotp", "fedprox", "fedyogi", "scaffold",
    ]  # fmt: skip


def test_fedavg_is_the_learners_aggregate():
    server = ServerState({"w": torch.tensor([0.0], dtype=D)}, {"head": torch.zeros(4, 1, dtype=D)})
    up = updates([[1.0], [3.0]], [1, 3], [1.0, 3.0], head=torch.tensor([[5.0], [7.0]], dtype=D))
    new = strategy("fedavg").aggregate(learner(), server, up, None)
    assert new.params["w"].tolist() == [2.5]  # 1/4 * 1 + 3/4 * 3
    assert new.personal["head"][:, 0].tolist() == [0.0, 5.0, 0.0, 7.0]


def test_fedavgm_two_rounds_by_hand():
    s, m = strategy("fedavgm", momentum=0.5, server_lr=1.0), learner()
    server = ServerState({"w": torch.tensor([2.0], dtype=D)})
    # avg 2.5, delta 0.5: v = 0.5 * 0 - 0.5 = -0.5, x = 2 - (-0.5) = 2.5
    one = s.aggregate(m, server, updates([[1.0], [3.0]], [0, 1], [1.0, 3.0]), None)
    assert one.params["w"].tolist() == [2.5]
    assert one.buffers["fedavgm.m.w"].tolist() == [-0.5]
    # delta 0: v = 0.5 * -0.5 = -0.25, x = 2.5 + 0.25
    two = s.aggregate(m, one, updates([[2.5], [2.5]], [0, 1], [1.0, 1.0]), None)
    assert two.params["w"].tolist() == [2.75]


def test_fedadam_by_hand_with_and_without_bias_correction():
    m = learner()
    server = ServerState({"w": torch.tensor([0.0], dtype=D)})
    up = updates([[0.2], [0.2]], [0, 1], [1.0, 1.0])
    # delta 0.2: m = 0.1 * 0.2 = 0.02, v = 0.01 * 0.04 = 4e-4, sqrt v = 0.02
    plain = strategy("fedadam", eta=0.1, tau=0.02, bias_correction=False)
    new = plain.aggregate(m, server, up, None)
    assert new.params["w"].item() == pytest.approx(0.1 * 0.02 / (0.02 + 0.02), abs=1e-15)
    assert new.buffers["fedadam.m.w"].item() == pytest.approx(0.02, abs=1e-15)
    assert new.buffers["fedadam.v.w"].item() == pytest.approx(4e-4, abs=1e-15)
    assert new.buffers["fedadam.t"].item() == 1
    # Flower's eta_norm in round 1: eta * sqrt(1 - 0.99^2) / (1 - 0.9^2)
    corrected = strategy("fedadam", eta=0.1, tau=0.02).aggregate(m, server, up, None)
    assert corrected.params["w"].item() == pytest.approx(0.05 * 0.0199**0.5 / 0.19, abs=1e-15)


def test_fedyogi_second_moment_by_hand():
    s, m = strategy("fedyogi", eta=0.1, tau=0.02), learner()
    server = ServerState({"w": torch.tensor([0.0], dtype=D)})
    one = s.aggregate(m, server, updates([[0.2]], [0], [1.0]), None)
    assert one.buffers["fedyogi.v.w"].item() == pytest.approx(4e-4, abs=1e-15)  # 0 + 0.01 * 0.04
    x1 = one.params["w"].item()
    assert x1 == pytest.approx(0.05, abs=1e-15)
    two = s.aggregate(m, one, updates([[x1 + 0.1]], [0], [1.0]), None)
    # d2 = 0.01, sign(4e-4 - 0.01) = -1: v = 4e-4 + 0.01 * 0.01 (Adam: 0.99 * 4e-4 + 1e-4)
    assert two.buffers["fedyogi.v.w"].item() == pytest.approx(5e-4, abs=1e-15)
    m2 = 0.9 * 0.02 + 0.1 * 0.1
    assert two.params["w"].item() == pytest.approx(x1 + 0.1 * m2 / (5e-4**0.5 + 0.02), abs=1e-14)


def test_fedadagrad_by_hand():
    s, m = strategy("fedadagrad", eta=0.1, tau=1e-9), learner()
    server = ServerState({"w": torch.tensor([0.0], dtype=D)})
    one = s.aggregate(m, server, updates([[0.2]], [0], [1.0]), None)
    assert one.params["w"].item() == pytest.approx(0.1, abs=1e-9)  # 0.1 * 0.2 / sqrt(0.04)
    two = s.aggregate(m, one, updates([[one.params["w"].item() + 0.1]], [0], [1.0]), None)
    step = two.params["w"].item() - one.params["w"].item()
    assert step == pytest.approx(0.1 * 0.1 / 0.05**0.5, abs=1e-9)  # v = 0.04 + 0.01


def test_server_optimisers_leave_personal_rows_to_the_learner():
    server = ServerState({"w": torch.tensor([0.0], dtype=D)}, {"head": torch.zeros(4, 1, dtype=D)})
    up = updates([[1.0]], [2], [1.0], head=torch.tensor([[9.0]], dtype=D))
    for name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold"):
        new = strategy(name).aggregate(learner(), server, up, torch.tensor([1.0], dtype=D))
        assert new.personal["head"][:, 0].tolist() == [0.0, 0.0, 9.0, 0.0], name


def test_fedprox_term_and_its_gradient_by_hand():
    server = ServerState({"w": torch.tensor([0.0, 1.0])})
    w = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    term = strategy("fedprox", mu=0.5).client_term(server, torch.tensor([0, 1]), {"w": w})
    assert term.tolist() == [0.5, 0.25]  # 0.25 * ||w - g||^2: 0.25 * 2, 0.25 * 1
    term.sum().backward()
    assert w.grad.tolist() == [[0.5, 0.5], [0.0, -0.5]]  # mu (w - g)
    frozen = {"w": w.detach()}  # a tensor the phase does not train takes no term
    assert strategy("fedprox").client_term(server, torch.tensor([0, 1]), frozen) is None


def test_scaffold_control_variates_by_hand():
    s, m = strategy("scaffold"), learner(num_clients=4)
    server = ServerState({"w": torch.tensor([1.0], dtype=D)})
    w = torch.ones(1, 1, dtype=D, requires_grad=True)
    s.client_step(server, torch.tensor([0]), {"w": w}, 0.1, torch.tensor([True]))
    assert w.tolist() == [[1.0]]  # round 1: every variate is zero
    # clients 0 and 2 end at 0.5 and 1.5 after steps whose lr sums to 0.5 and 1.0
    lr_steps = torch.tensor([0.5, 1.0], dtype=D)
    new = s.aggregate(m, server, updates([[0.5], [1.5]], [0, 2], [1.0, 1.0]), lr_steps)
    ci = new.buffers["scaffold.ci.w"][:, 0].tolist()
    assert ci == [1.0, 0.0, -0.5, 0.0]  # (1 - 0.5) / 0.5, (1 - 1.5) / 1.0
    assert new.buffers["scaffold.c.w"].tolist() == [0.125]  # (1.0 - 0.5) / N, N = 4
    assert new.params["w"].tolist() == [1.0]  # the weighted mean of 0.5 and 1.5
    # round 2: a step of client 0 (active) and 2 (not) is corrected by lr (c - c_0) = 0.1 * -0.875
    w = torch.tensor([[3.0], [3.0]], dtype=D, requires_grad=True)
    s.client_step(new, torch.tensor([0, 2]), {"w": w}, 0.1, torch.tensor([True, False]))
    assert w.tolist() == [[3.0875], [3.0]]
    # c_0+ = c_0 - c + (x - y) / lr_steps = 1 - 0.125 + (1 - 0.75) / 0.25
    again = s.aggregate(m, new, updates([[0.75]], [0], [1.0]), torch.tensor([0.25], dtype=D))
    assert again.buffers["scaffold.ci.w"][0].item() == pytest.approx(1.875, abs=1e-15)
    assert again.buffers["scaffold.c.w"].item() == pytest.approx(0.125 + 0.875 / 4, abs=1e-15)


def test_scaffold_counts_its_control_variates_as_sent():
    server = ServerState({"w": torch.zeros(3)})
    down, up = strategy("scaffold").communication(learner(), server)
    assert sorted(down) == sorted(up) == ["scaffold.c.w", "w"]


def test_fedotp_shares_the_first_prompts_and_keeps_the_rest():
    s, m = strategy("fedotp", tensor="ctx", shared=1), learner(num_clients=3)
    s.bind(m)
    assert "ctx" in m.personal and m.inference == "personal"
    assert "ctx" not in Learner.personal  # the instance, not the class
    server = ServerState({}, {"ctx": torch.zeros(3, 2, 1, dtype=D)})  # 3 clients, 2 prompts
    trained = torch.tensor([[[1.0], [10.0]], [[4.0], [20.0]]], dtype=D)  # clients 0 and 2
    new = s.aggregate(m, server, Updates({"ctx": trained}, torch.tensor([0, 2]),
                                         torch.tensor([2.0, 1.0], dtype=D)), None)  # fmt: skip
    rows = new.personal["ctx"][..., 0].tolist()
    # shared prompt: (2 * 1 + 1 * 4) / 3 = 2 in every row; local prompts: their own, or the start
    assert rows == [[2.0, 10.0], [2.0, 0.0], [2.0, 20.0]]
    down, _ = s.communication(m, new)
    assert down["ctx"].tolist() == [[2.0]]


def test_fedotp_refuses_a_tensor_without_enough_prompts():
    s, m = strategy("fedotp", shared=2), learner(num_clients=2)
    s.bind(m)
    server = ServerState({}, {"ctx": torch.zeros(2, 2, 1)})
    up = Updates({"ctx": torch.zeros(1, 2, 1)}, torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(FpbenchError, match="more than shared = 2 prompts"):
        s.aggregate(m, server, up, None)


def test_which_learners_take_which_strategies():
    assert not own_aggregate(METHODS.get("kgcoop")) and own_aggregate(METHODS.get("sgpt"))
    STRATEGIES.get("fedavg").check(METHODS.get("sgpt"))  # its own rule
    with pytest.raises(FpbenchError, match="takes only strategy 'fedavg'"):
        STRATEGIES.get("fedprox").check(METHODS.get("sgpt"))
    STRATEGIES.get("scaffold").check(METHODS.get("maple"))


# -- side by side with Flower -------------------------------------------------------------------


def _flower():
    """Flower's framework package from ../peer/flower, or a skip saying what is missing."""
    root = FLOWER / "framework" / "py"
    if not (root / "flwr").is_dir():  # the line names the folder the clone is looked for in
        pytest.skip(
            f"Flower's checkout is missing: git clone https://github.com/adap/flower {FLOWER}"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import flwr.common as common
        import flwr.server.strategy as strategies
    except ImportError as e:
        pytest.skip(f"Flower's checkout needs its dependencies (pip install flwr): {e}")
    return common, strategies


FLOWER_CASES = {  # fpbench's strategy and settings, Flower's class and its arguments
    "fedavgm": ({"server_lr": 0.7, "momentum": 0.9}, "FedAvgM",
                {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    "fedadam": ({"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3}, "FedAdam",
                {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3}),
    "fedyogi": ({"eta": 0.03, "tau": 1e-3}, "FedYogi", {"eta": 0.03, "tau": 1e-3}),
    "fedadagrad": ({"eta": 0.1, "tau": 1e-4}, "FedAdagrad", {"eta": 0.1, "tau": 1e-4}),
    "fedprox": ({"mu": 0.1}, "FedProx", {"proximal_mu": 0.1}),
}  # fmt: skip


@pytest.mark.parametrize("name", FLOWER_CASES)
def test_server_step_matches_flower(name):
    common, strategies = _flower()
    ours_args, cls, theirs_args = FLOWER_CASES[name]
    rng = np.random.default_rng(0)
    start = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=4)}
    theirs = getattr(strategies, cls)(
        initial_parameters=common.ndarrays_to_parameters(list(start.values())), **theirs_args
    )
    ours, m = strategy(name, **ours_args), learner(num_clients=5)
    server = ServerState({k: torch.tensor(v) for k, v in start.items()})
    for rnd in range(1, 5):
        uploads = [{k: v + rng.normal(scale=0.1, size=v.shape) for k, v in start.items()}
                   for _ in range(3)]  # fmt: skip
        sizes = [int(n) for n in rng.integers(5, 50, size=3)]
        results = [
            (None, common.FitRes(common.Status(common.Code.OK, ""),
                                 common.ndarrays_to_parameters(list(u.values())), n, {}))
            for u, n in zip(uploads, sizes, strict=True)
        ]  # fmt: skip
        aggregated, _ = theirs.aggregate_fit(rnd, results, [])
        expected = common.parameters_to_ndarrays(aggregated)
        up = Updates(
            {k: torch.tensor(np.stack([u[k] for u in uploads])) for k in start},
            torch.tensor([0, 2, 4]),
            torch.tensor(sizes, dtype=D),
        )
        if name == "fedadam":  # Flower's eta_norm of this round, as our bias correction computes
            assert ours.lr(rnd) == pytest.approx(
                0.05 * np.sqrt(1 - 0.95 ** (rnd + 1)) / (1 - 0.8 ** (rnd + 1)), rel=1e-15
            )
        server = ours.aggregate(m, server, up, None)
        for (k, got), want in zip(server.params.items(), expected, strict=True):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12, err_msg=k)
        start = {k: expected[i] for i, k in enumerate(start)}


def _niid_bench_models():
    path = FLOWER / "baselines" / "niid_bench" / "niid_bench" / "models.py"
    if not path.is_file():
        pytest.skip(f"Flower's niid_bench baseline is missing: {path} (git clone adap/flower)")
    spec = importlib.util.spec_from_file_location("niid_bench_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_client():
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Linear(3, 2, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(torch.randn(2, 3, generator=gen, dtype=D))
    batches = [(torch.randn(4, 3, generator=gen, dtype=D), torch.tensor([0, 1, 1, 0]))
               for _ in range(3)]  # fmt: skip
    return net, batches


def _train_ours(w0, batches, server, strat, lr, momentum=0.0):
    """SGD on cross-entropy plus the strategy's client term, then its client step, as the
    executor runs them, for one client (K = 1)."""
    w = w0.clone().unsqueeze(0).requires_grad_(True)
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    ids, active = torch.tensor([1]), torch.tensor([True])
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w[0].T, y)
        term = strat.client_term(server, ids, {"w": w})
        (loss if term is None else loss + term.sum()).backward()
        opt.step()
        strat.client_step(server, ids, {"w": w}, lr, active)
    return w.detach()[0]


def test_fedprox_client_training_matches_flowers_baseline():
    models = _niid_bench_models()
    net, batches = _tiny_client()
    w0 = net.weight.detach().clone()
    models.train_fedprox(net, batches, torch.device("cpu"), 1, 0.3, 0.1, 0.0, 0.0)
    server = ServerState({"w": w0})
    ours = _train_ours(w0, batches, server, strategy("fedprox", mu=0.3), 0.1)
    torch.testing.assert_close(ours, net.weight.detach(), rtol=1e-13, atol=1e-13)


def test_scaffold_client_step_matches_flowers_baseline():
    models = _niid_bench_models()
    net, batches = _tiny_client()
    w0 = net.weight.detach().clone()
    gen = torch.Generator().manual_seed(1)
    c, c1 = torch.randn(2, 3, generator=gen, dtype=D), torch.randn(2, 3, generator=gen, dtype=D)
    models.train_scaffold(net, batches, torch.device("cpu"), 1, 0.1, 0.9, 0.0, [c], [c1])
    ci = torch.stack([torch.zeros_like(c1), c1])  # client 1's row
    server = ServerState({"w": w0}, buffers={"scaffold.c.w": c, "scaffold.ci.w": ci})
    ours = _train_ours(w0, batches, server, strategy("scaffold"), 0.1, momentum=0.9)
    torch.testing.assert_close(ours, net.weight.detach(), rtol=1e-13, atol=1e-13)
