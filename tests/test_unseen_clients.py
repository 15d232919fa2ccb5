"""Clients that never trained: left out of a personal method's local metrics (counted), and
P-PT's score for a new client (the initial prompts and the federated head)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpbench.engine.build import build_populations
from fpbench.engine.evaluate import evaluate
from fpbench.engine.metrics import EvalCounts, aggregates, client_rows, domain_accuracies
from fpbench.engine.rounds import mark_untrained
from fpbench.engine.runner import run_cell
from fpbench.methods.base import Context
from fpbench.store import Store
from tests.conftest import tiny_config


def _counts(untrained=None) -> EvalCounts:
    """4 clients: 0 and 1 trained (50 %, 100 %), 2 never sampled (0 %), 3 held out."""
    return EvalCounts(
        correct_local=np.array([2, 4, 0, 3]),
        total_local=np.array([4, 4, 4, 4]),
        heldout=np.array([False, False, False, True]),
        global_acc=np.array([0.5, 0.7, 0.1, np.nan]),
        global_total=10,
        heldout_applicable=False,
        untrained=untrained,
    )


def test_excluded_clients_leave_every_local_metric_and_are_counted():
    scored = aggregates(_counts())
    assert scored["acc_local_worst"] == 0.0 and scored["acc_local_mean"] == pytest.approx(0.5)
    assert "clients_untrained" not in scored
    out = aggregates(_counts(np.array([False, False, True, False])))
    assert out["acc_local_mean"] == pytest.approx(0.75)
    assert out["acc_local_worst"] == pytest.approx(0.5)
    assert out["acc_pooled"] == pytest.approx(6 / 8)
    assert out["acc_global"] == pytest.approx(0.6)
    assert out["clients_untrained"] == 1.0
    rows = client_rows(_counts(np.array([False, False, True, False])))
    assert {c for c, *_ in rows} == {0, 1}
    dom = domain_accuracies(_counts(np.array([False, False, True, False])), [0, 0, 0, 0], ["a"])
    assert dom == {"acc_domain_a": pytest.approx(0.75)}


def test_only_personal_methods_mark_their_never_sampled_clients(tiny):
    for name in ("pfedpg", "fedvpt"):
        cfg, task, _ = tiny(name)
        populations = build_populations(cfg, task, torch.device("cpu"))
        heldout = task.heldout.numpy()
        counts = _counts()
        counts = EvalCounts(**{**counts.__dict__, "heldout": heldout})
        seen = [c for c in range(task.num_clients) if not heldout[c]][::2]
        marked = mark_untrained(counts, populations, seen, "exclude")
        if name == "fedvpt":  # a global model: a never-sampled client is a new client
            assert marked.untrained is None
            continue
        want = np.array([not heldout[c] and c not in seen for c in range(task.num_clients)])
        assert marked.untrained.tolist() == want.tolist() and want.any()
        assert mark_untrained(counts, populations, seen, "score").untrained is None


def test_a_run_records_the_excluded_count_and_no_rows_for_them(tmp_path):
    """pFedPG with 1 of 3 participating clients sampled in its only round."""
    cfg = tiny_config("pfedpg", rounds=1, participation=0.34)
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    run_cell(cfg, store, checkpoint_dir=tmp_path)
    m = store.metrics(aggregate_only=False)
    assert m[m["name"] == "clients_untrained"]["value"].tolist() == [2.0]
    assert len(m[m["name"] == "acc_local"]) == 1
    score = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"unseen_clients": "score"})}
    )
    assert score.run_key != cfg.run_key
    run_cell(score, store, checkpoint_dir=tmp_path)
    m = store.metrics(aggregate_only=False)
    run = store.find_run(score.run_key).id
    mine = m[m["run_id"] == run]
    assert len(mine[mine["name"] == "acc_local"]) == 3 and "clients_untrained" not in set(
        mine["name"]
    )


def test_p_pt_scores_a_new_client_with_the_initial_prompts_and_the_federated_head(tiny):
    _, task, method = tiny("p-pt")
    server = method.init_server(torch.Generator().manual_seed(0))
    trained = dict(server.personal)
    trained["prompts"] = server.personal["prompts"] + 1.0  # as if every client had trained
    held = int(np.flatnonzero(task.heldout.numpy())[0])
    initial = server.personal["prompts"][held].clone()
    trained["prompts"][held] = initial  # a held-out client never trains its prompts
    server = type(server)(server.params, trained, server.buffers)
    counts = evaluate(method, server, task, batch_size=64)
    assert counts.heldout_applicable and "acc_heldout_mean" in aggregates(counts)
    idx = task.test_idx[held]
    x = method.backbone.preprocess(task.data.test_images[idx])
    params = {"prompts": initial[None], "head_w": server.params["head_w"][None]}
    params["head_b"] = server.params["head_b"][None]
    rows = torch.zeros(len(idx), dtype=torch.long)
    pred = method.forward(params, x, rows, Context(training=False)).argmax(-1)
    assert counts.correct_local[held] == int((pred == task.data.test_labels[idx]).sum())
