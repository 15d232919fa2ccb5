"""FedPGP: the contrastive term by hand, ctx = U V + Sigma in CoOp's prompt, Sigma alone shared."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output, Updates
from fpbench.methods.fedpgp import pgp_contrastive
from tests.methods.common import features_as_images

from ..conftest import seeded_server, with_config
from .common import stacked_constants


def test_contrastive_term_by_hand():
    # anchor == global (cos 1), personal orthogonal to global (cos 0), tau = 0.5:
    # -log(e^2 / (e^2 + e^0)) = log(1 + e^-2)
    g = torch.tensor([[[1.0, 0.0]]])
    loss = pgp_contrastive(g, g, torch.tensor([[[0.0, 1.0]]]), 0.5)
    torch.testing.assert_close(loss, torch.tensor([math.log(1 + math.exp(-2.0))]))
    # two classes are averaged; a personal prompt equal to the global one gives log 2 there
    anchor = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    glob = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    pers = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    loss = pgp_contrastive(anchor, glob, pers, 1.0)
    c0 = math.log(1 + math.exp(-1.0))  # pos 1, neg 0
    c1 = -math.log(math.exp(0.0) / (math.exp(0.0) + math.exp(1.0)))  # pos 0, neg 1
    torch.testing.assert_close(loss, torch.tensor([(c0 + c1) / 2]))


def _coop_text(clip, names, ctx):
    """Text features (C, E) of "SOT ctx name . EOT", built from the token embeddings directly."""
    n = ctx.shape[0]
    ids = clip.tokenize([" ".join(["X"] * n + [c.replace("_", " ")]) + "." for c in names])
    emb = clip.token_embed(ids).clone()
    emb[:, 1 : 1 + n] = ctx
    return F.normalize(clip.encode_prompts(emb, ids), dim=-1)


def test_forward_uses_the_context_u_v_plus_sigma_and_the_anchor_is_the_placeholder_prompt(
    tiny, monkeypatch
):
    _, task, method = tiny("fedpgp")
    method = with_config(method, n_ctx=3, bottleneck=2)
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.randn(1, *v.shape, generator=gen) * 0.3
              for k, v in method.init_params(torch.Generator()).items()}  # fmt: skip
    clip, names = method.backbone, method.task.class_names
    x = clip.forward_features(clip.preprocess(task.data.train_images[:4])).cls
    features_as_images(monkeypatch, method)  # from here x holds image features
    rows = torch.zeros(4, dtype=torch.long)
    logits = method.forward(params, x, rows, Context(training=False))
    ctx = params["U"][0] @ params["V"][0] + params["sigma"][0]
    text = _coop_text(clip, names, ctx)
    expected = clip.logit_scale * F.normalize(x, dim=-1) @ text.T
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # training adds mu * the contrastive term of the sample's client to each sample
    out = method.forward(params, x, rows, Context(training=True))
    assert isinstance(out, Output)
    torch.testing.assert_close(out.logits, logits)
    ids = clip.tokenize(["X X X " + n.replace("_", " ") + "." for n in names])
    anchor = F.normalize(clip.encode_text(ids), dim=-1)
    glob = _coop_text(clip, names, params["sigma"][0])
    con = pgp_contrastive(anchor[None], glob[None], text[None], 0.5)
    torch.testing.assert_close(out.aux_loss, torch.full((4,), 0.5 * float(con)), atol=1e-5, rtol=0)


def test_only_sigma_is_shared_and_averaged_by_size(tiny):
    _, _, method = tiny("fedpgp")
    server = seeded_server(method)
    assert set(server.params) == {"sigma"} and set(server.personal) == {"U", "V"}
    assert method.inference == "personal"
    down, up = method.communication(server)
    assert set(down) == set(up) == {"sigma"}
    # every client starts from the same U, V
    for k in ("U", "V"):
        assert all(torch.equal(row, server.personal[k][0]) for row in server.personal[k])
    ids = torch.tensor([0, 2])
    trained = method.client_params(server, ids)
    trained["sigma"] = stacked_constants(server.params, [1.0, 4.0])["sigma"]
    trained["U"] = trained["U"] + torch.tensor([10.0, 20.0]).view(2, 1, 1)
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0])))
    torch.testing.assert_close(new.params["sigma"], torch.full_like(server.params["sigma"], 1.75))
    assert torch.equal(new.personal["U"][2], trained["U"][1])
    assert torch.equal(new.personal["U"][1], server.personal["U"][1])


def test_init_is_n_0_002_with_the_scripts_rank(tiny):
    _, _, method = tiny("fedpgp")
    p = method.init_params(torch.Generator().manual_seed(0))
    d = method.backbone.ctx_dim
    assert {k: tuple(v.shape) for k, v in p.items()} == {
        "U": (16, 8), "V": (8, d), "sigma": (16, d)
    }  # fmt: skip
    torch.testing.assert_close(float(p["sigma"].std()), 0.02, atol=2e-3, rtol=0)
