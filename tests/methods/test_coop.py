"""CoOp and the CLIP prompt family: aggregation, privacy and the backbone check."""

from __future__ import annotations

import pytest
import torch

from fpbench.errors import FpbenchError
from fpbench.methods.base import Updates
from fpbench.methods.coop import CoOpModel

from ..conftest import seeded_server
from .common import stacked_constants


@pytest.mark.parametrize("name", ["promptfl", "tpfl"])
def test_prompts_are_averaged_by_sample_size(tiny, name):
    _, _, method = tiny(name)
    server = seeded_server(method)
    expected = {"promptfl": {"ctx"}, "tpfl": {"ctx", "visual_prompt"}}[name]
    assert set(server.params) == expected
    trained = stacked_constants(server.params, [1.0, 4.0])
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]))
    )
    for v in new.params.values():  # (30 * 1 + 10 * 4) / 40
        torch.testing.assert_close(v, torch.full_like(v, 1.75))


def test_coop_local_keeps_everything_private(tiny):
    _, _, method = tiny("coop-local")
    server = seeded_server(method)
    assert server.params == {} and method.communication(server) == ({}, {})
    assert method.inference == "personal" and set(server.personal) == {"ctx"}


def test_clip_methods_refuse_a_vit_backbone(tiny):
    _, task, vit_method = tiny("fedvpt")
    _, _, clip_method = tiny("promptfl")
    with pytest.raises(FpbenchError, match="needs a CLIP backbone"):
        type(clip_method)(clip_method.cfg, vit_method.backbone, clip_method.task)
    assert issubclass(type(clip_method), CoOpModel)
