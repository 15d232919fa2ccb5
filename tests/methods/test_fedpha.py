"""FedPHA: the projection off the global prompt's top directions and the pull / push terms by
hand, the training loss against an independent composition, the local prompt alone at
inference, the global one averaged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output, Updates
from fpbench.methods.fedpha import FedPHAConfig, minor_projection, pull_push
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images, stacked_constants


def test_projection_by_hand():
    g = torch.tensor([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # right singular vectors e1 (3), e2 (1)
    loc = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # ratio 0.5: drop floor(2 * 0.5) = 1 top direction (e1), keep e2
    torch.testing.assert_close(
        minor_projection(loc, g, 0.5), torch.tensor([[0.0, 2.0, 0.0], [0.0, 5.0, 0.0]])
    )
    # ratio 0.8 (the default): floor(2 * 0.2) = 0 dropped, G's whole row space e1, e2 kept
    kept = torch.tensor([[1.0, 2.0, 0.0], [4.0, 5.0, 0.0]])
    torch.testing.assert_close(minor_projection(loc, g, 0.8), kept)
    torch.testing.assert_close(minor_projection(loc, g, 1.0), kept)
    torch.testing.assert_close(minor_projection(loc, g, 0.0), torch.zeros(2, 3))
    # batched over clients: each row with its own G
    both = minor_projection(torch.stack([loc, loc]), torch.stack([g, g.flip(0)]), 0.5)
    torch.testing.assert_close(both[1], torch.tensor([[0.0, 2.0, 0.0], [0.0, 5.0, 0.0]]))


def test_pull_and_push_by_hand():
    local = torch.tensor([[[1.0, 0.0]]])  # (K=1, C=1, E=2)
    glob = torch.tensor([[[0.0, 1.0]]])
    proj = torch.tensor([[[0.6, 0.8]]])
    pull, push = pull_push(local, glob, proj, 2.0)
    # pull: ((1 - 0.6)^2 + 0.8^2) / 2 = 0.4; push: 2 - sqrt(2)
    torch.testing.assert_close(pull, torch.tensor([0.4]))
    torch.testing.assert_close(push, torch.tensor([2.0 - 2.0**0.5]))
    assert pull_push(local, glob, proj, 1.0)[1].item() == 0.0  # sqrt(2) > 1: no push


def test_defaults_are_the_official_code():
    cfg = FedPHAConfig()
    assert (cfg.n_ctx, cfg.ratio, cfg.alpha, cfg.pull, cfg.push) == (16, 0.8, 1.0, 1.0, 1.0)


def _minor_by_eigh(loc, g, ratio):
    """The projection from the eigenvectors of G^T G (descending), not from an SVD."""
    vals, vecs = torch.linalg.eigh(g.T.double() @ g.double())
    order = vals.argsort(descending=True)[: min(g.shape)]
    v = vecs[:, order]
    v2 = v[:, int(v.shape[1] * (1 - ratio)) :]
    return (loc.double() @ v2 @ v2.T).float()


def test_training_loss_is_both_cross_entropies_and_the_alignment_terms(tiny, monkeypatch):
    _, task, method = tiny("fedpha")
    method = with_config(method, n_ctx=3, ratio=0.5, alpha=1.5, pull=2.0, push=0.5)
    gen = torch.Generator().manual_seed(3)
    w = method.backbone.ctx_dim
    params = {k: torch.randn(2, 3, w, generator=gen) * 0.5 for k in ("global_ctx", "local_ctx")}
    feats = torch.randn(4, method.backbone.embed_dim, generator=gen)
    features_as_images(monkeypatch, method)
    rows, labels = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 2, 1, 3])
    out = method.forward(params, feats, rows, Context(training=True, labels=labels))
    assert isinstance(out, Output)
    f, scale = F.normalize(feats, dim=-1), method.backbone.logit_scale
    for i, k in enumerate(rows.tolist()):
        t_loc = method.text_features(params["local_ctx"][k : k + 1])[0]
        t_glob = method.text_features(params["global_ctx"][k : k + 1])[0]
        proj = _minor_by_eigh(params["local_ctx"][k], params["global_ctx"][k], 0.5)
        t_proj = method.text_features(proj.unsqueeze(0))[0]
        torch.testing.assert_close(out.logits[i], scale * f[i] @ t_loc.T, atol=1e-4, rtol=1e-4)
        g_logits = scale * f[i] @ t_glob.T
        ce = torch.logsumexp(g_logits, 0) - g_logits[labels[i]]
        pull = ((t_loc - t_proj) ** 2).mean()
        push = torch.clamp(1.5 - (t_loc - t_glob).norm(dim=-1), min=0).mean()
        expected = ce + 2.0 * pull + 0.5 * push
        torch.testing.assert_close(out.aux_loss[i], expected, atol=1e-4, rtol=1e-4)
    # inference: the local prompt alone, whatever the global one
    params2 = {**params, "global_ctx": params["global_ctx"] * 3}
    ev = method.forward(params2, feats, rows, Context(training=False))
    torch.testing.assert_close(ev, out.logits)
    with pytest.raises(ValueError, match="labels"):
        method.forward(params, feats, rows, Context(training=True))


def test_global_prompt_averaged_local_kept(tiny):
    _, _, method = tiny("fedpha")
    server = seeded_server(method)
    assert set(server.params) == {"global_ctx"} and set(server.personal) == {"local_ctx"}
    assert method.inference == "personal"
    assert set(method.communication(server)[1]) == {"global_ctx"}
    ids = torch.tensor([0, 2])
    trained = method.client_params(server, ids)
    trained["global_ctx"] = stacked_constants(server.params, [1.0, 4.0])["global_ctx"]
    trained["local_ctx"] = trained["local_ctx"] - 1.0
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([2.0, 1.0])))
    torch.testing.assert_close(
        new.params["global_ctx"], torch.full_like(trained["local_ctx"][0], 2.0)
    )
    assert torch.equal(new.personal["local_ctx"][2], trained["local_ctx"][1])
    assert torch.equal(new.personal["local_ctx"][1], server.personal["local_ctx"][1])


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestFedPHAConformance(MethodConformance):
    method = "fedpha"
