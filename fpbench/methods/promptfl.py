"""PromptFL: CoOp context shared by all clients and averaged by the server.

PromptFL (Guo, Guo, Wang, Xu, "PromptFL: Let Federated Participants Cooperatively Learn
Prompts Instead of Models", IEEE TMC 2023), also the "CoOp" row of SDFed (Di et al., 2026) and a
baseline of TPFL (Zhao et al., 2023). Client: E local epochs of CoOp cross-entropy on a frozen
CLIP, starting from the global context. Server: the context averaged with weights proportional to
the clients' train sizes (FedOTP's re-implementation; the released PromptFL averages uniformly,
and in its code every upload aliased one live tensor). Inference: the global context for every
client. Defaults: CoOp's 16 random context vectors, class token at the end.

PromptFL is a preset of a composition: the learner `coop` (CoOp's context on a frozen CLIP) with
the strategy `fedavg`; `coop` takes any other strategy (`strategy = { name = "fedprox" }`).
"""

from __future__ import annotations

from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS


@METHODS.register()
class CoOp(CoOpModel):
    """CoOp (Zhou et al., IJCV 2022): a learned context shared by every class, on a frozen CLIP;
    federated by the cell's strategy (FedAvg: PromptFL)."""

    name = "coop"


@METHODS.register()
class PromptFL(CoOp):
    """PromptFL: the learner coop with FedAvg."""

    name = "promptfl"
