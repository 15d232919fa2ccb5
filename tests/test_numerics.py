"""Selections and mixing weights are computed in fp32 even under bf16 autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fpbench.methods.keys import key_cosines, nearest_group, select_groups
from fpbench.methods.numerics import fp32
from fpbench.methods.pep_fedpt import ccmp_weights
from fpbench.methods.sgpt import frequency_scores


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _near_ties(n: int = 512, g: int = 16, d: int = 64, seed: int = 0):
    """Queries (n, d) and keys (g, d) whose best two cosines differ by ~1e-3 (a bf16 ulp)."""
    gen = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(g, d, generator=gen), dim=-1)
    a, b = torch.randint(g, (n,), generator=gen), torch.randint(g, (n,), generator=gen)
    mix = 0.5 + 1e-3 * torch.randn(n, 1, generator=gen)
    query = mix * keys[a] + (1 - mix) * keys[b] + 1e-3 * torch.randn(n, d, generator=gen)
    return query, keys


def test_fp32_turns_autocast_off_and_keeps_gradients():
    x = torch.randn(4, 8, requires_grad=True)

    @fp32
    def mm(a):
        return a @ a.T

    with _bf16():
        assert (x @ x.T).dtype == torch.bfloat16
        out = mm(x)
    assert out.dtype == torch.float32 and torch.equal(out, x @ x.T)
    out.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_sgpt_select_under_bf16_autocast_equals_fp32():
    query, keys = _near_ties()
    rows = torch.zeros(len(query), dtype=torch.long)
    counts = torch.arange(16) * 7
    want_cos = key_cosines(query, keys[None], rows)
    want = frequency_scores(want_cos, counts, 5e-4).argmin(1)
    with _bf16():
        cos = key_cosines(query, keys[None], rows)
        got = frequency_scores(cos, counts, 5e-4).argmin(1)
        nearest = nearest_group(query, keys)
    assert torch.equal(cos, want_cos) and torch.equal(got, want)
    assert torch.equal(nearest, want_cos.argmax(1))


def test_fgpt_key_choice_under_bf16_autocast_equals_fp32():
    query, keys = _near_ties(seed=1)
    want = select_groups(query, keys, k=2)
    with _bf16():
        got = select_groups(query, keys, k=2)
    assert torch.equal(got, want)


def test_pep_ccmp_weights_under_bf16_autocast_equal_fp32():
    gen = torch.Generator().manual_seed(2)
    cls, protos = torch.randn(64, 48, generator=gen), torch.randn(10, 48, generator=gen)
    priors = torch.softmax(torch.randn(64, 10, generator=gen), -1)
    want = ccmp_weights(cls, protos, priors, 0.05)
    with _bf16():
        got = ccmp_weights(cls.bfloat16(), protos, priors, 0.05)  # a bf16 activation comes in
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ccmp_weights(cls.bfloat16().float(), protos, priors, 0.05))
    with _bf16():
        assert torch.equal(ccmp_weights(cls, protos, priors, 0.05), want)
