"""A frozen timm VisionTransformer that takes per-sample prompt tokens at any layer.

The forward pass is rebuilt from timm's public stages (`patch_embed`, `_pos_embed`,
`patch_drop`, `norm_pre`, `blocks`, `norm`); the timm model itself is never patched. With no
prompts the output equals timm's `forward_features` (tested).

Prompt styles, for `prompts[l]` of shape (B, p_l, d) given before block l (0-based):

* ``accumulate`` (SGPT's reference code): insert right after the prefix (cls) tokens and never
  remove, so the sequence grows; the most recent insertion sits first after cls.
* ``deep`` (VPT-deep): replace the prompt tokens currently in the sequence (insert if none);
  every layer's prompts must have the same length.
* ``shallow`` (VPT-shallow): layer 0 only; same as ``accumulate`` there.

`fpbench.backbones.catalog.BackboneSpec` builds it for a registered backbone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpbench.backbones.frozen_linear import freeze_linears
from fpbench.backbones.recall import (
    Recall,
    _Site,
    autocast_key,
    current,
    flat_prompts,
    recalled,
    shared_forward,
    shared_site,
)

if TYPE_CHECKING:
    from timm.models.vision_transformer import VisionTransformer

PromptStyle = Literal["accumulate", "deep", "shallow"]
STYLES: tuple[str, ...] = ("accumulate", "deep", "shallow")


@dataclass
class ViTFeatures:
    """Outputs of `PromptedViT.forward_features`.

    Attributes:
        tokens: (B, T, d) all tokens after the final norm.
        cls: (B, d) the cls token after the final norm (`tokens[:, 0]`).
        prompt_tokens: (B, P, d) final-normed outputs at the prompt positions (P may be 0).
        layer_cls: block index l -> (B, d) cls token output by block l (before the final norm).
    """

    tokens: Tensor
    cls: Tensor
    prompt_tokens: Tensor
    layer_cls: dict[int, Tensor] = field(default_factory=dict)


def preprocess_images(
    images: Tensor, size: int, mean: tuple[float, ...], std: tuple[float, ...]
) -> Tensor:
    """uint8 (B, 3, H, W) -> normalized float32 (B, 3, size, size), on the images' device.

    Bilinear resize with half-pixel centres (align_corners=False), antialiased when shrinking.
    """
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(
            f"expected uint8 images (B, 3, H, W), got {images.dtype} {tuple(images.shape)}"
        )
    x = images.to(torch.float32) / 255.0  # (B, 3, H, W)
    h, w = x.shape[-2:]
    if (h, w) != (size, size):
        shrink = h > size or w > size
        x = F.interpolate(
            x, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink
        )
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - m) / s


class PromptedViT(nn.Module):
    """A frozen, always-eval timm ViT whose blocks accept per-sample prompt tokens.

    Attributes: `embed_dim`, `depth`, `num_prefix_tokens`, `img_size`, `patch_size` (ints),
    `mean`, `std` (normalization tuples), `name` (registry name), `vit` (the timm model).

    Args:
        model: A timm `VisionTransformer` with a class token.
        name: The registry name this backbone was built from.
        mean: Per-channel normalization mean (default: the model's pretrained_cfg).
        std: Per-channel normalization std (default: the model's pretrained_cfg).
    """

    def __init__(
        self,
        model: VisionTransformer,
        name: str = "",
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
    ) -> None:
        from timm.models.vision_transformer import VisionTransformer

        super().__init__()
        if not isinstance(model, VisionTransformer) or model.cls_token is None:
            raise ValueError("PromptedViT needs a timm VisionTransformer with a class token")
        if getattr(model, "dynamic_img_size", False):
            raise ValueError("PromptedViT needs a fixed input size (dynamic_img_size=False)")
        self.vit = freeze_linears(model.requires_grad_(False))
        self.name = name
        self.embed_dim: int = model.embed_dim
        self.depth: int = len(model.blocks)
        self.num_prefix_tokens: int = model.num_prefix_tokens
        self.img_size: int = _square_size(model.patch_embed.img_size)
        self.patch_size: int = _square_size(model.patch_embed.patch_size)
        cfg = getattr(model, "pretrained_cfg", None) or {}
        self.mean = tuple(float(v) for v in (mean or cfg.get("mean", (0.5, 0.5, 0.5))))
        self.std = tuple(float(v) for v in (std or cfg.get("std", (0.5, 0.5, 0.5))))
        self._bf16_blocks: list[nn.ModuleList] = []  # unregistered: not in any state_dict
        self.train(False)

    def hold_bf16_blocks(self) -> None:
        """Keep a bf16 copy of the frozen blocks; under bf16 autocast they then compute in bf16
        end to end (weights cast once, a bf16 residual stream, no per-op casts), where autocast
        alone keeps the residual stream and layer norms in fp32. Frozen passes (autocast off)
        still run the fp32 blocks. `runtime.precision = "bf16-frozen"` asks for it."""
        if not self._bf16_blocks:
            self._bf16_blocks.append(copy.deepcopy(self.vit.blocks).to(torch.bfloat16))

    def blocks_for(self, tokens: Tensor) -> tuple[nn.ModuleList, Tensor, bool]:
        """The blocks to run `tokens` through, the tokens in their dtype, and whether autocast
        must be off around them (the bf16 copy under bf16 autocast)."""
        if self._bf16_blocks and _bf16_autocast(tokens.device.type):
            return self._bf16_blocks[0], tokens.to(torch.bfloat16), True
        return self.vit.blocks, tokens, False

    def _apply(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202  (nn.Module's signature)
        """`.to(device)` and friends reach the unregistered bf16 copy too (its dtype stays)."""
        out = super()._apply(fn, *args, **kwargs)
        for blocks in self._bf16_blocks:
            blocks._apply(lambda t: fn(t).to(t.dtype) if t.is_floating_point() else fn(t))
        return out

    def train(self, mode: bool = True) -> PromptedViT:
        """Stay in eval mode whatever is asked: dropout and drop-path never fire."""
        return super().train(False)

    def preprocess(self, images: Tensor) -> Tensor:
        """uint8 (B, 3, H, W) -> normalized float32 (B, 3, img_size, img_size), same device."""
        return preprocess_images(images, self.img_size, self.mean, self.std)

    def embed(self, x: Tensor) -> Tensor:
        """Preprocessed images (B, 3, S, S) -> the tokens entering block 0, (B, T0, d)."""
        vit = self.vit
        tokens = vit._pos_embed(vit.patch_embed(x))  # (B, T0, d): prefix + patches
        return vit.norm_pre(vit.patch_drop(tokens))

    def run_blocks(
        self,
        tokens: Tensor,
        start: int,
        end: int,
        prompts: Mapping[int, Tensor] | None = None,
        style: str = "accumulate",
        num_prompt_tokens: int = 0,
        return_layers: Iterable[int] = (),
    ) -> tuple[Tensor, dict[int, Tensor], int]:
        """Run blocks start..end-1, inserting prompts before each prompted block.

        Args:
            tokens: (B, T, d) hidden states entering block `start`.
            start: First block to run.
            end: One past the last block to run.
            prompts: layer -> (B, p_l, d) prompt tokens (batch 1 broadcasts); layers outside
                [start, end) are ignored, so a caller resuming from cached states may pass all.
            style: "accumulate", "deep" or "shallow" (see the module docstring).
            num_prompt_tokens: How many prompt tokens `tokens` already holds after the prefix.
            return_layers: Blocks in [start, end) whose output cls token to return.

        Returns:
            The hidden states after block end-1 (B, T', d), {l: (B, d) cls output by block l},
            and the number of prompt tokens now in the sequence.
        """
        prompts = dict(prompts or {})
        _check_prompts(prompts, style, self.depth, num_prompt_tokens)
        if not 0 <= start <= end <= self.depth:
            raise ValueError(f"need 0 <= start <= end <= depth={self.depth}, got {start}, {end}")
        wanted = set(return_layers)
        if not wanted <= set(range(start, end)):
            raise ValueError(f"return_layers {sorted(wanted)} outside blocks [{start}, {end})")
        layer_cls: dict[int, Tensor] = {}
        blocks, tokens, own = self.blocks_for(tokens) if start < end else (None, tokens, False)
        found = shared_site(tokens) if start < end else None
        with torch.autocast(tokens.device.type, enabled=False) if own else nullcontext():
            if found is not None:  # scoring many clients: shared states computed once
                args = (blocks, tokens, start, end, prompts, style, num_prompt_tokens, wanted)
                return self._run_shared(*found, *args)
            for layer in range(start, end):
                if layer in prompts:
                    tokens, num_prompt_tokens = self._insert(
                        tokens, prompts[layer], style, num_prompt_tokens
                    )
                tokens = blocks[layer](tokens)  # (B, T, d)
                if layer in wanted:
                    layer_cls[layer] = tokens[:, 0]  # (B, d)
        return tokens, layer_cls, num_prompt_tokens

    def _run_shared(
        self,
        site: _Site,
        slots: Tensor,
        blocks: nn.ModuleList,
        tokens: Tensor,
        start: int,
        end: int,
        prompts: dict[int, Tensor],
        style: str,
        n: int,
        wanted: set[int],
    ) -> tuple[Tensor, dict[int, Tensor], int]:
        """`run_blocks`'s loop where many clients' models score the same test samples: an item
        whose states entering the call and whose prompts so far equal (exactly) those stored
        for its sample takes the stored states; the others are computed, the first of each
        sample stored (`fpbench.backbones.recall.SharedStates`)."""
        batch = tokens.shape[0]
        fill, known = site.begin(slots)
        hit = site.same("in", slots, tokens, known)  # (B,) items riding the stored states
        live = (~hit).nonzero().squeeze(1)  # the computed items, in the order of `cur`
        cur = tokens[live]
        kept = site.store("in", slots[fill], tokens[fill]) if bool(fill.any()) else True
        where = torch.full((batch,), -1, dtype=torch.long, device=live.device)
        where[live] = torch.arange(len(live), device=live.device)
        fill_at = where[fill]  # positions in `cur` of the items stored (never moved)
        layer_cls: dict[int, Tensor] = {}
        last = "in"
        for layer in range(start, end):
            if layer in prompts:
                p = prompts[layer]
                p = p.expand(batch, -1, -1) if p.shape[0] == 1 else p
                name = f"p{layer}"
                still = hit & site.same(name, slots, p.to(tokens.dtype), known)
                broke = (hit & ~still).nonzero().squeeze(1)
                if len(broke):  # their prompts differ: computed from here on
                    cur = torch.cat([cur, site.get(last, slots[broke])])
                    live = torch.cat([live, broke])
                hit = still
                if bool(fill.any()):
                    kept = site.store(name, slots[fill], p[fill].to(tokens.dtype)) and kept
                cur, n = self._insert(cur, p[live], style, n)
            if len(cur):
                cur = blocks[layer](cur)  # (b, T, d)
            last = f"out{layer}"
            if len(fill_at):
                kept = site.store(last, slots[fill], cur[fill_at]) and kept
            if layer in wanted:
                layer_cls[layer] = self._assemble(site, last, slots, hit, live, cur)[:, 0]
        if bool(fill.any()):
            site.filled[slots[fill]] = kept
        return self._assemble(site, last, slots, hit, live, cur), layer_cls, n

    @staticmethod
    def _assemble(
        site: _Site, name: str, slots: Tensor, hit: Tensor, live: Tensor, cur: Tensor
    ) -> Tensor:
        """The batch's states (B, T, d): the computed rows `cur` at `live`, stored ones at hit."""
        if not len(live):
            return site.get(name, slots)
        out = cur.new_empty(len(hit), *cur.shape[1:])
        out[live] = cur
        if bool(hit.any()):
            out[hit] = site.get(name, slots[hit])
        return out

    def forward_features(
        self,
        x: Tensor,
        prompts: Mapping[int, Tensor] | None = None,
        style: str = "accumulate",
        return_layers: Iterable[int] = (),
    ) -> ViTFeatures:
        """Full prompted forward of preprocessed images x (B, 3, S, S).

        Frozen work is recalled, not redone (`fpbench.backbones.recall`): without prompts the
        features are read field by field as asked (`cls` and `layer_cls` from the engine's
        frozen store); with prompts, in a training phase, the hidden states entering the first
        block whose prompt requires grad come from the phase's states where the engine keeps
        them."""
        prompts = {k: v for k, v in (prompts or {}).items() if v is not None}
        layers = tuple(return_layers)
        if not prompts:
            if not set(layers) <= set(range(self.depth)):
                raise ValueError(f"return_layers {sorted(layers)} outside blocks [0, {self.depth})")
            return UnpromptedFeatures(self, x, layers)
        if not torch.is_grad_enabled():
            key = (id(self), style, layers, _signature(prompts), autocast_key(x))
            found_shared = shared_forward(x, key)
            if found_shared is not None:  # scoring many clients: shared forwards once
                return self._forward_shared(*found_shared, x, prompts, style, layers)
        found = current(x)
        if found is not None and found.states is not None and torch.is_grad_enabled():
            found.calls += 1
            start = min((k for k, v in prompts.items() if v.requires_grad), default=self.depth)
            if start > 0 and all(layer >= start for layer in layers):
                tokens = self._phase_states(found, x, prompts, style, start)
                return self.forward_from(tokens, start, prompts, style, layers)
        return self.forward_from(self.embed(x), 0, prompts, style, layers)

    def _forward_shared(
        self,
        site: _Site,
        slots: Tensor,
        x: Tensor,
        prompts: dict[int, Tensor],
        style: str,
        layers: tuple[int, ...],
    ) -> ViTFeatures:
        """`forward_features` where many clients' models score the same test samples (x is the
        engine's batch, so item i is the image of its sample): a batch whose every item's
        prompts equal (exactly) those stored for its sample takes the stored features; any
        other batch is computed (sharing what it can block by block, `_run_shared`), the first
        item of each sample stored."""
        fill, known = site.begin(slots)
        hit = known
        full = {k: p.expand(len(x), -1, -1) if p.shape[0] == 1 else p for k, p in prompts.items()}
        for layer in sorted(full):
            hit = hit & site.same(f"p{layer}", slots, full[layer], hit)
        if bool(hit.all()):
            first = self.num_prefix_tokens
            count = site.values["tokens"].shape[1] - first - self.vit.patch_embed.num_patches
            return StoredFeatures(site, slots, slice(first, first + count), layers)
        feats = self.forward_from(self.embed(x), 0, prompts, style, layers)
        if bool(fill.any()):
            at = slots[fill]
            kept = [site.store(f"p{k}", at, p, fill) for k, p in full.items()]
            kept.append(site.store("tokens", at, feats.tokens[fill]))
            kept.append(site.store("cls", at, feats.cls[fill]))
            kept += [site.store(f"cls{k}", at, feats.layer_cls[k][fill]) for k in layers]
            site.filled[at] = all(kept)
        return feats

    def _phase_states(
        self, found: Recall, x: Tensor, prompts: dict[int, Tensor], style: str, start: int
    ) -> Tensor:
        """The states entering block `start` of the batch x, kept for the phase."""
        assert found.states is not None and found.idx is not None and found.rows is not None
        lower = {k: v for k, v in prompts.items() if k < start}
        guard = flat_prompts(lower, len(x), x.device)

        def compute(mask: Tensor) -> Tensor:
            part = {k: v if v.shape[0] == 1 else v[mask] for k, v in lower.items()}
            return self.prefix(x[mask], start, part, style)

        key = (found.calls, start, style)
        return found.states.get(key, found.idx, found.rows, guard, compute)

    def unprompted(self, x: Tensor, return_layers: tuple[int, ...] = ()) -> ViTFeatures:
        """The unprompted forward of x, computed (never recalled)."""
        return self.forward_from(self.embed(x), 0, None, "accumulate", return_layers)

    def block_cls(self, x: Tensor, layer: int) -> Tensor:
        """The unprompted cls token (B, d) output by block `layer`, computed (never recalled)."""
        return self.run_blocks(self.embed(x), 0, layer + 1, return_layers=(layer,))[1][layer]

    def prefix(
        self,
        x: Tensor,
        end: int,
        prompts: Mapping[int, Tensor] | None = None,
        style: str = "accumulate",
    ) -> Tensor:
        """The hidden states (B, T, d) entering block `end` (`depth`: after the last block)."""
        return self.run_blocks(self.embed(x), 0, end, prompts, style)[0]

    def forward_from(
        self,
        tokens: Tensor,
        start: int,
        prompts: Mapping[int, Tensor] | None = None,
        style: str = "accumulate",
        return_layers: Iterable[int] = (),
    ) -> ViTFeatures:
        """Finish a forward from the hidden states (B, T, d) entering block `start`.

        The prompt tokens already in `tokens` are counted from its length; prompts of layers
        below `start` are ignored, so `forward_from(prefix(x, s, P), s, P)` equals
        `forward_features(x, P)`.
        """
        num_prompts = tokens.shape[1] - self.num_prefix_tokens - self.vit.patch_embed.num_patches
        tokens, layer_cls, num_prompts = self.run_blocks(
            tokens, start, self.depth, prompts, style, num_prompts, return_layers
        )
        return self.finish(tokens, num_prompts, layer_cls)

    def finish(
        self, tokens: Tensor, num_prompt_tokens: int, layer_cls: dict[int, Tensor] | None = None
    ) -> ViTFeatures:
        """Apply the final norm to the output of the last block and split the tokens."""
        tokens = self.vit.norm(tokens)  # (B, T, d)
        first = self.num_prefix_tokens
        return ViTFeatures(
            tokens=tokens,
            cls=tokens[:, 0],
            prompt_tokens=tokens[:, first : first + num_prompt_tokens],  # (B, P, d)
            layer_cls=layer_cls or {},
        )

    forward = forward_features

    def _insert(
        self, tokens: Tensor, prompt: Tensor, style: str, num_prompt_tokens: int
    ) -> tuple[Tensor, int]:
        """Put `prompt` (B, p, d) right after the prefix tokens; deep replaces old prompts."""
        batch, _, dim = tokens.shape
        if prompt.ndim != 3 or prompt.shape[0] not in (1, batch) or prompt.shape[2] != dim:
            raise ValueError(
                f"prompts must be (B={batch}, p, d={dim}) (or batch 1), got {tuple(prompt.shape)}"
            )
        prompt = prompt.to(tokens.dtype).expand(batch, -1, -1)  # (B, p, d)
        first = self.num_prefix_tokens
        rest = first + num_prompt_tokens if style == "deep" else first
        tokens = torch.cat([tokens[:, :first], prompt, tokens[:, rest:]], dim=1)
        kept = 0 if style == "deep" else num_prompt_tokens
        return tokens, kept + prompt.shape[1]


class StoredFeatures(ViTFeatures):
    """A shared forward's `ViTFeatures` taken from its site (`PromptedViT._forward_shared`),
    each field gathered for the batch's slots when first read."""

    def __init__(self, site: _Site, slots: Tensor, prompts: slice, layers: tuple[int, ...]) -> None:
        """prompts: where the prompt tokens sit among the tokens."""
        self.__dict__.update(_site=site, _slots=slots, _prompts=prompts, _layers=layers)

    def __getattr__(self, name: str):  # noqa: ANN204  (only the missing fields land here)
        site, slots = self.__dict__["_site"], self.__dict__["_slots"]
        if name == "cls":
            value = site.get("cls", slots)  # (B, d)
        elif name == "tokens":
            value = site.get("tokens", slots)
        elif name == "prompt_tokens":
            value = self.tokens[:, self.__dict__["_prompts"]]
        elif name == "layer_cls":
            value = {k: site.get(f"cls{k}", slots) for k in self.__dict__["_layers"]}
        else:
            raise AttributeError(name)
        self.__dict__[name] = value
        return value


class UnpromptedFeatures(ViTFeatures):
    """An unprompted forward's `ViTFeatures`, each field computed when first read: `cls` and
    `layer_cls` recalled (kinds "cls" and "block{l}-cls"), the tokens by one full pass."""

    def __init__(self, vit: PromptedViT, x: Tensor, return_layers: tuple[int, ...]) -> None:
        self.__dict__.update(_vit=vit, _x=x, _layers=return_layers)

    def __getattr__(self, name: str):  # noqa: ANN204  (only the missing fields land here)
        vit, x, layers = self.__dict__["_vit"], self.__dict__["_x"], self.__dict__["_layers"]
        if name == "cls":
            value = recalled("cls", lambda v: vit.unprompted(v).cls, x)
        elif name == "layer_cls":
            value = {
                layer: recalled(f"block{layer}-cls", lambda v, k=layer: vit.block_cls(v, k), x)
                for layer in layers
            }
        elif name in ("tokens", "prompt_tokens"):
            full = vit.unprompted(x, layers)
            self.__dict__.update(tokens=full.tokens, prompt_tokens=full.prompt_tokens)
            return self.__dict__[name]
        else:
            raise AttributeError(name)
        self.__dict__[name] = value
        return value


def _signature(prompts: Mapping[int, Tensor]) -> tuple:
    """What a forward's values depend on in its prompts besides their values: layers, shapes
    and dtypes (batch 1 and B alike)."""
    return tuple((k, tuple(p.shape[1:]), p.dtype) for k, p in sorted(prompts.items()))


def _bf16_autocast(device_type: str) -> bool:
    """Whether bf16 autocast is on for this device type (False on a torch without the query)."""
    try:
        on = torch.is_autocast_enabled(device_type)
        return on and torch.get_autocast_dtype(device_type) == torch.bfloat16
    except (AttributeError, TypeError):  # torch < 2.4
        return False


def _square_size(size: int | tuple[int, int]) -> int:
    if isinstance(size, int):
        return size
    if size[0] != size[1]:
        raise ValueError(f"PromptedViT needs square images and patches, got {tuple(size)}")
    return int(size[0])


def _check_prompts(
    prompts: dict[int, Tensor], style: str, depth: int, num_prompt_tokens: int
) -> None:
    """Raise ValueError for prompts that the style does not allow."""
    if style not in STYLES:
        raise ValueError(f"unknown prompt style {style!r}; use one of {', '.join(STYLES)}")
    bad = [layer for layer in prompts if not 0 <= layer < depth]
    if bad:
        raise ValueError(f"prompt layers {bad} outside blocks [0, {depth})")
    if style == "shallow" and set(prompts) - {0}:
        raise ValueError(f"shallow prompts go at layer 0 only, got layers {sorted(prompts)}")
    if style == "deep":
        lengths = {int(p.shape[1]) for p in prompts.values() if p.ndim == 3}
        if num_prompt_tokens and prompts:
            lengths.add(num_prompt_tokens)
        if len(lengths) > 1:
            raise ValueError(f"deep prompts need one length at every layer, got {sorted(lengths)}")
