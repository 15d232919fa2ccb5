"""Issue 48, everyday use: every missing input (datasets and backbone weights) named at once
before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fpbench.backbones import missing_weights
from fpbench.cli import app
from fpbench.suites import load_suite

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _suite(path: Path, dataset: str, backbone: str) -> Path:
    path.write_text(
        f'name = "w"\nseeds = [0]\n[defaults]\nbackbone = {backbone}\n'
        f'train = {{ rounds = 1 }}\n[[datasets]]\nname = "{dataset}"\n'
        '[[partitions]]\nname = "iid"\n[[methods]]\nname = "fedvpt"\n'
    )
    return path


def _hub_cache(root: Path, repo: str, filename: str) -> Path:
    """An (empty) weights file in the Hugging Face cache layout: presence, never loaded."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "snapshots" / "abc123" / filename).write_bytes(b"")
    return folder


def _no_probe() -> bool:
    raise AssertionError("the hub was probed for weights already cached")


def test_a_missing_dataset_and_a_missing_weights_file_are_one_error_and_nothing_is_written(here):
    _suite(here / "real.toml", "cifar10", '{ name = "vit-test", weights = "nowhere/w.pth" }')
    (here / "empty").mkdir()
    got = invoke("run", "--suite", "real.toml", "--data-root", "empty", "--db", "x.db")
    assert got.exit_code == 2, got.output
    said = " ".join(got.stderr.split())
    assert said.startswith("error: 2 inputs are missing: dataset 'cifar10' not found under")
    weights = here / "nowhere" / "w.pth"
    assert (
        f"; backbone weights file '{weights}' for vit-test does not exist; "
        "fix backbone.weights in the suite" in said
    )
    assert not (here / "x.db").exists() and not (here / "results").exists()
    dry = invoke("run", "--suite", "real.toml", "--data-root", "empty", "--db", "x.db", "--dry-run")
    assert dry.exit_code == 0, dry.output
    shown = " ".join(dry.stdout.split())
    assert (
        f"weights missing: backbone weights file '{weights}' for vit-test does not exist" in shown
    )
    assert not (here / "x.db").exists()


def test_a_weights_file_that_exists_and_offline_backbones_need_nothing(here):
    (here / "w.pth").write_bytes(b"")  # present: not loaded, so its content does not matter
    named = load_suite(
        str(_suite(here / "a.toml", "synthetic", '{ name = "vit-test", weights = "w.pth" }'))
    )
    offline = [
        load_suite(str(_suite(here / f"{b}.toml", "synthetic", f'{{ name = "{b}" }}'))).cells[0]
        for b in ("vit-test", "vit-smoke", "clip-test")
    ]
    assert missing_weights([*named.cells, *offline]) == []


def test_hub_weights_are_looked_for_in_the_local_cache_and_missing_offline(here, monkeypatch):
    import huggingface_hub.constants as hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(here / "hub"))
    cells = [
        load_suite(str(_suite(here / f"{b}.toml", "synthetic", f'{{ name = "{b}" }}'))).cells[0]
        for b in ("vit-b16-in21k", "clip-vit-b16")
    ]
    vit, clip = missing_weights(cells)
    assert vit.startswith("the weights for vit-b16-in21k (vit_base_patch16_224.orig_in21k) could")
    assert "(no network, or HF_HUB_OFFLINE is set)" in vit and 'weights = "PATH"' in vit
    assert clip.startswith("the openai weights of clip-vit-b16 (ViT-B-16-quickgelu) are missing")
    assert "download https://huggingface.co/timm/vit_base_patch16_clip_224.openai/" in clip
    _hub_cache(here / "hub", "timm/vit_base_patch16_224.orig_in21k", "model.safetensors")
    _hub_cache(here / "hub", "timm/vit_base_patch16_clip_224.openai", "open_clip_model.safetensors")
    from fpbench.registry import BACKBONES

    for name in ("vit-b16-in21k", "clip-vit-b16"):  # cached: present, the hub never asked
        assert BACKBONES.get(name).missing(None, _no_probe) is None


def test_uncached_hub_weights_with_the_hub_reachable_are_not_missing(here, monkeypatch):
    import huggingface_hub.constants as hf

    from fpbench.registry import BACKBONES

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(here / "hub"))
    assert BACKBONES.get("vit-b16-in21k").missing(None, lambda: True) is None  # run downloads
    assert (
        BACKBONES.get("clip-rn50")
        .missing(None, lambda: False)
        .startswith("the openai weights of clip-rn50")
    )


# -- SLURM: a requeued job takes its cell over at once; its own incarnation is not "gone" ------

SLURM_VARS = ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")


@pytest.fixture
def slurm_job(monkeypatch):
    """This process as the first run of SLURM job 77 (no requeue yet)."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    return monkeypatch


def _claimed(store, run_id: int, owner: str) -> None:
    """`owner` holds the run with a fresh heartbeat (as a live process, or one just killed)."""
    import datetime as dt

    from sqlalchemy import update

    from fpbench.store.models import Run

    beat = dt.datetime.now(dt.timezone.utc)
    with store._session.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status="running", owner=owner,
                                                             heartbeat_at=beat))  # fmt: skip


def test_a_process_of_the_same_slurm_job_run_is_live_a_requeued_runs_predecessor_is_gone(
    slurm_job,
):
    from fpbench.store import claims

    sibling = "node2:12345:abcd:job=77"  # another srun task of this job, on another node
    assert not claims.owner_is_gone(sibling)  # was taken for gone: its cell stolen, "stale"
    assert claims.stale_reason("running", sibling, claims._now(), 600) is None
    assert claims.shown_status("running", sibling, claims._now()) == "running"
    slurm_job.setenv("SLURM_RESTART_COUNT", "1")  # this job requeued: the first run is gone
    assert claims.owner_is_gone(sibling)
    assert claims.shown_status("running", sibling, claims._now()) == "stale"
    assert not claims.owner_is_gone("node2:12345:abcd:job=77:restart=1")  # this run's own
    assert not claims.owner_is_gone("node2:12345:abcd:job=770")  # another job
    slurm_job.setenv("SLURM_RESTART_COUNT", "2")
    assert claims.owner_is_gone("node2:12345:abcd:job=77:restart=1")


class _Requeued:
    """What submitit does on SLURM's preemption signal: `checkpoint`, requeue, `sys.exit(-1)`,
    here after round `k` is stored."""

    def __init__(self, k: int) -> None:
        self.k = k

    def cell_start(self, cfg, start_round):
        pass

    def stage(self, cfg, what, done, total):
        pass

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.k:
            from fpbench.engine.submitit_jobs import CellJob

            CellJob().checkpoint(cfg, "url", "ck", 600.0)  # submitit's handler calls it
            raise SystemExit(-1)


def test_a_job_slurm_requeues_stores_its_cell_interrupted_and_the_requeued_run_resumes_it(
    tmp_path, slurm_job
):
    from fpbench.engine import runner
    from fpbench.engine.runner import run_cell
    from fpbench.store import Store
    from fpbench.testing import tiny_config

    slurm_job.setattr(runner, "_exit_reasons", [])
    cfg = tiny_config(rounds=2)
    store, ck = Store(f"sqlite:///{tmp_path / 'r.db'}"), tmp_path / "ck"
    with pytest.raises(SystemExit) as stop:  # the process still exits as submitit asks
        run_cell(cfg, store, checkpoint_dir=ck, observer=_Requeued(0))
    assert stop.value.code == -1
    record = store.find_run(cfg.run_key)
    assert (record.status, record.error, record.traceback) == (
        "interrupted",  # was "failed", with SystemExit's traceback
        "interrupted after round 1/2 (SLURM preempted or timed out the job; requeued)",
        None,
    )
    slurm_job.setenv("SLURM_RESTART_COUNT", "1")  # the requeued job, maybe on another node
    assert run_cell(cfg, store, checkpoint_dir=ck).status == "done"
    assert store.rounds(record.id)["round"].tolist() == [0, 1]  # resumed after round 1
    assert store.find_run(cfg.run_key).owner.endswith(":job=77:restart=1")


def test_a_requeued_job_takes_over_its_predecessors_running_cell_at_once(tmp_path, slurm_job):
    """kill -9 of the first run (no time to store it interrupted) leaves a 'running' row with a
    fresh heartbeat on another node: the requeued run neither skips it nor waits 10 minutes."""
    from fpbench.engine.runner import run_cell
    from fpbench.store import Store
    from fpbench.testing import tiny_config

    cfg = tiny_config(rounds=2)
    store, ck = Store(f"sqlite:///{tmp_path / 'r.db'}"), tmp_path / "ck"
    assert run_cell(cfg, store, checkpoint_dir=ck).status == "done"
    run_id = store.find_run(cfg.run_key).id
    with store._session.begin() as s:  # as if killed during round 1
        from sqlalchemy import delete

        from fpbench.store.models import Metric, Round

        s.execute(delete(Metric).where(Metric.run_id == run_id, Metric.round == 1))
        s.execute(delete(Round).where(Round.run_id == run_id, Round.round == 1))
    _claimed(store, run_id, "node2:12345:abcd:job=77")
    skipped = run_cell(cfg, store, checkpoint_dir=ck)  # this same run of job 77: a live claim
    assert (skipped.status, skipped.error) == ("skipped", "claimed by another driver")
    slurm_job.setenv("SLURM_RESTART_COUNT", "1")
    assert run_cell(cfg, store, checkpoint_dir=ck).status == "done"
    assert store.rounds(run_id)["round"].tolist() == [0, 1]
