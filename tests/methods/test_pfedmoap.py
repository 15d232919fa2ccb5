"""pFedMoAP: the attention gate and the expert choice by hand, the mixed logits against an
independent attention, and the round-by-round flow of contexts, gates and experts."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.runner import run_cell
from fpbench.methods.base import Context, Updates
from fpbench.methods.pfedmoap import GATE_NAMES, PFedMoAPConfig, gate_mix, nearest_experts
from fpbench.store import Store
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, tiny_config, with_config
from tests.conftest import Crash, CrashAfter
from tests.methods.common import both_executors_agree, features_as_images


def _gate(wq=None, wo=None, bo=None, d=2):
    eye, zero = torch.eye(d), torch.zeros(d)
    g = {"gate_wq": eye if wq is None else wq, "gate_wk": eye, "gate_wv": eye,
         "gate_wo": eye if wo is None else wo, "gate_bq": zero, "gate_bk": zero,
         "gate_bv": zero, "gate_bo": zero if bo is None else bo}  # fmt: skip
    return {k: v.unsqueeze(0) for k, v in g.items()}  # one sample's gate (B = 1)


def test_gate_by_hand_one_head_two_heads_mask_and_output_map():
    q = torch.tensor([[1.0, 0.0]])
    kv = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (B=1, C=1, X=2, d=2)
    both = torch.tensor([[True, True]])
    s = math.log(3.0)  # scores (1, 0) * ln 3: softmax (3/4, 1/4)
    out = gate_mix(q, kv, both, _gate(), 1, s)
    torch.testing.assert_close(out, torch.tensor([[[0.75, 0.25]]]))
    # the second expert masked: all weight on the first
    out = gate_mix(q, kv, torch.tensor([[True, False]]), _gate(), 1, s)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0]]]))
    # two heads of width 1: head 1 as above on dim 0; head 2's query is 0, so uniform on dim 1
    out = gate_mix(q, kv, both, _gate(), 2, s)
    torch.testing.assert_close(out, torch.tensor([[[0.75, 0.5]]]))
    # W_q doubles the query (scores (2, 0) * ln 3: 9/10, 1/10); W_o swaps, b_o adds (1, 0)
    swap = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    out = gate_mix(q, kv, both, _gate(2 * torch.eye(2), swap, torch.tensor([1.0, 0.0])), 1, s)
    torch.testing.assert_close(out, torch.tensor([[[1.1, 0.9]]]))


def test_nearest_experts_by_hand():
    uploads = torch.tensor([0.0, 1.0, 3.0, 10.0, -1.0]).view(5, 1, 1)
    uploaded = torch.tensor([True, True, True, False, True])
    ids, mask = nearest_experts(uploads, uploaded, torch.tensor([0, 2, 3]),
                                torch.tensor([True, True, False]), 2)  # fmt: skip
    # client 0: 1 and -1 both at distance 1 (the lower id first); client 2: 1 (2), 0 (3)
    assert ids[0].tolist() == [1, 4] and ids[1].tolist() == [1, 0]
    assert mask[:2].all() and not mask[2].any()  # client 3 is not allowed experts
    ids, mask = nearest_experts(uploads, uploaded, torch.tensor([2]), torch.tensor([True]), 4)
    assert ids[0, :3].tolist() == [1, 0, 4] and mask.tolist() == [[True, True, True, False]]


def test_defaults_are_the_official_code():
    cfg = PFedMoAPConfig()
    assert (cfg.n_ctx, cfg.num_experts, cfg.lmbda, cfg.scaling) == (16, 10, 0.5, 10.0)
    assert (cfg.gating_heads, cfg.gating_embed_dim, cfg.gating_lr) == (8, 128, 0.01)
    assert (cfg.gating_momentum, cfg.gating_weight_decay) == (0.9, 5e-4)


def _independent_logits(method, params, uploads, feats, rows, lmbda, scaling, heads):
    """Per sample: lambda * local + s * q . W_o MHA(...) with torch's own attention."""
    clip, stride = method.backbone, method.stride
    f = F.normalize(feats, dim=-1)
    text = method.text_features(params["ctx"])  # (K, C, E)
    others = method.text_features(uploads)  # (N, C, E)
    out = []
    for i, k in enumerate(rows.tolist()):
        local = clip.logit_scale * f[i] @ text[k].T
        chosen = params["expert_ids"][k][params["expert_mask"][k]]
        if not len(chosen):
            out.append(local)
            continue
        q = f[i, ::stride]
        kv = torch.cat([text[k].unsqueeze(1), others[chosen].transpose(0, 1)], 1)[..., ::stride]
        lin = lambda x, n, k=k: x @ params[f"gate_w{n}"][k].T + params[f"gate_b{n}"][k]  # noqa: E731
        c, x, d = kv.shape
        qh = lin(q, "q").view(1, heads, 1, d // heads).expand(c, -1, -1, -1)
        kh = lin(kv, "k").view(c, x, heads, d // heads).transpose(1, 2)
        vh = lin(kv, "v").view(c, x, heads, d // heads).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scaling).reshape(c, d)
        out.append(lmbda * local + clip.logit_scale * lin(o, "o") @ q)
    return torch.stack(out)


def test_logits_mix_the_experts_by_an_independent_attention(tiny, monkeypatch):
    _, task, method = tiny("pfedmoap")
    method = with_config(method, n_ctx=3, lmbda=0.3, scaling=2.0, gating_embed_dim=8,
                         gating_heads=2, num_experts=3)  # fmt: skip
    assert method.stride == 4 and method.slots == 2
    gen = torch.Generator().manual_seed(1)
    d, m, w = 8, 3, method.backbone.ctx_dim
    params = {n: torch.randn(2, d, d, generator=gen) if "_w" in n else
              torch.randn(2, d, generator=gen) for n in GATE_NAMES}  # fmt: skip
    params["ctx"] = torch.randn(2, m, w, generator=gen) * 0.3
    uploads = torch.randn(4, m, w, generator=gen) * 0.3
    params["expert_ids"] = torch.tensor([[2, 3], [0, 1]])
    params["expert_mask"] = torch.tensor([[True, True], [True, False]])
    feats = torch.randn(5, method.backbone.embed_dim, generator=gen)
    features_as_images(monkeypatch, method)
    rows = torch.tensor([0, 1, 1, 0, 1])
    ctx = Context(training=True, buffers={"uploads": uploads})
    logits = method.forward(params, feats, rows, ctx)
    expected = _independent_logits(method, params, uploads, feats, rows, 0.3, 2.0, 2)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # client 1 without experts: CoOp's logits alone
    params["expert_mask"] = torch.tensor([[True, True], [False, False]])
    logits = method.forward(params, feats, rows, ctx)
    expected = _independent_logits(method, params, uploads, feats, rows, 0.3, 2.0, 2)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    plain = (
        method.backbone.logit_scale
        * F.normalize(feats[1], dim=-1)
        @ (method.text_features(params["ctx"])[1].T)
    )
    torch.testing.assert_close(logits[1], plain, atol=1e-5, rtol=1e-5)


def _trained(method, server, ids, shift):
    """The K clients' start params as if trained: context and gates moved by `shift`."""
    out = method.client_params(server, ids)
    for n in ("ctx", *GATE_NAMES):
        out[n] = out[n] + shift * (1 + torch.arange(len(ids))).view(-1, *[1] * (out[n].dim() - 1))
    return out


def test_rounds_contexts_averaged_gates_kept_only_after_training_with_experts(tiny):
    _, task, method = tiny("pfedmoap")
    method = with_config(method, gating_embed_dim=16, gating_heads=4, num_experts=2)
    server = seeded_server(method)
    n = task.num_clients
    assert n >= 3 and method.slots == 1
    assert set(server.params) == {"ctx"} and set(server.personal) == set(GATE_NAMES)
    first = method.client_params(server, torch.arange(n))
    assert not first["expert_mask"].any()  # round one: nobody uploaded, no experts
    ids = torch.tensor([0, 1])  # client 2 and later never train here
    up1 = _trained(method, server, ids, 0.1)
    s1 = method.aggregate(server, Updates(up1, ids, torch.tensor([1.0, 3.0])))
    # contexts: FedAvg by train size; gates of clients without experts: unchanged
    torch.testing.assert_close(s1.params["ctx"], 0.25 * up1["ctx"][0] + 0.75 * up1["ctx"][1])
    for g in GATE_NAMES:
        assert torch.equal(s1.personal[g], server.personal[g])
    assert torch.equal(s1.buffers["uploads"][:2], up1["ctx"])
    assert s1.buffers["uploaded"].tolist() == [True, True] + [False] * (n - 2)
    assert not s1.buffers["gated"].any()
    # round two, training: each has the other as its expert; client 2 (first time) has none
    start = method.client_params(s1, torch.tensor([0, 1, 2]))
    assert start["expert_ids"][:2, 0].tolist() == [1, 0]
    assert start["expert_mask"][:, 0].tolist() == [True, True, False]
    torch.testing.assert_close(start["ctx"][0], s1.params["ctx"])
    # evaluation after round one: own upload, no experts (never trained with them); a client
    # that never trained gets the server's context
    ev = method.client_params(s1, torch.tensor([1, 2]), training=False)
    assert torch.equal(ev["ctx"][0], up1["ctx"][1]) and torch.equal(ev["ctx"][1], s1.params["ctx"])
    assert not ev["expert_mask"].any()
    up2 = _trained(method, s1, torch.tensor([0, 2]), 0.2)
    s2 = method.aggregate(s1, Updates(up2, torch.tensor([0, 2]), torch.tensor([1.0, 1.0])))
    for g in GATE_NAMES:  # client 0 trained with an expert: its gate kept; client 2: not
        assert torch.equal(s2.personal[g][0], up2[g][0])
        assert torch.equal(s2.personal[g][2], s1.personal[g][2])
    assert s2.buffers["gated"][:3].tolist() == [True, False, False]
    ev = method.client_params(s2, torch.tensor([0]), training=False)
    assert ev["expert_mask"].tolist() == [[True]] and torch.equal(ev["ctx"][0], up2["ctx"][0])
    # client 0's nearest upload: client 2's (0.2 * 2 from the same start) or client 1's
    d1 = (up2["ctx"][0] - up1["ctx"][1]).norm()
    d2 = (up2["ctx"][0] - up2["ctx"][1]).norm()
    assert ev["expert_ids"].item() == (1 if d1 <= d2 else 2)


def test_executors_agree_with_experts(tiny):
    cfg, task, method = tiny("pfedmoap", local_epochs=2, weight_decay=1e-3)
    server = seeded_server(method)
    ids = torch.arange(task.num_clients)
    up = _trained(method, server, ids, 0.05)
    server = method.aggregate(server, Updates(up, ids, torch.ones(len(ids))))
    start = method.client_params(server, torch.tensor(task.trainable_clients()))
    assert start["expert_mask"].all()
    local = both_executors_agree(method, task, cfg, server)
    for g in GATE_NAMES:  # with experts the gates learn from the cross-entropy
        assert not torch.equal(local.params[g], start[g])


def test_a_resumed_run_keeps_uploads_and_gates(tmp_path, fpbench_cache):
    """Stopped after round 1 (experts from round 2 on: the uploads and flags are server buffers),
    resumed from its checkpoint: every stored value equals an uninterrupted run's."""
    cfg = tiny_config("pfedmoap", rounds=3)
    whole = Store(f"sqlite:///{tmp_path / 'whole.db'}")
    assert run_cell(cfg, whole, checkpoint_dir=tmp_path / "ck1").status == "done"
    split = Store(f"sqlite:///{tmp_path / 'split.db'}")
    with pytest.raises(Crash):
        run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2", observer=CrashAfter(1))
    assert run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2").status == "done"
    a, b = (s.metrics(aggregate_only=False) for s in (whole, split))
    keys = ["round", "client_id", "name"]
    a, b = (t.sort_values(keys, na_position="first").reset_index(drop=True) for t in (a, b))
    assert len(a) and a["round"].max() == 2
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), b.drop(columns="run_id"))


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestPFedMoAPConformance(MethodConformance):
    method = "pfedmoap"
