"""PromptFolio: a global and a local text prompt whose class features are mixed by theta.

PromptFolio (Pan, Huang, Fu, Yang, "Federated Learning from Vision-Language Foundation Models:
Theoretical Analysis and Method", NeurIPS 2024, arXiv 2409.19610). Each client holds two CoOp
contexts: a global one (averaged by the server, weighted by train size) and a local one (kept
on the client). Their normalised class text features are mixed like a portfolio,

    t_c = (1 - theta) * t^global_c + theta * t^local_c      (not renormalised)

and the logits are exp(logit_scale) * cos-like f . t_c with f the normalised image feature,
trained with cross-entropy. Inference uses the client's (global, local) pair, so it is
personal. This is the method's own federation; nothing was adapted.

Defaults from the official code (PanBikang/PromptFolio, `trainers/PromptFolio.py` and
`federated_main.py`, commit 8f729aa): theta = 0.4 (`--frac_p`), 8 context tokens (`--n_ctx`),
both prompts N(0, 0.02^2) (or both the init phrase's embeddings), class token at the end, every
client starting from the same local prompt. Its `configs/trainers/PromptFolio/vit_b16.yaml`
sets SGD with a per-epoch cosine schedule and one warmup epoch, and `federated_main.py`
overrides the rest: lr 1e-3 (`--lr`), 1 local epoch (`MAX_EPOCH = 1`), 10 rounds, batch 16
(`--train_batch_size`): the recipe the suite flip-compare-own runs
(benchmarks/protocols/recipes.toml; flip-compare runs FLiP's common recipe, declared). The official
server pairs the
sampled clients' prompts with the train sizes by position in the sampled order (its
`average_weights` indexes the list of uploads by client id); fpbench weights each client's
prompt by its own size, which is the same when sizes are equal (declared in
`method_readings`). The official middle / front class-token branches build only the first of
the two prompt sets (and fail); fpbench applies the position to both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, MethodConfig
from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class PromptFolioConfig(MethodConfig):
    n_ctx: int = Field(8, ge=1, le=70, description="context tokens per prompt (official: 8)")
    ctx_init: str | None = Field(
        None, description='init phrase for both prompts (e.g. "a photo of a"); sets n_ctx'
    )
    class_token_position: Literal["end", "middle", "front"] = "end"
    theta: float = Field(
        0.4, ge=0, le=1, description="weight of the local prompt's features (official: 0.4)"
    )


def mix_features(global_: Tensor, local: Tensor, theta: float) -> Tensor:
    """(1 - theta) * global_ + theta * local: the portfolio of two normalised feature sets."""
    return (1.0 - theta) * global_ + theta * local


class GlobalLocalPrompts(CoOpModel):
    """Two CoOp contexts per client: `global_ctx`, averaged by the server, and `local_ctx`, kept
    on the client, both drawn as CoOp's (global first); inference is personal. The base of
    PromptFolio, DP-FPL and FedPHA, which differ in how they use the two."""

    inference = "personal"
    personal = frozenset({"local_ctx"})

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        return {"global_ctx": self.init_context(gen), "local_ctx": self.init_context(gen)}


@METHODS.register()
class PromptFolio(GlobalLocalPrompts):
    name = "promptfolio"
    Config = PromptFolioConfig

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        text = mix_features(
            self.text_features(params["global_ctx"]),
            self.text_features(params["local_ctx"]),
            self.cfg.theta,
        )  # (K, C, E)
        return self.logits(self.image_features(x), text, client_index)
