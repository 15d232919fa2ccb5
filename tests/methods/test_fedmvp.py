"""FedMVP: description sentences, the attributes files, the prompt net's cross-attention and
GEGLU feed-forward, description-averaged logits, the flip-consistency term, the uniform mean."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.backbones.clip import encode_image_deep
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.fedmvp import (
    ENV_VAR,
    FedMVPConfig,
    class_descriptions,
    cross_attention,
    feed_forward,
    lora,
    patch_tokens,
    sentence,
    visual_prompts,
)
from fpbench.testing import MethodConformance

from ..conftest import seeded_server
from .common import both_executors_agree, stacked_constants

NAMES = ("c0", "c1", "c2", "c3", "c4", "c5")


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestFedMVPConformance(MethodConformance):
    method = "fedmvp"


def _write(folder, stem: str, data: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(data))


def _on(method, dataset: str = "synthetic", **args):
    """The same method on the same backbone, with config `args` and the task's dataset name."""
    task = dataclasses.replace(method.task, dataset=dataset)
    return type(method)(FedMVPConfig(**args), method.backbone, task)


@pytest.mark.parametrize(
    ("desc", "want"),
    [
        ("eyes", "a photo of a face, which has eyes"),
        ("a long tail", "a photo of a face, which is a long tail"),
        ("an engine", "a photo of a face, which is an engine"),
        ("about a metre", "a photo of a face, which is about a metre"),  # any leading "a"
        ("often red", "a photo of a face, which often red"),
        ("can fly", "a photo of a face, which can fly"),
        ("used for cooking", "a photo of a face, which is used for cooking"),
        ("", "a photo of a face, which has "),
    ],
)
def test_a_description_becomes_the_official_clause(desc, want):
    assert sentence("a photo of a", "face", "", desc) == want


def test_the_suffix_follows_the_name_and_the_sentence_is_cut_at_77_characters():
    got = sentence("a photo of a", "rose", "a type of flower, ", "petals")
    assert got == "a photo of a rose, a type of flower, which has petals"
    long = sentence("a photo of a", "rose", "", "x" * 100)
    assert long == "a photo of a rose, which has " + "x" * (77 - 29) and len(long) == 77


def test_descriptions_are_read_by_class_name_with_underscores_as_spaces(tmp_path, monkeypatch):
    _write(tmp_path, "oxford_pets", {"great pyrenees": ["white fur"], "pug": [], "cat": ["x"]})
    cfg = FedMVPConfig(attributes_dir=str(tmp_path))
    got = class_descriptions(cfg, "oxford-pets", ("great_pyrenees", "pug"))
    assert got == [["white fur"], [""]]  # an empty list is the one empty description
    monkeypatch.setenv(ENV_VAR, str(tmp_path))  # the environment names the folder too
    assert class_descriptions(FedMVPConfig(), "oxford-pets", ("pug",)) == [[""]]
    # up to case and spacing where no key is equal (the official code would drop the class)
    assert class_descriptions(cfg, "oxford-pets", ("Great  Pyrenees", "CAT")) == [
        ["white fur"],
        ["x"],
    ]


def test_missing_descriptions_fail_clearly_unless_the_setting_allows_them(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(
        FpbenchError, match=f"neither attributes_dir nor \\${ENV_VAR}.*mainaksingha01"
    ):
        class_descriptions(FedMVPConfig(), "caltech101", ("face",))
    cfg = FedMVPConfig(attributes_dir=str(tmp_path / "none"))
    with pytest.raises(FpbenchError, match="none/dtd.json does not exist"):
        class_descriptions(cfg, "dtd", ("banded",))
    _write(tmp_path, "dtd", {"banded": ["stripes"]})
    cfg = FedMVPConfig(attributes_dir=str(tmp_path))
    with pytest.raises(FpbenchError, match="no descriptions of 1 classes: dotted"):
        class_descriptions(cfg, "dtd", ("banded", "dotted"))
    lenient = FedMVPConfig(attributes_dir=str(tmp_path), missing_descriptions="class-name")
    assert class_descriptions(lenient, "dtd", ("banded", "dotted")) == [["stripes"], [""]]
    assert class_descriptions(lenient, "synthetic", ("c0",)) == [[""]]  # no file at all
    (tmp_path / "dtd.json").write_text('["not", "a", "mapping"]')
    with pytest.raises(FpbenchError, match="is not"):
        class_descriptions(cfg, "dtd", ("banded",))


def test_cross_attention_equals_torchs_multihead_attention():
    gen = torch.Generator().manual_seed(0)
    w, heads = 8, 4
    mha = torch.nn.MultiheadAttention(w, heads, batch_first=True)
    with torch.no_grad():
        for t in mha.parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
    p = {
        "attn_in_w": mha.in_proj_weight,
        "attn_in_b": mha.in_proj_bias,
        "attn_out_w": mha.out_proj.weight,
        "attn_out_b": mha.out_proj.bias,
    }
    q, kv = torch.randn(3, 5, w, generator=gen), torch.randn(7, w, generator=gen)
    k, v = torch.randn(7, w, generator=gen), kv
    want, _ = mha(q, k.expand(3, -1, -1), v.expand(3, -1, -1))
    torch.testing.assert_close(cross_attention(q, k, v, p, heads), want, atol=1e-6, rtol=1e-5)


def test_cross_attention_with_equal_scores_averages_the_values():
    # W_k = 0: every key scores alike, so each query gets the mean value, then W_o, b_o
    w = 2
    p = {
        "attn_in_w": torch.cat([torch.eye(w), torch.zeros(w, w), torch.eye(w)]),
        "attn_in_b": torch.zeros(3 * w),
        "attn_out_w": torch.tensor([[2.0, 0.0], [0.0, 1.0]]),
        "attn_out_b": torch.tensor([0.5, -1.0]),
    }
    kv = torch.tensor([[1.0, 2.0], [3.0, -4.0]])  # mean (2, -1)
    got = cross_attention(torch.randn(1, 3, w), torch.randn(2, w), kv, p, heads=1)
    torch.testing.assert_close(got, torch.tensor([[4.5, -2.0]]).expand(1, 3, 2))


def test_feed_forward_is_geglu_after_a_layer_norm():
    # w = 1: the layer norm of a scalar is its bias (1); [u, g] = [2, 1]; 3 * 2 gelu(1) + 0.5
    p = {
        "ff_norm_w": torch.ones(1),
        "ff_norm_b": torch.ones(1),
        "ff1_w": torch.tensor([[1.5], [0.5]]),
        "ff1_b": torch.tensor([0.5, 0.5]),
        "ff2_w": torch.tensor([[3.0]]),
        "ff2_b": torch.tensor([0.5]),
    }
    gelu1 = 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    got = feed_forward(torch.tensor([[[7.0]]]), p)
    assert got.item() == pytest.approx(3 * 2 * gelu1 + 0.5, abs=1e-6)


def test_prompts_are_the_pooled_patch_blocks_of_attention_plus_feed_forward(tiny):
    # with the feed-forward's output zero and identity maps, H = A = mean value for every patch
    # (W_k = 0), so each of the P pooled prompts is T W_t^T + b_t (not layer-normed) over M
    _, _, method = tiny("fedmvp")
    p = {k: v.clone() for k, v in seeded_server(method).params.items()}
    w = method.width
    p["attn_in_w"] = torch.cat([torch.eye(w), torch.zeros(w, w), torch.eye(w)])
    p["attn_out_w"], p["ff2_w"], p["ff2_b"] = torch.eye(w), torch.zeros(w, 4 * w), torch.zeros(w)
    gen = torch.Generator().manual_seed(1)
    text, patches = torch.randn(5, method.backbone.embed_dim, generator=gen), torch.randn(2, 4, w)
    values = text @ p["text_w"].T + p["text_b"]
    got = visual_prompts(p, patches, text, heads=4, n_prompts=2)
    torch.testing.assert_close(got, values.mean(0).expand(2, 2, w), atol=1e-5, rtol=1e-5)
    # the seeded net: each prompt is the mean of its block of N / P = 2 consecutive patches
    p = seeded_server(method).params
    q = torch.nn.functional.layer_norm(patches, (w,))
    keys = torch.nn.functional.layer_norm(values, (w,))  # LN_ctx at init: keys, not values
    a = cross_attention(q, keys, values, p, heads=4)
    h = a + feed_forward(a, p)
    got = visual_prompts(p, patches, text, heads=4, n_prompts=2)
    torch.testing.assert_close(got, (h[:, [0, 2]] + h[:, [1, 3]]) / 2, atol=1e-5, rtol=1e-5)
    assert (got[:, 0] - got[:, 1]).abs().max() > 1e-3


def test_the_patch_tokens_are_those_entering_ln_pre_after_the_cls_token(tiny):
    _, task, method = tiny("fedmvp")
    visual = method.backbone.model.visual
    x = method.backbone.preprocess(task.data.train_images[:2])
    seen = []
    hook = visual.ln_pre.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with torch.no_grad():
        visual(x)
    hook.remove()
    assert seen[0].shape == (2, 5, 32)  # CLS + 2 x 2 patches of 8 px, width 32
    torch.testing.assert_close(patch_tokens(method.backbone, x), seen[0][:, 1:])


def test_logits_average_the_descriptions_and_the_prompts_enter_the_image_encoder(tiny, tmp_path):
    _, task, method = tiny("fedmvp")
    descs = {n: [f"{n} spots", "a tail"] for n in NAMES[:5]} | {"c5": ["often small"]}
    _write(tmp_path, "synthetic", descs)
    method = _on(method, attributes_dir=str(tmp_path))
    clip = method.backbone
    params = {k: v.unsqueeze(0) for k, v in seeded_server(method).params.items()}
    x = clip.preprocess(task.data.train_images[:3])
    rows = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        logits = method.forward(params, x, rows, Context(training=False))
        prompts = method.prompts(params, x, rows)
        f = torch.nn.functional.normalize(encode_image_deep(clip, x, prompts), dim=-1)
        want = []
        for n in NAMES:  # the sentences written out by hand
            texts = [f"a photo of a {n}, which has {n} spots", f"a photo of a {n}, which is a tail"]
            texts = texts if n != "c5" else ["a photo of a c5, which often small"]
            t = torch.nn.functional.normalize(clip.encode_text(clip.tokenize(texts)), dim=-1)
            want.append(clip.logit_scale * (f @ t.T).mean(-1))
    torch.testing.assert_close(logits, torch.stack(want, 1), atol=1e-4, rtol=1e-5)
    assert prompts.shape == (3, 4, method.width)
    plain = torch.nn.functional.normalize(clip.model.encode_image(x), dim=-1)
    assert (f - plain).abs().max() > 1e-3  # the prompts change the image feature


def test_the_consistency_term_is_alpha_times_one_minus_cos_to_the_frozen_flipped_image(tiny):
    _, task, method = tiny("fedmvp")
    clip = method.backbone
    params = {k: v.unsqueeze(0) for k, v in seeded_server(method).params.items()}
    x = clip.preprocess(task.data.train_images[:4])
    rows = torch.zeros(4, dtype=torch.long)
    norm = torch.nn.functional.normalize
    with torch.no_grad():
        f = method.image_features(params, x, rows)
        cos_plain = (f * norm(clip.model.encode_image(x), dim=-1)).sum(-1)
        cos_flip = (f * norm(clip.model.encode_image(x.flip(-1)), dim=-1)).sum(-1)
        got = {}
        for flip in ("never", "always", "expected"):
            m = _on(method, flip=flip, alpha=2.0, missing_descriptions="class-name")
            got[flip] = m.forward(params, x, rows, Context(training=True)).aux_loss
    torch.testing.assert_close(got["never"], 2 * (1 - cos_plain), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["always"], 2 * (1 - cos_flip), atol=1e-5, rtol=1e-5)
    want = 2 * (1 - (cos_plain + cos_flip) / 2)
    torch.testing.assert_close(got["expected"], want, atol=1e-5, rtol=1e-5)
    assert (cos_plain - cos_flip).abs().max() > 1e-4  # the flip matters on these images


def test_each_sample_uses_its_own_clients_prompt_net(tiny):
    _, task, method = tiny("fedmvp")
    two = method.client_params(seeded_server(method), torch.tensor([0, 1]))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for v in two.values():
            if v.is_floating_point():
                v[1] += 0.3 * torch.randn(v[1].shape, generator=gen)
        x = method.backbone.preprocess(task.data.train_images[:4])
        rows = torch.tensor([1, 0, 1, 0])
        both = method.forward(two, x, rows, Context(training=False))
        for k in (0, 1):
            one = {n: v[k : k + 1] for n, v in two.items()}
            alone = method.forward(one, x, torch.zeros(4, dtype=torch.long), Context(False))
            torch.testing.assert_close(both[rows == k], alone[rows == k], atol=1e-5, rtol=1e-5)
        other = {n: v[:1] for n, v in two.items()}
        zero = torch.zeros(4, dtype=torch.long)
        assert (both[0] - method.forward(other, x, zero, Context(False))[0]).abs().max() > 1e-4


def test_the_server_mean_is_uniform_over_the_clients_that_trained(tiny):
    _, _, method = tiny("fedmvp")
    server = seeded_server(method)
    trained = stacked_constants(server.params, [1.0, 3.0])
    updates = Updates(trained, torch.tensor([0, 2]), torch.tensor([1.0, 3.0]))
    new = method.aggregate(server, updates)
    for name, v in new.params.items():  # no client trained with LoRA: its factors as they were
        want = server.params[name] if name.startswith("lora") else torch.full_like(v, 2.0)
        assert torch.equal(v, want), name
    sized = _on(method, aggregation="size", missing_descriptions="class-name")
    new = sized.aggregate(server, updates)
    torch.testing.assert_close(new.params["ff1_w"], torch.full_like(new.params["ff1_w"], 2.5))


def test_init_follows_pytorchs_modules_and_the_backbones_widths(tiny):
    _, _, method = tiny("fedmvp")
    p = seeded_server(method).params
    w, e = 32, 32  # clip-test's vision width and joint dim
    assert p["text_w"].shape == (w, e) and p["ff1_w"].shape == (8 * w, w)
    assert p["ff2_w"].shape == (w, 4 * w) and p["attn_in_w"].shape == (3 * w, w)
    assert p["attn_in_w"].abs().max() <= math.sqrt(6 / (4 * w))  # xavier_uniform
    assert p["ff2_w"].abs().max() <= 1 / math.sqrt(4 * w)  # nn.Linear's default
    assert torch.equal(p["norm_ctx_w"], torch.ones(w)) and not p["attn_in_b"].any()
    assert p["lora_qa"].shape == (w, 8) and p["lora_vb"].shape == (8, w)
    assert 0.01 < p["lora_ka"].std() < 0.03  # N(0, 0.02^2)
    no_lora = _on(method, lora_threshold=None, missing_descriptions="class-name")
    assert not any(n.startswith("lora") for n in seeded_server(no_lora).params)


def test_a_resnet_backbone_and_a_bad_head_count_are_refused(tiny):
    _, _, method = tiny("fedmvp")
    with pytest.raises(FpbenchError, match="heads = 5 must divide the width 32"):
        _on(method, heads=5, missing_descriptions="class-name")
    backbone = create_backbone("clip-test-rn")
    with pytest.raises(FpbenchError, match="needs a ViT CLIP"):
        type(method)(FedMVPConfig(missing_descriptions="class-name"), backbone, method.task)


SUITE = """
name = "fedmvp-tiny"
seeds = [0]
[defaults]
backbone = { name = "clip-test" }
dataset = { num_classes = 6, image_size = 16, train_per_class = 8, test_per_class = 4 }
partition = { num_clients = 2, heldout_frac = 0.0, shots = 4 }
train = { rounds = 1, batch_size = 8, eval_every = 1, eval_last = 1, summary_window = 1 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "iid"
[[methods]]
name = "fedmvp"
"""


def _run_cli(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fpbench.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    (tmp_path / "suite.toml").write_text(SUITE)
    db = tmp_path / "r.db"
    return CliRunner().invoke(app, ["run", "--suite", "suite.toml", "--db", str(db)]), db


def test_a_suite_reads_the_descriptions_from_the_folder_the_environment_names(
    tmp_path, monkeypatch
):
    import sqlite3

    _write(tmp_path / "attrs", "synthetic", {n: ["a tail", "stripes"] for n in NAMES})
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "attrs"))
    result, db = _run_cli(tmp_path, monkeypatch)
    assert result.exit_code == 0, result.output
    with sqlite3.connect(db) as con:
        assert con.execute("select method, status from runs").fetchall() == [("fedmvp", "done")]


def test_a_suite_without_descriptions_fails_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    result, db = _run_cli(tmp_path, monkeypatch)
    assert result.exit_code != 0
    assert "fedmvp needs attribute descriptions of the 'synthetic' classes" in result.output
    assert not db.exists()


def test_an_estimate_measures_a_fedmvp_cell_on_fake_data_without_descriptions(
    tmp_path, monkeypatch
):
    # fake data has fake class names: the measured cell gives each the empty description
    from fpbench.measure.estimate import estimate
    from fpbench.suites import load_suite

    monkeypatch.delenv(ENV_VAR, raising=False)
    (tmp_path / "suite.toml").write_text(SUITE)
    found = estimate(load_suite(str(tmp_path / "suite.toml")), torch.device("cpu"), rounds=1)
    assert [e.shape.method for e in found] == ["fedmvp"] and found[0].measured.train_round_s > 0


def test_lora_adds_x_a_b_to_each_input_and_zero_b_changes_nothing():
    x, a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.5]]), torch.tensor([[2.0, -1.0]])
    torch.testing.assert_close(lora(x, a, b), torch.tensor([[5.0, 0.0]]))  # x + (2) [2, -1]
    gen = torch.Generator().manual_seed(4)
    p = {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in _net(32).items()}
    patches, text = torch.randn(2, 4, 32, generator=gen), torch.randn(5, 32, generator=gen)
    plain = visual_prompts(p, patches, text, 4, 2)
    zero_b = p | {n: torch.zeros_like(p[n]) for n in ("lora_qb", "lora_kb", "lora_vb")}
    torch.testing.assert_close(visual_prompts(zero_b, patches, text, 4, 2, True), plain)
    assert (visual_prompts(p, patches, text, 4, 2, True) - plain).abs().max() > 1e-3


def _net(w: int) -> dict:
    from fpbench.methods.fedmvp import LORA, NAMES

    shapes = {
        "text_w": (w, 32),
        "attn_in_w": (3 * w, w),
        "attn_in_b": (3 * w,),
        "attn_out_w": (w, w),
        "ff1_w": (8 * w, w),
        "ff1_b": (8 * w,),
        "ff2_w": (w, 4 * w),
    }
    lora_shapes = {n: (w, 8) if n.endswith("a") else (8, w) for n in LORA}
    return {n: torch.zeros(shapes.get(n, lora_shapes.get(n, (w,)))) for n in (*NAMES, *LORA)}


def test_a_switched_client_trains_lora_and_the_text_map_not_the_attention(tiny):
    _, task, method = tiny("fedmvp")
    server = seeded_server(method)
    server.buffers["lora_on"][1] = True
    params = method.client_params(server, torch.tensor([0, 1]))
    assert params["lora_on"].tolist() == [False, True]
    scored = method.client_params(server, torch.tensor([1]), training=False)
    assert not {"lora_on", "lora_qa"} & set(scored)  # the server's model never applies LoRA
    before = method.client_params(seeded_server(method), torch.tensor([0, 1]))
    assert not {"lora_on", "lora_qa"} & set(before)  # nobody on LoRA: nothing to train there
    leaves = {n: v.requires_grad_(v.is_floating_point()) for n, v in params.items()}
    x = method.backbone.preprocess(task.data.train_images[:4])
    rows, y = torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 2, 3])
    out = method.forward(leaves, x, rows, Context(training=True, labels=y))
    training_loss(out, y)[0].mean().backward()
    grad = {n: v.grad for n, v in leaves.items() if v.is_floating_point()}
    for n in ("attn_in_w", "ff1_w", "norm_w"):  # row 1 (LoRA on) leaves its attention alone
        assert grad[n][0].abs().max() > 0 and not grad[n][1].any(), n
    for n in ("lora_qa", "lora_kb", "lora_va"):  # only row 1 uses its factors
        assert not grad[n][0].any() and grad[n][1].abs().max() > 0, n
    assert grad["text_w"][1].abs().max() > 0


def test_lora_switch_and_its_mean_by_hand(tiny):
    # two clients: 0 (LoRA already on) and 2 (off); their round's mean losses 0.4 and 1.5
    _, _, method = tiny("fedmvp")
    server = seeded_server(method)
    server.buffers["lora_on"][0] = True
    trained = stacked_constants(server.params, [1.0, 3.0])
    stats = {"loss_sum": torch.tensor([0.8, 3.0]), "samples": torch.tensor([2.0, 2.0])}
    new = method.aggregate(server, Updates(trained, torch.tensor([0, 2]), torch.ones(2), stats))
    s = server.params
    torch.testing.assert_close(new.params["text_w"], torch.full_like(s["text_w"], 2.0))
    torch.testing.assert_close(new.params["ff1_w"], (s["ff1_w"] + 3.0) / 2)  # 0's: frozen
    torch.testing.assert_close(new.params["lora_qa"], (1.0 + s["lora_qa"]) / 2)  # 2's: unused
    assert new.buffers["lora_on"].tolist() == [True, False, False, False]
    stats = {"loss_sum": torch.tensor([3.0, 0.9]), "samples": torch.tensor([2.0, 2.0])}
    new = method.aggregate(server, Updates(trained, torch.tensor([0, 2]), torch.ones(2), stats))
    assert new.buffers["lora_on"].tolist() == [True, False, True, False]  # 0.45 < 0.5: on
    # 2 switched in this round: its attention counts as it got it too (the official freeze
    # comes before the step), its W_t still trained; its factors were not used yet
    torch.testing.assert_close(new.params["ff1_w"], s["ff1_w"])
    torch.testing.assert_close(new.params["text_w"], torch.full_like(s["text_w"], 2.0))
    torch.testing.assert_close(new.params["lora_qa"], (1.0 + s["lora_qa"]) / 2)
    no_stats = method.aggregate(server, Updates(trained, torch.tensor([0, 2]), torch.ones(2)))
    assert torch.equal(no_stats.buffers["lora_on"], server.buffers["lora_on"])
    assert server.buffers["lora_on"].tolist() == [True, False, False, False]  # not written


def test_the_round_loss_stats_are_each_rows_summed_loss(tiny):
    _, task, method = tiny("fedmvp")
    params = method.client_params(seeded_server(method), torch.tensor([0, 1]))
    x = method.backbone.preprocess(task.data.train_images[:3])
    rows, y = torch.tensor([1, 0, 1]), torch.tensor([0, 1, 2])
    with torch.no_grad():
        out = method.forward(params, x, rows, Context(training=True, labels=y))
        loss, stats = training_loss(out, y)
    torch.testing.assert_close(stats["loss_sum"], torch.stack([loss[1], loss[0] + loss[2]]))
    assert stats["samples"].tolist() == [1.0, 2.0]


@pytest.mark.slow  # a round under both executors; tests/test_methods.py checks round one
def test_both_executors_agree_with_some_clients_on_lora(tiny):
    cfg, task, method = tiny("fedmvp")
    server = seeded_server(method)
    server.buffers["lora_on"][task.trainable_clients()[0]] = True
    out = both_executors_agree(method, task, cfg, server)
    assert set(out.stats) == {"loss_sum", "samples"} and out.stats["samples"].min() > 0


def test_two_rounds_switch_every_client_then_train_only_the_text_map_and_lora(tiny):
    # threshold 100: every client's round-1 loss is below it, so round 2 trains with LoRA
    from fpbench.engine.executor import train_clients

    cfg, task, method = tiny("fedmvp")
    method = _on(method, lora_threshold=100.0, missing_descriptions="class-name")
    ids = task.trainable_clients()
    server = seeded_server(method)
    for round_idx in (0, 1):
        local = train_clients(method, server, task, ids, cfg.train, round_idx=round_idx, seed=0)
        weights = task.train_sizes[local.client_ids]
        new = method.aggregate(
            server, Updates(local.params, local.client_ids, weights, local.stats)
        )
        if round_idx == 0:  # the switching round: only W_t, b_t move; the factors not used
            assert set(local.params) == {n for n in server.params if not n.startswith("lora")}
            assert new.buffers["lora_on"][ids].all()
            for n in ("ff1_w", "attn_in_w", "lora_qa"):  # (a mean of equal copies: rounding)
                torch.testing.assert_close(new.params[n], server.params[n], atol=1e-7, rtol=1e-6)
        else:  # on LoRA: the factors train, the attention block stays as it was
            assert local.params["lora_on"].all()
            assert not torch.equal(new.params["lora_qa"], server.params["lora_qa"])
            torch.testing.assert_close(
                new.params["attn_in_w"], server.params["attn_in_w"], atol=1e-7, rtol=1e-6
            )
        assert not torch.equal(new.params["text_w"], server.params["text_w"])
        server = new
