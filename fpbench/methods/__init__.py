"""Methods: one file each, registered in `fpbench.registry.METHODS` on import.

Every module of this package is imported here, so a new method is one file (plus its tests):
dropping `fpbench/methods/<name>.py` with a `@METHODS.register()` class is its registration.
"""

import importlib
import pkgutil

from fpbench.methods.base import Context, Method, MethodConfig, Phase, ServerState, TaskInfo

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Context", "Method", "MethodConfig", "Phase", "ServerState", "TaskInfo"]
