"""CoOp prompt learning on a frozen CLIP, and `coop-local`: every client alone.

CoOp (Zhou, Yang, Loy, Liu, "Learning to Prompt for Vision-Language Models", IJCV 2022): the
class prompts "SOT ctx_1..ctx_M name . EOT" share M learnable context vectors (or, with
`csc`, each class has its own), the frozen text encoder turns them into class weights, and the
logits are exp(logit_scale) * cos(image feature, text feature), trained with cross-entropy. The
image encoder, the text encoder and the logit scale stay frozen, so the backbone recalls the image
features from the engine's frozen store, computed once per sample. Defaults follow CoOp: M = 16
random N(0, 0.02^2) vectors, class token at the end, generic context.

`coop-local` is the "Local training" baseline of TPFL (Zhao et al., UbiComp 2023 adjunct,
Table 1): each client trains its own context on its own data and never communicates;
inference is personal (held-out clients are not applicable).

`CoOpModel` is the base of the CLIP methods (promptfl, tpfl, atpfl, sdfed): it builds the
prompt layout from the dataset's class names and turns per-client context (K, M, d) into
per-client text features (K, C, E).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, init_context, phrase_length
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Method, MethodConfig, ServerState, TaskInfo
from fpbench.methods.helpers import per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP


class CoOpConfig(MethodConfig):
    n_ctx: int = Field(16, ge=1, le=70, description="number of learnable context tokens M")
    ctx_init: str | None = Field(
        None, description='init phrase (e.g. "a photo of a"); sets M to its token count'
    )
    class_token_position: Literal["end", "middle", "front"] = "end"
    csc: bool = Field(False, description="class-specific context (ignored with ctx_init)")


class CoOpModel(Method):
    """CoOp text prompts on a frozen CLIP; subclasses choose how they are federated."""

    Config = CoOpConfig
    backbone_family: ClassVar[str] = "clip"

    def __init__(self, cfg: MethodConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        from fpbench.backbones.clip import PromptedCLIP

        super().__init__(cfg, backbone, task)
        if not isinstance(backbone, PromptedCLIP):
            raise FpbenchError(
                f"method {self.name} needs a CLIP backbone (clip-test, clip-vit-b16, clip-rn50), "
                f"got {getattr(backbone, 'name', type(backbone).__name__)}"
            )
        if len(task.class_names) != task.num_classes:
            raise FpbenchError(f"method {self.name} needs the dataset's class names")
        self._layouts: dict[int, PromptLayout] = {}
        self._fixed_text: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def n_ctx(self) -> int:
        phrase = getattr(self.cfg, "ctx_init", None)
        return phrase_length(self.backbone, phrase) if phrase else self.cfg.n_ctx

    def layout(self, n_ctx: int) -> PromptLayout:
        """The prompt layout for n_ctx context tokens (built once, on the backbone's device)."""
        if n_ctx not in self._layouts:
            self._layouts[n_ctx] = PromptLayout.build(
                self.backbone,
                list(self.task.class_names),
                n_ctx,
                getattr(self.cfg, "class_token_position", "end"),
            )
        return self._layouts[n_ctx]

    def init_context(self, gen: torch.Generator) -> Tensor:
        """(M, d), or (C, M, d) for class-specific context."""
        if getattr(self.cfg, "ctx_init", None):
            return init_context(self.backbone, gen, self.n_ctx, self.cfg.ctx_init)
        if getattr(self.cfg, "csc", False):
            c, m, d = self.task.num_classes, self.n_ctx, self.backbone.ctx_dim
            return torch.randn(c, m, d, generator=gen) * 0.02
        return init_context(self.backbone, gen, self.n_ctx)

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        return {"ctx": self.init_context(gen)}

    def text_features(self, ctx: Tensor) -> Tensor:
        """Normalised class text features (K, C, E) of per-client context (K, [C,] M, d)."""
        return self.layout(ctx.shape[-2]).text_features(self.backbone, ctx)

    def fixed_text_features(self, key: str, ctx: Tensor, stacked: bool = True) -> Tensor:
        """`text_features` (K, C, E) of a context that stays fixed during local training.

        No gradient. Kept per `key` and reused while the same tensor object comes back (every
        step of a round), so the text encoder runs on it once per round, not once per step.
        `stacked=False`: ctx is one context ([C,] M, d) and the result (1, C, E).
        """
        with torch.no_grad():
            held = self._fixed_text.get(key)
            if held is None or held[0] is not ctx:
                text = self.text_features(ctx if stacked else ctx.unsqueeze(0))
                held = self._fixed_text[key] = (ctx, text)
            return held[1]

    def image_features(self, x: Tensor) -> Tensor:
        """Normalised image features (B, E) of preprocessed images x (unprompted: recalled)."""
        return F.normalize(self.backbone.encode_image(x).float(), dim=-1)

    def logits(self, feats: Tensor, text: Tensor, client_index: Tensor) -> Tensor:
        """exp(logit_scale) * cos: feats (B, E), text (K, C, E) -> (B, C) with each row's text."""
        zeros = text.new_zeros(text.shape[:2])  # (K, C)
        return self.backbone.logit_scale * per_client_linear(feats, text, zeros, client_index)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        text = self.text_features(params["ctx"])  # (K, C, E)
        return self.logits(self.image_features(x), text, client_index)


@METHODS.register()
class CoOpLocal(CoOpModel):
    name = "coop-local"
    inference = "personal"
    personal = frozenset({"ctx"})

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        return {}, {}
