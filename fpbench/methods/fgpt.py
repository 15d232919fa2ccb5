"""FGPT and FGPT-U: shared prompts plus group prompts chosen by fixed orthogonal keys.

Deng, Thrampoulidis, Li, "Heterogeneous Federated Learning with Group-Aware Prompt Tuning"
(arXiv; fpbench copy: shared/papers/001_3c4383849fbd4dec.txt).

Client: VPT-shallow shared prompts (length 5) enter block 0; each sample's group g =
argmax_g cos(h(x), b_g) (eq. 5), where h(x) is the frozen backbone's final cls token (or a
lighter timm encoder's pooled feature, Table 10) and b_1..b_G are G fixed keys, orthogonal by
default (random in Table 4), never trained. The chosen group prompt (length 1) is inserted after
cls before the group layer and accumulates with the shared prompts (eq. 3); a linear head reads
the final cls (eq. 4). Shared prompts, group prompts and head all train with cross-entropy.
Server (Alg. 1): head and shared prompts by FedAvg over train sizes; group prompt g by weights
N_g^i / sum_i N_g^i, N_g^i = how often client i selected g this round (a group nobody selected
keeps its global value). FGPT predicts with the top-1 group (Alg. 2); FGPT-U averages the logits
of the top-K groups (Alg. 3, K = 5), running the blocks below the group layer once.

Layers are 0-based block indices. The paper inserts group prompts at its 6th layer L_6 (1-based,
L_1 = the first block), i.e. block 5 of ViT-B's 12; on other depths the default is
floor(5 * depth / 12). The aggregation also records Table 11's prompt similarities
(`sim_shared_prompt`, `sim_group_prompt_global`, `sim_group_prompt_local`; the shared one also
with G = 0, Table 11's "PT-FedAvg-share") in `server.buffers`, stored each round as metrics.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fpbench.backbones.recall import recalled
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
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear
from fpbench.methods.keys import group_counts, select_groups
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from fpbench.backbones import PromptedViT

PAPER_DEPTH = 12
PAPER_GROUP_BLOCK = 5  # the paper's L_6, 1-based


# Ablation presets: method args over the defaults (paper table in the name).
PRESETS: dict[str, dict[str, object]] = {
    # Table 4: PT-FedAvg (one group = prompts at both the shared and the group positions,
    # FedAvg; also Tables 1, 7, 8 and 11's "PT-FedAvg" per Table 11's text), + group prompts
    # with random keys, + orthogonal keys (= fgpt), + U-inference (= fgpt-u).
    "table4-pt-fedavg": {"num_groups": 1},
    "table4-group-random-keys": {"keys": "random"},
    "table4-orthogonal-keys": {},
    "table4-u-inference": {"topk": 5},
    # Table 3: number of groups.
    **{f"table3-groups-{g}": {"num_groups": g} for g in (15, 20, 25, 30, 35)},
    # Table 6: top-K of U-inference.
    "table6-u2": {"topk": 2},
    "table6-u5": {"topk": 5},
    # Table 10: a lighter Select encoder.
    "table10-resnet50": {"select_encoder": "resnet50"},
    # Table 11: shared prompts only (PT-FedAvg-share).
    "table11-shared-only": {"num_groups": 0},
}


class FGPTConfig(MethodConfig):
    PRESETS: ClassVar[dict[str, dict[str, object]]] = PRESETS
    preset: str | None = Field(
        None, description="a named setting of PRESETS; fields given explicitly override it"
    )

    num_groups: int = Field(
        20,
        ge=0,
        description="G group prompts and keys; paper default 20 (Table 3); 0 = shared only",
    )
    shared_prompt_len: int = Field(5, ge=1, description="VPT-shallow shared prompts; paper: 5")
    group_prompt_len: int = Field(1, ge=1, description="tokens per group prompt; paper: 1")
    group_layer: int | None = Field(
        None,
        ge=0,
        description="0-based block the group prompt enters; None = paper's L_6 (block 5 of 12), "
        "floor(5 * depth / 12) on other depths",
    )
    keys: Literal["orthogonal", "random"] = Field(
        "orthogonal", description="fixed keys: orthogonal (paper) or random Gaussian (Table 4)"
    )
    select_encoder: str = Field(
        "backbone",
        description="query encoder of Select: 'backbone' (frozen cls, paper) or a timm model "
        "name such as 'resnet50' (Table 10)",
    )
    query: Literal["frozen", "shared-prompted"] = Field(
        "frozen",
        description="Select's cls: the frozen model's (eq. 5, Alg. 2) or the one with the shared "
        "prompts (Fig. 1b's caption); 'backbone' select_encoder only",
    )
    select_pretrained: bool = Field(
        True, description="load pretrained weights for a timm select_encoder"
    )
    topk: int = Field(
        1, ge=1, description="groups whose logits are averaged at test time; 1 = FGPT"
    )


class FGPTUConfig(FGPTConfig):
    topk: int = Field(5, ge=1, description="top-K groups averaged at test time; paper: 5 (Table 6)")


# ---------------------------------------------------------------------------------------------
# the math, as small functions (unit-tested)


def make_keys(gen: torch.Generator, num: int, dim: int, kind: str) -> Tensor:
    """G fixed keys (G, dim): orthonormal rows (QR of a Gaussian), or Gaussian rows."""
    if kind == "random":
        return torch.randn(num, dim, generator=gen)
    if num > dim:
        raise FpbenchError(
            f"num_groups={num} orthogonal keys need num_groups <= key dimension {dim}; "
            "lower num_groups or use keys='random'"
        )
    q, _ = torch.linalg.qr(torch.randn(dim, num, generator=gen))  # (dim, G), orthonormal cols
    return q.T.contiguous()


def aggregate_groups(stacked: Tensor, counts: Tensor, previous: Tensor) -> Tensor:
    """Group prompts (G, ...) = sum_i N_g^i p_g^i / sum_i N_g^i; unselected groups keep `previous`.

    Args:
        stacked: (K, G, ...) the clients' trained group prompts.
        counts: (K, G) selection counts N_g^i.
        previous: (G, ...) the global group prompts sent this round.
    """
    total = counts.sum(0)  # (G,)
    beta = counts / total.clamp(min=1e-12)  # (K, G)
    mixed = torch.einsum("kg,kg...->g...", beta.to(stacked.dtype), stacked.detach())
    keep = (total == 0).view(-1, *[1] * (previous.dim() - 1))
    return torch.where(keep, previous, mixed)


def mean_pairwise_cosine(vectors: Tensor) -> Tensor:
    """Mean cosine similarity over pairs i < j of the rows of (n, D); NaN when n < 2."""
    n = vectors.shape[0]
    if n < 2:
        return torch.tensor(float("nan"))
    v = F.normalize(vectors.flatten(1).float(), dim=-1)
    sims = v @ v.T  # (n, n)
    iu = torch.triu_indices(n, n, offset=1)
    return sims[iu[0], iu[1]].mean()


def prompt_similarities(
    shared: Tensor, group: Tensor, counts: Tensor, global_group: Tensor
) -> dict[str, Tensor]:
    """FGPT Table 11: shared similarity, global and local group similarity.

    shared: across clients' locally trained shared prompts (K, S, d); global group: among the G
    aggregated group prompts (G, p, d); local group: for each group, across the clients that
    selected it, averaged over groups with at least two such clients.
    """
    local = [
        mean_pairwise_cosine(group[counts[:, g] > 0, g])
        for g in range(group.shape[1])
        if int((counts[:, g] > 0).sum()) >= 2
    ]
    return {
        "sim_shared_prompt": mean_pairwise_cosine(shared),
        "sim_group_prompt_global": mean_pairwise_cosine(global_group),
        "sim_group_prompt_local": torch.stack(local).mean() if local else torch.tensor(math.nan),
    }


SIMILARITIES = ("sim_shared_prompt", "sim_group_prompt_global", "sim_group_prompt_local")


def finite_similarities(buffers: dict[str, Tensor]) -> dict[str, float]:
    """The Table 11 similarities in `buffers` that are defined (NaN ones are not stored)."""
    values = {n: float(buffers[n]) for n in SIMILARITIES if n in buffers}
    return {n: v for n, v in values.items() if math.isfinite(v)}


def default_layer(paper_block: int, depth: int) -> int:
    """The paper's block on ViT-B (12 blocks) mapped to a backbone of `depth` blocks."""
    return min(depth - 1, math.floor(paper_block * depth / PAPER_DEPTH))


# ---------------------------------------------------------------------------------------------


class _TimmQuery:
    """A frozen timm encoder (e.g. ResNet-50) for Select, fed the ViT's preprocessed images."""

    def __init__(
        self,
        name: str,
        pretrained: bool,
        vit_mean: tuple[float, ...],
        vit_std: tuple[float, ...],
        device: torch.device,
    ) -> None:
        import timm

        try:
            with torch.random.fork_rng(devices=[]):  # a seeded init when not pretrained
                torch.manual_seed(0)
                model = timm.create_model(name, pretrained=pretrained, num_classes=0)
        except Exception as err:  # unknown name or weights unavailable
            raise FpbenchError(
                f"select_encoder {name!r} could not be built ({str(err).splitlines()[0][:200]}); "
                "use 'backbone' or a timm model name whose weights are available"
            ) from err
        self.model = model.requires_grad_(False).eval().to(device)
        self.kind = f"query-timm-{name}-{pretrained}"  # its frozen store's name
        cfg = model.pretrained_cfg or {}
        self.dim: int = model.num_features
        view = (1, 3, 1, 1)
        self.vit_mean = torch.tensor(vit_mean, device=device).view(view)
        self.vit_std = torch.tensor(vit_std, device=device).view(view)
        self.mean = torch.tensor(cfg.get("mean", (0.485, 0.456, 0.406)), device=device).view(view)
        self.std = torch.tensor(cfg.get("std", (0.229, 0.224, 0.225)), device=device).view(view)

    def __call__(self, x: Tensor) -> Tensor:
        """The query (B, dq) of the ViT's preprocessed images x: frozen, so recalled from the
        engine's store where x is its batch (`fpbench.backbones.recall`)."""
        return recalled(self.kind, self.encode, x)

    def encode(self, x: Tensor) -> Tensor:
        pixels = x * self.vit_std + self.vit_mean  # back to [0, 1]
        return self.model((pixels - self.mean) / self.std)  # (B, dq)


@METHODS.register()
class FGPT(Method):
    """FGPT: shared + group prompts by fixed orthogonal keys; top-1 group at test time."""

    name = "fgpt"
    Config = FGPTConfig
    inference = "global"

    def __init__(self, cfg: FGPTConfig, backbone: PromptedViT, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        depth = backbone.depth
        layer = cfg.group_layer
        self.group_layer = default_layer(PAPER_GROUP_BLOCK, depth) if layer is None else layer
        if not 0 <= self.group_layer < depth:
            raise FpbenchError(
                f"group_layer={self.group_layer} is outside the backbone's blocks [0, {depth}); "
                "give a 0-based block index"
            )
        if cfg.num_groups and cfg.topk > cfg.num_groups:
            raise FpbenchError(f"topk={cfg.topk} exceeds num_groups={cfg.num_groups}; lower topk")
        self.query_encoder = None
        if cfg.select_encoder != "backbone":
            device = next(backbone.parameters()).device
            self.query_encoder = _TimmQuery(
                cfg.select_encoder, cfg.select_pretrained, backbone.mean, backbone.std, device
            )
        self.key_dim = self.query_encoder.dim if self.query_encoder else backbone.embed_dim

    # -- parameters -------------------------------------------------------------------------
    def init_params(self, gen: torch.Generator) -> ServerState:
        """The prompts and head; the group keys, selection counts and similarities (buffers)."""
        cfg, d, patch = self.cfg, self.backbone.embed_dim, self.backbone.patch_size
        params = {"shared_prompts": init_prompts(gen, cfg.shared_prompt_len, d, patch)}
        if cfg.num_groups:
            params["group_prompts"] = torch.stack(
                [init_prompts(gen, cfg.group_prompt_len, d, patch) for _ in range(cfg.num_groups)]
            )  # (G, p, d)
        params["head_w"], params["head_b"] = init_linear(gen, self.task.num_classes, d)
        buffers = {}
        if g := cfg.num_groups:
            buffers["keys"] = make_keys(gen, g, self.key_dim, cfg.keys)  # (G, dq)
            buffers["selection_counts"] = torch.zeros(g)
        buffers.update({n: torch.tensor(math.nan) for n in SIMILARITIES})
        return ServerState(params, buffers=buffers)

    # -- math -------------------------------------------------------------------------------
    def query(self, x: Tensor) -> Tensor:
        """The frozen query (B, dq): the unprompted backbone's final cls, or the timm encoder's."""
        with torch.no_grad():
            if self.query_encoder is not None:
                return self.query_encoder(x)
            return self.backbone.forward_features(x).cls

    def select_query(self, x: Tensor, shared: Tensor, ctx: Context) -> Tensor:
        """Select's query (B, dq): frozen (recalled by the backbone or the timm encoder), or
        shared-prompted."""
        with torch.no_grad():
            if self.cfg.query == "shared-prompted" and self.query_encoder is None:
                return self.backbone.forward_features(x, {0: shared.detach()}, "accumulate").cls
            return self.query(x)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits (B, C); in training, with each row's group picks `group_counts` (K, G)."""
        shared = params["shared_prompts"][client_index]  # (B, S, d)
        if not self.cfg.num_groups:
            cls = self.backbone.forward_features(x, {0: shared}, style="accumulate").cls
            return per_client_linear(cls, params["head_w"], params["head_b"], client_index)
        k = 1 if ctx.training else self.cfg.topk
        top = select_groups(self.select_query(x, shared, ctx), ctx.buffers["keys"], k)  # (B, k)
        logits = self._grouped_logits(params, x, shared, client_index, top)
        if not ctx.training:
            return logits
        rows = params["shared_prompts"].shape[0]
        counts = group_counts(top[:, 0], client_index, rows, self.cfg.num_groups)  # (K, G)
        return Output(logits, stats={"group_counts": counts})

    def _grouped_logits(
        self,
        params: dict[str, Tensor],
        x: Tensor,
        shared: Tensor,
        client_index: Tensor,
        top: Tensor,
    ) -> Tensor:
        """Mean over the k selected groups of the logits; blocks below the group layer run once."""
        vit, u = self.backbone, self.group_layer
        b, k = top.shape
        tokens, _, n = vit.run_blocks(vit.embed(x), 0, u, {0: shared}, "accumulate")
        rows = client_index.repeat_interleave(k)  # (B*k,)
        group = params["group_prompts"][rows, top.flatten()]  # (B*k, p, d)
        if u == 0:  # both enter block 0: [cls, group, shared, patches] as in eq. 3
            group = torch.cat([group, shared.repeat_interleave(k, 0)], dim=1)
        tokens = tokens.repeat_interleave(k, 0)  # (B*k, T, d)
        tokens, _, n = vit.run_blocks(tokens, u, vit.depth, {u: group}, "accumulate", n)
        cls = vit.finish(tokens, n).cls  # (B*k, d)
        logits = per_client_linear(cls, params["head_w"], params["head_b"], rows)  # (B*k, C)
        return logits.view(b, k, -1).mean(1)

    # -- server -----------------------------------------------------------------------------
    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained, stats = updates.params, updates.stats
        params = super().aggregate(server, updates).params  # FedAvg
        buffers = dict(server.buffers)
        device = trained["head_w"].device
        sims = {"sim_shared_prompt": mean_pairwise_cosine(trained["shared_prompts"])}
        if self.cfg.num_groups:
            counts = stats["group_counts"].to(trained["head_w"].dtype)  # (K, G)
            old = server.params["group_prompts"]
            params["group_prompts"] = aggregate_groups(trained["group_prompts"], counts, old)
            buffers["selection_counts"] = counts.sum(0)
            sims = prompt_similarities(
                trained["shared_prompts"], trained["group_prompts"], counts, params["group_prompts"]
            )
        buffers.update({k: v.to(device) for k, v in sims.items()})
        return ServerState(params, server.personal, buffers)

    def round_metrics(
        self, server: ServerState, test: Callable[..., tuple[Tensor, Tensor]] | None = None
    ) -> dict[str, float]:
        """Table 11's prompt similarities of the last aggregation (where defined)."""
        return finite_similarities(server.buffers)

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Down: the trainable weights (keys are fixed and known to every client, not resent).

        Up: the trained weights plus the client's group selection counts N_g^i (G,).
        """
        up = dict(server.params)
        if "selection_counts" in server.buffers:
            up["selection_counts"] = server.buffers["selection_counts"]
        return server.params, up


@METHODS.register()
class FGPTU(FGPT):
    """FGPT-U: FGPT's training; test-time mean of the top-K groups' logits (K = 5)."""

    name = "fgpt-u"
    Config = FGPTUConfig
