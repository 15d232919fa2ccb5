"""A finished run's kept state (`fpbench.engine.artifacts`), checked directly on small files:
where it is kept and moved, which file a load reads, the NumPy archive's names, dtypes and
meta, the train split in the test split's place, and what `rescore` hands the evaluation (the
end-to-end CLI path is in tests/test_workflow.py)."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

import fpbench.engine.artifacts as artifacts
import fpbench.engine.numerics as numerics
import fpbench.engine.rounds as rounds
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.artifacts import (
    FORMAT,
    keep_params,
    load_params,
    params_path,
    read_npz,
    rescore,
    write_npz,
)
from fpbench.engine.seeding import derive_seed
from fpbench.engine.task import build_task, on_train_split
from fpbench.errors import FpbenchError
from fpbench.methods.base import ServerState
from tests.conftest import tiny_config

CPU = torch.device("cpu")


def _state() -> ServerState:
    return ServerState(
        {"prompts": torch.tensor([[1.0, 2.0]])},
        {"head_w": torch.tensor([[0.5], [1.5]], dtype=torch.bfloat16)},
        {"steps": torch.tensor([3])},
    )


def _save(path: Path, run_key: str, round_idx: int, scale: float = 1.0) -> None:
    server = ServerState({"w": torch.full((2,), scale)})
    ckpt_io.save(path, ckpt_io.Checkpoint(run_key, round_idx, server, [{"acc": 0.5}], 2.0))


def test_params_path_is_beside_a_sqlite_file_else_under_the_checkpoints():
    ck = Path("/c")
    assert params_path("sqlite:////r/x.db", ck, "k1") == Path("/r/x-params/k1.pt")
    assert params_path("sqlite:///rel/y.sqlite", ck, "k2") == Path("rel/y-params/k2.pt")
    assert params_path("postgresql+psycopg://u@h/db", ck, "k3") == Path("/c/params/k3.pt")


def test_keep_params_moves_the_last_checkpoint_beside_the_database(tmp_path):
    url, ck = f"sqlite:///{tmp_path}/db/r.db", tmp_path / "ck"
    assert keep_params(url, ck, "k") is None  # no checkpoint: nothing kept
    ck.mkdir()
    (ck / "k.pt").write_bytes(b"state of k")
    kept = keep_params(url, ck, "k")
    assert kept == tmp_path / "db" / "r-params" / "k.pt"
    assert kept.read_bytes() == b"state of k"
    assert not (ck / "k.pt").exists()
    assert sorted(p.name for p in kept.parent.iterdir()) == ["k.pt"]  # no .tmp left behind
    (ck / "k.pt").write_bytes(b"again")  # a rerun's state replaces the kept one
    assert keep_params(url, ck, "k").read_bytes() == b"again"
    (ck / "k.pt").write_bytes(b"on a server")  # a database server: under the checkpoints
    assert keep_params("postgresql+psycopg://u@h/db", ck, "k") == ck / "params" / "k.pt"
    assert (ck / "params" / "k.pt").read_bytes() == b"on a server"


def test_keep_params_copies_through_a_temporary_file_beside_the_target(tmp_path, monkeypatch):
    """A copy that stops half-way leaves `k.tmp`, never a `k.pt` a load would read."""
    copies = []
    monkeypatch.setattr(artifacts.shutil, "copyfile", lambda src, dst: copies.append((src, dst)))
    monkeypatch.setattr(artifacts.os, "replace", lambda src, dst: copies.append((src, dst)))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "k.pt").write_bytes(b"state")
    keep_params(f"sqlite:///{tmp_path}/r.db", ck, "k")
    tmp = tmp_path / "r-params" / "k.tmp"
    assert copies == [(ck / "k.pt", tmp), (tmp, tmp_path / "r-params" / "k.pt")]


def test_load_params_reads_the_kept_state_else_the_last_checkpoint(tmp_path):
    url, ck = f"sqlite:///{tmp_path}/r.db", tmp_path / "ck"
    _save(ck / "k.pt", "k", 1, scale=2.0)  # stopped right after finishing: not moved yet
    got = load_params(url, ck, "k", CPU)
    assert (got.run_key, got.round, got.server.params["w"].tolist()) == ("k", 1, [2.0, 2.0])
    _save(tmp_path / "r-params" / "k.pt", "k", 4, scale=3.0)  # kept: read first
    got = load_params(url, ck, "k", CPU)
    assert (got.round, got.history, got.elapsed_s) == (4, [{"acc": 0.5}], 2.0)
    assert got.server.params["w"].tolist() == [3.0, 3.0]
    _save(tmp_path / "r-params" / "k.pt", "other", 5)  # another run's file is not this one's
    assert load_params(url, ck, "k", CPU).round == 1
    server = "postgresql+psycopg://u@h/db"
    _save(ck / "params" / "k.pt", "k", 6)  # a database server: kept under the checkpoints
    assert load_params(server, ck, "k", CPU).round == 6


def test_load_params_without_a_state_says_where_it_looked(tmp_path):
    url = f"sqlite:///{tmp_path}/r.db"
    with pytest.raises(FpbenchError) as info:
        load_params(url, tmp_path / "ck", "k", CPU)
    assert str(info.value) == (
        f"run k has no trained state at {tmp_path}/r-params/k.pt (runs finished before fpbench "
        "kept it have none; run the cell again into a fresh database to get it)"
    )


def test_write_npz_names_each_part_stores_bf16_as_float32_and_the_meta(tmp_path):
    ckpt = ckpt_io.Checkpoint("key1", 2, _state(), [], 0.0)
    out = tmp_path / "new" / "deeper" / "s.npz"
    write_npz(ckpt, {"seed": 1, "method": {"name": "fedvpt"}}, out.with_name("first.npz"))
    write_npz(ckpt, {"seed": 1, "method": {"name": "fedvpt"}}, out)  # into a folder that exists
    with np.load(out, allow_pickle=False) as data:
        assert sorted(data.files) == ["buffers/steps", "meta", "params/prompts", "personal/head_w"]
        assert data["personal/head_w"].dtype == np.float32
        assert data["personal/head_w"].tolist() == [[0.5], [1.5]]
        assert data["params/prompts"].tolist() == [[1.0, 2.0]]
        assert data["buffers/steps"].dtype == np.int64 and data["buffers/steps"].tolist() == [3]
        meta = str(data["meta"])
    assert meta == json.dumps(
        {
            "config": {"method": {"name": "fedvpt"}, "seed": 1},
            "format": "fpbench-params-1",
            "round": 2,
            "run_key": "key1",
        }
    )
    state, back = read_npz(out)
    assert back == json.loads(meta) and back["config"] == {"method": {"name": "fedvpt"}, "seed": 1}
    assert FORMAT == "fpbench-params-1"
    assert state.params["prompts"].tolist() == [[1.0, 2.0]]
    assert state.personal["head_w"].dtype == torch.float32
    assert state.personal["head_w"].tolist() == [[0.5], [1.5]]
    assert state.buffers["steps"].tolist() == [3]


def test_read_npz_reads_nested_names_and_never_unpickles(tmp_path):
    """With model heterogeneity names are `<backbone>/<name>`: only the first `/` is the
    part's. An object array (a pickle) is refused, not loaded."""
    het = ServerState({"0-vit/prompts": torch.ones(1)}, {"1-clip/head": torch.zeros(2, 1)})
    out = tmp_path / "het.npz"
    write_npz(ckpt_io.Checkpoint("k", 0, het, [], 0.0), {}, out)
    state, _ = read_npz(out)
    assert list(state.params) == ["0-vit/prompts"] and list(state.personal) == ["1-clip/head"]
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta=np.array("{}"), **{"params/x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match="allow_pickle=False"):
        read_npz(bad)


def test_on_train_split_scores_each_client_on_its_own_train_samples():
    cfg = tiny_config()
    task = build_task(cfg, CPU)
    domains = torch.zeros(len(task.data.train_labels), dtype=torch.long)
    task = dataclasses.replace(task, data=dataclasses.replace(task.data, train_domains=domains))
    swapped = on_train_split(task)
    data = swapped.data
    assert data.test_images is task.data.train_images
    assert data.test_labels is task.data.train_labels
    assert data.test_domains is domains
    assert data.train_images is task.data.train_images
    assert swapped.test_idx == list(task.train_idx) and swapped.train_idx is task.train_idx
    assert task.data.test_images is not task.data.train_images  # the task itself is unchanged


@pytest.fixture
def evaluated(monkeypatch):
    """`evaluate_populations` replaced by a recorder of its arguments (and of the numerics and
    the global torch seed it runs under)."""
    seen: list[dict] = []
    inside: list[bool] = [False]

    @contextmanager
    def numerics_of(cfg):
        inside[0] = cfg
        yield
        inside[0] = False

    def record(cell, servers, history, r, clients):
        seen.append(
            {
                "populations": cell.populations,
                "servers": servers,
                "task": cell.task,
                "cfg": cell.cfg,
                "precision": cell.precision,
                "history": history,
                "r": r,
                "seen": clients,
                "in_numerics": inside[0],
                "torch_seed": torch.initial_seed(),
            }
        )
        return ["rows"]

    monkeypatch.setattr(numerics, "cell_numerics", numerics_of)
    monkeypatch.setattr(rounds, "evaluate_populations", record)
    return seen


@pytest.mark.parametrize(
    ("train", "last_round", "seen"),
    [
        ({"participation": 0.34}, 0, [2]),
        ({"participation": 0.34}, 1, [2, 3]),
        ({"participation": 0.34}, 3, [2, 3]),
        ({"participation": 0.75}, 3, [1, 2, 3]),
        ({"participation": 0.75, "dropout": 0.5}, 0, [3]),
        ({"participation": 0.75, "dropout": 0.5}, 1, [2, 3]),
    ],
)
def test_rescore_evaluates_the_kept_state_on_the_clients_trained_so_far(
    evaluated, train, last_round, seen
):
    """Seed 0, 3 trainable clients (1, 2, 3); the schedules: one a round, [2], [3], [2], [3];
    two a round, [3, 2], [2, 3], [2, 3], [2, 1]; two a round, one of them failing: [3], [2],
    [2], [2]."""
    cfg = tiny_config(rounds=4, **train)
    server = ServerState({"prompts": torch.full((1, 2), 7.0)}, {}, {"b": torch.tensor([1])})
    ckpt = ckpt_io.Checkpoint(cfg.run_key, last_round, server, [], 0.0)
    assert rescore(cfg, ckpt, CPU) == ["rows"]
    (call,) = evaluated
    assert call["seen"] == seen and call["cfg"] is cfg
    assert (call["precision"], call["history"], call["r"]) == ("fp32", [], -1)
    assert call["in_numerics"] is cfg and call["torch_seed"] == derive_seed(cfg.seed, "torch")
    assert list(call["servers"]) == [""]
    assert torch.equal(call["servers"][""].params["prompts"], torch.full((1, 2), 7.0))
    assert call["servers"][""].buffers["b"].tolist() == [1]
    (pop,) = call["populations"]
    assert pop.key == "" and pop.inputs.task is call["task"] and pop.method.task.num_clients == 4
    task = call["task"]
    assert task.data.test_images is not task.data.train_images and task.priors.device == CPU


def test_rescore_on_the_train_split_and_in_the_runs_precision(evaluated):
    cfg = tiny_config()
    cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"precision": "bf16"})})
    ckpt = ckpt_io.Checkpoint(cfg.run_key, 0, ServerState({}), [], 0.0)
    rescore(cfg, ckpt, CPU, "train")
    task = evaluated[0]["task"]
    assert task.data.test_images is task.data.train_images
    assert task.test_idx == list(task.train_idx) and evaluated[0]["precision"] == "bf16"
    assert evaluated[0]["populations"][0].inputs.task is task  # built on the swapped task
    with pytest.raises(FpbenchError, match="^--split must be test or train, got 'val'$"):
        rescore(cfg, ckpt, CPU, "val")
