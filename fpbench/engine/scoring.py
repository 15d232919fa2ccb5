"""Scoring a run's trained state on an evaluation mode's other sets (`fpbench.engine.eval_modes`):
the method rebuilt over the set's class names, and a task of the run's clients without local data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fpbench.data.base import ImageDataset
from fpbench.engine.task import Task
from fpbench.errors import FpbenchError
from fpbench.lazy import torch

if TYPE_CHECKING:
    from fpbench.engine.inputs import Inputs
    from fpbench.methods.base import Method, ServerState, TaskInfo


@dataclass(frozen=True)
class Target:
    """An eval set ready to score for one population: its task, method instance and inputs."""

    name: str
    task: Task
    method: Method
    inputs: Inputs


def scoring_task(data: ImageDataset, task: Task, where: str = "this evaluation") -> Task:
    """The run's clients with no local data, over `data` (already on the task's device);
    `where` names what scores them (a method that draws client data is refused with it)."""
    device, n, c = task.priors.device, task.num_clients, data.num_classes
    none = [torch.zeros(0, dtype=torch.long, device=device) for _ in range(n)]
    return Task(
        data=data,
        clients=task.clients,
        train_idx=none,
        test_idx=list(none),
        priors=torch.full((n, c), 1.0 / c, device=device),
        train_sizes=task.train_sizes,
        heldout=task.heldout,
        no_local_data=where,
    )


def method_for(method: Method, task: Task, where: str) -> Method:
    """The method built again over `task`'s class names, on the same backbone and config.

    A method that adapts on local data before scoring is refused when it draws it
    (`Method.client_params`'s `draw` raises on `task`, see `scoring_task`).

    Raises:
        FpbenchError: the method's parameters depend on the class count (it cannot be scored
            on other classes).
    """
    other = type(method)(method.cfg, method.backbone, task_info(task))
    names = [f"class {k}" for k in range(task.data.num_classes + 1)]
    probe = type(method)(method.cfg, method.backbone, task_info(task, names))
    bound = {k: v for k, v in vars(method).items() if k in ("personal", "inference")}
    for instance in (other, probe):  # what the cell's strategy set (`Strategy.bind`)
        vars(instance).update(bound)
    if _shapes(method) != _shapes(other) or _shapes(method) != _shapes(probe):
        raise FpbenchError(
            f"method {method.name} cannot be scored on other classes ({where}): its trained "
            "parameters depend on the number of classes (class-specific context or a "
            "classifier head); use a method that builds its classifier from the class names"
        )
    return other


def task_info(task: Task, class_names: list[str] | None = None) -> TaskInfo:
    """A method's view of a scoring task (optionally with other class names)."""
    from fpbench.methods.base import TaskInfo

    data = task.data
    names = list(data.class_names) if class_names is None else class_names
    n = task.num_clients
    priors = torch.full((n, len(names)), 1.0 / len(names), device=task.priors.device)
    return TaskInfo(
        num_classes=len(names),
        num_clients=n,
        class_priors=priors,
        train_sizes=task.train_sizes,
        class_names=tuple(names),
        dataset=data.name,
        train_images=data.train_images,
        train_idx=tuple(task.train_idx),
        heldout=task.heldout,
        train_labels=data.train_labels,
        coarse_of_class=data.coarse_of_class if class_names is None else None,
    )


def _shapes(method: Method) -> dict[str, dict[str, tuple[int, ...]]]:
    server: ServerState = method.init_server(torch.Generator().manual_seed(0))
    return {
        part: {k: tuple(v.shape) for k, v in getattr(server, part).items()}
        for part in ("params", "personal", "buffers")
    }
