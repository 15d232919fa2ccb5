"""P-PT: personalised prompt tuning, PEP-FedPT's baseline; prompts stay local, the head is shared.

P-PT is the baseline PEP-FedPT (Yashwanth, Ghosh, Tripathi, Chakraborty, "Prompt Estimation
from Prototypes for Federated Prompt Tuning of Vision Transformers", 2025) introduces to show
what personalising the prompts alone does: the FedVPT model (VPT-shallow prompts and a linear
head on a frozen ViT), where each client's prompts are personal (trained locally, never sent,
never aggregated) and the head is trained with FedAvg. The paper describes it in one sentence;
that the head is federated is our reading, consistent with its results (P-PT below FedVPT, and
an accuracy reported for unseen clients, which only a shared part can give). Inference is
personal. A new (held-out) client is scored with what P-PT deploys to it, zero-shot: the common
initial prompts (it has trained no personal ones) and the federated head; the paper reports this
"Testing Acc" (Tables 3 and 14) without saying how it was obtained, so this is fpbench's reading.

Defaults: one prompt token, PEP-FedPT's number of shared prompts n_S = 1 (the paper does not
state P-PT's own length); the local optimiser and schedule are the benchmark's `train` settings.
"""

from __future__ import annotations

from pydantic import Field

from fpbench.methods.fedvpt import VPTConfig, VPTModel
from fpbench.registry import METHODS


class PPTConfig(VPTConfig):
    prompt_len: int = Field(1, ge=1, description="personal VPT-shallow prompt tokens")


@METHODS.register()
class PPT(VPTModel):
    name = "p-pt"
    Config = PPTConfig
    inference = "personal-deploys"  # new clients: initial prompts + federated head (docstring)
    personal = frozenset({"prompts"})
