"""PromptFolio: the feature portfolio by hand, the local prompt private, the global averaged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates
from fpbench.methods.promptfolio import mix_features
from tests.methods.common import features_as_images

from ..conftest import seeded_server, with_config
from .common import stacked_constants


def test_mix_by_hand():
    g, loc = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    torch.testing.assert_close(mix_features(g, loc, 0.4), torch.tensor([[0.6, 0.4]]))
    torch.testing.assert_close(mix_features(g, loc, 0.0), g)  # theta 0: the global prompt alone
    torch.testing.assert_close(mix_features(g, loc, 1.0), loc)


def _coop_text(clip, names, ctx):
    """Normalised text features (C, E) of "SOT ctx name . EOT" from the token embeddings."""
    n = ctx.shape[0]
    ids = clip.tokenize([" ".join(["X"] * n + [c.replace("_", " ")]) + "." for c in names])
    emb = clip.token_embed(ids).clone()
    emb[:, 1 : 1 + n] = ctx
    return F.normalize(clip.encode_prompts(emb, ids), dim=-1)


def test_logits_mix_the_two_prompts_features_of_each_client(tiny, monkeypatch):
    _, task, method = tiny("promptfolio")
    method = with_config(method, n_ctx=3, theta=0.25)
    gen = torch.Generator().manual_seed(2)
    params = {k: torch.randn(2, 3, method.backbone.ctx_dim, generator=gen) * 0.5
              for k in ("global_ctx", "local_ctx")}  # fmt: skip
    clip, names = method.backbone, method.task.class_names
    x = clip.forward_features(clip.preprocess(task.data.train_images[:4])).cls
    features_as_images(monkeypatch, method)  # from here x holds image features
    rows = torch.tensor([0, 1, 1, 0])
    logits = method.forward(params, x, rows, Context(training=False))
    f = F.normalize(x, dim=-1)
    for i, k in enumerate(rows.tolist()):
        t = 0.75 * _coop_text(clip, names, params["global_ctx"][k]) + 0.25 * _coop_text(
            clip, names, params["local_ctx"][k]
        )
        torch.testing.assert_close(logits[i], clip.logit_scale * f[i] @ t.T, atol=1e-4, rtol=1e-4)


def test_local_prompt_stays_and_global_is_size_weighted(tiny):
    _, _, method = tiny("promptfolio")
    server = seeded_server(method)
    assert set(server.params) == {"global_ctx"} and set(server.personal) == {"local_ctx"}
    assert method.inference == "personal" and method.cfg.n_ctx == 8 and method.cfg.theta == 0.4
    assert set(method.communication(server)[1]) == {"global_ctx"}
    assert not torch.equal(server.params["global_ctx"], server.personal["local_ctx"][0])
    ids = torch.tensor([1, 3])
    trained = method.client_params(server, ids)
    trained["global_ctx"] = stacked_constants(server.params, [2.0, 6.0])["global_ctx"]
    trained["local_ctx"] = trained["local_ctx"] + 1.0
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([10.0, 30.0])))
    torch.testing.assert_close(
        new.params["global_ctx"], torch.full_like(server.params["global_ctx"], 5.0)
    )
    assert torch.equal(new.personal["local_ctx"][3], trained["local_ctx"][1])
    assert torch.equal(new.personal["local_ctx"][0], server.personal["local_ctx"][0])


def test_init_phrase_starts_both_prompts_from_its_embeddings(tiny):
    _, _, method = tiny("promptfolio")
    method = with_config(method, ctx_init="a photo of a")
    p = method.init_params(torch.Generator().manual_seed(0))
    ids = method.backbone.tokenize(["a photo of a"])
    expected = method.backbone.token_embed(ids)[0, 1:5]
    assert torch.equal(p["global_ctx"], expected) and torch.equal(p["local_ctx"], expected)
