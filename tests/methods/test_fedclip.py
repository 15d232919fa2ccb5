"""FedCLIP: the attention adapter and the contrastive loss by hand; uniform server mean."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.fedclip import adapter_attention, contrastive_loss

from ..conftest import seeded_server, with_config
from .common import stacked_constants


def test_adapter_of_identity_weights_by_hand():
    # W1 = W2 = I, b = 0: a = softmax(tanh(f)); f = (1, 0, -2)
    eye = torch.eye(3).unsqueeze(0)
    params = {"w1": eye, "b1": torch.zeros(1, 3), "w2": eye, "b2": torch.zeros(1, 3)}
    a = adapter_attention(torch.tensor([[1.0, 0.0, -2.0]]), params, torch.tensor([0]))
    e = [math.exp(math.tanh(v)) for v in (1.0, 0.0, -2.0)]
    torch.testing.assert_close(a[0], torch.tensor([v / sum(e) for v in e]))
    # biases shift the pre-softmax values; each sample reads its own client's adapter
    params = {k: torch.cat([v, v]) for k, v in params.items()}
    params["b2"][1] = torch.tensor([0.0, 0.0, 5.0])
    a = adapter_attention(torch.zeros(2, 3), params, torch.tensor([0, 1]))
    torch.testing.assert_close(a[0], torch.full((3,), 1 / 3))
    z = 2 + math.exp(5.0)
    torch.testing.assert_close(a[1], torch.tensor([1 / z, 1 / z, math.exp(5.0) / z]))


def test_contrastive_loss_of_two_orthogonal_pairs_by_hand():
    # image i == text i, orthogonal: logits = s * I; both directions give log(1 + e^-s)
    x = torch.eye(2)
    loss = contrastive_loss(x, x, torch.tensor([0, 0]), 2.0)
    torch.testing.assert_close(loss, torch.full((2,), math.log(1 + math.exp(-2.0))))
    # a third sample of another client: its loss is 0 (alone), the pair's is unchanged
    x3 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    loss = contrastive_loss(x3, x3, torch.tensor([0, 0, 1]), 2.0)
    expected = math.log(1 + math.exp(-2.0))
    torch.testing.assert_close(loss, torch.tensor([expected, expected, 0.0]))


def test_contrastive_loss_is_clips_symmetric_batch_loss_per_client():
    gen = torch.Generator().manual_seed(0)
    img = F.normalize(torch.randn(7, 5, generator=gen), dim=-1)
    txt = F.normalize(torch.randn(7, 5, generator=gen), dim=-1)
    rows = torch.tensor([1, 0, 1, 1, 0, 0, 1])
    loss = contrastive_loss(img, txt, rows, 3.0)
    for c in (0, 1):  # the reference code's batch loss on the client's own samples
        i, t = img[rows == c], txt[rows == c]
        logits = 3.0 * i @ t.T
        target = torch.arange(len(i))
        ref = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        torch.testing.assert_close(loss[rows == c].mean(), ref)


def test_forward_scores_the_adapted_feature_against_the_template_prompts(tiny):
    _, task, method = tiny("fedclip")
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    clip = method.backbone
    images = clip.preprocess(task.data.train_images[:3])
    x = clip.forward_features(images).cls
    rows = torch.zeros(3, dtype=torch.long)
    logits = method.forward(params, images, rows, Context(training=False))
    # independently: open_clip's own encode_text of "a picture of a <name>"
    ids = clip.tokenizer(["a picture of a " + n.replace("_", " ") for n in method.task.class_names])
    text = F.normalize(clip.model.encode_text(ids), dim=-1)
    p = {k: v[0] for k, v in params.items()}
    att = torch.softmax(torch.tanh(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"], dim=-1)
    expected = clip.logit_scale * F.normalize(att * x, dim=-1) @ text.T
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_adapter_init_is_pytorchs_linear_default(tiny):
    _, _, method = tiny("fedclip")
    p = seeded_server(method).params
    e = method.backbone.embed_dim
    assert {k: tuple(v.shape) for k, v in p.items()} == {
        "w1": (e, e), "b1": (e,), "w2": (e, e), "b2": (e,)
    }  # fmt: skip
    bound = 1 / math.sqrt(e)
    assert all(float(v.abs().max()) <= bound for v in p.values())
    assert float(p["w1"].abs().max()) > 0.9 * bound  # uniform over the whole range


def test_server_mean_is_uniform_by_default_and_by_size_on_request(tiny):
    _, _, method = tiny("fedclip")
    server = seeded_server(method)
    trained = stacked_constants(server.params, [1.0, 4.0])
    ids, sizes = torch.tensor([0, 2]), torch.tensor([30.0, 10.0])
    for m, value in ((method, 2.5), (with_config(method, aggregation="size"), 1.75)):
        new = m.aggregate(server, Updates(trained, ids, sizes))
        assert set(new.params) == {"w1", "b1", "w2", "b2"} and new.personal == {}
        for v in new.params.values():
            torch.testing.assert_close(v, torch.full_like(v, value))


def test_cross_entropy_reading_trains_on_all_class_prompts(tiny):
    _, task, method = tiny("fedclip")
    ce = with_config(method, loss="cross-entropy")
    params = ce.client_params(seeded_server(ce), torch.tensor([0]))
    clip = method.backbone
    x = clip.preprocess(task.data.train_images[:4])
    y, rows = task.data.train_labels[:4], torch.zeros(4, dtype=torch.long)
    ctx = Context(training=True, labels=y)
    logits = ce.forward(params, x, rows, Context(training=False))
    expected = F.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(training_loss(ce.forward(params, x, rows, ctx), y)[0], expected)
    text = method.class_text()[y]
    contrast = contrastive_loss(method.adapted(params, x, rows), text, rows, clip.logit_scale)
    out = method.forward(params, x, rows, ctx)  # the contrastive loss alone, no logits
    assert out.logits is None
    torch.testing.assert_close(training_loss(out, y)[0], contrast)
    torch.testing.assert_close(method.forward(params, x, rows, Context(training=False)), logits)
