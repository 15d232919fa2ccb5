"""SGPT's math on small hand-checked tensors, its schedule, server rule and presets."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from fpbench.backbones import ViTFeatures
from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import train_clients
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.keys import group_counts, key_cosines
from fpbench.methods.sgpt import (
    SGPT_PRESETS,
    SGPTConfig,
    batch_majority,
    frequency_scores,
    interpolate,
    key_loss,
    key_weights,
    orthogonal_keys,
    resolve_layers,
    select_query,
)
from fpbench.registry import METHODS
from fpbench.suites import load_suite

from ..conftest import with_config


def _sgpt(tiny, **args):
    """An SGPT method on the tiny task (vit-test: 2 blocks, width 32), with config `args`."""
    _, task, base = tiny("sgpt")
    return with_config(base, **args), task


# -- Select ------------------------------------------------------------------------------------
def test_select_query_is_relu_then_l2_normalised():
    cls = torch.tensor([[3.0, -1.0, 4.0, 0.0]])
    torch.testing.assert_close(select_query(cls), torch.tensor([[0.6, 0.0, 0.8, 0.0]]))
    leaky = torch.tensor([[3.0, -0.01, 4.0, 0.0]]) / math.sqrt(25.0001)
    torch.testing.assert_close(select_query(cls, "leaky-relu"), leaky)


def test_frequency_weighting_favours_rarely_selected_groups():
    cos = torch.tensor([[0.9, 0.5, 0.1]])
    never = frequency_scores(cos, torch.zeros(3, dtype=torch.long), 5e-4)
    torch.testing.assert_close(never, 1 - cos)  # no counts yet: plain 1 - cos
    scores = frequency_scores(cos, torch.tensor([8, 2, 0]), 5e-4)  # q = (0.8, 0.2, 0)
    expected = torch.tensor([[0.1 * 0.8005, 0.5 * 0.2005, 0.9 * 0.0005]])
    torch.testing.assert_close(scores, expected)
    assert scores.argmin().item() == 2 and (1 - cos).argmin().item() == 0


def test_batch_majority_per_client_row_with_lowest_tie():
    groups = torch.tensor([0, 1, 1, 2, 2, 2, 3, 1])
    rows = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    counts = group_counts(groups, rows, 3, 4)
    assert counts.tolist() == [[1, 2, 0, 0], [0, 0, 3, 0], [0, 1, 0, 1]]
    assert batch_majority(groups, rows, 3, 4).tolist() == [1, 1, 1, 2, 2, 2, 1, 1]


def test_key_loss_is_minus_cosine_of_the_chosen_key():
    cos = torch.tensor([[0.2, 0.7], [0.4, -0.1]])
    torch.testing.assert_close(key_loss(cos, torch.tensor([1, 0])), torch.tensor([-0.7, -0.4]))


def test_orthogonal_keys():
    keys = orthogonal_keys(torch.Generator().manual_seed(0), 5, 8)
    unit = torch.nn.functional.normalize(keys, dim=-1)
    torch.testing.assert_close(unit @ unit.T, torch.eye(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(keys[1:].norm(dim=1), torch.ones(4))
    assert not torch.allclose(keys[0].norm(), torch.tensor(1.0))  # row 0 keeps its norm


def test_training_selection_is_frequency_weighted_test_time_is_nearest_key(tiny):
    method, task = _sgpt(tiny, num_groups=3)
    x = method.backbone.preprocess(task.data.train_images[:6])
    q = method.query(x)  # (6, d)
    keys = torch.stack([q[0], q[1], -q[0]]).unsqueeze(0)  # (K=1, G=3, d)
    rows = torch.zeros(6, dtype=torch.long)
    cos = key_cosines(q, keys, rows)
    counts = torch.tensor([100, 100, 0])  # group 2 never picked: favoured while training
    eval_groups, _ = method.select_groups(keys, x, rows, Context(training=False))
    assert eval_groups.tolist() == cos.argmax(1).tolist()
    ctx = Context(training=True, phase="group", buffers={"select_counts": counts})
    train_groups, _ = method.select_groups(keys, x, rows, ctx)
    expected = ((1 - cos) * (counts / 200 + 5e-4)).argmin(1)
    assert train_groups.tolist() == expected.tolist() and 2 in train_groups.tolist()
    params = method.client_params(method.init_server(torch.Generator().manual_seed(0)), rows[:1])
    params["keys"] = keys  # the forward returns its picks, counted per row
    picked = method.forward(params, x, rows, ctx).stats["select_counts"]
    assert picked.tolist() == [torch.bincount(expected, minlength=3).tolist()]


def test_loss_adds_the_key_loss_and_only_keys_get_its_gradient(tiny):
    method, task = _sgpt(tiny, select_weighting="none")
    server = method.init_server(torch.Generator().manual_seed(0))
    x = method.backbone.preprocess(task.data.train_images[:5])
    y, rows = task.data.train_labels[:5], torch.zeros(5, dtype=torch.long)
    grads = {}
    for weight in (0.0, 1.0):
        method.cfg = method.cfg.model_copy(update={"key_loss_weight": weight})
        params = {k: v.requires_grad_() for k, v in method.client_params(server, rows[:1]).items()}
        ctx = Context(training=True, phase="group", labels=y, buffers=server.buffers)
        loss, stats = training_loss(method.forward(params, x, rows, ctx), y)
        out = method.forward(params, x, rows, ctx)
        assert torch.equal(stats["select_counts"], out.stats["select_counts"])
        ce = torch.nn.functional.cross_entropy(out.logits, y, reduction="none")
        cos = key_cosines(method.query(x), params["keys"], rows)
        torch.testing.assert_close(loss - ce, -weight * cos.max(1).values)
        torch.testing.assert_close(out.aux_loss, -weight * cos.max(1).values)
        loss.mean().backward()
        grads[weight] = {k: v.grad.clone() for k, v in params.items()}
    for name in ("group_prompts", "head_w", "head_b", "shared_prompts"):
        torch.testing.assert_close(grads[0.0][name], grads[1.0][name])
    assert not torch.allclose(grads[0.0]["keys"], grads[1.0]["keys"])


def test_head_pooling_counts_cls_group_and_shared_tokens(tiny):
    feats = ViTFeatures(
        tokens=torch.empty(0),
        cls=torch.tensor([[0.0]]),
        prompt_tokens=torch.tensor([[[3.0], [6.0], [9.0]]]),  # group token first, then shared
    )
    pooled = {}
    for pooling in ("cls", "cls-group", "cls-group-shared"):
        method, _ = _sgpt(tiny, head_pooling=pooling)  # 1 shared, 1 group block on vit-test
        pooled[pooling] = (method.pool(feats, True).item(), method.pool(feats, False).item())
    assert pooled == {"cls": (0.0, 0.0), "cls-group": (1.5, 0.0), "cls-group-shared": (3.0, 1.5)}


# -- sequential counts -------------------------------------------------------------------------
def test_sequential_counts_add_earlier_clients_of_the_round_only(tiny):
    buffers = {"select_counts": torch.tensor([1, 1])}
    earlier = {"select_counts": torch.tensor([4, 0])}
    sequential, _ = _sgpt(tiny, select_counts="sequential", num_groups=2)
    snapshot, _ = _sgpt(tiny, select_counts="snapshot", num_groups=2)
    first = Context(training=True, phase="group", buffers=buffers)
    assert sequential.counts(first).tolist() == [1, 1]
    second = Context(training=True, phase="group", buffers=buffers, earlier=earlier)
    assert sequential.counts(second).tolist() == [5, 1]
    with pytest.raises(TypeError):  # what the engine hands a method is read-only
        second.earlier["select_counts"] = torch.tensor([9, 9])
    assert snapshot.counts(second).tolist() == [1, 1]


def test_sequential_counts_change_the_reference_executor_only(tiny):
    cfg, task, _ = tiny("sgpt", local_epochs=1)
    method, _ = _sgpt(tiny, select_counts="sequential")
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()[:2]
    stats = {
        executor: train_clients(
            method, server, task, ids, cfg.train, round_idx=0, seed=0, executor=executor
        ).stats["select_counts"]
        for executor in ("reference", "lockstep")
    }
    assert torch.equal(stats["reference"][0], stats["lockstep"][0])  # nothing earlier yet
    # client 1 reads the round-start counts plus client 0's picks: the same as training it alone
    # from a server whose buffer already holds them
    server.buffers["select_counts"] = server.buffers["select_counts"] + stats["reference"][0]
    alone = train_clients(
        method, server, task, ids[1:], cfg.train, round_idx=0, seed=0, executor="lockstep"
    ).stats["select_counts"][0]
    torch.testing.assert_close(stats["reference"][1], alone, rtol=0, atol=0)
    assert not torch.equal(stats["reference"][1], stats["lockstep"][1])  # so it saw them


# -- server ------------------------------------------------------------------------------------
def test_key_weights_use_selection_counts_above_the_threshold():
    counts = torch.tensor([[30.0, 1.0], [30.0, 0.0], [0.0, 2.0]])  # (K=3, G=2): T = (60, 3)
    third = 1 / 3
    expected = torch.tensor([[0.5, third], [0.5, third], [0.0, third]])
    torch.testing.assert_close(key_weights(counts, 50), expected)
    paper = torch.tensor([[0.5, third], [0.5, 0.0], [0.0, 2 * third]])
    torch.testing.assert_close(key_weights(counts, 0), paper)


def test_interpolate():
    out = interpolate(torch.tensor(2.0), torch.tensor(6.0), 0.25)
    torch.testing.assert_close(out, torch.tensor(5.0))


def _toy_round(method, server, counts):
    trained = {k: torch.stack([torch.full_like(v, 1.0), torch.full_like(v, 3.0)])
               for k, v in server.params.items()}  # fmt: skip
    ids, weights = torch.tensor([0, 2]), torch.tensor([30.0, 10.0])
    return method.aggregate(server, Updates(trained, ids, weights, {"select_counts": counts}))


def test_aggregate_fedavg_momentum_and_selection_weighted_keys(tiny):
    method, _ = _sgpt(tiny, num_groups=2)
    server = method.init_server(torch.Generator().manual_seed(0))
    server.params = {k: torch.full_like(v, 2.0) for k, v in server.params.items()}
    counts = torch.tensor([[60, 2], [20, 0]])  # T = (80, 2): key 0 by counts, key 1 uniform
    new = _toy_round(method, server, counts)
    for name in ("head_w", "head_b", "shared_prompts"):  # FedAvg: (30 * 1 + 10 * 3) / 40
        torch.testing.assert_close(new.params[name], torch.full_like(server.params[name], 1.5))
    group = new.params["group_prompts"]  # 0.5 * 2 + 0.5 * 1.5
    torch.testing.assert_close(group, torch.full_like(group, 1.75))
    key0 = 0.5 * 2 + 0.5 * (0.75 * 1 + 0.25 * 3)  # 1.75
    key1 = 0.5 * 2 + 0.5 * (0.5 * 1 + 0.5 * 3)  # 2.0
    torch.testing.assert_close(new.params["keys"][:, 0], torch.tensor([key0, key1]))
    assert new.buffers["select_counts"].tolist() == [80, 2]
    assert server.buffers["select_counts"].tolist() == [0, 0]  # the old state is not modified


def _table4_round(tiny, preset):
    method, _ = _sgpt(tiny, num_groups=2, preset=preset)
    server = method.init_server(torch.Generator().manual_seed(0))
    server.params = {k: torch.full_like(v, 2.0) for k, v in server.params.items()}
    new = _toy_round(method, server, torch.tensor([[60, 2], [20, 0]]))
    return method, new.params["keys"][:, 0].tolist(), new.params["group_prompts"].unique().tolist()


def test_table4_fedavg_row_averages_keys_by_samples_without_momentum(tiny):
    method, keys, group = _table4_round(tiny, "keys-fedavg")
    assert keys == [1.5, 1.5] and group == [1.5]  # (30 * 1 + 10 * 3) / 40, no momentum
    x = method.backbone.preprocess(tiny("sgpt")[1].data.train_images[:4])
    rows = torch.zeros(4, dtype=torch.long)
    keys_t = torch.stack([method.query(x)[0], -method.query(x)[0]]).unsqueeze(0)
    ctx = Context(training=True, phase="group", buffers={"select_counts": torch.tensor([9, 0])})
    groups, cos = method.select_groups(keys_t, x, rows, ctx)  # no q_g: plain nearest key
    assert groups.tolist() == cos.argmax(1).tolist()


def test_table4_qg_row_weighs_keys_by_selection_counts_without_momentum(tiny):
    _, keys, group = _table4_round(tiny, "keys-qg")
    # key 0: counts (60, 20) > 50 -> (0.75 * 1 + 0.25 * 3); key 1: T = 2 <= 50 -> uniform
    assert keys == [1.5, 2.0] and group == [1.5]


def test_table4_momentum_row_is_sgpt_itself(tiny):
    _, keys, group = _table4_round(tiny, "keys-qg-momentum")
    assert keys == [1.75, 2.0] and group == [1.75]  # 0.5 * 2 + 0.5 * (1.5 | 2.0)
    same = SGPTConfig(preset="keys-qg-momentum").model_dump(exclude={"preset"})
    assert same == SGPTConfig().model_dump(exclude={"preset"})


def test_table3_share_row_is_fedvpt_d(tiny):
    """Table 3's "Share" (79.49 / 63.38) is Table 1's FedVPT-D s = 10 row: the preset must give
    the same parameters at init, the same single phase and the same logits."""
    cfg, task, vptd = tiny("fedvpt-d")
    share, _ = _sgpt(tiny, preset="shared-only")
    assert share.shared_layers == tuple(range(share.backbone.depth)) and not share.group_layers
    a = vptd.init_server(torch.Generator().manual_seed(3)).params
    b = share.init_server(torch.Generator().manual_seed(3)).params
    assert set(b) == {"shared_prompts", "head_w", "head_b"}
    torch.testing.assert_close(b["shared_prompts"], a["prompts"])
    torch.testing.assert_close(b["head_w"], a["head_w"])
    assert [p.name for p in share.phases(5, tuple(b))] == ["shared"]
    x = share.backbone.preprocess(task.data.train_images[:6])
    rows = torch.zeros(6, dtype=torch.long)
    pa = vptd.client_params(vptd.init_server(torch.Generator().manual_seed(3)), rows[:1])
    pb = share.client_params(share.init_server(torch.Generator().manual_seed(3)), rows[:1])
    for ctx in (Context(training=False), Context(training=True, phase="shared")):
        torch.testing.assert_close(
            share.forward(pb, x, rows, ctx).logits, vptd.forward(pa, x, rows, ctx)
        )


def test_communication_declares_counts(tiny):
    method, _ = _sgpt(tiny, num_groups=3)
    server = method.init_server(torch.Generator().manual_seed(0))
    down, up = method.communication(server)
    assert set(down) == set(up) == {*server.params, "select_counts"}
    assert set(server.params) == {"shared_prompts", "group_prompts", "keys", "head_w", "head_b"}
    assert server.params["group_prompts"].shape == (3, 1, 1, 32)  # (G, Lg, p, d)


# -- schedule, layers, presets -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("bcd", [("shared", {"shared_prompts"}), ("group", {"group_prompts", "keys"})]),
        ("bcd-inverted", [("group", {"group_prompts", "keys"}), ("shared", {"shared_prompts"})]),
        ("shared-group-joint", [("joint", {"shared_prompts", "group_prompts", "keys"})]),
        ("shared-only", [("shared", {"shared_prompts"})]),
        ("group-only", [("group", {"group_prompts", "keys"})]),
    ],
)
def test_phase_schedule(tiny, preset, expected):
    method, _ = _sgpt(tiny, preset=preset)
    names = tuple(method.init_server(torch.Generator().manual_seed(0)).params)
    phases = method.phases(3, names)
    assert [(p.name, set(p.trainable) - {"head_w", "head_b"}) for p in phases] == expected
    assert all({"head_w", "head_b"} <= set(p.trainable) and p.epochs == 3 for p in phases)


def test_layers_default_to_the_reference_layout_scaled_to_depth():
    assert resolve_layers(SGPTConfig(), 12) == ((0, 1, 2, 3), (4, 5, 6))
    assert resolve_layers(SGPTConfig(), 4) == ((0,), (1,))
    assert resolve_layers(SGPTConfig(preset="cifar-s50"), 12) == ((0, 1, 2, 3, 4), (5, 6))
    assert resolve_layers(SGPTConfig(shared_layers=()), 12) == ((), (4, 5, 6))
    for bad in ({"group_layers": (3,)}, {"shared_layers": (0, 12)}, {"group_layers": (5, 5)}):
        with pytest.raises(FpbenchError):
            resolve_layers(SGPTConfig(**{"shared_layers": (0, 1, 2, 3), **bad}), 12)
    with pytest.raises(FpbenchError):
        resolve_layers(SGPTConfig(shared_layers=(), group_layers=()), 12)


def test_presets_validate_and_explicit_fields_win():
    for name in SGPT_PRESETS:
        cfg = SGPTConfig(preset=name)
        again = SGPTConfig(**cfg.model_dump(mode="json"))
        assert again == cfg  # the stored config re-validates to itself
    assert SGPTConfig(preset="office", num_groups=6).num_groups == 6
    with pytest.raises(ValidationError, match="unknown preset"):
        SGPTConfig(preset="nope")


def test_ablation_suite_runs_every_table_preset():
    suite = load_suite("sgpt-ablations-smoke")
    presets = {c.method.args["preset"] for c in suite.cells}
    table3 = {"shared-only", "group-only", "shared-group-joint", "bcd-inverted", "bcd"}
    assert presets == table3 | {"keys-fedavg", "keys-qg", "keys-qg-momentum"}
    assert {(c.backbone.name, c.dataset.name) for c in suite.cells} == {("vit-smoke", "synthetic")}


def test_switches_train_evaluate_and_keep_executors_equal(tiny):
    cfg, task, _ = tiny("sgpt", local_epochs=1)
    method, _ = _sgpt(
        tiny,
        prompt_style="deep",
        head_pooling="cls-group-shared",
        query_activation="leaky-relu",
        query_layer=0,
        batch_majority=True,
        group_init="zero",
        shared_init="uniform",
        num_groups=4,
    )
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()[:2]
    ref, lock = (
        train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, executor=ex)
        for ex in ("reference", "lockstep")
    )
    for k in ref.params:
        torch.testing.assert_close(lock.params[k], ref.params[k], atol=2e-5, rtol=1e-4)
    assert torch.equal(ref.stats["select_counts"], lock.stats["select_counts"])
    new = method.aggregate(
        server, Updates(lock.params, lock.client_ids, task.train_sizes[ids], lock.stats)
    )
    assert new.buffers["select_counts"].sum() == lock.stats["select_counts"].sum() > 0
    counts = evaluate(method, new, task, 64)
    x = method.backbone.preprocess(task.data.test_images)
    rows = torch.zeros(len(x), dtype=torch.long)
    with torch.no_grad():  # the global model, nearest-key selection, on the whole test set
        params = method.client_params(new, rows[:1])
        logits = method.forward(params, x, rows, Context(training=False)).logits
    right = (logits.argmax(1) == task.data.test_labels).float().mean().item()
    assert counts.global_acc[0] == pytest.approx(right)


# -- block coordinate descent: each block leaves the other's parameters alone ------------------
def _trained(tiny, method, task, only=None):
    cfg, _, _ = tiny("sgpt", local_epochs=2)
    server = method.init_server(torch.Generator().manual_seed(0))
    if only is not None:
        phases = method.phases
        method.phases = lambda e, names: [p for p in phases(e, names) if p.name == only]
    ids = task.trainable_clients()[:2]
    out = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    return server, out.params


def test_the_group_block_leaves_shared_prompts_and_the_shared_block_keys(tiny):
    method, task = _sgpt(tiny, num_groups=3, cluster_metric=False)
    server, full = _trained(tiny, method, task)
    _, shared_only = _trained(
        tiny, _sgpt(tiny, num_groups=3, cluster_metric=False)[0], task, "shared"
    )
    # the shared block trains the shared prompts alone and leaves keys and group prompts as sent
    for name in ("keys", "group_prompts"):
        sent = server.params[name].expand_as(shared_only[name])
        torch.testing.assert_close(shared_only[name], sent, rtol=0, atol=0)
    # the group block, which follows it, leaves the shared prompts where the shared block put them
    torch.testing.assert_close(
        full["shared_prompts"], shared_only["shared_prompts"], rtol=0, atol=0
    )
    # ... and trains the keys (the key loss reaches them)
    assert not torch.equal(full["keys"], server.params["keys"].expand_as(full["keys"]))


@pytest.mark.parametrize(
    "arch, size",
    [
        ({"embed_dim": 48, "num_heads": 3, "img_size": 32}, 32),  # ViT-B's 12 blocks, narrow
        pytest.param({}, 224, marks=pytest.mark.slow),  # ViT-B/16 itself
    ],
)
def test_vit_b16_head_reads_cls_and_the_group_tokens(arch, size):
    """On the ViT-B/16 architecture (random weights, timm blocks) with the reference layout
    (shared 0-3, group 4-6, accumulating), each group token enters its block right after cls and
    the head's input is the mean of the final cls and those three group-token outputs."""
    from fpbench.backbones import BackboneSpec
    from fpbench.methods.base import TaskInfo

    spec = BackboneSpec(name="b16", timm_name="vit_base_patch16_224", timm_kwargs=arch)
    backbone = spec.create()
    d = backbone.embed_dim
    info = TaskInfo(num_classes=d, num_clients=1, class_priors=torch.ones(1, d) / d,
                    train_sizes=torch.ones(1))  # fmt: skip
    method = METHODS.get("sgpt")(SGPTConfig(num_groups=2, cluster_metric=False), backbone, info)
    assert (method.shared_layers, method.group_layers) == ((0, 1, 2, 3), (4, 5, 6))
    params = method.client_params(method.init_server(torch.Generator().manual_seed(0)),
                                  torch.zeros(1, dtype=torch.long))  # fmt: skip
    params["head_w"] = torch.eye(d).unsqueeze(0)  # the logits are the head's input
    params["head_b"] = torch.zeros(1, d)
    params["shared_prompts"] = torch.randn_like(params["shared_prompts"])
    x = torch.randn(2, 3, size, size)
    rows = torch.zeros(2, dtype=torch.long)
    entering, final = {}, {}
    hooks = [
        backbone.vit.blocks[b].register_forward_pre_hook(
            lambda _m, a, b=b: entering.__setitem__(b, a[0].detach())
        )
        for b in (4, 5, 6)
    ]
    hooks.append(backbone.vit.norm.register_forward_hook(
        lambda _m, _a, out: final.__setitem__("tokens", out.detach())))  # fmt: skip
    with torch.no_grad():
        groups, _ = method.select_groups(params["keys"], x, rows, Context(training=False))
        pooled = method.forward(params, x, rows, Context(training=False)).logits
    for h in hooks:
        h.remove()
    chosen = params["group_prompts"][0, groups]  # (B, 3, 1, d)
    for i, block in enumerate((4, 5, 6)):
        torch.testing.assert_close(entering[block][:, 1], chosen[:, i, 0])
    tokens = final["tokens"]  # (B, 1 + 3 + 4 + patches, d): cls, g6, g5, g4, s3..s0, patches
    assert tokens.shape[1] == 1 + 3 + 4 + (size // 16) ** 2
    torch.testing.assert_close(pooled, tokens[:, :4].mean(1), rtol=1e-5, atol=1e-5)
