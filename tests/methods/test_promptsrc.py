"""PromptSRC: the self-regulating terms by hand, GPA over rounds, the zero-shot teacher."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output, Updates
from fpbench.methods.promptsrc import gpa_log_weight, imagenet_templates, self_regulating_loss
from fpbench.testing import MethodConformance

from ..conftest import seeded_server, with_config
from .common import stacked_constants


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestPromptSRCConformance(MethodConformance):
    method = "promptsrc"


def test_self_regulating_terms_of_a_2_class_case_by_hand():
    # p = softmax(0, 0) = (1/2, 1/2), q = softmax(ln 3, 0) = (3/4, 1/4)
    logits, zs_logits = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    image, zs_image = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8]])  # L1 mean 0.6
    text = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (B, C, E)
    zs_text = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # L1 mean (1 + 1 + 0 + 0) / 4 = 0.5
    kl = (0.75 * math.log(1.5) + 0.25 * math.log(0.5)) / 2  # KL(q || p) over C = 2
    got = self_regulating_loss(logits, zs_logits, image, text, zs_image, zs_text, 25.0, 10.0)
    torch.testing.assert_close(got, torch.tensor([25 * 0.5 + 10 * 0.6 + kl]))
    # two clients, the first with the zero-shot text itself (L1 0): each sample its client's
    clients = torch.cat([zs_text[None], text])  # (K = 2, C, E)
    rows = torch.tensor([1, 0])
    two = [t.expand(2, -1) for t in (logits, zs_logits, image, zs_image)]
    got = self_regulating_loss(*two[:3], clients, two[3], zs_text, 25.0, 10.0, rows)
    torch.testing.assert_close(got, torch.tensor([25 * 0.5 + 6 + kl, 6 + kl]))


def test_batch_mean_is_the_reference_formula():
    gen = torch.Generator().manual_seed(0)
    b, c, e = 5, 4, 3
    logits, zs_logits = torch.randn(b, c, generator=gen) * 5, torch.randn(b, c, generator=gen) * 5
    image, zs_image = torch.randn(b, e, generator=gen), torch.randn(b, e, generator=gen)
    text, zs_text = torch.randn(c, e, generator=gen), torch.randn(c, e, generator=gen)
    got = self_regulating_loss(
        logits, zs_logits, image, text.expand(b, -1, -1), zs_image, zs_text, 25.0, 10.0
    ).mean()
    kl = F.kl_div(F.log_softmax(logits, 1), F.log_softmax(zs_logits, 1), reduction="sum",
                  log_target=True) / logits.numel()  # fmt: skip
    want = kl + 25 * F.l1_loss(text, zs_text) + 10 * F.l1_loss(image, zs_image)
    torch.testing.assert_close(got, want)


def _rounds(method, values):
    server = seeded_server(method)
    for v in values:
        trained = stacked_constants(server.params, [v, v])
        server = method.aggregate(
            server, Updates(trained, torch.tensor([0, 1]), torch.tensor([1.0, 3.0]))
        )
    return server


def test_gpa_is_the_gaussian_weighted_mean_over_rounds(tiny):
    _, _, method = tiny("promptsrc")
    method = with_config(method, prompt_depth_text=2, prompt_depth_vision=2, gpa_mean=2.0)
    server = _rounds(method, [1.0, 2.0, 4.0])
    g = math.exp(-0.5)  # N(1; 2, 1) / N(2; 2, 1) = N(3; 2, 1) / N(2; 2, 1)
    want = (g * 1.0 + 1.0 * 2.0 + g * 4.0) / (2 * g + 1.0)
    ids = torch.tensor([0, 3])
    evaluated = method.client_params(server, ids, training=False)
    trained = method.client_params(server, ids, training=True)
    assert set(evaluated) == {"ctx", "deep_text", "vision", "deep_vision"}
    for k in evaluated:
        torch.testing.assert_close(evaluated[k], torch.full_like(evaluated[k], want))
        assert torch.equal(trained[k], torch.full_like(trained[k], 4.0))  # FedAvg goes on
    assert float(server.buffers["gpa_round"]) == 3
    off = with_config(method, prompt_depth_text=2, prompt_depth_vision=2, gpa=False)
    assert torch.equal(off.client_params(server, ids, training=False)["ctx"], trained["ctx"])


def test_gpa_far_from_its_mean_does_not_underflow(tiny):
    _, _, method = tiny("promptsrc")
    method = with_config(method, prompt_depth_text=2, prompt_depth_vision=2, gpa_mean=400.0)
    server = _rounds(method, [1.0, 3.0])  # weights e^-79600 and e^-79401: far below fp64
    share = 1 / (1 + math.exp(gpa_log_weight(1, 400, 1) - gpa_log_weight(2, 400, 1)))
    want = 1.0 + share * (3.0 - 1.0)
    got = method.client_params(server, torch.tensor([0]), training=False)["ctx"]
    torch.testing.assert_close(got, torch.full_like(got, want))
    assert want > 2.9  # the later round dominates (its weight is e^199 times the first)


def test_zero_shot_text_is_the_normalised_template_mean(tiny):
    _, _, method = tiny("promptsrc")
    templates = imagenet_templates()
    assert len(templates) == 60 and templates[0] == "a photo of a {}."
    clip, name = method.backbone, method.task.class_names[1].replace("_", " ")
    with torch.no_grad():
        feats = clip.encode_text(clip.tokenize([t.format(name) for t in templates]))
    want = F.normalize(feats.mean(0), dim=-1)
    torch.testing.assert_close(method.zero_shot_text()[1], want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(F.normalize(F.normalize(feats, dim=-1).mean(0), dim=-1), want)


def test_training_forward_adds_the_terms_to_the_prompted_logits(tiny):
    # text prompts of depth 1 at their phrase init and no vision prompts: the image term is 0,
    # the text term is the L1 of "a photo of a {}." to the ensemble, the KL compares the logits
    _, task, method = tiny("promptsrc")
    method = with_config(method, prompt_depth_text=1, prompt_depth_vision=0)
    server = seeded_server(method)
    assert set(server.params) == {"ctx"}
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:3])
    rows = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        out = method.forward(params, x, rows, Context(training=True))
        plain = method.forward(params, x, rows, Context(training=False))
        clip = method.backbone
        names = [n.replace("_", " ") for n in method.task.class_names]
        text = F.normalize(clip.encode_text(clip.tokenize([f"a photo of a {n}." for n in names])))
        image = F.normalize(clip.encode_image(x))
        zs = method.zero_shot_text()
    assert isinstance(out, Output) and torch.equal(out.logits, plain)
    torch.testing.assert_close(plain, clip.logit_scale * image @ text.T, atol=1e-4, rtol=1e-5)
    zs_logits = clip.logit_scale * image @ zs.T
    q, p = F.softmax(zs_logits, -1), F.softmax(plain, -1)
    kl = (q * (q.log() - p.log())).sum(-1) / len(names)
    want = 25 * (text - zs).abs().mean() + kl
    torch.testing.assert_close(out.aux_loss, want, atol=1e-5, rtol=1e-4)


def test_the_engines_evaluation_scores_the_gpa_prompts(tiny, monkeypatch):
    from fpbench.engine.evaluate import evaluate
    from fpbench.methods.base import ServerState

    cfg, task, method = tiny("promptsrc")
    server = seeded_server(method)
    trained = {k: v + 1.0 for k, v in server.params.items()}  # FedAvg state != GPA's mean
    server = ServerState(trained, server.personal, server.buffers)
    seen = []
    forward = type(method).forward

    def spy(self, params, x, client_index, ctx):
        seen.append(params["ctx"].detach().clone())
        return forward(self, params, x, client_index, ctx)

    monkeypatch.setattr(type(method), "forward", spy)
    evaluate(method, server, task, batch_size=64)
    assert seen and all(torch.equal(s[0], server.buffers["gpa_ctx"]) for s in seen)
    seen.clear()
    evaluate(with_config(method, prompt_depth_text=2, prompt_depth_vision=2, gpa=False),
             server, task, batch_size=64)  # fmt: skip
    assert seen and all(torch.equal(s[0], trained["ctx"]) for s in seen)
