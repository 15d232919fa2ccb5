"""FGPT / FGPT-U math: fixed keys, selection, frequency-weighted group aggregation, top-K."""

from __future__ import annotations

import pytest
import torch

from fpbench.engine.executor import train_clients
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates
from fpbench.methods.fgpt import (
    PRESETS,
    FGPTConfig,
    aggregate_groups,
    default_layer,
    make_keys,
    mean_pairwise_cosine,
    prompt_similarities,
    select_groups,
)
from fpbench.registry import METHODS

from ..conftest import seeded_server, with_config
from .common import assert_presets_are_rows


def _method(tiny, name="fgpt", **args):
    """(cfg, task, method) on the tiny federation with these method args."""
    cfg, task, method = tiny(name)
    return cfg, task, with_config(method, **args)


def test_orthogonal_keys_are_orthonormal_and_random_keys_are_not():
    keys = make_keys(torch.Generator().manual_seed(0), 5, 8, "orthogonal")
    torch.testing.assert_close(keys @ keys.T, torch.eye(5), atol=1e-5, rtol=0)
    rand = make_keys(torch.Generator().manual_seed(0), 5, 8, "random")
    off = rand @ rand.T - torch.diag(torch.diagonal(rand @ rand.T))
    assert rand.shape == (5, 8) and off.abs().max() > 0.1
    with pytest.raises(FpbenchError, match="num_groups"):
        make_keys(torch.Generator(), 9, 8, "orthogonal")


def test_group_aggregation_is_selection_frequency_weighted():
    stacked = torch.tensor([[[1.0], [5.0], [2.0]], [[9.0], [7.0], [4.0]]])  # (K=2, G=3, 1)
    counts = torch.tensor([[3.0, 0.0, 1.0], [1.0, 0.0, 1.0]])
    previous = torch.tensor([[0.0], [-1.0], [0.0]])
    out = aggregate_groups(stacked, counts, previous)
    # g0: 3/4 * 1 + 1/4 * 9 = 3; g1: nobody selected it -> previous; g2: (2 + 4) / 2 = 3
    torch.testing.assert_close(out, torch.tensor([[3.0], [-1.0], [3.0]]))


def test_default_group_layer_maps_the_papers_sixth_layer():
    assert default_layer(5, 12) == 5  # L_6, 1-based, of ViT-B
    assert default_layer(5, 4) == 1 and default_layer(5, 2) == 0


def test_config_defaults_are_the_papers():
    cfg = FGPTConfig()
    assert (cfg.num_groups, cfg.shared_prompt_len, cfg.group_prompt_len) == (20, 5, 1)
    assert cfg.keys == "orthogonal" and cfg.topk == 1
    assert METHODS.get("fgpt-u").Config().topk == 5


def test_bad_layer_and_topk_raise(tiny):
    with pytest.raises(FpbenchError, match="group_layer"):
        _method(tiny, group_layer=2)  # vit-test has 2 blocks
    with pytest.raises(FpbenchError, match="topk"):
        _method(tiny, num_groups=3, topk=4)


def _manual_logits(method, params, x, group_idx, layer):
    """The prompted forward written out with the backbone's own prompt insertion."""
    vit = method.backbone
    b = len(x)
    shared = params["shared_prompts"][0].expand(b, -1, -1)
    group = params["group_prompts"][0, group_idx]  # (B, p, d)
    prompts = {0: shared, layer: group} if layer else {0: torch.cat([group, shared], 1)}
    cls = vit.forward_features(x, prompts, style="accumulate").cls
    return cls @ params["head_w"][0].T + params["head_b"][0]


@pytest.mark.parametrize("layer", [0, 1])
def test_forward_inserts_the_selected_group_prompt_at_its_layer(tiny, layer):
    _, task, method = _method(tiny, group_layer=layer, num_groups=4)
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:6])
    keys = server.buffers["keys"]
    query = method.backbone.forward_features(x).cls  # frozen, unprompted cls
    chosen = (torch.nn.functional.normalize(query, dim=-1) @ keys.T).argmax(-1)
    rows = torch.zeros(6, dtype=torch.long)
    ctx = Context(training=True, buffers=server.buffers)
    out = method.forward(params, x, rows, ctx)
    torch.testing.assert_close(out.logits, _manual_logits(method, params, x, chosen, layer))
    assert out.stats["group_counts"].tolist() == [[float((chosen == g).sum()) for g in range(4)]]


def test_fgpt_u_averages_the_top_k_groups_logits(tiny):
    _, task, method = _method(tiny, "fgpt-u", group_layer=1, num_groups=4, topk=2)
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:5])
    top = select_groups(method.backbone.forward_features(x).cls, server.buffers["keys"], 2)
    expected = sum(_manual_logits(method, params, x, top[:, i], 1) for i in range(2)) / 2
    rows = torch.zeros(5, dtype=torch.long)
    ctx = Context(training=False, buffers=server.buffers)
    torch.testing.assert_close(method.forward(params, x, rows, ctx), expected)
    train = method.forward(params, x, rows, Context(training=True, buffers=server.buffers))
    torch.testing.assert_close(train.logits, _manual_logits(method, params, x, top[:, 0], 1))


def test_round_counts_selections_and_aggregates_by_frequency(tiny):
    cfg, task, method = _method(tiny, num_groups=3)
    server = seeded_server(method)
    ids = task.trainable_clients()
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    counts = local.stats["group_counts"]  # (K, G)
    sizes = task.train_sizes[local.client_ids]
    assert counts.sum(1).tolist() == (sizes * cfg.train.local_epochs).tolist()
    new = method.aggregate(server, Updates(local.params, local.client_ids, sizes, local.stats))
    w = sizes / sizes.sum()
    torch.testing.assert_close(new.params["head_w"], torch.tensordot(w, local.params["head_w"], 1))
    torch.testing.assert_close(
        new.params["shared_prompts"], torch.tensordot(w, local.params["shared_prompts"], 1)
    )
    beta = counts / counts.sum(0)
    for g in range(3):
        if counts[:, g].sum() > 0:
            expected = torch.tensordot(beta[:, g], local.params["group_prompts"][:, g], 1)
            torch.testing.assert_close(new.params["group_prompts"][g], expected)
    assert torch.equal(new.buffers["keys"], server.buffers["keys"])  # keys are never trained
    torch.testing.assert_close(new.buffers["selection_counts"], counts.sum(0).float())
    assert method.round_metrics(server) == {}  # NaN before any round: not stored
    metrics = method.round_metrics(new)
    assert set(metrics) == {
        "sim_shared_prompt",
        "sim_group_prompt_global",
        "sim_group_prompt_local",
    }
    assert metrics["sim_shared_prompt"] == pytest.approx(
        mean_pairwise_cosine(local.params["shared_prompts"]).item()
    )
    down, up = method.communication(new)
    assert "keys" not in down and set(up) == set(new.params) | {"selection_counts"}


def test_prompt_similarities_of_table_11():
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert mean_pairwise_cosine(torch.stack([a, a, b])).item() == pytest.approx(1 / 3)
    shared = torch.stack([a, a])  # (K=2, S=1, d)
    group = torch.stack([torch.stack([a, a]), torch.stack([a, b])])  # (K=2, G=2, 1, d)
    counts = torch.tensor([[1.0, 2.0], [3.0, 0.0]])  # group 1: only client 0 selected it
    sims = prompt_similarities(shared, group, counts, torch.stack([a, b]))
    assert sims["sim_shared_prompt"].item() == pytest.approx(1.0)
    assert sims["sim_group_prompt_global"].item() == pytest.approx(0.0)
    assert sims["sim_group_prompt_local"].item() == pytest.approx(1.0)  # group 0 only (a vs a)


def test_shared_only_is_vpt_shallow(tiny):
    _, task, method = _method(tiny, num_groups=0)
    server = seeded_server(method)
    assert "group_prompts" not in server.params and "keys" not in server.buffers
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:3])
    cls = method.backbone.forward_features(x, {0: params["shared_prompts"][0][None]}).cls
    logits = method.forward(params, x, torch.zeros(3, dtype=torch.long), Context(training=True))
    torch.testing.assert_close(logits, cls @ params["head_w"][0].T + params["head_b"][0])


def test_shared_prompted_query_selects_on_the_prompted_cls(tiny):
    _, task, method = _method(tiny, query="shared-prompted", num_groups=4)
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:8])
    shared = params["shared_prompts"][0].expand(8, -1, -1)
    prompted = method.backbone.forward_features(x, {0: shared}).cls
    ctx = Context(training=True)
    torch.testing.assert_close(method.select_query(x, shared, ctx), prompted)
    frozen = _method(tiny, num_groups=4)[2]
    torch.testing.assert_close(frozen.query(x), method.backbone.forward_features(x).cls)
    assert not torch.allclose(frozen.query(x), prompted)
    torch.testing.assert_close(frozen.select_query(x, shared, ctx), frozen.query(x))


def test_engine_cached_query_gives_the_same_training(tiny):
    cfg, task, method = _method(tiny, num_groups=4)
    server = seeded_server(method)
    ids = task.trainable_clients()
    inputs = Inputs.of(method, task, FeatureCache(), batch_size=16)
    idx = torch.arange(5)
    x = method.backbone.preprocess(task.data.train_images[idx])
    cached = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, inputs=inputs)
    store = {s.what: s for s in inputs.frozen_splits()}["cls (train)"]  # found: Select's cls
    torch.testing.assert_close(store[idx], method.query(x))
    plain = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    assert torch.equal(cached.stats["group_counts"], plain.stats["group_counts"])
    for k in plain.params:
        torch.testing.assert_close(cached.params[k], plain.params[k])


# The paper's ablation rows, written out from the paper (not from PRESETS): each preset must
# resolve to exactly these settings, everything else FGPT's defaults.
PAPER_ROWS = {
    "table4-pt-fedavg": {"num_groups": 1},  # D.4: shared and group positions, FedAvg
    "table4-group-random-keys": {"keys": "random"},
    "table4-orthogonal-keys": {},
    "table4-u-inference": {"topk": 5},
    "table3-groups-15": {"num_groups": 15},
    "table3-groups-20": {"num_groups": 20},
    "table3-groups-25": {"num_groups": 25},
    "table3-groups-30": {"num_groups": 30},
    "table3-groups-35": {"num_groups": 35},
    "table6-u2": {"topk": 2},
    "table6-u5": {"topk": 5},
    "table10-resnet50": {"select_encoder": "resnet50"},
    "table11-shared-only": {"num_groups": 0},
}


def test_presets_are_the_papers_rows():
    assert_presets_are_rows(FGPTConfig, PRESETS, PAPER_ROWS)


def test_pt_fedavg_is_fedavg_at_the_shared_and_group_positions(tiny):
    """Table 4 / 11's PT-FedAvg: one group prompt, every sample selects it, so its aggregation
    by selection counts is FedAvg by train size, and it still enters at FGPT's group layer."""
    cfg, task, method = _method(tiny, preset="table4-pt-fedavg")
    assert method.group_layer == default_layer(5, method.backbone.depth)
    server = seeded_server(method)
    local = train_clients(
        method, server, task, task.trainable_clients(), cfg.train, round_idx=0, seed=0
    )
    sizes = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, sizes, local.stats))
    w = sizes / sizes.sum()
    for k in ("group_prompts", "shared_prompts", "head_w"):
        torch.testing.assert_close(new.params[k], torch.tensordot(w, local.params[k], 1))


def test_lighter_select_encoder_from_timm(tiny):
    _, task, method = _method(tiny, select_encoder="resnet10t", select_pretrained=False)
    server = seeded_server(method)
    assert server.buffers["keys"].shape == (20, 512)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:2])
    out = method.forward(
        params, x, torch.zeros(2, dtype=torch.long), Context(False, buffers=server.buffers)
    )
    assert out.shape == (2, task.data.num_classes) and torch.isfinite(out).all()
    with pytest.raises(FpbenchError, match="select_encoder"):
        _method(tiny, select_encoder="no-such-model")
