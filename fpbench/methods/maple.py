"""MaPLe: multi-modal prompts, deep language prompts coupled to vision prompts.

MaPLe (Khattak, Rasheed, Maaz, Khan, Khan, "MaPLe: Multi-modal Prompt Learning", CVPR 2023,
arXiv 2210.03117; reference code muzairkhattak/multimodal-prompt-learning, `trainers/maple.py`).
The text prompt is the init phrase "a photo of a {name}." whose first `n_ctx` tokens are learned
(CoOp's context at layer 0); in each of the next J - 1 text layers, tokens 1..n_ctx entering the
layer are replaced by that layer's learned prompt. The vision prompts are not learned on their
own: at layer 0 and at each of the J - 1 deeper layers, n_ctx vision tokens (appended after the
patch tokens, before `ln_pre`; later replaced) are a learned linear map (text width -> vision
width) of the same layer's text prompt. Logits: exp(logit_scale) * cos(image, text), trained with
cross-entropy; both CLIP towers stay frozen. ViT CLIP only (a ResNet has no vision tokens).

Adapted to FL: every trained tensor (the text prompts of all J layers and the J coupling
functions) is averaged by FedAvg (weighted by train size), as FLiP adapts centralised prompt
learners; inference is global. Defaults from the reference config
(`configs/trainers/MaPLe/vit_b16_c2_ep5_batch4_2ctx.yaml`): n_ctx = 2, init "a photo of a",
J = 9; its recipe (SGD lr 0.0035, batch 4, 5 epochs, cosine) is the suite's `train` settings.
The reference runs CLIP and the prompts in fp16 (its deep prompts are cast to fp16 as they
enter); fpbench keeps the prompts in fp32 (declared in `method_readings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, clean_name, init_context
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Method, MethodConfig, TaskInfo
from fpbench.methods.helpers import init_linear, per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP


class MaPLeConfig(MethodConfig):
    n_ctx: int = Field(2, ge=1, le=70, description="learned prompt tokens per layer")
    ctx_init: str | None = Field(
        "a photo of a",
        description="the prompt's phrase; its first n_ctx tokens initialise the layer-0 context "
        "(random N(0, 0.02^2) and 'X' placeholders when unset or shorter than n_ctx)",
    )
    prompt_depth: int = Field(9, ge=1, description="J: layers of both towers that get prompts")


def clip_backbone(method: Method, backbone: PromptedCLIP, task: TaskInfo) -> None:
    """Raise unless the backbone is a CLIP and the task has its class names."""
    from fpbench.backbones.clip import PromptedCLIP

    if not isinstance(backbone, PromptedCLIP):
        raise FpbenchError(
            f"method {method.name} needs a CLIP backbone (clip-test, clip-vit-b16, clip-rn50), "
            f"got {getattr(backbone, 'name', type(backbone).__name__)}"
        )
    if len(task.class_names) != task.num_classes:
        raise FpbenchError(f"method {method.name} needs the dataset's class names")


def check_depth(backbone: PromptedCLIP, method: str, **depths: int) -> None:
    """Raise unless every prompt depth fits the text and vision transformers."""
    model = backbone.model
    layers = min(len(model.transformer.resblocks), len(model.visual.transformer.resblocks))
    for name, depth in depths.items():
        if depth > layers:
            raise FpbenchError(
                f"method {method}: {name} = {depth} exceeds the backbone's {layers} layers "
                f"({backbone.name}); use at most {layers}"
            )


def phrase_layout(
    clip: PromptedCLIP, class_names: list[str], n_ctx: int, phrase: str | None
) -> PromptLayout:
    """ "SOT <phrase> name . EOT" with tokens 1..n_ctx as the learned context (MaPLe's and
    PromptSRC's prompt: the rest of the phrase stays in the frozen suffix); "X" placeholders
    where the phrase is unset or has fewer than n_ctx tokens."""
    with torch.no_grad():
        words = phrase if uses_phrase(clip, phrase, n_ctx) else " ".join(["X"] * n_ctx)
        names = [clean_name(n) for n in class_names]
        texts = [f"{words} {n}." for n in names]
        lens = [len(clip.tokenizer.encode(t)) for t in texts]
        if max(lens) + 2 > clip.context_length:
            raise FpbenchError(
                f"prompt {texts[lens.index(max(lens))]!r} exceeds CLIP's "
                f"{clip.context_length}-token budget"
            )
        ids = clip.tokenize(texts)  # (C, L)
        emb = clip.token_embed(ids).float()  # (C, L, d)
        length = ids.shape[1] - 1
        order = torch.arange(length, device=ids.device).expand(len(names), -1)
        name_lens = [len(clip.tokenizer.encode(n)) for n in names]
        return PromptLayout(n_ctx, "end", ids, emb[:, :1], emb[:, 1 + n_ctx :], order, name_lens)


def uses_phrase(clip: PromptedCLIP, phrase: str | None, n_ctx: int) -> bool:
    return bool(phrase) and n_ctx <= len(clip.tokenizer.encode(phrase))


def phrase_context(
    clip: PromptedCLIP, gen: torch.Generator, n_ctx: int, phrase: str | None
) -> Tensor:
    """The layer-0 context (n_ctx, d): the phrase's first n_ctx token embeddings, else
    N(0, 0.02^2)."""
    if uses_phrase(clip, phrase, n_ctx):
        return init_context(clip, gen, n_ctx, phrase)[:n_ctx].clone()
    return init_context(clip, gen, n_ctx)


def deep_text_features(
    clip: PromptedCLIP, layout: PromptLayout, ctx: Tensor, deep: Tensor
) -> Tensor:
    """Normalised text features (K, C, E): per client, layer-0 context ctx (K, n, d) and deep
    prompts deep (K, J - 1, n, d) replacing tokens 1..n entering layers 1..J - 1."""
    from fpbench.backbones.clip import encode_prompts_deep

    emb = layout.assemble(ctx)  # (K, C, L, d)
    k, c = emb.shape[:2]
    ids = layout.ids.repeat(k, 1)  # (K*C, L)
    per_prompt = deep.repeat_interleave(c, dim=0)  # (K*C, J-1, n, d)
    layers = [per_prompt[:, j] for j in range(deep.shape[1])]
    feats = encode_prompts_deep(clip, emb.flatten(0, 1), ids, layers, truncate=True)
    return F.normalize(feats.float(), dim=-1).view(k, c, -1)


def clip_logits(clip: PromptedCLIP, image: Tensor, text: Tensor, client_index: Tensor) -> Tensor:
    """exp(logit_scale) * cos: normalised image (B, E), text (K, C, E) -> (B, C), own client's."""
    zeros = text.new_zeros(text.shape[:2])
    return clip.logit_scale * per_client_linear(image, text, zeros, client_index)


@METHODS.register()
class MaPLe(Method):
    name = "maple"
    Config = MaPLeConfig
    backbone_family: ClassVar[str] = "clip"

    def __init__(self, cfg: MaPLeConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        from fpbench.backbones.clip import check_vit

        super().__init__(cfg, backbone, task)
        clip_backbone(self, backbone, task)
        check_vit(backbone, self.name)
        check_depth(backbone, self.name, prompt_depth=cfg.prompt_depth)
        self._layout: PromptLayout | None = None

    @property
    def layout(self) -> PromptLayout:
        if self._layout is None:
            cfg = self.cfg
            names = list(self.task.class_names)
            self._layout = phrase_layout(self.backbone, names, cfg.n_ctx, cfg.ctx_init)
        return self._layout

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        from fpbench.backbones.clip import vision_width

        cfg, clip = self.cfg, self.backbone
        d, w, deep = clip.ctx_dim, vision_width(clip), cfg.prompt_depth - 1
        ctx = phrase_context(clip, gen, cfg.n_ctx, cfg.ctx_init)
        proj_w, proj_b = init_linear(gen, w, d)
        deep_ctx = torch.randn(deep, cfg.n_ctx, d, generator=gen) * 0.02
        one_w, one_b = init_linear(gen, w, d)  # the reference clones one layer J - 1 times
        params = {"ctx": ctx, "proj_w": proj_w, "proj_b": proj_b}  # (n, d), (w, d), (w,)
        if deep:
            params["deep_ctx"] = deep_ctx  # (J-1, n, d)
            params["deep_proj_w"] = one_w.expand(deep, -1, -1).clone()  # (J-1, w, d)
            params["deep_proj_b"] = one_b.expand(deep, -1).clone()  # (J-1, w)
        return params

    def vision_prompts(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Per client: layer-0 vision prompts (K, n, w) and deep ones (K, J-1, n, w)."""
        shallow = params["ctx"] @ params["proj_w"].transpose(-1, -2) + params["proj_b"][:, None]
        if "deep_ctx" not in params:  # J = 1
            return shallow, shallow.new_zeros(shallow.shape[0], 0, *shallow.shape[1:])
        deep = params["deep_ctx"] @ params["deep_proj_w"].transpose(-1, -2)  # (K, J-1, n, w)
        return shallow, deep + params["deep_proj_b"][:, :, None]

    def image_features(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Normalised prompted image features (B, E)."""
        from fpbench.backbones.clip import encode_image_deep

        shallow, deep = self.vision_prompts(params)
        shallow, deep = shallow[client_index], deep[client_index]  # (B, n, w), (B, J-1, n, w)
        layers = [deep[:, j] for j in range(deep.shape[1])]
        return F.normalize(encode_image_deep(self.backbone, x, shallow, layers).float(), dim=-1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        deep = params.get("deep_ctx", params["ctx"][:, :0, None])  # (K, J-1, n, d)
        text = deep_text_features(self.backbone, self.layout, params["ctx"], deep)
        image = self.image_features(params, x, client_index)
        return clip_logits(self.backbone, image, text, client_index)
