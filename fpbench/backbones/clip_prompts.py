"""Prompt pieces for the CLIP backbone: CoOp's text prompt layout and pixel-space prompts.

* `PromptLayout`: CoOp's prompt learner without its parameters (Zhou et al., IJCV 2022): the
  tokenised template "SOT X..X name . EOT", its frozen prefix/suffix embeddings, and
  `assemble(ctx)` for the class token at the end, middle or front, with generic (K, n, d) or
  class-specific (K, C, n, d) context; `text_features` runs the frozen text encoder on them.
* `PixelPrompter`: the padding, fixed-patch and random-patch visual prompts of Bahng et al.
  ("Exploring Visual Prompts for Adapting Large-Scale Models", 2022), added to the normalised
  image.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP


def clean_name(name: str) -> str:
    return name.replace("_", " ").strip()


@dataclass
class PromptLayout:
    """CoOp's tokenised class prompts "SOT ctx_1..ctx_n name . EOT" and their frozen parts.

    Attributes:
        n_ctx: Number of context tokens.
        position: Where the class name goes: "end", "middle" (after ctx[:n//2]) or "front".
        ids: (C, L) token ids of "X .. X name." (EOT at 1 + n_ctx + len(name) + 1 for every
            position; text pooling reads it from here).
        prefix: (C, 1, d) SOT embedding; suffix: (C, L - 1 - n_ctx, d) the rest.
        order: (C, L - 1) where each position after SOT reads from cat(ctx, suffix).
        name_lens: (C,) BPE length of each class name.
    """

    n_ctx: int
    position: str
    ids: Tensor
    prefix: Tensor
    suffix: Tensor
    order: Tensor
    name_lens: list[int] = field(default_factory=list)

    @classmethod
    def build(
        cls, clip: PromptedCLIP, class_names: list[str], n_ctx: int, position: str = "end"
    ) -> PromptLayout:
        """Tokenise the class prompts; raise if a prompt would exceed the token budget."""
        with torch.no_grad():
            if position not in ("end", "middle", "front"):
                raise FpbenchError(f"class_token_position {position!r}: use end, middle or front")
            names = [clean_name(n) for n in class_names]
            lens = [len(clip.tokenizer.encode(n)) for n in names]
            budget = clip.context_length
            longest = max(range(len(names)), key=lambda c: lens[c])
            if 1 + n_ctx + lens[longest] + 2 > budget:
                raise FpbenchError(
                    f"prompt of {n_ctx} context tokens + class {names[longest]!r} "
                    f"({lens[longest]} tokens) exceeds CLIP's {budget}-token budget; "
                    f"use at most {budget - 3 - lens[longest]} context tokens"
                )
            ids = clip.tokenize([" ".join(["X"] * n_ctx + [n]) + "." for n in names])  # (C, L)
            eot = ids.argmax(-1).tolist()
            if eot != [1 + n_ctx + n + 1 for n in lens]:
                raise FpbenchError("class names did not tokenise as expected; check the names")
            emb = clip.token_embed(ids).float()  # (C, L, d)
            return cls(
                n_ctx=n_ctx,
                position=position,
                ids=ids,
                prefix=emb[:, :1],
                suffix=emb[:, 1 + n_ctx :],
                order=_order(n_ctx, lens, ids.shape[1] - 1, position).to(ids.device),
                name_lens=lens,
            )

    @property
    def num_classes(self) -> int:
        return self.ids.shape[0]

    def assemble(self, ctx: Tensor) -> Tensor:
        """Prompt embeddings (K, C, L, d) from ctx (K, n, d) generic or (K, C, n, d) per class."""
        c, n = self.num_classes, self.n_ctx
        if ctx.ndim == 3:
            ctx = ctx.unsqueeze(1).expand(-1, c, -1, -1)  # (K, C, n, d)
        if ctx.shape[1:3] != (c, n):
            raise ValueError(f"ctx must be (K, [C={c},] n={n}, d), got {tuple(ctx.shape)}")
        k, d = ctx.shape[0], ctx.shape[-1]
        suffix = self.suffix.to(ctx.dtype).expand(k, -1, -1, -1)  # (K, C, L-1-n, d)
        body = torch.cat([ctx, suffix], dim=2)  # (K, C, L-1, d)
        index = self.order.view(1, c, -1, 1).expand(k, -1, -1, d)
        body = body.gather(2, index)
        return torch.cat([self.prefix.to(ctx.dtype).expand(k, -1, -1, -1), body], dim=2)

    def text_features(self, clip: PromptedCLIP, ctx: Tensor) -> Tensor:
        """L2-normalised text features (K, C, E) of the prompts built from ctx."""
        emb = self.assemble(ctx)  # (K, C, L, d)
        k, c = emb.shape[:2]
        ids = self.ids.repeat(k, 1)  # (K*C, L)
        feats = clip.encode_prompts(emb.flatten(0, 1), ids, truncate=True)  # (K*C, E)
        return F.normalize(feats.float(), dim=-1).view(k, c, -1)


def _order(n_ctx: int, lens: list[int], length: int, position: str) -> Tensor:
    """(C, length) source index into cat(ctx (n), suffix) for each position after SOT."""
    rows = []
    for name_len in lens:
        ctx = list(range(n_ctx))
        name = list(range(n_ctx, n_ctx + name_len))
        rest = list(range(n_ctx + name_len, n_ctx + length - n_ctx))
        if position == "end":
            row = ctx + name + rest
        elif position == "front":
            row = name + ctx + rest
        else:
            half = n_ctx // 2
            row = ctx[:half] + name + ctx[half:] + rest
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def init_context(
    clip: PromptedCLIP, gen: torch.Generator, n_ctx: int, phrase: str | None = None
) -> Tensor:
    """CoOp's context init: N(0, 0.02^2) (n_ctx, d), or the embeddings of a phrase's tokens."""
    if not phrase:
        return torch.randn(n_ctx, clip.ctx_dim, generator=gen) * 0.02
    ids = clip.tokenize([phrase])  # (1, L)
    n = int(ids.argmax(-1)) - 1
    with torch.no_grad():
        return clip.token_embed(ids)[0, 1 : 1 + n].float().cpu().clone()  # (n, d)


def phrase_length(clip: PromptedCLIP, phrase: str) -> int:
    return len(clip.tokenizer.encode(phrase))


# ---------------------------------------------------------------------------------------------
# Pixel-space visual prompts (Bahng et al.)


class PixelPrompter:
    """Which pixels a visual prompt of a given pattern owns; renders (B, 3, S, S) prompts.

    The learnable tensor is (3, P): P pixels per channel in row-major order. `padding` owns a
    frame `size` pixels wide, `fixed_patch` a size x size patch at the top-left corner,
    `random_patch` a size x size patch placed at a uniformly drawn position for every sample.
    """

    def __init__(self, pattern: str, image_size: int, size: int) -> None:
        s = image_size
        if pattern == "padding" and not 0 < 2 * size < s:
            raise FpbenchError(f"padding prompt size {size} must be in [1, {(s - 1) // 2}]")
        if pattern in ("fixed_patch", "random_patch") and not 0 < size <= s:
            raise FpbenchError(f"patch prompt size {size} must be in [1, {s}]")
        if pattern not in ("padding", "fixed_patch", "random_patch"):
            raise FpbenchError(f"visual prompt pattern {pattern!r}: padding, fixed_patch, ...")
        self.pattern, self.image_size, self.size = pattern, s, size
        r = torch.arange(s).view(-1, 1)
        c = torch.arange(s).view(1, -1)
        if pattern == "padding":
            mask = (r < size) | (r >= s - size) | (c < size) | (c >= s - size)
        else:
            mask = (r < size) & (c < size)
        self.index = mask.flatten().nonzero().flatten()  # (P,) at the top-left for patches

    @property
    def num_pixels(self) -> int:
        return int(self.index.numel())

    def init(self, gen: torch.Generator) -> Tensor:
        """Bahng's init: standard normal (3, P)."""
        return torch.randn(3, self.num_pixels, generator=gen)

    def render(self, prompt: Tensor, gen: torch.Generator | None = None) -> Tensor:
        """(B, 3, P) per-sample prompts -> (B, 3, S, S) images, zero outside the pattern."""
        b, s = prompt.shape[0], self.image_size
        index = self.index.to(prompt.device).expand(b, -1)  # (B, P)
        if self.pattern == "random_patch":
            high = s - self.size + 1
            rc = torch.randint(0, high, (b, 2), generator=gen, device=gen.device if gen else None)
            index = index + (rc[:, :1] * s + rc[:, 1:]).to(prompt.device)  # (B, P)
        out = prompt.new_zeros(b, 3, s * s)
        out = out.scatter(2, index.unsqueeze(1).expand(-1, 3, -1), prompt)
        return out.view(b, 3, s, s)
