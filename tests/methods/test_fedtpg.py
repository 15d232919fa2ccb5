"""FedTPG: the prompt generator against torch's own modules and by hand; the client's label
space in training, every class at evaluation; uniform server mean."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fpbench.methods.base import Context, Updates
from fpbench.methods.fedtpg import generate
from tests.methods.common import features_as_images

from ..conftest import seeded_server, with_config
from .common import stacked_constants


def _random_params(method, seed=0):
    gen = torch.Generator().manual_seed(seed)
    start = method.init_params(torch.Generator().manual_seed(seed))
    return {k: (v + 0.1 * torch.randn(v.shape, generator=gen)).unsqueeze(0)
            for k, v in start.items()}  # fmt: skip


def test_generator_is_torchs_cross_attention_and_feed_forward(tiny):
    _, _, method = tiny("fedtpg")
    p = _random_params(method)
    d, dk = method.backbone.ctx_dim, method.backbone.embed_dim
    text = F.normalize(torch.randn(5, dk, generator=torch.Generator().manual_seed(3)), dim=-1)
    keep = torch.tensor([[True, False, True, True, False]])
    got = generate(p, text, keep, 4)[0]
    # independently, with torch's modules holding the same weights
    one = {k: v[0] for k, v in p.items()}
    mha = nn.MultiheadAttention(d, 4, kdim=dk, vdim=dk, batch_first=True)
    with torch.no_grad():
        if mha.in_proj_weight is not None:  # equal widths: torch packs q, k, v
            mha.in_proj_weight.copy_(torch.cat([one["q_w"], one["k_w"], one["v_w"]]))
        else:
            mha.q_proj_weight.copy_(one["q_w"])
            mha.k_proj_weight.copy_(one["k_w"])
            mha.v_proj_weight.copy_(one["v_w"])
        mha.in_proj_bias.copy_(torch.cat([one["q_b"], one["k_b"], one["v_b"]]))
        mha.out_proj.weight.copy_(one["out_w"])
        mha.out_proj.bias.copy_(one["out_b"])
    ln = lambda x, n: F.layer_norm(x, x.shape[-1:], one[f"{n}_w"], one[f"{n}_b"])  # noqa: E731
    q = ln(one["queries"], "ln_q")[None]
    kv = ln(text, "ln_kv")[None]
    h, _ = mha(q, kv, kv, key_padding_mask=~keep)
    a, g = F.linear(ln(h, "ff_ln"), one["ff1_w"], one["ff1_b"]).chunk(2, -1)
    expected = h + F.linear(a * F.gelu(g), one["ff2_w"], one["ff2_b"])
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)


def test_one_visible_class_makes_the_context_its_value_path_by_hand(tiny):
    # a single key gets all the attention: H = W_o (W_v LN(t) + b_v) + b_o, whatever the queries
    _, _, method = tiny("fedtpg")
    p = _random_params(method, seed=1)
    dk = method.backbone.embed_dim
    text = F.normalize(torch.randn(3, dk, generator=torch.Generator().manual_seed(4)), dim=-1)
    keep = torch.tensor([[False, True, False]])
    got = generate(p, text, keep, 4)[0]
    one = {k: v[0] for k, v in p.items()}
    t = F.layer_norm(text[1], (dk,), one["ln_kv_w"], one["ln_kv_b"])
    h = one["out_w"] @ (one["v_w"] @ t + one["v_b"]) + one["out_b"]  # (d,)
    a, g = F.linear(F.layer_norm(h, h.shape, one["ff_ln_w"], one["ff_ln_b"]), one["ff1_w"],
                    one["ff1_b"]).chunk(2)  # fmt: skip
    row = h + one["ff2_w"] @ (a * 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))) + one["ff2_b"]
    torch.testing.assert_close(got, row.expand_as(got), atol=1e-5, rtol=1e-5)


def test_training_uses_the_clients_classes_evaluation_every_class(tiny, monkeypatch):
    _, task, method = tiny("fedtpg")
    p = _random_params(method, seed=2)
    clip = method.backbone
    x = clip.forward_features(clip.preprocess(task.data.train_images[:3])).cls
    features_as_images(monkeypatch, method)  # from here x holds image features
    rows = torch.zeros(3, dtype=torch.long)
    c = method.task.num_classes
    priors = torch.zeros(1, c)
    priors[0, [1, 3]] = 0.5
    train = method.forward(p, x, rows, Context(training=True, priors=priors))
    assert torch.isinf(train[:, [0, 2] + list(range(4, c))]).all()
    keep = priors > 0
    text = method.text_features(generate(p, method.name_features(), keep, 4))
    expected = clip.logit_scale * F.normalize(x, dim=-1) @ text[0].T
    torch.testing.assert_close(train[:, [1, 3]], expected[:, [1, 3]], atol=1e-4, rtol=1e-4)
    full = method.forward(p, x, rows, Context(training=False))
    text = method.text_features(
        generate(p, method.name_features(), torch.ones(1, c, dtype=bool), 4)
    )
    expected = clip.logit_scale * F.normalize(x, dim=-1) @ text[0].T
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)
    # the names are CLIP's features of the bare class names
    ids = clip.tokenize([n.replace("_", " ") for n in method.task.class_names])
    torch.testing.assert_close(method.name_features(), F.normalize(clip.encode_text(ids), dim=-1))


def test_init_follows_torchs_defaults_and_the_mean_is_uniform(tiny):
    _, _, method = tiny("fedtpg")
    server = seeded_server(method)
    p = server.params
    d = method.backbone.ctx_dim
    assert p["queries"].shape == (4, d) and server.personal == {}
    qkv = torch.cat([p["q_w"], p["k_w"], p["v_w"]])  # clip-test: text width = joint width
    assert float(qkv.abs().max()) <= math.sqrt(6 / (4 * d)) and float(qkv.abs().max()) > 0.9 * (
        math.sqrt(6 / (4 * d))
    )
    for k in ("q_b", "k_b", "v_b", "out_b", "ln_q_b", "ff_ln_b"):
        assert torch.equal(p[k], torch.zeros_like(p[k])), k
    assert torch.equal(p["ln_kv_w"], torch.ones_like(p["ln_kv_w"]))
    trained = stacked_constants(p, [1.0, 4.0])
    ids, sizes = torch.tensor([0, 1]), torch.tensor([30.0, 10.0])
    for m, value in ((method, 2.5), (with_config(method, aggregation="size"), 1.75)):
        new = m.aggregate(server, Updates(trained, ids, sizes))
        for v in new.params.values():
            torch.testing.assert_close(v, torch.full_like(v, value))
