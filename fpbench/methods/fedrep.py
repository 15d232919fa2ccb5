"""FedRep: shared prompts, personal heads; head epochs first, then prompt epochs.

FedRep (Collins et al., "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021), adapted to prompt tuning on a frozen ViT: the shared representation is the
VPT-shallow prompts, the personal part is each client's linear head. Client: `head_epochs` epochs
training only its head (prompts fixed), then `rep_epochs` epochs training only the prompts (head
fixed), each phase with a fresh optimiser. FedRep's representation phase is one epoch (its paper
and code: 10 head epochs, 1 representation epoch), so `rep_epochs` defaults to 1; None takes the
run's `train.local_epochs`. Server: FedAvg of the prompts by client train
size; heads never leave the clients. Inference is personal: held-out clients, which never trained
a head, are not applicable. Defaults `head_epochs = 10`, `rep_epochs = 1`, the paper's settings.
"""

from __future__ import annotations

from pydantic import Field

from fpbench.methods.base import Phase
from fpbench.methods.fedvpt import VPTConfig, VPTModel
from fpbench.registry import METHODS


class FedRepConfig(VPTConfig):
    head_epochs: int = Field(10, ge=1, description="local epochs of the head-only phase")
    rep_epochs: int | None = Field(
        1,
        ge=1,
        description="local epochs of the prompt (representation) phase; FedRep: 1; "
        "None: train.local_epochs",
    )


@METHODS.register()
class FedRep(VPTModel):
    name = "fedrep"
    Config = FedRepConfig
    inference = "personal"
    personal = frozenset({"head_w", "head_b"})

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [
            # prompts are fixed while the head trains: the backbone keeps the final states
            Phase("head", ("head_w", "head_b"), self.cfg.head_epochs),
            Phase("representation", ("prompts",), self.cfg.rep_epochs or local_epochs),
        ]
