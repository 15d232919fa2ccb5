"""torch, imported on first use, so that loading a suite does not import it.

Loading a suite imports every built-in component's module (they register on import) and
validates each cell with the components' `Config` classes; importing torch would add 1.7 s on 2
cores to `fpbench run --dry-run` and every other command that only reads suites. The built-in
modules therefore write

    from fpbench.lazy import F, torch      # torch and torch.nn.functional

    if TYPE_CHECKING:
        from torch import Tensor           # names used only in annotations

and call `torch.no_grad()` as a context manager rather than a decorator (a decorator runs at
import). `torch` here is a stand-in module: the first attribute read imports the real one and
points every fpbench module at it. Python 3.15's `lazy import torch` (PEP 810) will say the
same in one line. A method in another package can import torch the usual way; loading a suite
then imports torch too, and nothing else changes. `tests/test_registry.py` names the first
built-in module that imports torch early.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any


class LazyModule(types.ModuleType):
    """A module that is imported when one of its attributes is first read.

    On that first read every fpbench module that holds the stand-in is pointed at the real
    module, so later reads cost what they cost after a plain `import torch` (about 40 times less
    than a forwarded read) and see what tests patch on it.
    """

    def __getattr__(self, attr: str) -> Any:  # only called for names not set on the stand-in
        module = self.__dict__.get("_module")
        if module is None:  # the first read: import, then repoint fpbench's modules (once)
            module = self.__dict__["_module"] = importlib.import_module(self.__name__)
            for name, imported in list(sys.modules.items()):
                if name == "fpbench" or name.startswith("fpbench."):
                    namespace = getattr(imported, "__dict__", {})  # sys.modules may hold None
                    for key, value in list(namespace.items()):
                        if value is self:
                            namespace[key] = module
        return getattr(module, attr)


if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = LazyModule("torch")
    F = LazyModule("torch.nn.functional")

__all__ = ["F", "LazyModule", "torch"]
