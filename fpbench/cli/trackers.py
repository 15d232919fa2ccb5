"""Logging a run's curves to the trackers people already use, as it trains (optional extras).

`fpbench run --log tensorboard|wandb|mlflow` wraps the run's progress observer in a
`TrackingObserver`, which hands every evaluated round's aggregates (and the training loss) to
each tracker, one tracker run per cell. Like every view, a tracker sees rounds numbered from 1
(the step) and accuracies in percent. The metrics come from the driver's observer: the
`local` launcher logs them, with or without `--jobs` (workers' rounds are forwarded to the
driver); cells run by submitit, SLURM or Ray log nothing (`fpbench export` has their curves).

* TensorBoard: event files under `<log dir>/<suite>/<run name>`
  (pip install 'fpbench[tensorboard]').
* W&B: one run per cell in project `fpbench-<suite>`, group = the suite, config = the cell's
  resolved config; `WANDB_MODE=offline` keeps it local (pip install 'fpbench[wandb]').
* MLflow: one run per cell in experiment `fpbench/<suite>`, params = the cell's identity
  flattened, tracking URI from `MLFLOW_TRACKING_URI` or `<log dir>/mlruns` (MLflow's file
  store, which MLflow 3 keeps behind `MLFLOW_ALLOW_FILE_STORE=true`, set here for it)
  (pip install 'fpbench[mlflow]').

A tracker that cannot start stops `fpbench run` before any cell runs; one that fails during a
run is warned about once and dropped, and the run goes on (the database has every value).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from fpbench.errors import FpbenchError

log = logging.getLogger(__name__)
TRACKERS = ("tensorboard", "wandb", "mlflow")
EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
MODULE = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def run_name(cfg: Any) -> str:
    """A cell's name in a tracker: method, dataset, partition, seed and its key's first 8."""
    parts = (cfg.method.label, cfg.dataset.label, cfg.partition.label, f"s{cfg.seed}")
    return "-".join(p.replace("/", "_") for p in parts) + f"-{cfg.run_key[:8]}"


def shown(metrics: dict[str, float]) -> dict[str, float]:
    """Accuracies in percent, as every view shows them."""
    from fpbench.report.tables import is_percent

    return {k: 100.0 * v if is_percent(k) else float(v) for k, v in metrics.items()}


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as `a.b.c -> value` pairs."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoard:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.writers = log_dir, {}

    def start(self, cfg: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        path = self.log_dir / cfg.suite.replace("/", "_") / run_name(cfg)
        self.writers[cfg.run_key] = SummaryWriter(log_dir=str(path))

    def log(self, cfg: Any, step: int, metrics: dict[str, float]) -> None:
        writer = self.writers[cfg.run_key]
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
        writer.flush()

    def end(self, cfg: Any, status: str) -> None:
        if (writer := self.writers.pop(cfg.run_key, None)) is not None:
            writer.close()


class Wandb:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.runs = log_dir, {}

    def start(self, cfg: Any) -> None:
        import wandb

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.runs[cfg.run_key] = wandb.init(
            project=f"fpbench-{cfg.suite}".replace("/", "_")[:128],
            group=cfg.suite,
            name=run_name(cfg),
            config=cfg.model_dump(mode="json"),
            dir=str(self.log_dir),
            reinit="create_new",
        )

    def log(self, cfg: Any, step: int, metrics: dict[str, float]) -> None:
        self.runs[cfg.run_key].log(metrics, step=step)

    def end(self, cfg: Any, status: str) -> None:
        if (run := self.runs.pop(cfg.run_key, None)) is not None:
            run.finish(exit_code=0 if status == "done" else 1)


class Mlflow:
    def __init__(self, log_dir: Path) -> None:
        import os

        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # MLflow 3 keeps its file store for those who opt in, as here
            uri = (log_dir / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(uri)
        self.client.search_experiments(max_results=1)  # an unusable store fails here
        self.runs: dict[str, str] = {}

    def start(self, cfg: Any) -> None:
        name = f"fpbench/{cfg.suite}"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        run = self.client.create_run(experiment, run_name=run_name(cfg))
        for key, value in sorted(flat(cfg.identity()).items()):
            self.client.log_param(run.info.run_id, key[:250], str(value)[:6000])
        self.runs[cfg.run_key] = run.info.run_id

    def log(self, cfg: Any, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.client.log_metric(self.runs[cfg.run_key], name, value, step=step)

    def end(self, cfg: Any, status: str) -> None:
        if (run := self.runs.pop(cfg.run_key, None)) is not None:
            self.client.set_terminated(run, "FINISHED" if status == "done" else "FAILED")


CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


def make_trackers(names: list[str], log_dir: Path) -> list[Any]:
    """The trackers named (each once), checked to be installed before anything runs.

    Raises:
        FpbenchError: an unknown name, or its package is not installed (names the extra).
    """
    out = []
    for name in dict.fromkeys(names):
        if name not in TRACKERS:
            raise FpbenchError(f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        if importlib.util.find_spec(MODULE[name]) is None:
            raise FpbenchError(
                f"--log {name} needs the {name} package: pip install 'fpbench[{EXTRA[name]}]'"
            )
        try:
            out.append(CLASSES[name](log_dir))
        except Exception as e:  # noqa: BLE001 - any tracker's own error, in one line
            raise FpbenchError(f"--log {name}: {type(e).__name__}: {e}") from None
    return out


class TrackingObserver:
    """An observer that forwards every call to `inner` and logs rounds to the trackers."""

    def __init__(self, inner: Any, trackers: list[Any]) -> None:
        self.inner, self.trackers = inner, list(trackers)
        self.open: dict[str, Any] = {}

    def _each(self, call: str, *args: Any) -> None:
        """`call` on every tracker; one that raises is warned about and dropped."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self.trackers.remove(tracker)
                log.warning(
                    "stopped logging to %s: %s: %s", type(tracker).__name__, type(e).__name__, e
                )

    def cell_start(self, cfg: Any, start_round: int) -> None:
        self.inner.cell_start(cfg, start_round)
        self._each("start", cfg)
        self.open[cfg.run_key] = cfg

    def round_end(self, cfg: Any, round_idx: int, metrics: dict[str, float]) -> None:
        self.inner.round_end(cfg, round_idx, metrics)
        if metrics and cfg.run_key in self.open:
            self._each("log", cfg, round_idx + 1, shown(metrics))

    def stage(self, cfg: Any, what: str, done: int, total: int) -> None:
        self.inner.stage(cfg, what, done, total)

    def cell_end(self, result: Any) -> None:
        self.inner.cell_end(result)
        if self.open.pop(result.cfg.run_key, None) is not None:
            self._each("end", result.cfg, result.status)
