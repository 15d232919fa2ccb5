"""FedRep: shared prompts, personal heads; head epochs first, then prompt epochs.

FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021), adapted to prompt tuning on a frozen ViT: the shared representation is the
VPT-shallow prompts, the personal part is each client's linear head. Client: `head_epochs` epochs
training only its head (prompts fixed), then `train.local_epochs` epochs training only the prompts
(head fixed), each phase with a fresh optimiser. Server: FedAvg of the prompts by client train
size; heads never leave the clients. Inference is personal: held-out clients, which never trained
a head, are not applicable. Default `head_epochs = 10`, the paper's setting.
"""

from __future__ import annotations

from pydantic import Field

from fpbench.methods.base import Phase
from fpbench.methods.fedvpt import ShallowPromptModel, VPTConfig
from fpbench.registry import METHODS


class FedRepConfig(VPTConfig):
    head_epochs: int = Field(10, ge=1, description="local epochs of the head-only phase")


@METHODS.register()
class FedRep(ShallowPromptModel):
    name = "fedrep"
    Config = FedRepConfig
    inference = "personal"
    personal = frozenset({"head_w", "head_b"})

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [
            # prompts are fixed while the head trains: the final states are computed once
            Phase("head", ("head_w", "head_b"), self.cfg.head_epochs, self.backbone.depth),
            Phase("representation", ("prompts",), local_epochs),
        ]
