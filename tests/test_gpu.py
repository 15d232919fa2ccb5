"""bf16 against fp32, and the executors against each other, on the device a run trains on.

`pytest -m gpu` runs every case on CUDA (skipped where there is none); the CPU cases of the bf16
check run by default, under CPU bf16 autocast, so the tolerances below hold on every machine.

bf16 tolerances: one round of one local step per client (the whole client is one minibatch),
so the update is one gradient step and its error is that of one bf16 gradient. Measured with
CPU autocast when these tests were written (2026-11): relative update error at most 0.003 for
the ViT methods (0.02 for SDFed), 0.026 for CLIP text prompts, 0.115 for TPFL's pixel-space
visual prompt (its gradient w.r.t. the input runs back through the whole bf16 image encoder);
loss at most 0.002 relative. The CUDA cases passed with the same bounds on an H200.
"""

from __future__ import annotations

import pytest
import torch

from fpbench.engine.build import build_method
from fpbench.engine.executor import train_clients
from fpbench.engine.task import build_task
from fpbench.registry import METHODS

from .conftest import seeded_server, tiny_config

ALL = METHODS.names()
UPDATE_TOL = 0.1  # relative error of one bf16 update against fp32
PIXEL_PROMPT_TOL = 0.4  # methods whose visual prompt lives in pixel space
PIXEL_PROMPTS = {"tpfl", "atpfl"}
LOSS_TOL = 1e-2


def _device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device(kind)


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def _setup(name: str, device: torch.device, **train):
    cfg = tiny_config(name, **train)
    task = build_task(cfg, device)
    method = build_method(cfg, task, device)
    return cfg, task, method, seeded_server(method).to(device)


def _round(method, server, task, cfg, **kw):
    ids = task.trainable_clients()
    return train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, **kw)


def relative_update_error(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """|got - want| / |want - start|: the error of an update relative to the update."""
    return ((got.float() - want.float()).norm() / (want.float() - start.float()).norm()).item()


def test_relative_update_error_is_measured_on_the_update():
    start = torch.tensor([10.0, 0.0])
    got = relative_update_error(torch.tensor([11.0, 0.5]), torch.tensor([11.0, 0.0]), start)
    assert got == 0.5  # the update is 1 long, the error 0.5 (the values are 11 long)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_one_bf16_step_agrees_with_fp32(name, kind):
    cfg, task, method, server = _setup(name, _device(kind), batch_size=64)
    fp32 = _round(method, server, task, cfg, precision="fp32")
    bf16 = _round(method, server, task, cfg, precision="bf16")
    tol = PIXEL_PROMPT_TOL if name in PIXEL_PROMPTS else UPDATE_TOL
    start = {**server.params, **server.personal}
    for k, want in fp32.params.items():
        got = bf16.params[k]
        assert got.dtype == want.dtype, k  # what trains stays fp32
        assert torch.isfinite(got).all(), k
        if k in start and start[k].shape == want.shape and not torch.equal(want, start[k]):
            assert relative_update_error(got, want, start[k]) <= tol, k
    torch.testing.assert_close(bf16.loss.float(), fp32.loss.float(), rtol=LOSS_TOL, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL)
def test_reference_and_lockstep_executors_agree_on_cuda(name):
    """tests/test_methods.py's CPU check on CUDA, fp32 (cuDNN's TF32 convolutions included)."""
    cfg, task, method, server = _setup(
        name, _device("cuda"), local_epochs=2, weight_decay=1e-3, grad_clip=1.0
    )
    ref = _round(method, server, task, cfg, executor="reference")
    lock = _round(method, server, task, cfg, executor="lockstep")
    assert ref.client_ids.tolist() == lock.client_ids.tolist()
    for k in ref.params:
        torch.testing.assert_close(lock.params[k], ref.params[k], atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(lock.loss, ref.loss, atol=1e-4, rtol=1e-3)
