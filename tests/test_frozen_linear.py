"""Frozen linear layers through oneDNN on the CPU: the same products as nn.Linear, and a plain
nn.Linear wherever that path does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fpbench.backbones import create_backbone, frozen_linear
from fpbench.backbones.frozen_linear import FrozenLinear, cpu_linear, freeze_linears
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from tests.conftest import tiny_config


def _layers(seed: int = 0) -> tuple[nn.Linear, FrozenLinear]:
    torch.manual_seed(seed)
    plain = nn.Linear(48, 80).requires_grad_(False)
    frozen = freeze_linears(nn.Sequential(nn.Linear(48, 80)))[0]
    frozen.load_state_dict(plain.state_dict())
    return plain, frozen.requires_grad_(False)


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """Count the products computed by oneDNN."""
    seen: list[int] = []
    real = frozen_linear._onednn

    def counting(x, weight, bias):
        seen.append(1)
        return real(x, weight, bias)

    monkeypatch.setattr(frozen_linear, "_onednn", counting)
    return seen


@pytest.mark.skipif(not frozen_linear._HAS_ONEDNN, reason="this torch build has no oneDNN")
def test_forward_and_input_gradient_equal_nn_linear_up_to_rounding(calls):
    plain, frozen = _layers()
    x = torch.randn(3, 7, 48)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), frozen(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert len(calls) == 2  # forward, and the input gradient
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    assert plain.weight.grad is None and frozen.weight.grad is None


@pytest.mark.skipif(not frozen_linear._HAS_ONEDNN, reason="this torch build has no oneDNN")
def test_new_weights_are_used_by_the_input_gradient(calls):
    plain, frozen = _layers()
    x = torch.randn(5, 48, requires_grad=True)
    frozen(x).sum().backward()  # caches W^T
    other, _ = _layers(seed=1)
    with torch.no_grad():
        frozen.weight.copy_(other.weight)
    x2 = x.detach().clone().requires_grad_()
    frozen(x2).sum().backward()
    expected = torch.ones(5, 80) @ other.weight
    torch.testing.assert_close(x2.grad, expected, rtol=1e-5, atol=1e-5)


def test_plain_linear_where_onednn_does_not_apply(calls):
    plain, frozen = _layers()
    x = torch.randn(4, 48)
    with cpu_linear("blas"):
        assert torch.equal(frozen(x), plain(x))
    assert torch.equal(frozen.double()(x.double()), plain.double()(x.double()))
    plain.float(), frozen.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = frozen(x)
        assert y.dtype == torch.bfloat16 and torch.equal(y, plain(x))
    frozen.requires_grad_(True)  # a weight that trains (e.g. pretraining vit-smoke)
    assert torch.equal(frozen(x), plain(x))
    assert calls == []


def test_backbones_compute_their_linear_layers_through_it(calls):
    vit = create_backbone("vit-test", pretrained=False)
    linears = [m for m in vit.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FrozenLinear for m in linears)
    assert not any(p.requires_grad for p in vit.parameters())
    cls = vit.forward_features(torch.zeros(2, 3, vit.img_size, vit.img_size)).cls  # computed here
    assert cls.shape == (2, vit.embed_dim)
    assert len(calls) == (len(linears) if frozen_linear._HAS_ONEDNN else 0)


@pytest.mark.skipif(not frozen_linear._HAS_ONEDNN, reason="this torch build has no oneDNN")
def test_the_input_gradient_is_differentiable(calls):
    """FedMix differentiates the input gradient (create_graph): second order equals nn.Linear's."""
    plain, frozen = _layers()
    x = torch.randn(6, 48)
    v = torch.randn(6, 48)

    def second_order(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(torch.tanh(layer(xx)).pow(2).sum(), xx, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), xx)
        return g.detach(), h

    (ga, ha), (gb, hb) = second_order(plain), second_order(frozen)
    assert len(calls) >= 4  # forward, input gradient, and their products in the second order
    torch.testing.assert_close(gb, ga, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hb, ha, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["onednn", "blas"])
def test_a_cell_computes_with_its_runtime_cpu_linear(backend, calls, tmp_path):
    cfg = tiny_config("fedvpt", rounds=1)
    runtime = cfg.runtime.model_copy(update={"cpu_linear": backend, "device": "cpu"})
    cfg = cfg.model_copy(update={"runtime": runtime})  # on the CPU also where CUDA is there
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    assert (len(calls) > 0) == (backend == "onednn" and frozen_linear._HAS_ONEDNN)
    assert frozen_linear._backend == "onednn"  # the default is back after the cell
