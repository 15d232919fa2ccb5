"""Methods: one file each, registered in `fpbench.registry.METHODS` on import."""

from fpbench.methods import fedrep, fedvpt, fedvpt_d, head_tune, local  # noqa: F401
from fpbench.methods.base import Context, Method, MethodConfig, Phase, ServerState, TaskInfo

__all__ = ["Context", "Method", "MethodConfig", "Phase", "ServerState", "TaskInfo"]
