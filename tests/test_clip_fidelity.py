"""The CLIP methods run what the SDFed and TPFL papers ran; each test fails on the old code."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Context


def _server(method):
    return method.init_server(torch.Generator().manual_seed(0))


# -- TPFL / ATPFL's visual prompt ---------------------------------------------------------------
def test_tpfl_initial_visual_prompt_leaves_clip_zero_shot_logits_unchanged(tiny):
    _, task, method = tiny("tpfl")
    server = _server(method)
    params = method.client_params(server, torch.tensor([0]))
    x = method.backbone.preprocess(task.data.test_images[:6])
    rows = torch.zeros(6, dtype=torch.long)
    logits = method.forward(params, x, rows, Context(training=False))
    plain = F.normalize(method.backbone.encode_image(x).float(), dim=-1)  # no prompt at all
    text = method.text_features(params["ctx"])
    torch.testing.assert_close(logits, method.logits(plain, text, rows), atol=1e-5, rtol=1e-5)


def test_tpfl_visual_prompt_moves_within_a_few_steps(tiny):
    # the suite's Adam at lr 1e-3 moved a pixel by at most 0.003 in these 2-3 steps
    cfg, task, method = tiny("tpfl", optimizer="adam", lr=0.001)
    server = _server(method)
    ids = task.trainable_clients()
    out = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    moved = (out.params["visual_prompt"] - server.params["visual_prompt"]).abs()
    assert moved.mean() > 0.02 and moved.max() > 0.1
    # the text context still trains with the run's Adam: each step moves it by at most ~lr
    ctx_moved = (out.params["ctx"] - server.params["ctx"].unsqueeze(0)).abs().max()
    assert 0 < ctx_moved <= 3 * 0.001 * 1.01


def test_visual_prompt_follows_its_own_optimiser_and_the_run_schedule(tiny):
    from fpbench.engine.executor import phase_optimizer
    from fpbench.engine.optim import StackedAdam, StackedSGD

    cfg, _, method = tiny("tpfl", optimizer="adam", lr=0.002)
    phase = method.phases(1, ("ctx", "visual_prompt"))[0]
    tensors = [torch.zeros(2, 3), torch.zeros(2, 4)]
    group = phase_optimizer(method, cfg.train, tensors, phase, lr=0.001)  # half of train.lr
    adam, sgd = group.optimizers
    assert isinstance(adam, StackedAdam) and adam.params == [tensors[0]] and adam.lr == 0.001
    assert isinstance(sgd, StackedSGD) and sgd.params == [tensors[1]]
    assert sgd.lr == 20.0 and sgd.momentum == 0.9 and sgd.weight_decay == 0.0
