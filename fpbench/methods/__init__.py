"""Methods: one file each, registered in `fpbench.registry.METHODS` on import."""

from fpbench.methods import fedvpt, head_tune, local  # noqa: F401  (registration)
from fpbench.methods.base import Context, Method, MethodConfig, Phase, ServerState, TaskInfo

__all__ = ["Context", "Method", "MethodConfig", "Phase", "ServerState", "TaskInfo"]
