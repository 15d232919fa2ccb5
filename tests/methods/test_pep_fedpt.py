"""PEP-FedPT math: CCMP weights and mixture, priors, prototype schedule, DP sensitivity."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from fpbench.backbones import VIT_TEST_ARCH, PromptedViT
from fpbench.engine.executor import train_clients
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates
from fpbench.methods.pep_fedpt import (
    PRESETS,
    PEPConfig,
    ccmp_weights,
    class_sums,
    default_layers,
    dp_sensitivity,
    laplace,
    max_deviation,
    mix_prompts,
    update_prototypes,
)
from fpbench.registry import METHODS

from ..conftest import seeded_server, with_config
from .common import assert_presets_are_rows


def _warm_client(method, task):
    """Buffers after three rounds (seeded random prototypes), client 2's params, 4 images."""
    server = seeded_server(method)
    protos = torch.randn(
        server.buffers["prototypes"].shape, generator=torch.Generator().manual_seed(1)
    )
    buffers = {**server.buffers, "prototypes": protos, "rounds_done": torch.tensor(3)}
    params = method.client_params(server, torch.tensor([2]))
    return buffers, params, method.backbone.preprocess(task.data.train_images[:4])


def _method(tiny, **args):
    cfg, task, method = tiny("pep-fedpt")
    return cfg, task, with_config(method, **args)


def test_ccmp_weights_by_hand():
    cls = torch.tensor([[2.0, 0.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 3.0], [-1.0, 0.0]])  # cos = 1, 0, -1
    priors = torch.tensor([[0.5, 0.25, 0.25]])
    s = ccmp_weights(cls, protos, priors, tau=0.5)
    raw = torch.tensor([math.exp(2) * 0.5, 0.25, math.exp(-2) * 0.25])
    torch.testing.assert_close(s, (raw / raw.sum())[None])


def test_ccmp_weights_prior_zero_and_limits():
    cls = torch.tensor([[1.0, 0.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # last: no prototype yet
    s = ccmp_weights(cls, protos, torch.tensor([[0.0, 0.5, 0.5]]), tau=0.05)
    assert s[0, 0] == 0  # a class the client does not have never mixes in
    torch.testing.assert_close(s[0, 1:], torch.tensor([0.5, 0.5]))  # cos 0 both
    prior = torch.tensor([[0.2, 0.3, 0.5]])
    torch.testing.assert_close(ccmp_weights(cls, protos, prior, 1e6), prior, atol=1e-5, rtol=0)
    assert ccmp_weights(cls, protos, prior, 1e-4).argmax().item() == 0  # tau -> 0: nearest


def test_mix_prompts_is_the_weighted_sum_of_class_prompts():
    prompts = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [4.0, 4.0]]]).expand(2, -1, -1)
    w = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.25, 0.75]])
    torch.testing.assert_close(mix_prompts(w, prompts), torch.tensor([[[0.5, 1.0]], [[3.0, 3.5]]]))


def test_class_sums_and_deviation_per_row_and_class():
    feats = torch.tensor([[[1.0, 0.0]], [[3.0, 2.0]], [[5.0, 5.0]], [[0.0, 1.0]]])  # (B, L=1, 2)
    rows, labels = torch.tensor([0, 0, 1, 0]), torch.tensor([1, 1, 0, 0])
    sums, counts = class_sums(feats, rows, labels, 2, 2)
    assert counts.tolist() == [[1.0, 2.0], [1.0, 0.0]]
    assert sums[0, 0].tolist() == [[0.0, 1.0], [4.0, 2.0]] and sums[1, 0, 0].tolist() == [5.0, 5.0]
    protos = torch.tensor([[[0.0, 0.0], [2.0, 1.0]]])  # (L, C, d)
    dev = max_deviation(feats, protos, rows, labels, 2)  # L1 to the global prototype
    assert dev[0, 0].tolist() == [1.0, 2.0] and dev[1, 0].tolist() == [10.0, 0.0]
    sens = dp_sensitivity(dev, counts)
    assert sens[0, 0].tolist() == [2.0, 2.0]  # 2 * 1 / 1, 2 * 2 / 2


def test_laplace_noise_scale():
    gen = torch.Generator().manual_seed(0)
    x = laplace((20000,), torch.tensor(3.0), gen)
    assert abs(x.mean().item()) < 0.1 and x.abs().mean().item() == pytest.approx(3.0, rel=0.05)
    assert laplace((5,), torch.zeros(5), gen).abs().max() == 0


def _buffers(protos, t):
    return {
        "prototypes": protos,
        "period_sum": torch.zeros_like(protos),
        "period_holders": torch.zeros(protos.shape[1]),
        "rounds_done": torch.tensor(t),
    }


def test_prototype_warm_start_then_periodic_momentum():
    means = torch.tensor([[[[2.0], [9.0], [0.0]]], [[[4.0], [0.0], [0.0]]]])  # (K=2, L=1, C=3, 1)
    held = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    warm = update_prototypes(_buffers(torch.zeros(1, 3, 1), 0), means, held, 2, 0.25)
    # eq. 19 over holders: class 0 (2 + 4) / 2, class 1 only client 0, class 2 nobody
    assert warm["prototypes"].flatten().tolist() == [3.0, 9.0, 0.0]
    assert warm["rounds_done"] == 1 and warm["period_holders"].sum() == 0
    mid = update_prototypes(warm, means, held, 2, 0.25)  # t = 1: accumulate only
    assert torch.equal(mid["prototypes"], warm["prototypes"])
    assert mid["period_holders"].tolist() == [2.0, 1.0, 0.0]
    means2 = torch.tensor([[[[8.0], [1.0], [0.0]]]])
    end = update_prototypes(mid, means2, torch.tensor([[1.0, 1.0, 0.0]]), 2, 0.25)  # t = 2
    # hat: class 0 (2 + 4 + 8) / 3, class 1 (9 + 1) / 2; mu = 0.25 mu + 0.75 hat; class 2 keeps
    expected = [0.25 * 3 + 0.75 * 14 / 3, 0.25 * 9 + 0.75 * 5, 0.0]
    torch.testing.assert_close(end["prototypes"].flatten(), torch.tensor(expected))
    assert end["period_holders"].sum() == 0 and end["rounds_done"] == 3


def test_default_layers_and_config_are_the_papers(tiny):
    assert default_layers(12) == (5, 6, 7)
    assert default_layers(4) == (1, 2) and default_layers(2) == (0, 1)
    cfg = PEPConfig()
    assert (cfg.num_shared, cfg.tau, cfg.prototype_period, cfg.use_priors) == (1, 0.05, 10, True)
    assert cfg.aggregation == "uniform" and cfg.ccmp_style == "replace" and cfg.dp_epsilon is None
    with pytest.raises(FpbenchError, match="ccmp_layers"):
        _method(tiny, ccmp_layers=[1, 0])
    with pytest.raises(FpbenchError, match="ccmp_layers"):
        _method(tiny, ccmp_layers=[2])


# The paper's ablation rows, written out from the paper (not from PRESETS); block indices are
# ViT-B's. Each preset must resolve to exactly these settings, the rest PEP-FedPT's defaults.
PAPER_ROWS = {
    "table4-shared-only": {"ccmp_layers": ()},
    "table4-shared-ccmp": {},
    "table5-without-priors": {"use_priors": False},
    "table5-with-priors": {},
    "table11-ns-1": {"num_shared": 1},
    "table11-ns-5": {"num_shared": 5},
    "table11-ns-10": {"num_shared": 10},
    "table13-layers-1-2-3": {"ccmp_layers": (1, 2, 3)},
    "table13-layers-5-6-7": {"ccmp_layers": (5, 6, 7)},
    "table13-layers-8-9-10": {"ccmp_layers": (8, 9, 10)},
    **{
        f"table17-layers-{a}-{a + 1}-{a + 2}-tau-{tau}": {
            "ccmp_layers": (a, a + 1, a + 2),
            "tau": t,
        }
        for a in (1, 5, 9)
        for tau, t in (("0.0001", 1e-4), ("0.05", 0.05), ("100", 100.0))
    },
    **{
        f"fig10-tau-{tau}": {"tau": t}
        for tau, t in (
            ("1e-05", 1e-5),
            ("0.0001", 1e-4),
            ("0.001", 1e-3),
            ("0.01", 1e-2),
            ("0.05", 0.05),
            ("1", 1.0),
            ("10", 10.0),
            ("100", 100.0),
        )
    },  # fmt: skip
    "table8-dp-eps-0.2": {"dp_epsilon": 0.2},
}


def test_presets_are_the_papers_rows():
    assert_presets_are_rows(PEPConfig, PRESETS, PAPER_ROWS)


def _manual(method, params, x, protos, prior, style):
    """Eqs. 5-8 written out on the backbone's blocks, for one client row."""
    vit, b = method.backbone, len(x)
    p_c = params["class_prompts"][0]
    tokens = vit.embed(x)
    tokens = torch.cat(
        [tokens[:, :1], params["shared_prompts"][0].expand(b, -1, -1), tokens[:, 1:]], 1
    )
    n, start = 1, 0
    for j, block in enumerate(method.layers):
        tokens, _, n = vit.run_blocks(tokens, start, block, None, "accumulate", n)
        s = ccmp_weights(tokens[:, 0], protos[j], prior.expand(b, -1), method.cfg.tau)
        m = (s @ p_c)[:, None]  # (B, 1, d)
        cut = 2 if (j and style == "replace") else 1
        tokens = torch.cat([tokens[:, :1], m, tokens[:, cut:]], 1)
        n += cut == 1
        start = block
    tokens, _, n = vit.run_blocks(tokens, start, vit.depth, None, "accumulate", n)
    cls = vit.finish(tokens, n).cls
    return cls @ params["head_w"][0].T + params["head_b"][0], tokens.shape[1]


@pytest.mark.parametrize("style", ["replace", "accumulate"])
def test_forward_mixes_class_prompts_into_each_ccmp_block(tiny, style):
    _, task, method = _method(tiny, ccmp_style=style, tau=0.5)
    assert method.layers == (0, 1)
    buffers, params, x = _warm_client(method, task)
    protos = buffers["prototypes"]
    prior = task.priors[2:3]
    ctx = Context(training=False, priors=prior, buffers=buffers)
    logits = method.forward(params, x, torch.zeros(4, dtype=torch.long), ctx)
    expected, length = _manual(method, params, x, protos, prior, style)
    torch.testing.assert_close(logits, expected)
    tokens = 1 + 1 + (x.shape[-1] // method.backbone.patch_size) ** 2
    assert length == tokens + (1 if style == "replace" else 2)


def test_client_prior_conditions_the_prediction(tiny):
    _, task, method = _method(tiny)
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0, 1]))
    x = method.backbone.preprocess(task.data.train_images[:3]).repeat(2, 1, 1, 1)
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    priors = torch.stack([torch.eye(6)[0], torch.eye(6)[5]])  # two clients, one class each
    out = method.forward(params, x, rows, Context(False, priors=priors, buffers=server.buffers))
    assert not torch.allclose(out[:3], out[3:])  # same images, same weights, other prior
    _, _, flat = _method(tiny, use_priors=False)
    uniform = torch.full((2, 6), 1 / 6)
    a = flat.forward(params, x, rows, Context(False, priors=priors, buffers=server.buffers))
    b = method.forward(params, x, rows, Context(False, priors=uniform, buffers=server.buffers))
    torch.testing.assert_close(a, b)  # without priors = uniform priors (Table 5)
    torch.testing.assert_close(a[:3], a[3:])
    assert method.inference == "client-conditioned"


def _frozen_class_means(method, task, clients):
    """(K, L, C, d) class means of the frozen model's cls entering blocks 0 and 1; counts."""
    x = method.backbone.preprocess(task.data.train_images)
    with torch.no_grad():
        emb = method.backbone.embed(x)
        after0, _, _ = method.backbone.run_blocks(emb, 0, 1)
    feats = torch.stack([emb[:, 0], after0[:, 0]], 1)  # (n, L=2, d)
    sums, counts = [], []
    for c in clients:
        idx = task.train_idx[c]
        y = task.data.train_labels[idx]
        s, n = class_sums(feats[idx], torch.zeros_like(y), y, 1, 6)
        sums.append(s[0])
        counts.append(n[0])
    return torch.stack(sums), torch.stack(counts)


def test_warm_start_is_the_frozen_class_mean_over_holders(tiny):
    _, task, method = _method(tiny)
    server = seeded_server(method)
    ids = task.trainable_clients()  # S_0 = every training client by default
    sums, counts = _frozen_class_means(method, task, ids)
    holders = (counts > 0).sum(0)  # (C,)
    means = sums / counts.clamp(min=1)[:, None, :, None]
    expected = means.sum(0) / holders.clamp(min=1)[None, :, None]
    torch.testing.assert_close(server.buffers["prototypes"], expected, atol=1e-5, rtol=1e-5)
    assert server.buffers["rounds_done"] == 1
    _, _, one = _method(tiny, warm_start_clients=1)
    s0 = one._warm_start_clients(torch.Generator().manual_seed(3))
    assert len(s0) == 1 and s0[0] in ids


def test_warm_start_reports_its_pass_over_s0(tiny):
    from fpbench.stages import reporting

    _, task, method = _method(tiny)
    seen = []
    with reporting(lambda what, done, total: seen.append((what, done, total))):
        seeded_server(method)
    n = sum(len(task.train_idx[c]) for c in task.trainable_clients())
    what = "frozen class means (PEP-FedPT warm start)"
    assert seen[0] == (what, 0, n) and seen[-1] == (what, n, n)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def test_without_client_data_the_first_round_warm_starts_from_frozen_features(tiny):
    cfg, task, method = _method(tiny)
    method.task = dataclasses.replace(method.task, train_images=None)
    server = seeded_server(method)
    assert server.buffers["rounds_done"] == 0 and server.buffers["prototypes"].abs().sum() == 0
    ids = task.trainable_clients()
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    sums, counts = _frozen_class_means(method, task, local.client_ids.tolist())
    torch.testing.assert_close(local.stats["proto_sum"], sums, atol=1e-4, rtol=1e-5)
    assert torch.equal(local.stats["proto_count"], counts)
    sizes = task.train_sizes[local.client_ids]
    warm = method.aggregate(server, Updates(local.params, local.client_ids, sizes, local.stats))
    assert warm.buffers["rounds_done"] == 1 and warm.buffers["prototypes"].abs().sum() > 0


def test_prompted_prototypes_and_dp_agree_across_executors(tiny):
    cfg, task, method = _method(tiny, dp_epsilon=1.0, prototype_period=1)
    server = seeded_server(method)
    ids = task.trainable_clients()
    ref = train_clients(
        method, server, task, ids, cfg.train, round_idx=0, seed=0, executor="reference"
    )
    lock = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    for k in ("proto_sum", "proto_count", "max_proto_dev"):
        torch.testing.assert_close(lock.stats[k], ref.stats[k], atol=2e-5, rtol=1e-4)
    sums, _ = _frozen_class_means(method, task, ref.client_ids.tolist())
    assert not torch.allclose(ref.stats["proto_sum"], sums, atol=1e-3)  # prompted, not frozen
    sizes = task.train_sizes[ref.client_ids]
    a = method.aggregate(server, Updates(ref.params, ref.client_ids, sizes, ref.stats))
    b = method.aggregate(server, Updates(lock.params, lock.client_ids, sizes, lock.stats))
    torch.testing.assert_close(
        a.buffers["prototypes"], b.buffers["prototypes"], atol=1e-4, rtol=1e-4
    )
    assert not torch.equal(a.buffers["prototypes"], server.buffers["prototypes"])  # R = 1 update


def test_dp_noise_follows_the_sensitivity(tiny):
    _, _, method = _method(tiny, dp_epsilon=0.5)
    server = seeded_server(method)
    means = torch.zeros(2, 2, 6, 32)
    dev = torch.zeros(2, 2, 6)
    dev[0, 1, 3] = 4.0  # client row 0, block 1, class 3: max L1 deviation 4 over 2 samples
    counts = torch.zeros(2, 6)
    counts[0, 3] = 2.0
    noisy = method._noisy(means, dev, counts, torch.tensor([1, 2]), server.buffers)
    nonzero = (noisy != 0).any(-1)
    assert nonzero.nonzero().tolist() == [[0, 1, 3]]  # zero sensitivity: no noise
    scale = 2 * 4.0 / 2 / 0.5  # S / epsilon = 8
    assert 0 < noisy[0, 1, 3].abs().mean().item() < 5 * scale
    again = method._noisy(means, dev, counts, torch.tensor([1, 2]), server.buffers)
    assert torch.equal(noisy, again)  # seeded by (run, round, client): resumable
    method.local_epochs = 2  # the 2 counted passes were 1 sample seen twice: S doubles
    twice = method._noisy(means, dev, counts, torch.tensor([1, 2]), server.buffers)
    torch.testing.assert_close(twice, 2 * noisy)


@pytest.mark.parametrize("kind", ["uniform", "samples"])
def test_everything_trained_is_fedavged(tiny, kind):
    _, _, method = _method(tiny, aggregation=kind)
    server = seeded_server(method)
    trained = {
        k: torch.stack([torch.full_like(v, 1.0), torch.full_like(v, 4.0)])
        for k, v in server.params.items()
    }
    stats = {"proto_sum": torch.zeros(2, 2, 6, 32), "proto_count": torch.zeros(2, 6)}
    sizes = torch.tensor([30.0, 10.0])
    new = method.aggregate(server, Updates(trained, torch.tensor([0, 2]), sizes, stats))
    value = 2.5 if kind == "uniform" else 1.75  # (1 + 4) / 2; (30 * 1 + 10 * 4) / 40
    for v in new.params.values():
        torch.testing.assert_close(v, torch.full_like(v, value))
    assert torch.equal(new.buffers["prototypes"], server.buffers["prototypes"])  # nobody held


def test_communication_and_shared_only_ablation(tiny):
    _, task, method = _method(tiny)
    server = seeded_server(method)
    down, up = method.communication(server)
    assert (
        set(down)
        == set(up)
        == {"shared_prompts", "class_prompts", "head_w", "head_b", "prototypes"}
    )
    assert down["prototypes"].shape == (2, 6, 32)
    _, _, shared = _method(tiny, ccmp_layers=[])
    s = seeded_server(shared)
    assert set(s.params) == {"shared_prompts", "head_w", "head_b"} and not s.buffers
    params = shared.client_params(s, torch.tensor([0]))
    x = shared.backbone.preprocess(task.data.train_images[:2])
    cls = shared.backbone.forward_features(x, {0: params["shared_prompts"][0][None]}).cls
    out = shared.forward(
        params, x, torch.zeros(2, dtype=torch.long), Context(False, priors=task.priors[:1])
    )
    torch.testing.assert_close(out, cls @ params["head_w"][0].T + params["head_b"][0])


def _deep_method(tiny, **args):
    """PEP-FedPT on a 12-block tiny ViT (ViT-B's depth): the default CCMP blocks 5, 6, 7 are
    deep enough that the cls entering them depends on the input (on the 2-block test backbone
    the first CCMP block sees the embedded cls token, the same for every image)."""
    cfg, task, small = tiny("pep-fedpt")
    arch = {**VIT_TEST_ARCH, "depth": 12}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        deep = PromptedViT(
            VisionTransformer(**arch, num_classes=0), mean=(0.5,) * 3, std=(0.5,) * 3
        )
    cls = METHODS.get("pep-fedpt")
    return cfg, task, cls(cls.Config(**args), deep, small.task)


def test_ccmp_on_a_deep_backbone_mixes_per_sample_weights_at_blocks_5_6_7(tiny):
    cfg, task, method = _deep_method(tiny, tau=0.5)
    assert method.layers == (5, 6, 7)
    buffers, params, x = _warm_client(method, task)
    protos = buffers["prototypes"]
    prior = torch.full((1, task.data.num_classes), 1.0 / task.data.num_classes)
    vit = method.backbone
    tokens = torch.cat([vit.embed(x)[:, :1], params["shared_prompts"][0].expand(4, -1, -1)], 1)
    tokens = torch.cat([tokens, vit.embed(x)[:, 1:]], 1)
    entering, _, _ = vit.run_blocks(tokens, 0, 5, None, "accumulate", 1)  # cls entering block 5
    s = ccmp_weights(entering[:, 0], protos[0], prior.expand(4, -1), method.cfg.tau)
    assert (s - s[:1]).abs().amax(-1)[1:].min() > 1e-4  # every image its own mixture
    first = ccmp_weights(vit.embed(x)[:, 0], protos[0], prior.expand(4, -1), method.cfg.tau)
    assert (first - first[:1]).abs().max() < 1e-6  # block 0 would give all images one mixture
    ctx = Context(training=False, priors=prior, buffers=buffers)
    logits = method.forward(params, x, torch.zeros(4, dtype=torch.long), ctx)
    expected, _ = _manual(method, params, x, protos, prior, method.cfg.ccmp_style)
    torch.testing.assert_close(logits, expected)
