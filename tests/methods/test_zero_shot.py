"""Zero-shot CLIP: CoOp's hand-written templates, logits against open_clip's own towers, and a
round that trains nothing (the engine scores the clients' batches without a step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates
from fpbench.methods.zero_shot import dataset_template
from fpbench.testing import MethodConformance, check_only_declared_tensors_are_communicated
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images


def test_templates_are_coops_per_dataset_with_a_generic_fallback():
    assert dataset_template("oxford-pets") == "a photo of a {}, a type of pet."
    assert dataset_template("dtd") == "{} texture."
    assert dataset_template("eurosat") == "a centered satellite photo of {}."
    assert dataset_template("food101") == "a photo of {}, a type of food."
    assert dataset_template("ucf101") == "a photo of a person doing {}."
    assert dataset_template("cifar100") == "a photo of a {}."
    assert dataset_template("dtd", "itap of a {}.") == "itap of a {}."
    with pytest.raises(FpbenchError, match="exactly one"):
        dataset_template("dtd", "no slot")


def _open_clip_logits(method, images, template):
    """Zero-shot logits from open_clip's own encode_image / encode_text and tokenizer."""
    model, tok = method.backbone.model, method.backbone.tokenizer
    names = [n.replace("_", " ") for n in method.task.class_names]
    ids = tok([template.format(n) for n in names], context_length=77)
    with torch.no_grad():
        text = F.normalize(model.encode_text(ids), dim=-1)
        img = F.normalize(model.encode_image(images), dim=-1)
    return model.logit_scale.exp() * img @ text.T


@pytest.mark.parametrize("template", [None, "{} texture."])
def test_logits_are_clips_on_the_filled_template(tiny, template, monkeypatch):
    _, task, method = tiny("zero-shot")
    method = with_config(method, template=template)
    images = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    x = method.backbone.forward_features(images).cls
    features_as_images(monkeypatch, method)  # from here x holds image features
    got = method.forward({}, x, torch.zeros(5, dtype=torch.long), Context(training=False))
    expected = _open_clip_logits(method, images, template or "a photo of a {}.")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_round_trains_nothing_and_scores_each_clients_data(tiny, monkeypatch):
    cfg, task, method = tiny("zero-shot", local_epochs=2)
    server = seeded_server(method)
    assert server.params == server.personal == {}
    ids = task.trainable_clients()
    local = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    assert local.params == {} and local.client_ids.tolist() == ids
    feats = method.backbone.forward_features(method.backbone.preprocess(task.data.train_images))
    features_as_images(monkeypatch, method)  # from here x holds image features
    logits = method.forward({}, feats.cls, None, Context(training=False))
    ce = F.cross_entropy(logits, task.data.train_labels, reduction="none")
    # a client's loss: the mean over its steps (2 epochs) of each minibatch's mean loss
    expected = torch.stack(
        [
            torch.stack(
                [
                    ce[b].mean()
                    for e in range(2)
                    for b in client_batches(task.train_idx[c], 8, derive_seed(0, 0, c, 0, e))
                ]
            ).mean()
            for c in ids
        ]
    )
    torch.testing.assert_close(local.loss, expected, atol=1e-5, rtol=1e-5)
    new = method.aggregate(server, Updates({}, local.client_ids, task.train_sizes[ids], {}))
    assert new.params == new.personal == {}
    check_only_declared_tensors_are_communicated(tiny, "zero-shot")
    assert method.communication(server) == ({}, {})


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestZeroShotConformance(MethodConformance):
    method = "zero-shot"
