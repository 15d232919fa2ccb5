"""A frozen open_clip CLIP with CoOp text prompts and Bahng-style pixel prompts.

Nothing in open_clip is patched: the text path is rebuilt from the model's public parts
(`token_embedding`, `positional_embedding`, `transformer`, `attn_mask`, `ln_final`,
`text_projection`, `text_global_pool`) and, fed the tokens' own embeddings, equals
`model.encode_text` exactly (tested). Images go through `model.encode_image`, optionally after
adding a pixel-space visual prompt to the normalised image.

Pieces:

* `PromptedCLIP`: the frozen model, `preprocess(uint8)` with CLIP's normalisation, `encode_image`,
  `encode_prompts` (prompt embeddings -> text features), `forward_features(x).cls` (image
  features, which the engine caches for methods that train no visual prompt), `logit_scale`
  (frozen, exp of the model's learned log scale).
* `fpbench.backbones.clip_prompts`: CoOp's prompt layout and Bahng et al.'s pixel prompts.
* `ClipSpec`: registered backbones. OpenAI weights (the quickgelu variants) load by name when
  online or from a local file; the tiny test configs are saved once as a seeded random checkpoint
  and loaded through the same open_clip file path.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpbench.backbones.frozen_linear import freeze_linears
from fpbench.backbones.smoke import default_cache_dir
from fpbench.backbones.vit import _first_line, _hub_reachable
from fpbench.errors import FpbenchError

# open_clip is imported where it is used: it imports torchvision and transformers (about 2.5 s
# on 2 cores), which registering these backbones and loading a suite do not need.

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_TINY_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "fpbench-clip-test": {
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8,
                       "head_width": 16},
        "text_cfg": _TINY_TEXT,
    },
    "fpbench-clip-test-rn": {
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
        "text_cfg": _TINY_TEXT,
    },
}  # fmt: skip


@dataclass
class ClipFeatures:
    """`forward_features` output; `cls` is the image feature (B, E), unnormalised."""

    cls: Tensor


class PromptedCLIP(nn.Module):
    """A frozen, always-eval open_clip CLIP with a prompt-aware text path.

    Attributes: `name`, `embed_dim` (joint space E), `ctx_dim` (token width d),
    `context_length`, `img_size`, `mean`, `std`, `tokenizer`, `model` (the open_clip CLIP).
    """

    family = "clip"

    def __init__(self, model: nn.Module, name: str = "", tokenizer: Any = None) -> None:
        import open_clip

        super().__init__()
        if not hasattr(model, "token_embedding") or not hasattr(model, "visual"):
            raise ValueError("PromptedCLIP needs an open_clip CLIP with its own text tower")
        self.model = freeze_linears(model.requires_grad_(False))
        self.name = name
        self.tokenizer = tokenizer or open_clip.get_tokenizer("ViT-B-16")
        self.ctx_dim: int = model.token_embedding.weight.shape[1]
        self.context_length: int = model.positional_embedding.shape[0]
        self.embed_dim: int = _joint_dim(model)
        size = model.visual.image_size
        self.img_size: int = int(size[0] if isinstance(size, (tuple, list)) else size)
        norm = getattr(model.visual, "preprocess_cfg", None) or {}  # the pretrained config's
        self.mean = tuple(float(v) for v in norm.get("mean", CLIP_MEAN))
        self.std = tuple(float(v) for v in norm.get("std", CLIP_STD))
        self.train(False)

    def train(self, mode: bool = True) -> PromptedCLIP:
        """Stay in eval mode whatever is asked (batch norm in RN50 stays frozen)."""
        return super().train(False)

    @property
    def logit_scale(self) -> float:
        """exp of the model's (frozen) log temperature: 100 for OpenAI weights."""
        return float(self.model.logit_scale.detach().exp())

    # -- images -----------------------------------------------------------------------------
    def preprocess(self, images: Tensor) -> Tensor:
        """uint8 (B, 3, H, W) -> CLIP-normalised float32 (B, 3, S, S) on the same device.

        Bicubic resize of the shorter side to S (antialiased when shrinking), centre crop.
        """
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 (B, 3, H, W), got {images.dtype} {images.shape}")
        x = images.to(torch.float32) / 255.0  # (B, 3, H, W)
        h, w = x.shape[-2:]
        s = self.img_size
        if (h, w) != (s, s):
            scale = s / min(h, w)
            size = (max(s, round(h * scale)), max(s, round(w * scale)))
            shrink = min(h, w) > s
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=shrink)
            top, left = (size[0] - s) // 2, (size[1] - s) // 2
            x = x[..., top : top + s, left : left + s].clamp(0.0, 1.0)
        m = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        sd = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - m) / sd

    def encode_image(self, x: Tensor, pixel_prompt: Tensor | None = None) -> Tensor:
        """Image features (B, E) of preprocessed x, plus an optional pixel prompt (B, 3, S, S)."""
        if pixel_prompt is not None:
            x = x + pixel_prompt.to(x.dtype)
        return self.model.encode_image(x)

    def encode_image_tokens(self, x: Tensor, pixel_prompt: Tensor | None = None) -> Tensor:
        """Projected image tokens (B, 1 + M, E): 0 is the pooled feature, 1.. the local ones.

        ViT: the patch tokens after `ln_post`, through `proj` (FedOTP's local features). RN:
        `attnpool`'s attention evaluated at every position (open_clip returns position 0 only).
        """
        if pixel_prompt is not None:
            x = x + pixel_prompt.to(x.dtype)
        visual = self.model.visual
        if hasattr(visual, "attnpool"):
            return _attnpool_all(visual.attnpool, _resnet_trunk(visual, x))
        pooled, tokens = visual._pool(visual.transformer(visual._embeds(x)))
        out = torch.cat([pooled.unsqueeze(1), tokens], dim=1)  # (B, 1 + M, width)
        return out @ visual.proj if visual.proj is not None else out

    def forward_features(self, x: Tensor) -> ClipFeatures:
        """Frozen image features of preprocessed images, as the engine's feature cache wants."""
        return ClipFeatures(cls=self.encode_image(x))

    forward = forward_features

    # -- text -------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> Tensor:
        """Token ids (N, context_length) on the model's device."""
        ids = self.tokenizer(texts, context_length=self.context_length)
        return ids.to(self.model.token_embedding.weight.device)

    def token_embed(self, ids: Tensor) -> Tensor:
        """Frozen token embeddings (N, L, d) of ids (N, L)."""
        return self.model.token_embedding(ids)

    def encode_prompts(self, embeds: Tensor, ids: Tensor, truncate: bool = False) -> Tensor:
        """Text features (N, E) of prompt embeddings (N, L, d); ids (N, L) locate EOT.

        With `truncate`, tokens after the last EOT are dropped: under the causal mask they never
        reach an EOT output, so the features agree with the full pass up to float rounding, at a
        fraction of the cost (prompts are ~10-30 of 77 tokens).
        """
        from open_clip.transformer import text_global_pool

        model = self.model
        cast = model.transformer.get_cast_dtype()
        n = int(ids.argmax(-1).max()) + 1 if truncate else ids.shape[1]
        embeds, ids = embeds[:, :n], ids[:, :n]
        x = embeds.to(cast) + model.positional_embedding[:n].to(cast)  # (N, n, d)
        mask = model.attn_mask[:n, :n] if model.attn_mask is not None else None
        x = model.transformer(x, attn_mask=mask)
        x = model.ln_final(x)
        pool = getattr(model, "text_pool_type", "argmax")
        x = text_global_pool(x, ids, pool, eos_token_id=getattr(model, "text_eos_id", None))
        proj = model.text_projection
        if proj is None:
            return x
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj  # (N, E)

    def encode_text(self, ids: Tensor) -> Tensor:
        """`encode_prompts` on the ids' own embeddings (= open_clip's `encode_text`)."""
        return self.encode_prompts(self.token_embed(ids), ids)


def _resnet_trunk(visual: nn.Module, x: Tensor) -> Tensor:
    x = visual.stem(x.to(visual.conv1.weight.dtype))
    for layer in (visual.layer1, visual.layer2, visual.layer3, visual.layer4):
        x = layer(x)
    return x  # (B, C, h, w)


def _attnpool_all(pool: nn.Module, x: Tensor) -> Tensor:
    """open_clip's AttentionPool2d, keeping the outputs at all 1 + h*w positions (B, 1+hw, E)."""
    x = x.flatten(2).permute(2, 0, 1)  # (hw, B, C)
    x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)  # (1 + hw, B, C)
    x = x + pool.positional_embedding[:, None, :].to(x.dtype)
    x, _ = F.multi_head_attention_forward(
        query=x, key=x, value=x, embed_dim_to_check=x.shape[-1], num_heads=pool.num_heads,
        q_proj_weight=pool.q_proj.weight, k_proj_weight=pool.k_proj.weight,
        v_proj_weight=pool.v_proj.weight, in_proj_weight=None,
        in_proj_bias=torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]),
        bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
        out_proj_weight=pool.c_proj.weight, out_proj_bias=pool.c_proj.bias,
        use_separate_proj_weight=True, training=False, need_weights=False,
    )  # fmt: skip
    return x.permute(1, 0, 2)  # (B, 1 + hw, E)


def _joint_dim(model: nn.Module) -> int:
    proj = model.text_projection
    if proj is None:
        return model.token_embedding.weight.shape[1]
    return proj.out_features if isinstance(proj, nn.Linear) else proj.shape[1]


# ---------------------------------------------------------------------------------------------
# Registry specs and weight loading


@dataclass(frozen=True)
class ClipSpec:
    """A registered CLIP backbone.

    Attributes:
        name: Registry name (e.g. "clip-vit-b16").
        model_name: open_clip architecture (OpenAI weights need the -quickgelu variants).
        description: One line for `fpbench list backbones`.
        pretrained: "openai" (open_clip's pretrained `tag`, or a local file), "seeded" (a tiny
            config: a seeded random init saved once to the cache and loaded from that file) or
            "file" (only a local weights file).
        tag: open_clip's pretrained tag ("openai", "laion2b_s34b_b79k", ...).
        hf_repo: Hugging Face repo of the open_clip weights, for the offline cache lookup.
        own_tokenizer: the architecture's own tokenizer (else ViT-B-16's, as OpenAI's CLIPs).
        seed: Seed of the random init.
    """

    name: str
    model_name: str
    description: str = ""
    pretrained: Literal["openai", "seeded", "file"] = "seeded"
    tag: str = "openai"
    hf_repo: str = ""
    own_tokenizer: bool = False
    seed: int = 0

    def create(
        self,
        weights: str | Path | None = None,
        cache_dir: Path | None = None,
        pretrained: bool = True,
    ) -> PromptedCLIP:
        """Build the frozen `PromptedCLIP`; see `fpbench.backbones.create_backbone`."""
        import open_clip

        _register_tiny_configs(cache_dir)
        if not pretrained:
            model = self._random()
        elif weights is not None:
            model = self._from_file(Path(weights).expanduser())
        elif self.pretrained == "seeded":
            model = self._from_file(self._seeded_file(cache_dir))
        elif self.pretrained == "file":
            raise FpbenchError(
                f"{self.name} names no pretrained tag: give backbone.weights = PATH, or a tag "
                f"(open_clip:{self.model_name}@TAG; `open_clip.list_pretrained()` lists them)"
            )
        else:
            model = self._from_openai()
        tokenizer = open_clip.get_tokenizer(self.model_name if self.own_tokenizer else "ViT-B-16")
        return PromptedCLIP(model, name=self.name, tokenizer=tokenizer)

    def _random(self) -> nn.Module:
        import open_clip

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return open_clip.create_model(self.model_name, pretrained=None)

    def _seeded_file(self, cache_dir: Path | None) -> Path:
        """The tiny model's seeded random weights, saved once as a state_dict file."""
        import open_clip

        cfg = json.dumps([TINY_CONFIGS.get(self.model_name), self.seed, open_clip.__version__])
        key = hashlib.sha256(cfg.encode()).hexdigest()[:12]
        path = (cache_dir or default_cache_dir()) / f"{self.name}-{key}.pth"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(self._random().state_dict(), tmp)
            tmp.replace(path)
        return path

    def _from_file(self, path: Path) -> nn.Module:
        import open_clip

        if not path.is_file():
            raise FpbenchError(
                f"backbone weights file {str(path)!r} for {self.name} does not exist; "
                "fix backbone.weights in the suite"
            )
        try:  # OpenAI's TorchScript archives (.pt) cannot load with weights_only=True
            return open_clip.create_model(
                self.model_name, pretrained=str(path), weights_only=path.suffix != ".pt"
            )
        except Exception as err:
            raise FpbenchError(
                f"weights file {str(path)!r} does not fit backbone {self.name} "
                f"({self.model_name}): {_first_line(err)}"
            ) from err

    def _from_openai(self) -> nn.Module:
        import open_clip

        cached = hf_cached_file(self.hf_repo)
        if cached is not None:
            return self._from_file(cached)
        if not _hub_reachable():
            raise FpbenchError(self._download_hint("no network, or HF_HUB_OFFLINE is set"))
        try:
            return open_clip.create_model(self.model_name, pretrained=self.tag)
        except Exception as err:
            raise FpbenchError(self._download_hint(_first_line(err))) from err

    def _download_hint(self, why: str) -> str:
        import open_clip

        cfg = open_clip.get_pretrained_cfg(self.model_name, self.tag) or {}
        url = f"https://huggingface.co/{self.hf_repo}/resolve/main/open_clip_model.safetensors"
        return (
            f"the {self.tag} weights of {self.name} ({self.model_name}) are missing ({why}); "
            f"download {url} (or {cfg.get('url', 'the OpenAI .pt archive')}) and set "
            f'backbone = {{ name = "{self.name}", weights = "PATH" }} in the suite'
        )


def hf_cached_file(repo: str) -> Path | None:
    """The open_clip weights of a Hugging Face repo if already in the local hub cache."""
    if not repo:
        return None
    from huggingface_hub import try_to_load_from_cache

    for name in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return Path(found)
    return None


def _register_tiny_configs(cache_dir: Path | None) -> None:
    """Make the tiny configs known to open_clip by its public `add_model_config` (once)."""
    import open_clip

    missing = [n for n in TINY_CONFIGS if n not in open_clip.list_models()]
    if not missing:
        return
    folder = (cache_dir or default_cache_dir()) / "open_clip_configs"
    folder.mkdir(parents=True, exist_ok=True)
    for name in missing:
        path = folder / f"{name}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(TINY_CONFIGS[name], indent=1))
        tmp.replace(path)
        open_clip.add_model_config(path)


CLIP_SPECS = (
    ClipSpec(
        name="clip-test",
        model_name="fpbench-clip-test",
        description="Test-sized CLIP (ViT 16 px, width 32, 2+2 layers), seeded random weights",
    ),
    ClipSpec(
        name="clip-test-rn",
        model_name="fpbench-clip-test-rn",
        description="Test-sized CLIP (ModifiedResNet 32 px, width 8), seeded random weights",
    ),
    ClipSpec(
        name="clip-vit-b16",
        model_name="ViT-B-16-quickgelu",
        description="CLIP ViT-B/16, OpenAI weights (QuickGELU)",
        pretrained="openai",
        hf_repo="timm/vit_base_patch16_clip_224.openai",
    ),
    ClipSpec(
        name="clip-rn50",
        model_name="RN50-quickgelu",
        description="CLIP RN50, OpenAI weights (QuickGELU)",
        pretrained="openai",
        hf_repo="timm/resnet50_clip.openai",
    ),
)
