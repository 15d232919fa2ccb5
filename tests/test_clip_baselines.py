"""SDFed's remaining baselines (powder, gpt-fl, uopp) and the cosine lr schedule, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

from fpbench.cli.data import data_app
from fpbench.data.gpt_fl_generate import class_folder, generate_images, load_generated
from fpbench.engine.executor import round_lr, train_clients
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates
from fpbench.methods.powder import generation_weights
from fpbench.methods.uopp import class_sums, dual_head
from fpbench.specs import TrainConfig

from .conftest import tiny_config


def _server(method):
    return method.init_server(torch.Generator().manual_seed(0))


# -- cosine learning-rate schedule --------------------------------------------------------------
def test_round_lr_exp_and_cosine_by_hand():
    exp = TrainConfig(lr=0.1, lr_decay=0.5, rounds=4)
    assert [round_lr(exp, r) for r in (0, 3)] == pytest.approx([0.1, 0.0125])
    cos = TrainConfig(lr=0.1, lr_decay=0.5, rounds=4, lr_schedule="cosine")  # lr_decay ignored
    expected = [
        0.1,
        0.1 * (1 + math.cos(math.pi / 4)) / 2,
        0.05,
        0.1 * (1 - math.cos(math.pi / 4)) / 2,
        0.0,
    ]
    assert [round_lr(cos, r) for r in range(5)] == pytest.approx(expected)


def test_default_schedule_keeps_old_run_keys_and_cosine_changes_them():
    base = tiny_config("promptfl")
    identity = base.identity()
    assert "lr_schedule" not in identity["train"] and base.train.lr_schedule == "exp"
    cosine = tiny_config("promptfl", lr_schedule="cosine")
    assert cosine.identity()["train"]["lr_schedule"] == "cosine"
    assert cosine.run_key != base.run_key


def test_cosine_reaches_the_optimiser(tiny):
    cfg, task, method = tiny("promptfl", lr_schedule="cosine", rounds=2)
    server = _server(method)
    ids = task.trainable_clients()[:1]
    last = train_clients(method, server, task, ids, cfg.train, round_idx=2, seed=0)  # lr 0
    assert torch.equal(last.params["ctx"][0], server.params["ctx"])
    first = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    assert not torch.equal(first.params["ctx"][0], server.params["ctx"])


# -- UOPP ---------------------------------------------------------------------------------------
def test_class_sums_by_hand():
    feats = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0], [1.0, 1.0]])
    labels, rows = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 0])
    sums, counts = class_sums(feats, labels, rows, rows=2, num_classes=2)
    assert sums.tolist() == [[[1.0, 0.0], [1.0, 3.0]], [[3.0, 3.0], [0.0, 0.0]]]
    assert counts.tolist() == [[1.0, 2.0], [1.0, 0.0]]


def test_dual_head_takes_the_more_confident_head_per_sample():
    prompt = torch.tensor([[3.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    proto = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.0, 5.0, 0.0]])  # row 2: a tie
    out = dual_head(prompt, proto)
    assert torch.equal(out, torch.stack([prompt[0], proto[1], prompt[2]]))


def test_uopp_prototypes_are_count_weighted_and_added_once(tiny):
    _, task, method = tiny("uopp")
    server = _server(method)
    c, e = task.data.num_classes, method.backbone.embed_dim
    sums = torch.zeros(2, c, e)
    sums[0, 0, 0], sums[1, 0, 1], sums[1, 2, 2] = 3.0, 1.0, 2.0  # class 0 from both clients
    counts = torch.zeros(2, c)
    counts[0, 0], counts[1, 0], counts[1, 2] = 3.0, 1.0, 2.0
    trained = {"ctx": torch.stack([torch.full_like(server.params["ctx"], v) for v in (1.0, 4.0)])}
    stats = {"proto_sum": sums, "proto_count": counts}
    ids = torch.tensor([0, 2])
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0]), stats))
    torch.testing.assert_close(new.params["ctx"], torch.full_like(server.params["ctx"], 1.75))
    proto = new.buffers["prototypes"]
    torch.testing.assert_close(proto[0, :2], F.normalize(torch.tensor([3.0, 1.0]) / 4, dim=0))
    torch.testing.assert_close(proto[2, 2], torch.tensor(1.0))
    assert proto[1].abs().sum() == 0 and new.buffers["proto_seen"].tolist() == [1, 0, 1, 0]
    again = method.aggregate(new, Updates(trained, ids, torch.tensor([30.0, 10.0]), stats))
    assert torch.equal(again.buffers["proto_count"], new.buffers["proto_count"])  # not re-added
    down, up = method.communication(again)
    assert set(down) == {"ctx", "prototypes"} and set(up) == {"ctx", "proto_sum", "proto_count"}


def test_uopp_eval_uses_the_prototype_head_where_confident(tiny):
    _, task, method = tiny("uopp")
    server = _server(method)
    feats = torch.randn(5, method.backbone.embed_dim, generator=torch.Generator().manual_seed(1))
    protos = F.normalize(feats[:3], dim=-1)  # samples 0..2 are their own class prototype
    server.buffers["prototypes"] = torch.cat([protos, torch.zeros(task.data.num_classes - 3, 32)])
    params = method.client_params(server, torch.tensor([0]), training=False)
    rows = torch.zeros(5, dtype=torch.long)
    train_logits = method.forward(params, feats, rows, Context(training=True))
    logits = method.forward(params, feats, rows, Context(training=False, buffers=server.buffers))
    proto_logits = (
        method.backbone.logit_scale * F.normalize(feats, dim=-1) @ server.buffers["prototypes"].T
    )
    valid = torch.arange(task.data.num_classes) < 3  # classes with a prototype
    torch.testing.assert_close(logits, dual_head(train_logits, proto_logits, valid))
    loss = method.loss(params, feats, torch.arange(5) % 3, rows, Context(training=True))
    torch.testing.assert_close(loss, F.cross_entropy(train_logits, torch.arange(5) % 3,
                                                     reduction="none"))  # fmt: skip


# -- Powder -------------------------------------------------------------------------------------
def test_generation_weights_by_hand():
    query = torch.tensor([[1.0, 0.0]])
    cands = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = generation_weights(query, cands, torch.tensor([[True, True, True]]), tau=0.5)
    # cosines 1, 0 and 1/sqrt(2) over tau 0.5: softmax(2, sqrt(2)) over the correlated two
    a, b = math.exp(2), math.exp(2**0.5)
    torch.testing.assert_close(w, torch.tensor([[a / (a + b), 0, b / (a + b)]]))
    w = generation_weights(query, cands, torch.tensor([[True, True, False]]), tau=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0, 0]]))  # the third is masked out


def test_powder_generation_aggregation_and_eval(tiny):
    _, task, method = tiny("powder")
    server = _server(method)
    g = server.params["ctx"]
    first = method.client_params(server, torch.tensor([0, 1]))
    assert torch.equal(first["ctx"], g.expand(2, *g.shape)) and torch.equal(
        first["start_ctx"], first["ctx"]
    )
    trained = {"ctx": torch.stack([torch.full_like(g, 1.0), torch.full_like(g, 4.0)])}
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]), {})
    )
    torch.testing.assert_close(new.params["ctx"], torch.full_like(g, 1.75))  # step 2: FedAvg
    assert torch.equal(new.buffers["pool"][2], trained["ctx"][1])  # step 1: the task's prompt
    assert new.buffers["pool_seen"].tolist() == [1, 0, 1, 0]
    # client 1's start prompt mixes G and the seen tasks 0, 2 with the prior-correlation weights
    priors = task.priors.float()
    fed = (task.train_sizes.float() / task.train_sizes.sum()) @ priors
    w = generation_weights(priors[1:2], torch.stack([fed, priors[0], priors[2]]),
                           torch.ones(1, 3, dtype=torch.bool), method.cfg.tau)[0]  # fmt: skip
    expected = w[0] * 1.75 + w[1] * 1.0 + w[2] * 4.0
    start = method.client_params(new, torch.tensor([1]))["ctx"][0]
    torch.testing.assert_close(start, torch.full_like(g, float(expected)))
    # client 0 excludes its own row: G and task 2 only
    start0 = method.client_params(new, torch.tensor([0]))["ctx"][0]
    assert start0.min() >= 1.75 - 1e-6 and start0.max() <= 4.0 + 1e-6
    evals = method.client_params(new, torch.tensor([0, 1]), training=False)["ctx"]
    assert torch.equal(evals[0], trained["ctx"][0]) and torch.allclose(evals[1], start)
    down, up = method.communication(new)
    assert set(down) == set(up) == {"ctx"} and down["ctx"].shape == g.shape


def test_powder_distillation_vanishes_at_the_start_prompt(tiny):
    _, task, method = tiny("powder")
    params = method.client_params(_server(method), torch.tensor([0]))
    feats, y = torch.randn(4, 32), torch.tensor([0, 1, 2, 3])
    rows = torch.zeros(4, dtype=torch.long)
    logits = method.forward(params, feats, rows, Context(training=False))  # the bare logits
    ce = F.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(method.loss(params, feats, y, rows, Context(training=True)), ce)
    params["ctx"] = params["ctx"] + 0.1 * torch.randn_like(params["ctx"])
    moved = method.forward(params, feats, rows, Context(training=False))
    teacher = method.forward({"ctx": params["start_ctx"]}, feats, rows, Context(training=False))
    kl = (teacher.softmax(-1) * (teacher.log_softmax(-1) - moved.log_softmax(-1))).sum(-1)
    out = method.loss(params, feats, y, rows, Context(training=True))
    torch.testing.assert_close(out, F.cross_entropy(moved, y, reduction="none") + kl)
    assert (kl > 0).all()


# -- GPT-FL -------------------------------------------------------------------------------------
def _write_generated(root, names, per_class=3, size=20):
    rng = np.random.default_rng(0)
    for name in names:
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size + 4 * i, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:05d}.png")


def test_load_generated_reads_class_folders(tmp_path):
    _write_generated(tmp_path, ["golden_retriever", "tabby cat"], per_class=2)
    assert class_folder(tmp_path, "golden retriever").name == "golden_retriever"
    assert class_folder(tmp_path, "tabby_cat").name == "tabby cat"
    images, labels = load_generated(tmp_path, ["tabby_cat", "golden retriever"])
    assert images.shape == (4, 3, 20, 20) and images.dtype == torch.uint8  # first's short side
    assert labels.tolist() == [0, 0, 1, 1]
    # the second image is 24 wide, 20 high: it keeps its rows and loses 2 columns each side
    raw = torch.from_numpy(np.asarray(Image.open(tmp_path / "tabby cat" / "00001.png")).copy())
    assert torch.equal(images[1], raw.permute(2, 0, 1)[:, :, 2:22])
    small, _ = load_generated(tmp_path, ["tabby_cat"], size=8)
    assert small.shape == (2, 3, 8, 8)
    with pytest.raises(FpbenchError, match="no folder for class 'dog'"):
        load_generated(tmp_path, ["dog"])


def test_gpt_fl_without_images_stops_with_one_line_and_opts_out_with_zero_epochs(tiny):
    _, _, method = tiny("gpt-fl")
    _, _, promptfl = tiny("promptfl")
    assert method.cfg.server_epochs == 0  # the offline opt-out: PromptFL from CoOp's init
    torch.testing.assert_close(_server(method).params["ctx"], _server(promptfl).params["ctx"])
    method.cfg = method.Config()
    with pytest.raises(FpbenchError, match=r"^gpt-fl needs generated images: run `fpbench data "
                       r"generate-gpt-fl synthetic --out DIR"):  # fmt: skip
        _server(method)
    method.cfg = method.Config(synthetic_dir="nowhere/{dataset}")
    with pytest.raises(FpbenchError, match="in 'nowhere/synthetic': run `fpbench data generate"):
        _server(method)


def test_gpt_fl_pretrains_the_prompt_on_generated_images(tiny, tmp_path):
    _, task, method = tiny("gpt-fl")
    _write_generated(tmp_path, task.data.class_names, per_class=4, size=16)
    images, labels = load_generated(tmp_path, list(task.data.class_names))
    feats = method.generated_features(images)
    start = _server(method).params["ctx"]

    def loss(ctx):
        rows = torch.zeros(len(labels), dtype=torch.long)
        logits = method.logits(method.image_features(feats), method.text_features(ctx[None]), rows)
        return F.cross_entropy(logits, labels).item()

    (tmp_path / "synthetic").symlink_to(tmp_path, target_is_directory=True)
    folder = str(tmp_path / "{dataset}")  # the cell's dataset fills it in
    method.cfg = method.Config(synthetic_dir=folder, server_epochs=5, server_lr=0.05)
    pretrained = _server(method).params["ctx"]
    assert pretrained.shape == start.shape and loss(pretrained) < loss(start)


def test_generation_says_what_is_missing(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def no_diffusers(name, *args):
        return None if name == "diffusers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_diffusers)
    with pytest.raises(FpbenchError, match="pip install diffusers"):
        generate_images(["cat"], tmp_path, tmp_path, 1)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        data_app, ["generate-gpt-fl", "synthetic", "--out", str(out), "--model", str(tmp_path)]
    )
    assert result.exit_code == 2 and "diffusers" in result.output and not out.exists()
