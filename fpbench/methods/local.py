"""Local: every client trains its own VPT-shallow prompts and head and never communicates.

The "Local training" baseline of TPFL (Table 1) and the usual lower bound of personalised FL:
the same model as FedVPT, but all parameters are personal, nothing is aggregated, and each client
is evaluated with its own parameters (held-out clients, which never train, are not applicable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.methods.base import ServerState
from fpbench.methods.fedvpt import VPTModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


@METHODS.register()
class Local(VPTModel):
    name = "local"
    inference = "personal"
    personal = frozenset({"prompts", "head_w", "head_b"})

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return {}, {}
