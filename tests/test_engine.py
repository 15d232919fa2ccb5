"""The round loop: sampling, evaluation, storage, checkpoints and resume."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.cell import sampling_schedule
from fpbench.engine.evaluate import evaluate
from fpbench.engine.observer import CellResult
from fpbench.engine.rounds import should_eval
from fpbench.engine.runner import run_cell
from fpbench.engine.seeding import derive_seed
from fpbench.methods.base import Context
from fpbench.store import Store
from tests.conftest import Crash, CrashAfter, tiny_config


def test_sampling_schedule_is_seeded_and_respects_participation():
    a = sampling_schedule(0, 20, [0, 1, 2, 4, 5], 0.4)
    assert a == sampling_schedule(0, 20, [0, 1, 2, 4, 5], 0.4)
    assert a != sampling_schedule(1, 20, [0, 1, 2, 4, 5], 0.4)
    assert all(len(r) == 2 and len(set(r)) == 2 and set(r) <= {0, 1, 2, 4, 5} for r in a)
    assert sampling_schedule(0, 3, list(range(100)), 0.05)[0].__len__() == 5  # floor(N * p)


def test_eval_schedule():
    cfg = tiny_config(rounds=10, eval_every=4, eval_last=2)
    assert [r for r in range(10) if should_eval(r, cfg.train)] == [3, 7, 8, 9]


def test_the_last_round_is_evaluated_without_eval_last():
    """`eval_last = 0`: every `eval_every`-th round, and the last one whatever its number."""
    cfg = tiny_config(rounds=10, eval_every=4, eval_last=0)
    assert [r for r in range(10) if should_eval(r, cfg.train)] == [3, 7, 9]
    cfg = tiny_config(rounds=7, eval_every=3, eval_last=1)
    assert [r for r in range(7) if should_eval(r, cfg.train)] == [2, 5, 6]


def test_sampling_draws_from_its_own_seed_without_replacement():
    """Each round draws floor(p * N) distinct clients from `derive_seed(seed, "client-sampling")`
    (every method of a seed sees the same clients), as plain ints; p * N just under an integer
    by rounding (0.29 * 100 = 28.999999999999996) still gives that integer, and a tiny p still
    one client."""
    clients = [0, 1, 2, 4, 5, 7, 8, 9, 11, 12]
    got = sampling_schedule(6, 3, clients, 0.3)
    rng = np.random.default_rng(derive_seed(6, "client-sampling"))
    assert got == [rng.choice(clients, 3, replace=False).tolist() for _ in range(3)]
    assert {type(c) for ids in got for c in ids} == {int}
    assert [sorted(ids) for ids in sampling_schedule(0, 4, clients, 1.0)] == [clients] * 4
    assert [len(ids) for ids in sampling_schedule(0, 4, [3, 4, 5], 0.1)] == [1] * 4
    assert [len(ids) for ids in sampling_schedule(0, 2, list(range(100)), 0.29)] == [29, 29]


def test_global_evaluation_indexes_one_prediction_pass(tiny):
    cfg, task, method = tiny("fedvpt")
    server = method.init_server(torch.Generator().manual_seed(0))
    ev = evaluate(method, server, task, batch_size=7)
    assert len(ev.global_acc) == 1
    assert ev.total_local.tolist() == [len(i) for i in task.test_idx]
    # the same counts from a per-client pass of the same global model
    for c, idx in enumerate(task.test_idx):
        x = method.backbone.preprocess(task.data.test_images[idx])
        params = method.client_params(server, torch.tensor([0]), training=False)
        pred = method.forward(
            params, x, torch.zeros(len(idx), dtype=torch.long), Context(training=False)
        ).argmax(-1)
        assert int((pred == task.data.test_labels[idx]).sum()) == ev.correct_local[c]


def test_personal_evaluation_skips_heldout(tiny):
    cfg, task, method = tiny("local")
    server = method.init_server(torch.Generator().manual_seed(0))
    ev = evaluate(method, server, task, batch_size=64)
    held = task.heldout.numpy()
    assert held.any() and not ev.heldout_applicable
    assert pd.isna(ev.global_acc[held]).all() and not pd.isna(ev.global_acc[~held]).any()


class _Starts:
    """Records the round each cell starts at."""

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def cell_start(self, cfg, start_round):
        self.rounds.append(start_round)

    def round_end(self, cfg, round_idx, metrics):
        pass


def _table(store: Store) -> pd.DataFrame:
    m = store.metrics(aggregate_only=False)
    return m.sort_values(["round", "client_id", "name"], na_position="first").reset_index(drop=True)


def test_killed_run_resumes_where_it_stopped_with_identical_results(tmp_path):
    cfg = tiny_config(rounds=4)
    whole = Store(f"sqlite:///{tmp_path / 'whole.db'}")
    assert run_cell(cfg, whole, checkpoint_dir=tmp_path / "ck1").status == "done"

    split = Store(f"sqlite:///{tmp_path / 'split.db'}")
    with pytest.raises(Crash):
        run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2", observer=CrashAfter(1))
    record = split.find_run(cfg.run_key)
    assert record.status == "failed" and split.last_round(record.id) == 1
    checkpoint = tmp_path / "ck2" / split.database_id / f"{cfg.run_key}.pt"  # its database's
    assert checkpoint.exists()
    # bound to its database and run: another database's or run's copy would not be resumed
    assert ckpt_io.saved_round(checkpoint) == (1, f"{split.database_id}:{record.id}")
    resumed = _Starts()
    assert run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2", observer=resumed).status == "done"
    assert resumed.rounds == [2]  # resumed after round 1, not restarted
    assert not checkpoint.exists()

    a, b = _table(whole), _table(split)
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), b.drop(columns="run_id"))
    rounds = split.rounds(record.id)
    assert rounds["round"].tolist() == [0, 1, 2, 3]


def test_finished_run_is_skipped_and_adds_no_rows(tmp_path):
    cfg = tiny_config(rounds=2)
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    run_cell(cfg, store, checkpoint_dir=tmp_path)
    n = len(store.metrics(aggregate_only=False))
    assert run_cell(cfg, store, checkpoint_dir=tmp_path) == CellResult(cfg, "skipped")
    assert len(store.metrics(aggregate_only=False)) == n
    names = set(store.metrics()["name"])
    expected = {
        "acc_global",
        "acc_pooled",
        "acc_local_mean",
        "acc_local_worst",
        "acc_local_p05",
        "acc_local_p10",
        "acc_local_p15",
        "acc_heldout_mean",
        "acc_heldout_worst",
        "loss_train",
    }
    assert expected <= names
    assert {f"{n}_last10" for n in expected - {"loss_train"}} <= names
    rounds = store.rounds(store.find_run(cfg.run_key).id)
    assert (rounds["bytes_up"] > 0).all() and (rounds["bytes_down"] > 0).all()


def test_batched_personal_evaluation_equals_one_client_at_a_time(tiny):
    cfg, task, method = tiny("local")
    server = method.init_server(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    server.personal = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in server.personal.items()
    }  # clients now differ
    one = evaluate(method, server, task, batch_size=16)  # chunks of 1 client
    many = evaluate(method, server, task, batch_size=128)  # 4 clients per forward
    assert one.correct_local.tolist() == many.correct_local.tolist()
    assert pd.Series(one.global_acc).equals(pd.Series(many.global_acc))


def test_a_non_finite_training_loss_fails_the_cell_with_advice(tmp_path, monkeypatch):
    """One client's infinite loss (its steps then go NaN) fails the cell in round 0, with the
    stored error saying which round and what to change; no round is stored."""
    from fpbench.engine.rounds import NonFiniteLoss
    from fpbench.methods.base import Output, training_loss
    from fpbench.methods.fedvpt import FedVPT

    forward = FedVPT.forward

    def blows_up(self, params, x, client_index, ctx):
        out = forward(self, params, x, client_index, ctx)
        if ctx.labels is None:
            return out
        loss, _ = training_loss(out, ctx.labels)
        return Output(out, loss=torch.where(client_index == 0, loss * float("inf"), loss))

    monkeypatch.setattr(FedVPT, "forward", blows_up)
    cfg = tiny_config(rounds=2)
    message = (
        "training loss is nan (not finite) after local training in round 0; "
        "lower train.lr or set train.grad_clip"
    )
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        with pytest.raises(NonFiniteLoss) as info:
            run_cell(cfg, store, checkpoint_dir=tmp_path)
        assert str(info.value) == message
        record = store.find_run(cfg.run_key)
        assert record.status == "failed" and record.error == f"NonFiniteLoss: {message}"
        assert store.last_round(record.id) is None


def test_how_a_cell_is_named_in_errors_and_on_its_record():
    """The strings a user reads: a cell's label, a resume error's span of missing rounds, an
    interruption, a crash's stored error, and the device a run records with its numerics."""
    import platform

    from fpbench.engine import runner

    cfg = tiny_config()
    label = runner.cell_label(cfg)
    assert label == f"fedvpt / {cfg.dataset.label} / {cfg.partition.label} / seed 0"
    assert [runner._span(r) for r in ([0, 1, 2, 3], [4], [0, 2, 3], [5, 6])] == [
        "0-3",
        "4",
        "0, 2, 3",
        "5-6",
    ]
    assert str(runner.CellInterrupted(cfg, 3)) == (
        f"interrupted after round 3/3 of cell {label} ({cfg.run_key}); rerun the same command to "
        "resume"
    )
    assert str(runner.CellInterrupted(cfg, None)) == (
        f"interrupted while preparing cell {label} ({cfg.run_key}); "
        "rerun the same command to resume"
    )
    assert runner.CellInterrupted(cfg, 0).round == 0
    assert runner.error_text(ValueError("bad")) == "ValueError: bad"
    cpu = torch.device("cpu")
    name = f"cpu ({platform.processor() or platform.machine()})"
    tf32 = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"frozen_precision": "tf32"})}
    )
    bf16 = cfg.model_copy(
        update={
            "runtime": cfg.runtime.model_copy(
                update={"precision": "bf16", "frozen_precision": "bf16"}
            )
        }
    )
    assert runner._device_name(cpu, tf32) == f"{name} (fp32)"  # no TF32 on the CPU
    assert runner._device_name(cpu, bf16) == f"{name} (bf16, frozen bf16)"
    auto = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"precision": "auto"})})
    stored = runner.stored_config(auto, cpu)
    dumped = auto.model_dump(mode="json")
    assert dumped["method"].pop("strategy") is None  # the method's own federation: not stored
    assert stored == {**dumped, "runtime": {**dumped["runtime"], "precision": "fp32"}}


@pytest.mark.parametrize("name", ["fedvpt", "local"])
def test_client_label_space_masks_each_clients_classes_without_train_data(tiny, name):
    """`label_space="client"`: a client's local predictions are the argmax over the classes it
    has train samples of (its confidences from those logits too); the full test split keeps
    every class. Class 2's bias is raised by 10, so the unmasked model predicts 2 everywhere
    and the clients without class 2 differ between the two."""
    from fpbench.engine.metrics import expected_calibration_error

    cfg, task, method = tiny(name)
    server = method.init_server(torch.Generator().manual_seed(0))
    (server.params or server.personal)["head_b"][..., 2] += 10.0  # global or per client
    every = evaluate(method, server, task, batch_size=7)
    own = evaluate(method, server, task, batch_size=7, label_space="client")
    scored = [c for c in range(task.num_clients) if name == "fedvpt" or not task.heldout[c]]
    want_all, want_own, want_ece = {}, {}, {}
    for c in scored:
        idx = task.test_idx[c]
        x = method.backbone.preprocess(task.data.test_images[idx])
        row = torch.tensor([0 if name == "fedvpt" else c])
        params = method.client_params(server, row, training=False)
        rows = torch.zeros(len(idx), dtype=torch.long)
        with torch.no_grad():
            logits = method.forward(params, x, rows, Context(training=False)).float()
        labels = task.data.test_labels[idx]
        masked = logits.masked_fill(~(task.priors[c] > 0), float("-inf"))
        want_all[c] = int((logits.argmax(-1) == labels).sum())
        hit = masked.argmax(-1) == labels
        want_own[c] = int(hit.sum())
        conf = masked.softmax(-1).amax(-1)
        want_ece[c] = expected_calibration_error(conf.numpy(), hit.numpy())
    assert {c: int(every.correct_local[c]) for c in scored} == want_all
    assert {c: int(own.correct_local[c]) for c in scored} == want_own
    assert want_own != want_all  # the masks matter here
    assert own.ece_local[scored].tolist() == pytest.approx([want_ece[c] for c in scored])
    np.testing.assert_array_equal(own.global_acc, every.global_acc)
    np.testing.assert_array_equal(own.f1_global, every.f1_global)


def test_a_checkpoint_bound_to_another_database_is_not_resumed(tmp_path):
    """A checkpoint of the same cell in another database, copied into this one's folder: the
    round loop loads it against this run's binding, ignores it and starts at round 0."""
    import shutil

    cfg = tiny_config(rounds=2)
    ck = tmp_path / "ck"
    with Store(f"sqlite:///{tmp_path / 'a.db'}") as a, pytest.raises(Crash):
        run_cell(cfg, a, checkpoint_dir=ck, observer=CrashAfter(0))
    src = ckpt_io.checkpoint_path(ckpt_io.folder_for(ck, a.database_id), cfg.run_key)
    with Store(f"sqlite:///{tmp_path / 'b.db'}") as b:
        dst = ckpt_io.checkpoint_path(ckpt_io.folder_for(ck, b.database_id), cfg.run_key)
        dst.parent.mkdir(parents=True)
        shutil.copy(src, dst)
        starts = _Starts()
        assert run_cell(cfg, b, checkpoint_dir=ck, observer=starts).status == "done"
        assert starts.rounds == [0]
        assert b.rounds(b.find_run(cfg.run_key).id)["round"].tolist() == [0, 1]
