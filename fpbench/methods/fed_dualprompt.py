"""Fed-DualPrompt: DualPrompt's G-prompt and key-selected E-prompts, trained with FedAvg.

DualPrompt (Wang, Zhang, Ebrahimi, Sun, Zhang, Lee, Ren, Su, Perot, Dy, Pfister; "DualPrompt:
Complementary Prompting for Rehearsal-free Continual Learning", ECCV 2022), federated with FedAvg
as FGPT's Fed-DualPrompt baseline, on a frozen ViT.

Client: a shared G-prompt at the first blocks and a pool of E-prompts at the next ones, with one
learned key per E-prompt. Each sample's query is the final cls token of the frozen ViT without
prompts; the E-prompt whose key has the highest cosine similarity is used for that sample (top-1).
DualPrompt picks the E-prompt by task identity during training; federated data have no tasks, so
the keys pick it in training as at test time, as in L2P. Loss: cross-entropy of a linear head on
the final cls token plus `key_weight` * (1 - cos(query, selected key)), DualPrompt's matching
loss, which pulls the selected key towards its queries. Prompts are inserted as tokens (VPT-deep
style: each prompted block replaces the previous prompt tokens) rather than DualPrompt's default
prefix-tuning, which the backbone does not provide; the G- and E-prompt lengths must be equal.

Server: FedAvg of everything (G-prompt, E-prompt pool, keys, head) by client train size. The
aggregation also records FGPT Table 11's prompt similarities with the G-prompt as the shared
prompt and the E-prompts as the group prompts (`sim_shared_prompt`: across the clients' trained
G-prompts; `sim_group_prompt_global`: among the aggregated E-prompts; `sim_group_prompt_local`:
per E-prompt across the clients that selected it, see `fpbench.methods.fgpt`).

Defaults from DualPrompt's Split CIFAR-100 configuration: G-prompt length 5 at blocks 0-1,
E-prompts of length 5 at blocks 2-4, pool size 10, top-1 selection, matching-loss weight 1.
For backbones other than 12 blocks the default blocks scale with depth (blocks [0, 2D/12) and
[2D/12, 5D/12), at least one each). DualPrompt trains with Adam (lr 0.03, grad-norm clip 1).
Prompts start from VPT's uniform init and keys from U(-1, 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import (
    Context,
    Method,
    MethodConfig,
    Output,
    ServerState,
    TaskInfo,
    Updates,
)
from fpbench.methods.fgpt import (
    SIMILARITIES,
    finite_similarities,
    prompt_similarities,
)
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear
from fpbench.methods.keys import group_counts, key_cosines
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from fpbench.backbones import PromptedViT


class DualPromptConfig(MethodConfig):
    g_len: int = Field(5, ge=1, description="G-prompt tokens per block")
    g_layers: tuple[int, ...] | None = Field(None, description="G-prompt blocks (None: 0-1)")
    e_len: int = Field(5, ge=1, description="E-prompt tokens per block (must equal g_len)")
    e_layers: tuple[int, ...] | None = Field(None, description="E-prompt blocks (None: 2-4)")
    pool_size: int = Field(10, ge=1, description="number of E-prompts (and keys)")
    key_weight: float = Field(1.0, ge=0, description="weight of the key matching loss")


def default_layers(depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """DualPrompt's blocks for ViT-B (G: 0-1, E: 2-4) scaled to `depth` blocks."""
    if depth < 2:
        raise FpbenchError(f"fed-dualprompt needs a backbone of at least 2 blocks, got {depth}")
    g_end = max(1, round(2 * depth / 12))
    e_end = min(depth, max(g_end + 1, round(5 * depth / 12)))
    return tuple(range(g_end)), tuple(range(g_end, e_end))


def select_prompts(keys: Tensor, query: Tensor, client_index: Tensor) -> tuple[Tensor, Tensor]:
    """Top-1 key per sample: keys (K, M, d), query (B, d) -> index (B,), cosine (B,)."""
    sim = key_cosines(F.normalize(query, dim=-1).to(keys.dtype), keys, client_index)  # (B, M)
    index = sim.argmax(-1)  # (B,)
    return index, sim.gather(1, index[:, None])[:, 0]


@METHODS.register()
class FedDualPrompt(Method):
    name = "fed-dualprompt"
    Config = DualPromptConfig

    def __init__(self, cfg: DualPromptConfig, backbone: PromptedViT, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        g_default, e_default = default_layers(backbone.depth)
        self.g_layers = cfg.g_layers if cfg.g_layers is not None else g_default
        self.e_layers = cfg.e_layers if cfg.e_layers is not None else e_default
        self._check()

    def _check(self) -> None:
        g, e, depth = self.g_layers, self.e_layers, self.backbone.depth
        if not g or not e or any(not 0 <= b < depth for b in g + e):
            raise FpbenchError(
                f"fed-dualprompt: g_layers {g} and e_layers {e} must be non-empty blocks in "
                f"[0, {depth}); fix them or leave them unset"
            )
        if set(g) & set(e) or len(set(g)) < len(g) or len(set(e)) < len(e):
            raise FpbenchError(f"fed-dualprompt: g_layers {g} and e_layers {e} must not repeat")
        if self.cfg.g_len != self.cfg.e_len:
            raise FpbenchError(
                f"fed-dualprompt: g_len {self.cfg.g_len} != e_len {self.cfg.e_len}; token "
                "prompts replace each other per block, so set them equal"
            )

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The prompts, keys and head; the similarity buffers start undefined (NaN)."""
        d, patch, cfg = self.backbone.embed_dim, self.backbone.patch_size, self.cfg
        g = torch.stack([init_prompts(gen, cfg.g_len, d, patch) for _ in self.g_layers])
        e = torch.stack(
            [
                torch.stack([init_prompts(gen, cfg.e_len, d, patch) for _ in self.e_layers])
                for _ in range(cfg.pool_size)
            ]
        )  # (M, Le, p, d)
        keys = torch.rand(cfg.pool_size, d, generator=gen) * 2 - 1  # (M, d)
        w, b = init_linear(gen, self.task.num_classes, d)
        params = {"g_prompts": g, "e_prompts": e, "e_keys": keys, "head_w": w, "head_b": b}
        return ServerState(params, buffers={n: torch.tensor(float("nan")) for n in SIMILARITIES})

    def query(self, x: Tensor) -> Tensor:
        """The frozen, unprompted backbone's final cls (B, d): what keys are matched against."""
        with torch.no_grad():
            return self.backbone.forward_features(x).cls

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Output:
        """Logits (B, C); in training, the key loss: each sample's weighted 1 - cosine with
        its selected key (B,)."""
        query = self.query(x)  # (B, d), unprompted: recalled
        index, match = select_prompts(params["e_keys"], query, client_index)
        stats = None
        if ctx.training:  # N_m^i of each row, for the similarity metrics
            rows, pool = params["e_keys"].shape[:2]
            stats = {"prompt_counts": group_counts(index, client_index, rows, pool)}  # (K, M)
        g = params["g_prompts"][client_index]  # (B, Lg, p, d)
        e = params["e_prompts"][client_index, index]  # (B, Le, p, d)
        prompts = {b: g[:, i] for i, b in enumerate(self.g_layers)}
        prompts.update({b: e[:, i] for i, b in enumerate(self.e_layers)})
        feats = self.backbone.forward_features(x, prompts, style="deep").cls  # (B, d)
        logits = per_client_linear(feats, params["head_w"], params["head_b"], client_index)
        aux = self.cfg.key_weight * (1 - match) if ctx.training else None
        return Output(logits, aux, stats)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained, stats = updates.params, updates.stats
        new = super().aggregate(server, updates)  # FedAvg
        e = trained["e_prompts"]  # (K, M, Le, p, d)
        counts = stats.get("prompt_counts", torch.zeros(e.shape[:2], device=e.device))
        sims = prompt_similarities(trained["g_prompts"], e, counts, new.params["e_prompts"])
        buffers = dict(new.buffers) | {k: v.to(e.device) for k, v in sims.items()}
        return ServerState(new.params, new.personal, buffers)

    def round_metrics(
        self, server: ServerState, test: Callable[..., tuple[Tensor, Tensor]] | None = None
    ) -> dict[str, float]:
        """FGPT Table 11's prompt similarities of the last aggregation (where defined)."""
        return finite_similarities(server.buffers)
