"""A cell's lifecycle in `run_cell` / `run_suite`: what is stored when building fails, when the
claim is lost or taken, on Ctrl-C, and when the rounds crash; each on the tiny federation with
the failing step planted by a monkeypatch (no round trains unless the test needs one)."""

from __future__ import annotations

import datetime as dt

import pytest
import torch
from sqlalchemy import update

import fpbench
import fpbench.engine.runner as runner
from fpbench.engine import cell as cell_module
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import CellInterrupted, run_cell, run_suite
from fpbench.engine.seeding import derive_seed
from fpbench.errors import FpbenchError
from fpbench.methods.base import ServerState
from fpbench.store import ClaimLost, Store
from fpbench.store.models import Run
from tests.conftest import tiny_config


class _Boom(RuntimeError):
    pass


@pytest.fixture
def store(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as s:
        yield s


def _raise(error: BaseException):
    def fail(*args, **kwargs):
        raise error

    return fail


def test_a_crash_while_building_is_stored_as_failed_with_its_record(store, tmp_path, monkeypatch):
    """A bug while building the methods is recorded (a run, failed, its error and traceback),
    with the cell's identity, versions and device."""
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_populations", _raise(_Boom("no method")))
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error) == ("failed", "_Boom: no method")
    assert "raise error" in record.traceback and record.traceback.endswith("_Boom: no method\n")
    assert record.owner is not None and store.last_round(record.id) is None
    assert (record.suite, record.method, record.dataset, record.partition, record.seed) == (
        cfg.suite,
        cfg.method.label,
        cfg.dataset.label,
        cfg.partition.label,
        cfg.seed,
    )
    assert (record.fpbench_version, record.torch_version) == (
        fpbench.__version__,
        torch.__version__,
    )
    assert record.device == runner._device_name(torch.device("cpu"), cfg)
    assert record.config == runner.stored_config(cfg, torch.device("cpu"))


def test_a_crash_while_building_leaves_a_run_another_driver_holds(store, tmp_path, monkeypatch):
    """The failure is stored only under a claim: a run another driver took meanwhile stays its."""
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_populations", _raise(_Boom("no method")))
    monkeypatch.setattr(Store, "claim_run", lambda self, run_id, owner, **kw: False)
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error, record.traceback) == ("pending", None, None)


def test_a_user_error_while_building_writes_no_run(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_populations", _raise(FpbenchError("no weights")))
    with pytest.raises(FpbenchError, match="no weights"):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert store.find_run(cfg.run_key) is None


def test_the_global_torch_seed_is_the_runs_before_building(store, tmp_path, monkeypatch):
    """`torch.manual_seed(derive_seed(seed, "torch"))` before the task and methods are built."""
    cfg = tiny_config(rounds=1).model_copy(update={"seed": 3})
    seeds = []

    def spy(*args, **kwargs):
        seeds.append(torch.initial_seed())
        raise FpbenchError("stop here")

    monkeypatch.setattr(cell_module, "build_task", spy)
    with pytest.raises(FpbenchError):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert seeds == [derive_seed(3, "torch")]


def test_ctrl_c_while_preparing_is_an_interruption_of_no_round(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_task", _raise(KeyboardInterrupt()))
    with pytest.raises(CellInterrupted) as info:
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert info.value.round is None and info.value.cfg is cfg
    assert info.value.args == (cfg.run_key,)  # the CLI prints str(e) when it has args
    assert store.find_run(cfg.run_key) is None


class _Stages(Observer):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stage(self, cfg, what, done, total):
        self.calls.append((cfg, what, done, total))


def test_data_preparation_is_reported_as_a_stage_of_the_cell(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_populations", _raise(FpbenchError("stop here")))
    observer = _Stages()
    with pytest.raises(FpbenchError):
        run_cell(cfg, store, checkpoint_dir=tmp_path, observer=observer)
    prep = [c for c in observer.calls if c[1] == "preparing data"]
    assert prep == [(cfg, "preparing data", 0, 1), (cfg, "preparing data", 1, 1)]


def test_a_claim_held_elsewhere_skips_the_cell_before_training(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(Store, "claim_run", lambda self, run_id, owner, **kw: False)
    monkeypatch.setattr(runner, "run_rounds", _raise(AssertionError("trained")))
    result = run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert result == CellResult(cfg, "skipped", "claimed by another driver")
    assert store.find_run(cfg.run_key).status == "pending"


def test_a_claim_lost_during_the_rounds_skips_the_cell(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(runner, "run_rounds", _raise(ClaimLost("run 1: claim taken over")))
    result = run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert result == CellResult(cfg, "skipped", "run 1: claim taken over")


def test_a_claim_lost_at_the_end_skips_the_cell(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    record_cost = Store.record_cost

    def lost_at_end(self, run_id, **kw):
        if "peak_mem_bytes" in kw:
            raise ClaimLost("gone at the end")
        return record_cost(self, run_id, **kw)

    monkeypatch.setattr(Store, "record_cost", lost_at_end)
    result = run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert result == CellResult(cfg, "skipped", "gone at the end")
    assert store.find_run(cfg.run_key).status == "running"


def test_a_claim_taken_before_the_finish_skips_the_cell(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(Store, "finish_run", lambda self, *a, **kw: False)
    result = run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert result == CellResult(cfg, "skipped", "claim taken over by another driver")
    folder = ckpt_io.folder_for(tmp_path, store.database_id)
    assert ckpt_io.checkpoint_path(folder, cfg.run_key).exists()  # not finished: kept


class _InterruptAt(Observer):
    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.round_idx:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    "after, resume_at, said", [(None, 0, "before round 1/2"), (0, 1, "after round 1/2")]
)
def test_ctrl_c_in_the_rounds_stores_where_to_resume(
    store, tmp_path, monkeypatch, after, resume_at, said
):
    """Interrupted after round k is stored: the cell resumes at k + 1 (0 if none is stored)."""
    cfg = tiny_config(rounds=2)
    if after is None:
        monkeypatch.setattr(runner, "run_rounds", _raise(KeyboardInterrupt()))
    observer = Observer() if after is None else _InterruptAt(after)
    with pytest.raises(CellInterrupted) as info:
        run_cell(cfg, store, checkpoint_dir=tmp_path, observer=observer)
    assert info.value.round == resume_at and info.value.cfg is cfg
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error) == (
        "interrupted",
        f"interrupted {said} (Ctrl-C)",
    )


def test_a_crash_in_the_rounds_stores_the_error_traceback_and_peak_memory(
    store, tmp_path, monkeypatch
):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(runner, "run_rounds", _raise(_Boom("round broke")))
    monkeypatch.setattr(runner.PeakMemory, "read", lambda self: 1234)
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error) == ("failed", "_Boom: round broke")
    assert record.traceback.endswith("_Boom: round broke\n")
    assert record.peak_mem_bytes == 1234


def test_a_finished_cell_keeps_its_params_and_drops_a_torn_checkpoint(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    kept = []
    monkeypatch.setattr(runner, "keep_params", lambda *args: kept.append(args))
    run_rounds = runner.run_rounds

    def torn_write(cell, store, run_id, folder, *rest):
        run_rounds(cell, store, run_id, folder, *rest)
        torn = ckpt_io.checkpoint_path(folder, cell.cfg.run_key).with_suffix(".tmp")
        torn.write_text("torn")  # after the last save, which would replace it
        return 12.5  # the rounds' wall time

    monkeypatch.setattr(runner, "run_rounds", torn_write)
    monkeypatch.setattr(runner.PeakMemory, "read", lambda self: 99)
    assert run_cell(cfg, store, checkpoint_dir=tmp_path) == CellResult(cfg, "done")
    folder = ckpt_io.folder_for(tmp_path, store.database_id)
    assert kept == [(store.url, folder, cfg.run_key)]
    assert not ckpt_io.checkpoint_path(folder, cfg.run_key).with_suffix(".tmp").exists()
    record = store.find_run(cfg.run_key)
    assert (record.status, record.peak_mem_bytes, record.wall_s) == ("done", 99, 12.5)
    # the torn file is gone; the checkpoint stays for `keep_params` (faked here)
    assert [p.name for p in folder.iterdir()] == [f"{cfg.run_key}.pt"]


def test_a_cell_stored_done_is_skipped_before_building(store, tmp_path, monkeypatch):
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(runner, "run_rounds", lambda *args: 0.5)
    assert run_cell(cfg, store, checkpoint_dir=tmp_path) == CellResult(cfg, "done")
    monkeypatch.setattr(cell_module, "build_task", _raise(AssertionError("built again")))
    assert run_cell(cfg, store, checkpoint_dir=tmp_path) == CellResult(cfg, "skipped", None)


def test_a_crash_after_the_claim_is_taken_writes_nothing_to_the_other_drivers_run(
    store, tmp_path, monkeypatch
):
    """The rounds crash after another driver took the claim: neither the peak memory nor the
    failure is stored (both are written under the cell's claim); the crash is re-raised."""
    cfg = tiny_config(rounds=1)

    def taken_then_crash(cell, store, run_id, *rest):
        _TakenOverAfter(store, cell.cfg).round_end(cell.cfg, 0, {})
        raise _Boom("round broke")

    monkeypatch.setattr(runner, "run_rounds", taken_then_crash)
    monkeypatch.setattr(runner.PeakMemory, "read", lambda self: 1234)
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.owner, record.peak_mem_bytes, record.error) == (
        "running",
        "elsewhere:1:z",
        None,
        None,
    )


class _Ends(Observer):
    def __init__(self) -> None:
        self.results: list[CellResult] = []

    def cell_end(self, result):
        self.results.append(result)


def test_a_suite_goes_on_after_a_crashed_cell_but_stops_at_a_user_error(
    store, tmp_path, monkeypatch
):
    """A crash is the cell's result (failed, with its error) and the next cell runs; an
    `FpbenchError` (bad input) stops the suite."""
    plain = tiny_config(rounds=1)
    crash = plain.model_copy(update={"seed": 1})
    run_rounds = runner.run_rounds

    def crash_seed_1(cell, *args):
        if cell.cfg.seed == 1:
            raise _Boom("seed 1 broke")
        return run_rounds(cell, *args)

    monkeypatch.setattr(runner, "run_rounds", crash_seed_1)
    observer = _Ends()
    results = run_suite([crash, plain], store, checkpoint_dir=tmp_path, observer=observer)
    assert [(r.cfg, r.status, r.error) for r in results] == [
        (crash, "failed", "_Boom: seed 1 broke"),
        (plain, "done", None),
    ]
    assert observer.results == results
    monkeypatch.setattr(cell_module, "build_task", _raise(FpbenchError("no data")))
    with pytest.raises(FpbenchError, match="no data"):
        run_suite([plain.model_copy(update={"seed": 2}), plain], store, checkpoint_dir=tmp_path)


class _Rounds:
    """What `check_resumable` reads of a store: its identity and a run's stored rounds."""

    def __init__(self, stored: list[int]) -> None:
        self.database_id, self.stored = "db1", stored

    def round_numbers(self, run_id: int) -> list[int]:
        return self.stored if run_id == 7 else list(range(10))


def _saved(tmp_path, cfg, round_idx: int, bound_to: str | None):
    path = ckpt_io.checkpoint_path(tmp_path, cfg.run_key)
    empty = ckpt_io.Checkpoint(cfg.run_key, round_idx, ServerState({}, {}, {}), [], 0.0)
    ckpt_io.save(path, empty, bound_to)
    return path


@pytest.mark.parametrize("bound_to", ["db1:7", None])
def test_a_checkpoint_ahead_of_the_stored_rounds_is_refused(tmp_path, bound_to):
    """Its own checkpoint (or an unbound one) at round 2 over stored rounds {0}: refused, naming
    the missing span; with rounds 0..2 stored it resumes."""
    cfg = tiny_config(rounds=4)
    path = _saved(tmp_path, cfg, 2, bound_to)
    with pytest.raises(FpbenchError) as info:
        runner.check_resumable(cfg, _Rounds([0]), 7, tmp_path)
    assert str(info.value) == (
        f"cannot resume cell {runner.cell_label(cfg)} ({cfg.run_key}): its checkpoint {path} is "
        "at round 2 but the database lacks rounds 1-2; delete the checkpoint to run the cell "
        "again from round 0"
    )
    runner.check_resumable(cfg, _Rounds([0, 1, 2]), 7, tmp_path)


@pytest.mark.parametrize("bound_to", ["db2:7", "db1:8"])
def test_another_runs_checkpoint_is_not_checked(tmp_path, bound_to):
    """Bound to another database or run, `load` ignores it (the cell restarts): no refusal."""
    cfg = tiny_config(rounds=4)
    _saved(tmp_path, cfg, 2, bound_to)
    runner.check_resumable(cfg, _Rounds([]), 7, tmp_path)
    runner.check_resumable(cfg, _Rounds([]), 7, tmp_path / "none")  # no checkpoint at all


def test_a_crash_while_building_takes_over_a_claim_stale_by_the_cells_timeout(
    store, tmp_path, monkeypatch
):
    """A claim silent for longer than `claim_timeout` (here 60 s of 600 s's default) is taken
    over when the crash is recorded, as when the cell starts."""
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(cell_module, "build_populations", _raise(_Boom("no method")))
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    run_id = store.find_run(cfg.run_key).id
    beat = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=120)
    with store._session.begin() as s:
        stale = dict(status="running", owner="elsewhere:1:z", heartbeat_at=beat, error=None)
        s.execute(update(Run).where(Run.id == run_id).values(**stale))
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path, claim_timeout=60)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error) == ("failed", "_Boom: no method")
    assert record.owner != "elsewhere:1:z"


class _TakenOverAfter(Observer):
    """After round 0 another driver takes the run's claim."""

    def __init__(self, store: Store, cfg) -> None:
        self.store, self.cfg = store, cfg

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == 0:
            run_id = self.store.find_run(self.cfg.run_key).id
            beat = dt.datetime.now(dt.timezone.utc)
            with self.store._session.begin() as s:
                other = dict(owner="elsewhere:1:z", heartbeat_at=beat)
                s.execute(update(Run).where(Run.id == run_id).values(**other))


def _assert_skipped_as_taken_over(result, cfg, record) -> None:
    """The cell was skipped with the claim's error (another driver holds the run)."""
    assert (result.cfg, result.status) == (cfg, "skipped")
    assert result.error.startswith(f"run {record.id}: claim of ")
    assert result.error.endswith(" was taken over by another driver")


def test_a_round_written_after_the_claim_is_taken_is_refused(store, tmp_path):
    """The round loop writes each round under the cell's claim: once another driver holds it,
    round 1 is not stored and the cell is skipped with the claim's error."""
    cfg = tiny_config(rounds=2)
    result = run_cell(cfg, store, checkpoint_dir=tmp_path, observer=_TakenOverAfter(store, cfg))
    record = store.find_run(cfg.run_key)
    _assert_skipped_as_taken_over(result, cfg, record)
    assert store.last_round(record.id) == 0 and record.owner == "elsewhere:1:z"


def _held_elsewhere(store: Store, cfg, seconds_ago: float) -> int:
    """The cell's run, held by another live driver whose last heartbeat was `seconds_ago`."""
    run_id = runner._create_record(cfg, store, torch.device("cpu")).id
    beat = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    with store._session.begin() as s:
        held = dict(status="running", owner="elsewhere:1:z", heartbeat_at=beat)
        s.execute(update(Run).where(Run.id == run_id).values(**held))
    return run_id


def test_a_live_claim_of_another_driver_skips_the_cell_before_building(
    store, tmp_path, monkeypatch
):
    """Its heartbeat 120 s ago, within the cell's `claim_timeout` of 300 s: skipped, nothing
    built, the claim left as it was."""
    cfg = tiny_config(rounds=1)
    _held_elsewhere(store, cfg, 120)
    monkeypatch.setattr(cell_module, "build_task", _raise(AssertionError("built")))
    result = run_cell(cfg, store, checkpoint_dir=tmp_path, claim_timeout=300)
    assert result == CellResult(cfg, "skipped", "claimed by another driver")
    record = store.find_run(cfg.run_key)
    assert (record.status, record.owner) == ("running", "elsewhere:1:z")


def test_a_claim_stale_by_the_cells_timeout_is_taken_over_and_kept_alive(
    store, tmp_path, monkeypatch
):
    """Its heartbeat 120 s ago, past the cell's `claim_timeout` of 60 s (not the default 600 s):
    the cell takes the run over and runs it, beating every `claim_timeout / 4` s under its own
    claim."""
    cfg = tiny_config(rounds=1)
    run_id = _held_elsewhere(store, cfg, 120)
    beats = []
    keep_alive = Store.keep_alive

    def spy(self, run_id, owner, interval_s):
        beats.append((run_id, owner, interval_s))
        return keep_alive(self, run_id, owner, interval_s)

    monkeypatch.setattr(Store, "keep_alive", spy)
    assert run_cell(cfg, store, checkpoint_dir=tmp_path, claim_timeout=60) == CellResult(
        cfg, "done"
    )
    record = store.find_run(cfg.run_key)
    assert record.status == "done" and record.owner != "elsewhere:1:z"
    assert beats == [(run_id, record.owner, 15.0)]


def test_a_claim_taken_after_the_last_round_stores_no_cost_and_skips_the_cell(store, tmp_path):
    """The peak memory is stored under the cell's claim: taken after the last round, the write
    is refused with the claim's error (no cost stored, the other driver's run left running)."""
    cfg = tiny_config(rounds=1)  # round 0, after which the claim is taken, is the last
    result = run_cell(cfg, store, checkpoint_dir=tmp_path, observer=_TakenOverAfter(store, cfg))
    record = store.find_run(cfg.run_key)
    _assert_skipped_as_taken_over(result, cfg, record)
    assert (record.status, record.owner, record.peak_mem_bytes) == (
        "running",
        "elsewhere:1:z",
        None,
    )


def test_the_device_a_cpu_run_records_is_the_processor_else_the_machine(monkeypatch):
    """'cpu (<processor>)', or the machine where Python knows no processor name, with the
    numerics: fp32 and frozen fp32 say nothing more."""
    import platform

    cfg, cpu = tiny_config(), torch.device("cpu")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(platform, "processor", lambda: "Intel64 Family 6")
    assert runner._device_name(cpu, cfg) == "cpu (Intel64 Family 6) (fp32)"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert runner._device_name(cpu, cfg) == "cpu (x86_64) (fp32)"


def test_the_device_a_cuda_run_records_is_the_cards_name_with_its_numerics(monkeypatch):
    """On CUDA: the card's name (`torch.cuda.get_device_name`), "auto" precision as bf16, and
    TF32 frozen passes named (they exist there), also in the stored config; a fake card, no
    GPU needed."""
    cfg = tiny_config()
    cuda = torch.device("cuda", 1)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: asked.append(d) or "NVIDIA H200")
    runtime = cfg.runtime.model_copy(update={"precision": "auto", "frozen_precision": "tf32"})
    auto = cfg.model_copy(update={"runtime": runtime})
    assert runner._device_name(cuda, auto) == "NVIDIA H200 (bf16, frozen tf32)"
    assert asked == [cuda]
    plain = cfg.model_copy(
        update={
            "runtime": runtime.model_copy(update={"precision": "fp32", "frozen_precision": "fp32"})
        }
    )
    assert runner._device_name(cuda, plain) == "NVIDIA H200 (fp32)"
    stored = runner.stored_config(auto, cuda)["runtime"]
    assert (stored["precision"], stored["frozen_precision"]) == ("bf16", "tf32")


class _Heard(_Ends):
    def __init__(self) -> None:
        super().__init__()
        self.rounds: list[tuple] = []

    def round_end(self, cfg, round_idx, metrics):
        self.rounds.append((cfg.seed, round_idx))


def test_a_suite_hands_each_cell_its_observer_and_feature_cache(store, tmp_path, monkeypatch):
    """`run_suite`'s observer hears every cell's rounds, and its feature cache reaches each
    cell's populations."""
    from fpbench.engine.inputs import FeatureCache

    cells = [tiny_config(rounds=1), tiny_config(rounds=1).model_copy(update={"seed": 1})]
    cache, handed = FeatureCache(), []
    build = cell_module.build_populations

    def spy(cfg, task, device, cache, *args, **kwargs):
        handed.append(cache)
        return build(cfg, task, device, cache, *args, **kwargs)

    monkeypatch.setattr(cell_module, "build_populations", spy)
    observer = _Heard()
    results = run_suite(cells, store, checkpoint_dir=tmp_path, observer=observer, cache=cache)
    assert [r.status for r in results] == ["done", "done"] and observer.results == results
    assert observer.rounds == [(0, 0), (1, 0)]
    assert len(handed) == 2 and all(c is cache for c in handed)


def test_a_rerun_refuses_its_checkpoint_when_the_database_lost_its_rounds(
    store, tmp_path, monkeypatch
):
    """Stopped after round 0 (checkpoint at round 0), then round 0 deleted from the database:
    the rerun checks its own checkpoint (in the database's folder, bound to this run) against
    the stored rounds and refuses before building anything."""
    from sqlalchemy import delete

    from fpbench.store.models import Round
    from tests.conftest import Crash, CrashAfter

    cfg = tiny_config(rounds=2)
    with pytest.raises(Crash):
        run_cell(cfg, store, checkpoint_dir=tmp_path, observer=CrashAfter(0))
    run_id = store.find_run(cfg.run_key).id
    with store._session.begin() as s:
        s.execute(delete(Round).where(Round.run_id == run_id))
    monkeypatch.setattr(cell_module, "build_task", _raise(AssertionError("built")))
    path = ckpt_io.checkpoint_path(ckpt_io.folder_for(tmp_path, store.database_id), cfg.run_key)
    with pytest.raises(FpbenchError) as info:
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    assert str(info.value).startswith(f"cannot resume cell {runner.cell_label(cfg)} (")
    assert f"its checkpoint {path} is at round 0 but the database lacks rounds 0;" in str(
        info.value
    )


def test_a_crash_in_the_rounds_is_stored_even_when_its_cost_cannot_be(store, tmp_path, monkeypatch):
    """The peak memory write failing too (say the database hiccups) neither masks the crash
    nor keeps it from being stored."""
    cfg = tiny_config(rounds=1)
    monkeypatch.setattr(runner, "run_rounds", _raise(_Boom("round broke")))
    monkeypatch.setattr(Store, "record_cost", _raise(RuntimeError("cost not written")))
    with pytest.raises(_Boom):
        run_cell(cfg, store, checkpoint_dir=tmp_path)
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error, record.peak_mem_bytes) == (
        "failed",
        "_Boom: round broke",
        None,
    )
