"""What is specific to each personalised baseline: pFedPG, pFedHN, FedEM, Per-FedAvg, P-PT."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import train_clients
from fpbench.methods.base import Context, Updates
from fpbench.methods.fedem import responsibilities
from fpbench.methods.per_fedavg import inner_half

TRAIN = Context(training=True)


def _with(method, **cfg):
    """The same method class on the same backbone and task, with a different config."""
    return type(method)(method.Config(**cfg), method.backbone, method.task)


def _server(method):
    return method.init_server(torch.Generator().manual_seed(0))


# -- pFedPG -----------------------------------------------------------------------------------
def test_pfedpg_generator_descends_half_squared_distance_to_trained_prompts(tiny):
    _, task, method = tiny("pfedpg")
    method = _with(method, server_lr=0.1)
    server = _server(method)
    ids = torch.tensor([0, 2])
    start = method.client_params(server, ids)
    assert set(start) == {"prompts", "head_w", "head_b"}
    assert not torch.allclose(start["prompts"][0], start["prompts"][1])  # descriptor-specific
    gen = torch.Generator().manual_seed(1)
    trained = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([3.0, 1.0]), {}))

    # the formula: phi' = phi - lr * grad_phi 1/2 mean_k ||P_k(phi) - P~_k||^2
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    gap = method.generate(leaves, ids)["prompts"] - trained["prompts"]
    (0.5 * gap.pow(2).sum() / len(ids)).backward()
    for k, v in server.params.items():
        torch.testing.assert_close(new.params[k], v - 0.1 * leaves[k].grad)
    # the direction: the generated prompts move towards the adapted ones (not away: +delta bug)
    before = (start["prompts"] - trained["prompts"]).flatten(1).norm(dim=1)
    after = (
        (method.generate(new.params, ids)["prompts"] - trained["prompts"]).flatten(1).norm(dim=1)
    )
    assert (after < before).all()


def test_pfedpg_keeps_heads_and_adapted_prompts_local(tiny):
    _, task, method = tiny("pfedpg")
    server = _server(method)
    ids = torch.tensor([1, 3])
    start = method.client_params(server, ids)
    trained = {k: v + 1.0 for k, v in start.items()}
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([1.0, 1.0]), {}))
    ev = method.client_params(new, ids, training=False)
    for k in ("prompts", "head_w", "head_b"):
        torch.testing.assert_close(ev[k], trained[k])  # adapted prompts, own head
    assert torch.equal(new.personal["head_w"][0], server.personal["head_w"][0])
    down, up = method.communication(new)
    shape = (method.cfg.prompt_len, method.backbone.embed_dim)
    assert set(down) == set(up) == {"prompts"} and down["prompts"].shape == shape


# -- pFedHN -----------------------------------------------------------------------------------
def test_pfedhn_outputs_every_clients_prompts_and_head_and_gradients_reach_the_hypernetwork(tiny):
    _, task, method = tiny("pfedhn")
    server = _server(method)
    n, d, c = task.num_clients, method.backbone.embed_dim, task.data.num_classes
    assert server.params["embeddings"].shape == (n, 1 + n // 4)
    ids = torch.tensor([2, 0, 2])
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    out = method.generate(leaves, ids)
    assert out["prompts"].shape == (3, method.cfg.prompt_len, d)
    assert out["head_w"].shape == (3, c, d) and out["head_b"].shape == (3, c)
    torch.testing.assert_close(out["head_w"][0], out["head_w"][2])  # same client, same model
    sum(t.square().sum() for t in out.values()).backward()
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.abs().sum() > 0, k
    used = leaves["embeddings"].grad.abs().sum(1) > 0
    assert used.tolist() == [i in (0, 2) for i in range(n)]  # only the clients' own embeddings


@pytest.mark.parametrize(("reduce", "divide"), [("sum", 1), ("mean", 2)])
def test_pfedhn_server_step_is_torch_sgd_on_the_delta_gradient(tiny, reduce, divide):
    """Default "sum": each client's delta gets the full server step (pFedHN's per-client step)."""
    _, task, method = tiny("pfedhn")
    assert method.cfg.server_reduce == "sum"
    method.cfg = method.cfg.model_copy(update={"server_reduce": reduce})
    server = _server(method)
    ids = torch.tensor([0, 1])
    leaves = {k: v.clone().requires_grad_() for k, v in server.params.items()}
    opt = torch.optim.SGD(leaves.values(), lr=1e-2, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):  # two rounds: the momentum buffer carries over in the server buffers
        start = method.client_params(server, ids)
        trained = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
        server = method.aggregate(server, Updates(trained, ids, torch.ones(2), {}))
        opt.zero_grad()
        out = method.generate(leaves, ids)
        sum(0.5 * (out[k] - trained[k]).pow(2).sum() for k in out).div(divide).backward()
        opt.step()
    for k, v in leaves.items():
        torch.testing.assert_close(server.params[k], v.detach(), atol=1e-6, rtol=1e-5)


# -- FedEM ------------------------------------------------------------------------------------
def test_fedem_e_step_by_hand():
    log_pi = torch.tensor([[0.5, 0.25, 0.25]]).log()
    losses = torch.tensor([[math.log(2), 0.0, math.log(4)]])
    # q ∝ pi * exp(-loss) = (1/4, 1/4, 1/16) -> (4/9, 4/9, 1/9)
    q = responsibilities(log_pi, losses)
    torch.testing.assert_close(q, torch.tensor([[4 / 9, 4 / 9, 1 / 9]]))


def test_fedem_weighted_loss_m_step_and_mixture_prediction(tiny):
    _, task, method = tiny("fedem")
    server = _server(method)
    m = method.cfg.learners
    assert server.personal["pi"].shape == (task.num_clients, m)
    ids = torch.tensor([1])
    params = method.client_params(server, ids)
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.zeros(4, dtype=torch.long)
    ctx = Context(training=True)
    per_learner = method.learner_logits(params, x, rows)  # (B, M, C)
    losses = F.cross_entropy(per_learner.flatten(0, 1), y.repeat_interleave(m), reduction="none")
    q = responsibilities(torch.full((4, m), 1.0 / m).log(), losses.view(4, m))
    torch.testing.assert_close(method.loss(params, x, y, rows, ctx), (q * losses.view(4, m)).sum(1))
    torch.testing.assert_close(ctx.stats["q_sum"], q.sum(0, keepdim=True))
    # M-step: pi = mean responsibility of the round's samples
    stats = {"q_sum": torch.tensor([[2.0, 1.0, 1.0]])}
    new = method.aggregate(server, Updates(params, ids, torch.tensor([4.0]), stats))
    torch.testing.assert_close(new.personal["pi"][1], torch.tensor([0.5, 0.25, 0.25]))
    assert torch.equal(new.personal["pi"][0], server.personal["pi"][0])
    # prediction: log sum_m pi_m softmax(f_m(x)); a one-hot pi picks one learner
    new.personal["pi"][1] = torch.tensor([0.0, 1.0, 0.0])
    ev = method.client_params(new, ids, training=False)
    logits = method.forward(ev, x, rows, Context(training=False))
    torch.testing.assert_close(logits, per_learner[:, 1].log_softmax(-1), atol=1e-5, rtol=1e-5)
    down, up = method.communication(new)
    assert set(down) == set(up) == {"prompts", "head_w", "head_b"}


# -- Per-FedAvg -------------------------------------------------------------------------------
def test_per_fedavg_inner_half_is_the_first_half_of_each_clients_samples():
    rows = torch.tensor([0, 1, 0, 0, 1, 1, 1, 2])
    assert inner_half(rows).tolist() == [True, True, False, False, True, False, False, False]


def test_per_fedavg_meta_gradient_is_first_order_maml(tiny):
    _, task, method = tiny("per-fedavg")
    method = _with(method, alpha=0.5)
    server = _server(method)
    params = {
        k: v.requires_grad_() for k, v in method.client_params(server, torch.tensor([0])).items()
    }
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.zeros(4, dtype=torch.long)
    method.loss(params, x, y, rows, TRAIN).mean().backward()  # the engine's per-client mean
    got = {k: v.grad.clone() for k, v in params.items()}

    # by hand: theta' = theta - alpha grad L(theta; first two); expect grad L(theta'; last two)
    theta = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    inner = F.cross_entropy(method.forward(theta, x[:2], rows[:2], Context(training=True)), y[:2])
    grads = torch.autograd.grad(inner, list(theta.values()))
    adapted = {
        k: (v - 0.5 * g).detach().requires_grad_()
        for (k, v), g in zip(theta.items(), grads, strict=True)
    }
    F.cross_entropy(
        method.forward(adapted, x[2:], rows[2:], Context(training=True)), y[2:]
    ).backward()
    for k in got:
        torch.testing.assert_close(got[k], adapted[k].grad, atol=1e-6, rtol=1e-5)
    # and it is not the plain gradient of the outer half at theta
    plain = F.cross_entropy(method.forward(theta, x[2:], rows[2:], Context(training=True)), y[2:])
    plain = torch.autograd.grad(plain, list(theta.values()))
    assert any(not torch.allclose(got[k], g, atol=1e-5) for k, g in zip(theta, plain, strict=True))


def test_per_fedavg_takes_one_local_step_before_evaluation(tiny):
    cfg, task, method = tiny("per-fedavg")
    method = _with(method, adapt_batch=5)
    server = _server(method)
    seen = []
    plain_adapt = method.adapt

    def spy(params, x, y, rows, ctx):
        seen.append((rows.clone(), y.clone()))
        out = plain_adapt(params, x, y, rows, ctx)
        assert all(not torch.equal(out[k], params[k]) for k in params)  # one step moved them
        return out

    method.adapt = spy
    evaluate(method, server, task, cfg.train.eval_batch_size)
    rows = torch.cat([r for r, _ in seen])
    per_row = [int((r == k).sum()) for r, _ in seen for k in range(int(r.max()) + 1)]
    assert len(per_row) == len(task.trainable_clients())
    assert all(
        n == min(5, len(task.train_idx[c]))
        for n, c in zip(per_row, task.trainable_clients(), strict=True)
    )
    assert rows.numel() > 0
    # the step itself: theta - alpha * grad of each row's mean loss
    x = method.backbone.preprocess(task.data.train_images[:3])
    y = task.data.train_labels[:3]
    start = method.client_params(server, torch.tensor([0]), training=False)
    stepped = plain_adapt(start, x, y, torch.zeros(3, dtype=torch.long), Context(training=False))
    theta = {k: v.clone().requires_grad_() for k, v in start.items()}
    F.cross_entropy(
        method.forward(theta, x, torch.zeros(3, dtype=torch.long), Context(training=True)), y
    ).backward()
    for k in theta:
        torch.testing.assert_close(stepped[k], start[k] - 0.01 * theta[k].grad)


# -- P-PT -------------------------------------------------------------------------------------
def test_p_pt_never_aggregates_prompts(tiny):
    cfg, task, method = tiny("p-pt")
    server = _server(method)
    assert set(server.params) == {"head_w", "head_b"} and set(server.personal) == {"prompts"}
    ids = task.trainable_clients()[:2]
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    weights = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, weights, local.stats))
    for row, c in enumerate(ids):
        assert torch.equal(new.personal["prompts"][c], local.params["prompts"][row])
    others = [c for c in range(task.num_clients) if c not in ids]
    assert torch.equal(new.personal["prompts"][others], server.personal["prompts"][others])
    w = weights / weights.sum()
    torch.testing.assert_close(new.params["head_w"], torch.tensordot(w, local.params["head_w"], 1))
    down, up = method.communication(new)
    assert set(down) == set(up) == {"head_w", "head_b"}
