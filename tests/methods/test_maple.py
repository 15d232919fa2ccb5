"""MaPLe: the phrase prompt, vision prompts as linear maps of the text prompts, routing, FedAvg."""

from __future__ import annotations

import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates
from fpbench.testing import MethodConformance

from ..conftest import seeded_server, with_config
from .common import stacked_constants


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestMaPLeConformance(MethodConformance):
    method = "maple"


def _stack(params: dict, k: int = 1) -> dict:
    return {n: v.unsqueeze(0).expand(k, *v.shape).clone() for n, v in params.items()}


def test_initial_text_prompt_is_the_phrase_prompt_exactly(tiny):
    # depth 1 at init: tokens 1..2 are "a photo", the suffix "of a {name}." - the prompt path
    # must give open_clip's encode_text of the written-out prompt
    _, task, method = tiny("maple")
    method = with_config(method, prompt_depth=1)
    params = _stack(method.init_params(torch.Generator().manual_seed(0)))
    assert set(params) == {"ctx", "proj_w", "proj_b"}
    clip = method.backbone
    names = [n.replace("_", " ") for n in method.task.class_names]
    ids = clip.tokenize([f"a photo of a {n}." for n in names])
    with torch.no_grad():
        want = torch.nn.functional.normalize(clip.model.encode_text(ids), dim=-1)
        from fpbench.methods.maple import deep_text_features

        got = deep_text_features(clip, method.layout, params["ctx"], params["ctx"][:, :0, None])
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)
    assert method.layout.ids.equal(ids)


def test_vision_prompts_are_each_layers_linear_map_of_its_text_prompt(tiny):
    _, _, method = tiny("maple")
    gen = torch.Generator().manual_seed(3)
    p = {
        k: torch.randn(2, *v.shape, generator=gen) for k, v in seeded_server(method).params.items()
    }
    shallow, deep = method.vision_prompts(p)
    for k in range(2):  # written out per client and token: W t + b
        for t in range(2):
            want = p["proj_w"][k] @ p["ctx"][k, t] + p["proj_b"][k]
            torch.testing.assert_close(shallow[k, t], want)
            want = p["deep_proj_w"][k, 0] @ p["deep_ctx"][k, 0, t] + p["deep_proj_b"][k, 0]
            torch.testing.assert_close(deep[k, 0, t], want)
    assert deep.shape == (2, 1, 2, 32)  # K, J - 1 = 1, n_ctx = 2, vision width 32


def test_each_sample_uses_its_own_clients_prompts(tiny):
    _, task, method = tiny("maple")
    server = seeded_server(method)
    two = method.client_params(server, torch.tensor([0, 1]))
    with torch.no_grad():
        for name in two:
            two[name][1] += 0.05 * torch.randn_like(two[name][1])
        x = method.backbone.preprocess(task.data.train_images[:4])
        rows = torch.tensor([0, 1, 1, 0])
        both = method.forward(two, x, rows, Context(training=False))
        for k in (0, 1):
            one = {n: v[k : k + 1] for n, v in two.items()}
            alone = method.forward(one, x, torch.zeros(4, dtype=torch.long), Context(False))
            sel = rows == k
            torch.testing.assert_close(both[sel], alone[sel], atol=1e-5, rtol=1e-5)
        assert (both[1] - method.forward(
            {n: v[:1] for n, v in two.items()}, x, torch.zeros(4, dtype=torch.long),
            Context(False))[1]).abs().max() > 1e-4  # fmt: skip


def test_every_tensor_is_averaged_by_sample_size(tiny):
    _, _, method = tiny("maple")
    server = seeded_server(method)
    assert set(server.params) == {"ctx", "proj_w", "proj_b", "deep_ctx", "deep_proj_w",
                                  "deep_proj_b"}  # fmt: skip
    assert server.personal == {}
    trained = stacked_constants(server.params, [1.0, 4.0])
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]))
    )
    for v in new.params.values():  # (30 * 1 + 10 * 4) / 40
        torch.testing.assert_close(v, torch.full_like(v, 1.75))


def test_resnets_and_too_deep_prompts_are_refused(tiny, fpbench_cache):
    _, _, method = tiny("maple")
    with pytest.raises(FpbenchError, match="prompt_depth = 3 exceeds the backbone's 2 layers"):
        with_config(method, prompt_depth=3)
    rn = create_backbone("clip-test-rn")
    with pytest.raises(FpbenchError, match="needs a ViT CLIP"):
        type(method)(method.cfg, rn, method.task)


def _three_layer_clip(tmp_path):
    import json

    import open_clip

    from fpbench.backbones.clip import PromptedCLIP

    text = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 3}
    vision = {"image_size": 16, "layers": 3, "width": 32, "patch_size": 8, "head_width": 16}
    cfg = tmp_path / "fpbench-maple-3.json"
    cfg.write_text(json.dumps({"embed_dim": 32, "quick_gelu": True, "vision_cfg": vision,
                               "text_cfg": text}))  # fmt: skip
    open_clip.add_model_config(cfg)
    return PromptedCLIP(open_clip.create_model("fpbench-maple-3"), "fpbench-maple-3")


def test_deep_projections_start_as_clones_of_one_layer_and_random_init_uses_x(tiny, tmp_path):
    _, _, method = tiny("maple")
    clip = _three_layer_clip(tmp_path)
    deep = type(method)(method.Config(prompt_depth=3), clip, method.task)
    params = deep.init_params(torch.Generator().manual_seed(0))
    assert params["deep_ctx"].shape == (2, 2, 32)
    assert torch.equal(params["deep_proj_w"][0], params["deep_proj_w"][1])  # the reference's
    assert torch.equal(params["deep_proj_b"][0], params["deep_proj_b"][1])  # _get_clones
    assert not torch.equal(params["deep_ctx"][0], params["deep_ctx"][1])
    assert not torch.equal(params["proj_w"], params["deep_proj_w"][0])  # a separate draw
    # no phrase: "X X name." with N(0, 0.02^2) context
    plain = type(method)(method.Config(prompt_depth=3, ctx_init=None), clip, method.task)
    name = method.task.class_names[0].replace("_", " ")
    assert plain.layout.ids[0].equal(clip.tokenize([f"X X {name}."])[0])
    ctx = plain.init_params(torch.Generator().manual_seed(0))["ctx"]
    torch.testing.assert_close(
        ctx, torch.randn(2, 32, generator=torch.Generator().manual_seed(0)) * 0.02
    )
