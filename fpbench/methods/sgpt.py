"""SGPT: shared prompts, group prompts, a learned Select module and block coordinate descent.

Deng et al., "Unlocking the Potential of Prompt-Tuning in Bridging Generalized and Personalized
Federated Learning", CVPR 2024. Defaults follow the authors' public code (ubc-tea/SGPT, notes in
shared/specs/sgpt-reference-code.md) where it and the paper differ; the paper's readings are
options (field descriptions of `SGPTConfig`, preset "paper").

Versus FedAvg. Client: one block-coordinate-descent sweep, a fresh optimiser per block: phase
"shared" trains head + shared prompts (early blocks, no group prompts, head on cls); phase "group"
trains head + group prompts (higher blocks) + keys, shared prompts inserted but frozen. Select
embeds a sample with the frozen, unprompted backbone (cls after block `query_layer`, final norm,
ReLU, L2 normalisation) and picks the key with the smallest (1 - cos) * (q_g + eps), q_g the
accumulated selection frequency of group g; loss = CE - cos(query, chosen key). Server: FedAvg (by
train size) of head and shared prompts; group prompts P <- a_p P_old + (1 - a_p) FedAvg(P_c); keys
k_g <- a_k k_old + (1 - a_k) sum_c rho_cg k_cg, rho_cg = n_cg / sum_c n_cg from this round's
selection counts (uniform when that sum is at most `key_count_threshold`); the accumulated counts
are the server buffer `select_counts`. Inference is global: each sample takes its nearest key.

Executors: the reference code trains a round's clients one after another and each reads the
counts of those before it; the lockstep executor trains them together, where that cannot be
reproduced. The default therefore reads the counts of the round start (`select_counts =
"snapshot"`, identical under both executors); "sequential" is the reference's behaviour and needs
the reference executor (under lockstep it equals "snapshot").

Select's query does not depend on anything trained: it reads the unprompted backbone's cls
after block `query_layer`, which the backbone recalls from the engine's frozen store (computed
once per sample, when first needed; without a store, recomputed).

Metrics (`round_metrics`, switch `cluster_metric`, off by default: they cost two frozen passes,
so only the suites that report them turn them on): appendix D.2's congruence score of Fig. 6a.
Centralised k-means (G clusters, seeded) on the frozen queries of up to `cluster_samples` train
images of the training clients, computed once; every round each of those samples takes its nearest
current key, Acc_overlap = sum over k-means clusters of the largest fraction of the sample in one
of their groups, Q_kmeans = sum over classes of the largest fraction in one k-means cluster, and
congruence_kmeans = Acc_overlap / Q_kmeans. That literal order scores a Select that puts
everything in one group as Acc_overlap = 1, so `cluster_purity` (rows = Select's groups, columns
= k-means clusters; not in the paper) is recorded alongside to show such a collapse.

Table 4's acc_cluster is Select's clustering accuracy on the test set (Sec. 4.3, "Ablation on
Clustering Performance"): each test sample takes its nearest current key, and the groups are
scored against the samples' coarse labels under the best one-to-one matching of groups to coarse
classes (Hungarian; an unmatched group counts as wrong, so a collapse onto one group scores the
largest coarse class's share, 1/20 on CIFAR-100, the paper's 5.00 for FedAvg keys). The method
never holds the test split: the engine hands `round_metrics` its labels and a map over its
images (the queries' cls recalled, as for evaluation); datasets without coarse labels record no
acc_cluster.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import (
    Context,
    Method,
    MethodConfig,
    Output,
    Phase,
    ServerState,
    TaskInfo,
    Updates,
)
from fpbench.methods.clustering import cluster_accuracy, congruence, kmeans, overlap
from fpbench.methods.helpers import batched_queries, init_linear, init_prompts, per_client_linear
from fpbench.methods.keys import group_counts, key_cosines, nearest_group
from fpbench.methods.numerics import fp32
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from fpbench.backbones import PromptedViT, ViTFeatures

LEAKY_SLOPE = 0.01  # the reference's `--leaky` query activation
HEAD = ("head_w", "head_b")
SHARED_PHASE = (*HEAD, "shared_prompts")
GROUP_PHASE = (*HEAD, "group_prompts", "keys")

# Named settings: preset -> field overrides (explicit fields win over the preset).
SGPT_PRESETS: dict[str, dict[str, Any]] = {
    # SGPT Table 3 (prompts and local schedule). "Share" is FedVPT-D (its values are Table 1's
    # FedVPT-D s = 10 row): a VPT-uniform prompt at every block, replaced block to block, head
    # on cls, FedAvg, one phase
    "shared-only": {
        "shared_layers": "all",
        "group_layers": (),
        "prompt_style": "deep",
        "shared_init": "uniform",
    },
    "group-only": {"shared_layers": ()},
    "shared-group-joint": {"schedule": "joint"},
    "bcd-inverted": {"schedule": "bcd-inverted"},
    "bcd": {},
    # SGPT Table 4 (learning Select's keys), read from sec. 4.3 and appendix B.2: "FedAvg" learns
    # the keys with plain FedAvg (sample-size weights, plain nearest-key Select, no momentum);
    # "w/ qg" adds the selection probability q_g, i.e. Eq. 6's weighted Select and B.2's key
    # weights N_g^i / sum_i N_g^i from the selection counts; "w/ momentum and qg" adds Eq. 7's
    # momentum on keys and group prompts, which is SGPT itself. (The other reading, q_g in Select
    # only with keys still FedAvg'd, is `key_weighting = "samples"`.)
    "keys-fedavg": {
        "select_weighting": "none",
        "key_weighting": "samples",
        "key_momentum": 0.0,
        "group_momentum": 0.0,
    },
    "keys-qg": {"key_momentum": 0.0, "group_momentum": 0.0},
    "keys-qg-momentum": {},
    # the reference's other train.sh settings (ViT-B/16), and the paper's readings
    "cifar-s50": {"shared_layers": (0, 1, 2, 3, 4), "group_layers": (5, 6)},
    "office": {
        "num_groups": 4,
        "shared_layers": (0, 1, 2, 3, 4),
        "group_layers": (5, 6),
        "query_layer": 5,
        "batch_majority": True,
        "key_momentum": 0.0,
    },
    "paper": {
        "shared_layers": (0, 1, 2),
        "group_layers": (3, 4, 5),
        "head_pooling": "cls-group-shared",
        "key_count_threshold": 0,
    },
}


class SGPTConfig(MethodConfig):
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = SGPT_PRESETS
    preset: str | None = Field(
        None, description="a named setting of PRESETS; fields given explicitly override it"
    )
    num_groups: int = Field(20, ge=1, description="G groups/keys (reference: CIFAR 20, Office 4)")
    shared_layers: tuple[int, ...] | Literal["all"] | None = Field(
        None,
        description="0-based blocks with a shared prompt; () none; 'all' every block. None: the "
        "reference layout scaled to the depth, the first max(1, depth // 3) blocks (0-3 on "
        "ViT-B, as train.sh)",
    )
    group_layers: tuple[int, ...] | None = Field(
        None,
        description="0-based blocks with a group prompt; () none. None: the max(1, depth // 4) "
        "blocks after the shared ones (4-6 on ViT-B, as train.sh; the paper's 1-based 'layers "
        "4-6' are 3-5, preset 'paper')",
    )
    prompt_len: int = Field(1, ge=1, description="tokens per prompted block (paper, reference: 1)")
    prompt_style: Literal["accumulate", "deep"] = Field(
        "accumulate",
        description="accumulate: tokens stay in the sequence (reference code); deep: each "
        "block's prompts replace the previous ones (VPT-deep)",
    )
    head_pooling: Literal["cls-group", "cls-group-shared", "cls"] = Field(
        "cls-group",
        description="head input: mean of cls + group-token outputs (reference since 2024-07), "
        "of cls + group + shared tokens (code of the paper's time), or cls only; a phase "
        "without selection has no group tokens",
    )
    shared_init: Literal["zero", "uniform"] = Field(
        "zero", description="shared prompt init: zeros (reference) or VPT uniform"
    )
    group_init: Literal["uniform", "zero"] = Field(
        "uniform", description="group prompt init: VPT uniform (reference) or zeros (no initial_g)"
    )
    query_layer: int | None = Field(
        None,
        description="0-based block whose cls (after the final norm) is Select's query; None: "
        "the last (label heterogeneity); 5 = the 6th block (feature heterogeneity)",
    )
    query_activation: Literal["relu", "leaky-relu"] = Field(
        "relu", description="before L2 normalisation: ReLU (reference) or leaky ReLU 0.01"
    )
    select_weighting: Literal["frequency", "none"] = Field(
        "frequency", description="training-time score (1 - cos) * (q_g + eps), or plain 1 - cos"
    )
    select_eps: float = Field(
        5e-4, ge=0, description="eps added to q_g (reference 5e-4; the paper's Eq. 6 has none)"
    )
    select_counts: Literal["snapshot", "sequential"] = Field(
        "snapshot",
        description="q_g from the counts at round start (executor-independent), or also from "
        "the clients trained earlier in the round (reference code; reference executor only, "
        "under lockstep it equals snapshot)",
    )
    batch_majority: bool = Field(
        False, description="training: move each client batch to its majority group (Office)"
    )
    key_loss_weight: float = Field(1.0, ge=0, description="weight of -cos(query, chosen key)")
    schedule: Literal["bcd", "bcd-inverted", "joint"] = Field(
        "bcd",
        description="bcd: shared phase then group phase (local_epochs each); bcd-inverted: "
        "the same two phases in reverse order; joint: one phase of local_epochs training "
        "everything with selection on",
    )
    key_weighting: Literal["selection", "samples"] = Field(
        "selection", description="key aggregation weights: this round's selection counts, or FedAvg"
    )
    key_count_threshold: int = Field(
        50, ge=0, description="uniform key weights when a group's round count is <= this (paper 0)"
    )
    key_momentum: float = Field(0.5, ge=0, lt=1, description="a_k, weight of the old keys")
    group_momentum: float = Field(0.5, ge=0, lt=1, description="a_p, weight of old group prompts")
    cluster_metric: bool = Field(
        False,
        description="diagnostics, on only in the suites that report them (Table 4, Fig. 6a): "
        "record appendix D.2's congruence with centralised k-means every round "
        "(metrics congruence_kmeans, cluster_overlap, cluster_purity; one frozen pass over "
        "cluster_samples train images at start) and Table 4's acc_cluster against the coarse "
        "labels (from the test split's frozen queries, which evaluation computes anyway; "
        "skipped without coarse labels)",
    )
    cluster_samples: int = Field(
        2000, ge=1, description="train samples (seeded draw) the congruence score is computed on"
    )


# -- the math, as small functions ------------------------------------------------------------
def select_query(cls: Tensor, activation: str = "relu") -> Tensor:
    """Select's query: L2-normalise(ReLU(cls)) (B, d); leaky ReLU (slope 0.01) as an option."""
    act = F.leaky_relu(cls, LEAKY_SLOPE) if activation == "leaky-relu" else F.relu(cls)
    return F.normalize(act, dim=-1)


@fp32
def frequency_scores(cos: Tensor, counts: Tensor, eps: float) -> Tensor:
    """Training-time distances (B, G): (1 - cos) * (q_g + eps), q = counts / sum; 1 - cos at 0."""
    total = counts.sum()
    q = counts.to(cos.dtype) / total.clamp(min=1)  # (G,)
    return (1 - cos) * torch.where(total > 0, q + eps, torch.ones_like(q))


def batch_majority(groups: Tensor, client_index: Tensor, k: int, g: int) -> Tensor:
    """Every sample gets its row's most picked group in this batch (ties: the lowest index)."""
    return group_counts(groups, client_index, k, g).argmax(1)[client_index]


def key_loss(cos: Tensor, groups: Tensor) -> Tensor:
    """-cos(query_b, chosen key) (B,)."""
    return -cos.gather(1, groups.unsqueeze(1)).squeeze(1)


def key_weights(counts: Tensor, threshold: int) -> Tensor:
    """rho (K, G): n_kg / T_g where T_g = sum_k n_kg > threshold, else uniform 1 / K."""
    total = counts.sum(0, keepdim=True)  # (1, G)
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(total > threshold, counts / total.clamp(min=1), uniform)


def interpolate(old: Tensor, new: Tensor, alpha: float) -> Tensor:
    """Server momentum as in the paper's Eq. 7: alpha * old + (1 - alpha) * new."""
    return alpha * old + (1 - alpha) * new


def orthogonal_keys(gen: torch.Generator, g: int, d: int) -> Tensor:
    """Gram-Schmidt of a xavier-uniform (G, d) draw; like the reference, row 0 keeps its norm."""
    bound = math.sqrt(6.0 / (g + d))
    raw = ((torch.rand(g, d, generator=gen) * 2 - 1) * bound).double()
    rows: list[Tensor] = []
    for i in range(g):
        v = raw[i]
        for u in rows:
            v = v - (v @ u) / (u @ u) * u
        rows.append(v if i == 0 else v / v.norm())
    return torch.stack(rows).float()


def resolve_layers(cfg: SGPTConfig, depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shared, group) 0-based blocks; None fields take the reference layout scaled to depth."""
    n_shared = max(1, depth // 3)
    if cfg.shared_layers == "all":
        shared = tuple(range(depth))
    else:
        shared = tuple(range(n_shared)) if cfg.shared_layers is None else tuple(cfg.shared_layers)
    start = max(shared) + 1 if shared else n_shared
    group = (
        tuple(range(start, min(depth, start + max(1, depth // 4))))
        if cfg.group_layers is None
        else tuple(cfg.group_layers)
    )
    for field, layers in (("shared_layers", shared), ("group_layers", group)):
        bad = sorted({x for x in layers if not 0 <= x < depth} | _duplicates(layers))
        if bad:
            raise FpbenchError(
                f"sgpt {field} has invalid or repeated blocks {bad}; use distinct 0..{depth - 1}"
            )
    if set(shared) & set(group) or not (shared or group):
        raise FpbenchError(
            f"sgpt needs disjoint, not both empty shared_layers {shared} and group_layers {group}"
        )
    return shared, group


def _duplicates(layers: tuple[int, ...]) -> set[int]:
    return {x for x in layers if layers.count(x) > 1}


@METHODS.register()
class SGPT(Method):
    name = "sgpt"
    Config = SGPTConfig

    def __init__(self, cfg: SGPTConfig, backbone: PromptedViT, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        depth, d = backbone.depth, backbone.embed_dim
        self.shared_layers, self.group_layers = resolve_layers(cfg, depth)
        self.query_layer = depth - 1 if cfg.query_layer is None else cfg.query_layer
        if not 0 <= self.query_layer < depth:
            raise FpbenchError(f"sgpt query_layer {cfg.query_layer} outside blocks 0..{depth - 1}")
        if self.group_layers and cfg.num_groups > d:
            raise FpbenchError(f"sgpt num_groups {cfg.num_groups} > embed dim {d}: keys orthogonal")
        self.cluster: tuple[Tensor, Tensor, Tensor] | None = None  # queries, k-means, classes
        if cfg.cluster_metric and self.group_layers:
            self.cluster = self._cluster_reference(task)

    def _cluster_reference(self, task: TaskInfo) -> tuple[Tensor, Tensor, Tensor] | None:
        """Frozen queries (n, dq) of a seeded draw of the training clients' images, their
        centralised k-means labels (n,) with G clusters, and their classes (n,); None where the
        caller gives no train images or labels."""
        if task.train_images is None or task.train_idx is None or task.train_labels is None:
            return None
        sharing = [
            idx
            for c, idx in enumerate(task.train_idx)
            if task.heldout is None or not bool(task.heldout[c])
        ]
        pool = torch.cat(sharing).cpu() if sharing else torch.zeros(0, dtype=torch.long)
        if len(pool) < self.cfg.num_groups:
            return None
        gen = torch.Generator().manual_seed(0)
        pick = pool[torch.randperm(len(pool), generator=gen)[: self.cfg.cluster_samples]]
        pick = pick.to(task.train_images.device)
        queries = batched_queries(self.query, self.backbone, task.train_images, pick)  # (n, dq)
        labels, _ = kmeans(queries, self.cfg.num_groups, seed=0)
        return queries, labels, task.train_labels[pick].to(queries.device)

    # -- parameters -------------------------------------------------------------------------
    def init_params(self, gen: torch.Generator) -> ServerState:
        """The prompts, keys and head; with groups, the buffer of their selection counts."""
        cfg, d, patch = self.cfg, self.backbone.embed_dim, self.backbone.patch_size
        p, g = cfg.prompt_len, cfg.num_groups
        out: dict[str, Tensor] = {}
        if self.shared_layers:
            n = len(self.shared_layers)
            uniform = cfg.shared_init == "uniform"
            shared = init_prompts(gen, n * p, d, patch) if uniform else torch.zeros(n * p, d)
            out["shared_prompts"] = shared.view(n, p, d)
        if self.group_layers:
            n = len(self.group_layers)
            uniform = cfg.group_init == "uniform"
            group = init_prompts(gen, g * n * p, d, patch) if uniform else torch.zeros(g * n * p, d)
            out["group_prompts"] = group.view(g, n, p, d)
            out["keys"] = orthogonal_keys(gen, g, d)
        out["head_w"], out["head_b"] = init_linear(gen, self.task.num_classes, d)
        counts = {"select_counts": torch.zeros(g, dtype=torch.long)} if self.group_layers else {}
        return ServerState(out, buffers=counts)

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        shared = tuple(n for n in SHARED_PHASE if n in names)
        group = tuple(n for n in GROUP_PHASE if n in names)
        if not self.group_layers:
            return [Phase("shared", shared, local_epochs)]
        # shared prompts are fixed in the group phase: the backbone keeps the states below it
        group_phase = Phase("group", group, local_epochs)
        if not self.shared_layers:
            return [group_phase]
        if self.cfg.schedule == "joint":
            return [Phase("joint", tuple(dict.fromkeys(shared + group)), local_epochs)]
        blocks = [Phase("shared", shared, local_epochs), group_phase]
        return blocks[::-1] if self.cfg.schedule == "bcd-inverted" else blocks

    # -- math -------------------------------------------------------------------------------
    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Output:
        """Logits (B, C) and, when keys train, the weighted per-sample key loss (B,) and the
        picks of each row's groups, `select_counts` (K, G)."""
        prompts = self.shared_prompts(params, client_index)
        selecting = bool(self.group_layers) and (not ctx.training or ctx.phase != "shared")
        aux, stats = None, None
        if selecting:
            groups, cos = self.select_groups(params["keys"], x, client_index, ctx)  # (B,), (B, G)
            chosen = params["group_prompts"][client_index, groups]  # (B, Lg, p, d)
            prompts.update({layer: chosen[:, i] for i, layer in enumerate(self.group_layers)})
            if ctx.training:
                aux = self.cfg.key_loss_weight * key_loss(cos, groups)
                k, g = params["keys"].shape[:2]
                stats = {"select_counts": group_counts(groups, client_index, k, g)}
        feats = self.backbone.forward_features(x, prompts, self.cfg.prompt_style)
        pooled = self.pool(feats, selecting)  # (B, d)
        logits = per_client_linear(pooled, params["head_w"], params["head_b"], client_index)
        return Output(logits, aux, stats)

    def shared_prompts(self, params: dict[str, Tensor], client_index: Tensor) -> dict[int, Tensor]:
        """Each sample's row of shared prompts by layer: {layer: (B, p, d)}."""
        if not self.shared_layers:
            return {}
        shared = params["shared_prompts"][client_index]  # (B, Ls, p, d)
        return {layer: shared[:, i] for i, layer in enumerate(self.shared_layers)}

    def pool(self, feats: ViTFeatures, selecting: bool) -> Tensor:
        """The head's input (B, d): mean of cls and the first prompt-token outputs.

        The count follows the reference's positions (group tokens first, then shared ones);
        VPT-deep keeps only the last prompted block's tokens, so it is capped by what is there.
        """
        p, n = self.cfg.prompt_len, 0
        if self.cfg.head_pooling != "cls":
            n += p * len(self.group_layers) if selecting else 0
            n += p * len(self.shared_layers) if self.cfg.head_pooling == "cls-group-shared" else 0
        tokens = torch.cat([feats.cls.unsqueeze(1), feats.prompt_tokens[:, :n]], dim=1)
        return tokens.mean(1)

    def query(self, x: Tensor) -> Tensor:
        """Select's query (B, d) from the frozen, unprompted backbone (its cls: recalled)."""
        with torch.no_grad():
            layer = self.query_layer
            cls = self.backbone.forward_features(x, return_layers=(layer,)).layer_cls[layer]
            return select_query(self.backbone.vit.norm(cls), self.cfg.query_activation)

    def select_groups(
        self, keys: Tensor, x: Tensor, client_index: Tensor, ctx: Context
    ) -> tuple[Tensor, Tensor]:
        """Each sample's group (B,) and its cosines to its row's keys (B, G).

        Test time: nearest key. Training: frequency-weighted score, optional batch majority.
        """
        query = self.query(x)  # (B, dq)
        cos = key_cosines(query, keys, client_index)  # (B, G)
        if not ctx.training:
            return cos.argmax(1), cos
        k, g = keys.shape[:2]
        dist = 1 - cos.detach()
        if self.cfg.select_weighting == "frequency":
            dist = frequency_scores(cos.detach(), self.counts(ctx), self.cfg.select_eps)
        groups = dist.argmin(1)
        if self.cfg.batch_majority:
            groups = batch_majority(groups, client_index, k, g)
        return groups, cos

    def counts(self, ctx: Context) -> Tensor:
        """Accumulated selection counts (G,) that q_g is computed from."""
        base = ctx.buffers["select_counts"]
        if self.cfg.select_counts == "sequential" and "select_counts" in ctx.earlier:
            return base + ctx.earlier["select_counts"]
        return base

    def round_metrics(
        self, server: ServerState, test: Callable[..., tuple[Tensor, Tensor]] | None = None
    ) -> dict[str, float]:
        """Appendix D.2's congruence of the current keys' groups (nearest key, as at test time)
        with centralised k-means on the same frozen queries (see `congruence`), and Table 4's
        clustering accuracy on the test set against its coarse labels (`cluster_accuracy`),
        from the engine's `test` split (its frozen queries and labels)."""
        out: dict[str, float] = {}
        g = self.cfg.num_groups
        if self.cluster is not None:
            queries, km, classes = self.cluster
            groups = nearest_group(queries, server.params["keys"])  # (n,)
            acc, score = congruence(km, groups, classes, g, g, self.task.num_classes)
            purity = overlap(groups, km, g, g)  # the other order: 1 / G-ish when Select collapses
            out |= {"cluster_overlap": acc, "congruence_kmeans": score, "cluster_purity": purity}
        coarse_of_class = self.task.coarse_of_class
        scored = self.cfg.cluster_metric and self.group_layers and coarse_of_class is not None
        if scored and test is not None:
            queries, labels = test(self.query)  # (M, dq), (M,)
            groups = nearest_group(queries, server.params["keys"])  # (M,)
            coarse = coarse_of_class.to(labels.device)[labels].to(groups.device)
            out["acc_cluster"] = cluster_accuracy(groups, coarse, g, self.num_coarse)
        return out

    @property
    def num_coarse(self) -> int:
        """How many coarse classes the dataset has (0 without a hierarchy)."""
        coarse = self.task.coarse_of_class
        return 0 if coarse is None else int(coarse.max()) + 1

    # -- server -----------------------------------------------------------------------------
    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained, weights, stats = updates.params, updates.weights, updates.stats
        new = super().aggregate(server, updates)  # FedAvg
        params, buffers = new.params, dict(server.buffers)
        if self.group_layers:
            w = (weights / weights.sum()).to(trained["head_w"].dtype)  # (K,)
            cfg, old = self.cfg, server.params
            counts = stats.get("select_counts", torch.zeros(len(w), cfg.num_groups)).to(w.device)
            params["group_prompts"] = interpolate(
                old["group_prompts"], params["group_prompts"], cfg.group_momentum
            )
            rho = (
                key_weights(counts.to(w.dtype), cfg.key_count_threshold)
                if cfg.key_weighting == "selection"
                else w.unsqueeze(1).expand(-1, cfg.num_groups)
            )  # (K, G)
            keys = torch.einsum("kg,kgd->gd", rho, trained["keys"].detach())
            params["keys"] = interpolate(old["keys"], keys, cfg.key_momentum)
            buffers["select_counts"] = server.buffers["select_counts"] + counts.sum(0).long()
        return ServerState(params, new.personal, buffers)

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Everything trained both ways, plus G counts: the accumulated ones down (q_g), the
        client's round counts up (same size as the `select_counts` buffer)."""
        counts = {k: v for k, v in server.buffers.items() if k == "select_counts"}
        return {**server.params, **counts}, {**server.params, **counts}
