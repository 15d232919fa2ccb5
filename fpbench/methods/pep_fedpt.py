"""PEP-FedPT: a shared prompt plus class prompts mixed into a client-conditioned prompt (CCMP).

"Prompt Estimation from Prototypes for Federated Prompt Tuning of Vision Transformers"
(PEP-FedPT; fpbench copy: shared/papers/002_2a9de9da80878dce.txt).

Client: n_S shared prompts enter block 0 (eq. 5). Before each CCMP block l (0-based; default
5, 6, 7) the cls token entering the block, cls_{l-1}, scores every class c by
exp(cos(cls_{l-1}, mu^c_{l-1}) / tau) * delta_k^c (eq. 13), normalised over classes (eq. 15),
where mu^c_{l-1} is the global cls prototype of class c at that block and delta_k the client's
class prior; the CCMP s @ P_C (eq. 6) is one token mixed from the bank of class prompts P_C
(C, d), one bank shared by all CCMP blocks (the paper's parameter count, sec. 5.2.2). A linear
head reads the final cls. Shared prompts, class prompts and head train with cross-entropy and
are all FedAvg'd, uniformly over the round's clients as sec. 3.2 writes FedAvg (`aggregation`
switches to train-size weights). Prototypes: a warm start from the frozen model (eq. 19), then
each client's class means of cls_{l-1} every round (eq. 10), averaged over the clients holding
the class every R = 10 rounds (eq. 20) and mixed with momentum rho (eq. 21; rho = 1 for a class
nobody held). Optional Laplace noise on the uploaded prototypes (appendix A.4.1). Inference is
client-conditioned: any client, held-out ones included, uses its own class prior, no training.

Readings of the paper (defaults; switches where it matters):
* Block indices are 0-based, as Algorithm 1's "shared prompts at layer 0" implies: CCMP enters
  before blocks 5, 6, 7 of ViT-B's 12; on other depths floor(l * depth / 12), deduplicated.
* Eq. 7 keeps one CCMP slot right after cls: a later CCMP replaces the earlier one's output
  token (`ccmp_style="replace"`); "accumulate" keeps all of them (SGPT-code style).
* Eq. 10 takes a client's class means with the round's starting model; fpbench accumulates them
  (detached) over the round's own training forwards, so no extra pass over the client data.
* The warm start (eq. 19) runs in `init_params` on the frozen, unprompted model over S_0 (all
  training clients unless `warm_start_clients` is set: the paper does not give |S_0|), and
  averages over the clients holding each class (the cosine scores equal eq. 19's plain mean's).
  Where the caller gives no client data (`TaskInfo.train_images` None), the first round's
  clients are S_0 instead and that round mixes by the class prior alone.
* rho is not stated in the paper: default 0.5, SGPT's server momentum (the paper follows SGPT's
  optimiser). The paper's optimiser (SGD lr 0.1, exponential decay, momentum 0.9, clip 10) is
  a train setting, held by the PEP-FedPT protocol (benchmarks/papers/pep-fedpt.toml).
* DP sensitivity S_{c,k} = 2 max_i ||cls_i - mu_c||_1 / N_{c,k} uses the global prototype mu_c
  the client received; Laplace(0, S/epsilon) per coordinate, every upload, every CCMP block.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar, Literal

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
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear
from fpbench.methods.numerics import fp32
from fpbench.registry import METHODS
from fpbench.stages import report

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones import PromptedViT

PAPER_DEPTH = 12
PAPER_CCMP_BLOCKS = (5, 6, 7)


# Ablation presets: method args over the defaults (paper table in the name). Block indices are
# ViT-B's (12 blocks).
PRESETS: dict[str, dict[str, object]] = {
    "table4-shared-only": {"ccmp_layers": []},
    "table4-shared-ccmp": {},
    "table5-without-priors": {"use_priors": False},
    "table5-with-priors": {},
    **{f"table11-ns-{n}": {"num_shared": n} for n in (1, 5, 10)},
    **{
        f"table13-layers-{'-'.join(map(str, b))}": {"ccmp_layers": list(b)}
        for b in ((1, 2, 3), (5, 6, 7), (8, 9, 10))
    },
    **{
        f"table17-layers-{'-'.join(map(str, b))}-tau-{tau:g}": {"ccmp_layers": list(b), "tau": tau}
        for b in ((1, 2, 3), (5, 6, 7), (9, 10, 11))
        for tau in (1e-4, 0.05, 100.0)
    },
    **{
        f"fig10-tau-{tau:g}": {"tau": tau}
        for tau in (1e-5, 1e-4, 1e-3, 1e-2, 0.05, 1.0, 10.0, 100.0)
    },
    "table8-dp-eps-0.2": {"dp_epsilon": 0.2},
}


class PEPConfig(MethodConfig):
    PRESETS: ClassVar[dict[str, dict[str, object]]] = PRESETS
    preset: str | None = Field(
        None, description="a named setting of PRESETS; fields given explicitly override it"
    )

    num_shared: int = Field(1, ge=1, description="n_S shared prompts at block 0; paper: 1")
    ccmp_layers: tuple[int, ...] | None = Field(
        None,
        description="0-based blocks the CCMP enters; None = paper's 5, 6, 7 of 12 blocks, "
        "floor(l * depth / 12) on other depths; [] = shared prompts only (Table 4)",
    )
    tau: float = Field(0.05, gt=0, description="temperature of the CCMP scores; paper: 0.05")
    use_priors: bool = Field(True, description="weight scores by the class prior (Table 5)")
    prototype_period: int = Field(10, ge=1, description="R rounds between prototype updates")
    prototype_momentum: float = Field(
        0.5, ge=0, le=1, description="rho of eq. 12; not stated in the paper (SGPT's 0.5)"
    )
    ccmp_style: Literal["replace", "accumulate"] = Field(
        "replace", description="a later CCMP replaces the earlier one's token (eq. 7) or adds one"
    )
    dp_epsilon: float | None = Field(
        None, gt=0, description="Laplace DP budget on uploaded prototypes (Table 8: 0.2); None=off"
    )
    aggregation: Literal["uniform", "samples"] = Field(
        "uniform",
        description="FedAvg weights of the trained tensors: 1/|S_t| as the paper's sec. 3.2 "
        "writes FedAvg, or client train sizes",
    )
    warm_start_clients: int | None = Field(
        None,
        ge=1,
        description="|S_0|, clients whose frozen class means warm-start the prototypes (not "
        "stated in the paper); None = every client that trains",
    )


# ---------------------------------------------------------------------------------------------
# the math, as small functions (unit-tested)


@fp32
def ccmp_weights(cls: Tensor, prototypes: Tensor, priors: Tensor, tau: float) -> Tensor:
    """Eqs. 13-15: s^c proportional to exp(cos(cls, mu^c) / tau) * delta^c, normalised.

    Args:
        cls: (B, d) cls tokens entering the CCMP block.
        prototypes: (C, d) global class prototypes at that block (zero rows: cosine 0).
        priors: (B, C) each sample's client class prior delta_k.
        tau: temperature.
    Returns:
        (B, C) mixing weights; rows sum to 1.
    """
    cos = F.normalize(cls.float(), dim=-1) @ F.normalize(prototypes.float(), dim=-1).T  # (B, C)
    logits = cos / tau + torch.log(priors.float())  # -inf where a class has zero prior
    return torch.softmax(logits, dim=-1)


def mix_prompts(weights: Tensor, class_prompts: Tensor) -> Tensor:
    """Eq. 6: CCMP m = P_C s, per sample: weights (B, C), class_prompts (B, C, d) -> (B, 1, d)."""
    return torch.bmm(weights.unsqueeze(1).to(class_prompts.dtype), class_prompts)


def class_sums(
    feats: Tensor, client_index: Tensor, labels: Tensor, rows: int, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Per row and class: sums (K, L, C, d) of feats (B, L, d) and sample counts (K, C)."""
    flat = client_index * num_classes + labels  # (B,)
    b, layers, d = feats.shape
    sums = feats.new_zeros(rows * num_classes, layers, d).index_add_(0, flat, feats)
    counts = feats.new_zeros(rows * num_classes).index_add_(0, flat, feats.new_ones(b))
    return sums.view(rows, num_classes, layers, d).transpose(1, 2), counts.view(rows, num_classes)


def max_deviation(
    feats: Tensor, prototypes: Tensor, client_index: Tensor, labels: Tensor, rows: int
) -> Tensor:
    """Per row, block and class: max_i ||cls_i - mu_c||_1 (K, L, C) over the samples of class c.

    feats (B, L, d) cls tokens; prototypes (L, C, d) the global prototypes.
    """
    num_classes = prototypes.shape[1]
    dev = (feats - prototypes[:, labels].transpose(0, 1)).abs().sum(-1)  # (B, L)
    flat = (client_index * num_classes + labels).unsqueeze(1).expand_as(dev)
    out = dev.new_zeros(rows * num_classes, dev.shape[1])
    out = out.scatter_reduce(0, flat, dev, reduce="amax", include_self=True)
    return out.view(rows, num_classes, -1).transpose(1, 2)


def dp_sensitivity(max_dev: Tensor, samples: Tensor) -> Tensor:
    """Appendix A.4.1: S_{c,k} = 2 max_i ||cls_i - mu_c||_1 / N_{c,k}; (K, L, C), (K, C)."""
    return 2 * max_dev / samples.clamp(min=1).unsqueeze(1)


def laplace(shape: tuple[int, ...], scale: Tensor, gen: torch.Generator) -> Tensor:
    """Laplace(0, scale) samples by inverse CDF from uniforms drawn with `gen` (CPU)."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64) - 0.5
    unit = -torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 1)
    return unit.to(scale.dtype).to(scale.device) * scale


def update_prototypes(
    buffers: dict[str, Tensor], means: Tensor, held: Tensor, period: int, momentum: float
) -> dict[str, Tensor]:
    """Accumulate this round's client prototypes; warm start after round 0, then every R rounds.

    Args:
        buffers: `prototypes` (L, C, d), `period_sum` (L, C, d), `period_holders` (C,),
            `rounds_done` () as kept by the server.
        means: (K, L, C, d) this round's client class means (eq. 10).
        held: (K, C) whether each client has the class (its mean counts, eq. 20's indicator).
        period: R.
        momentum: rho.
    """
    t = int(buffers["rounds_done"])
    acc = buffers["period_sum"] + (means * held[:, None, :, None]).sum(0)  # (L, C, d)
    holders = buffers["period_holders"] + held.sum(0)  # (C,)
    protos = buffers["prototypes"]
    have = (holders > 0).view(1, -1, 1)
    hat = acc / holders.clamp(min=1).view(1, -1, 1)  # eq. 20 / eq. 19
    if t == 0:
        protos = torch.where(have, hat, protos)
    elif t % period == 0:
        protos = torch.where(have, momentum * protos + (1 - momentum) * hat, protos)  # eq. 21
    if t == 0 or t % period == 0:
        acc, holders = torch.zeros_like(acc), torch.zeros_like(holders)
    return {
        **buffers,
        "prototypes": protos,
        "period_sum": acc,
        "period_holders": holders,
        "rounds_done": buffers["rounds_done"] + 1,
    }


def default_layers(depth: int) -> tuple[int, ...]:
    """The paper's CCMP blocks on ViT-B (12 blocks) mapped to a backbone of `depth` blocks."""
    mapped = {min(depth - 1, math.floor(b * depth / PAPER_DEPTH)) for b in PAPER_CCMP_BLOCKS}
    return tuple(sorted(mapped))


def _insert(tokens: Tensor, prompt: Tensor, at: int, replace: bool) -> Tensor:
    """Put prompt (B, p, d) at position `at`; replace the p tokens there if asked."""
    rest = at + prompt.shape[1] if replace else at
    return torch.cat([tokens[:, :at], prompt.to(tokens.dtype), tokens[:, rest:]], dim=1)


# ---------------------------------------------------------------------------------------------


@METHODS.register()
class PEPFedPT(Method):
    """PEP-FedPT: shared prompt + class prompts mixed by prototype similarity and class prior."""

    name = "pep-fedpt"
    Config = PEPConfig
    inference = "client-conditioned"

    def __init__(self, cfg: PEPConfig, backbone: PromptedViT, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        depth = backbone.depth
        layers = default_layers(depth) if cfg.ccmp_layers is None else cfg.ccmp_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= b < depth for b in layers):
            raise FpbenchError(
                f"ccmp_layers={list(layers)} must be distinct increasing 0-based blocks in "
                f"[0, {depth}); fix method.ccmp_layers"
            )
        self.layers = tuple(layers)
        self.local_epochs = 1  # set by `phases` each round (sample counts for DP sensitivity)

    # -- parameters -------------------------------------------------------------------------
    def init_params(self, gen: torch.Generator) -> ServerState:
        """The prompts and head; with CCMP, the prototype buffers (warm-started where the
        clients' data is given, eq. 19)."""
        d, patch, c = self.backbone.embed_dim, self.backbone.patch_size, self.task.num_classes
        params = {"shared_prompts": init_prompts(gen, self.cfg.num_shared, d, patch)}
        if self.layers:
            params["class_prompts"] = init_prompts(gen, c, d, patch)  # (C, d): one token each
        params["head_w"], params["head_b"] = init_linear(gen, c, d)
        buffers: dict[str, Tensor] = {}
        if self.layers:
            shape = (len(self.layers), c, d)
            buffers.update(
                prototypes=torch.zeros(shape),
                period_sum=torch.zeros(shape),
                period_holders=torch.zeros(c),
                rounds_done=torch.tensor(0),
                noise_seed=torch.randint(2**62, (), generator=gen),
            )
            if self._client_data() is not None:
                buffers = self._warm_start(buffers, gen)
        return ServerState(params, buffers=buffers)

    def _client_data(self) -> tuple[Tensor, Tensor, tuple[Tensor, ...]] | None:
        """(train images, train labels, per-client indices) where the caller gives them."""
        task = self.task
        if task.train_images is None or task.train_idx is None or task.train_labels is None:
            return None
        return task.train_images, task.train_labels, task.train_idx

    def _warm_start_clients(self, gen: torch.Generator) -> list[int]:
        """S_0: the training (not held-out) clients, or a seeded sample of them."""
        heldout = self.task.heldout
        clients = [c for c in range(self.task.num_clients) if heldout is None or not heldout[c]]
        m = self.cfg.warm_start_clients
        if m is not None and m < len(clients):
            pick = torch.randperm(len(clients), generator=gen)[:m].sort().values
            clients = [clients[i] for i in pick.tolist()]
        return clients

    def _warm_start(self, buffers: dict[str, Tensor], gen: torch.Generator) -> dict[str, Tensor]:
        """Eq. 19: the frozen model's class means on S_0, averaged over the class holders."""
        with torch.no_grad():
            clients = self._warm_start_clients(gen)
            images, labels, train_idx = self._client_data()
            idx = torch.cat([train_idx[c] for c in clients])  # (n,) all of S_0's samples
            rows = torch.cat([torch.full((len(train_idx[c]),), k) for k, c in enumerate(clients)])
            parts, what = [], "frozen class means (PEP-FedPT warm start)"
            report(what, 0, len(idx))  # a pass over all of S_0: minutes on a large dataset
            for part in idx.split(256):
                parts.append(self._frozen_cls(self.backbone.preprocess(images[part])).float())
                report(what, sum(map(len, parts)), len(idx))
            feats = torch.cat(parts)  # (n, L, d)
            rows, y = rows.to(feats.device), labels[idx].to(feats.device)
            sums, count = class_sums(feats, rows, y, len(clients), self.task.num_classes)
            sums, count = sums.cpu(), count.cpu()  # (K, L, C, d), (K, C)
            means = sums / count.clamp(min=1)[:, None, :, None]  # (K, L, C, d)
            if self.cfg.dp_epsilon is not None:
                self.local_epochs = 1
                protos = buffers["prototypes"].to(feats.device)
                devs = max_deviation(feats, protos, rows, y, len(clients)).cpu()  # (K, L, C)
                means = self._noisy(means, devs, count, torch.tensor(clients), buffers)
            held = (count > 0).to(means.dtype)
            cfg = self.cfg
            return update_prototypes(
                buffers, means, held, cfg.prototype_period, cfg.prototype_momentum
            )

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        self.local_epochs = local_epochs
        return super().phases(local_epochs, names)

    # -- math -------------------------------------------------------------------------------
    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits (B, C); in training, with the batch's class sums and counts (`stats`)."""
        vit, first = self.backbone, self.backbone.num_prefix_tokens
        shared = params["shared_prompts"][client_index]  # (B, S, d)
        tokens = _insert(vit.embed(x), shared, first, replace=False)  # (B, T, d)
        n, start, seen = shared.shape[1], 0, []
        if self.layers:
            priors = self._priors(ctx, client_index)  # (B, C)
            class_prompts = params["class_prompts"][client_index]  # (B, C, d)
            protos = ctx.buffers["prototypes"]  # (L, C, d)
        for j, block in enumerate(self.layers):
            tokens, _, n = vit.run_blocks(tokens, start, block, None, "accumulate", n)
            seen.append(tokens[:, 0])  # (B, d) cls entering the block
            m = mix_prompts(ccmp_weights(seen[-1], protos[j], priors, self.cfg.tau), class_prompts)
            replace = j > 0 and self.cfg.ccmp_style == "replace"
            tokens = _insert(tokens, m, first, replace)
            n += 0 if replace else 1
            start = block
        tokens, _, n = vit.run_blocks(tokens, start, vit.depth, None, "accumulate", n)
        cls = vit.finish(tokens, n).cls  # (B, d)
        logits = per_client_linear(cls, params["head_w"], params["head_b"], client_index)
        if ctx.labels is not None and ctx.training and self.layers:
            stats = self._record(params, x, seen, client_index, ctx.labels, ctx)
            return Output(logits, stats=stats)
        return logits

    def _priors(self, ctx: Context, client_index: Tensor) -> Tensor:
        c = self.task.num_classes
        if not self.cfg.use_priors or ctx.priors is None:
            return torch.full((len(client_index), c), 1.0 / c, device=client_index.device)
        return ctx.priors[client_index]

    def _frozen_cls(self, x: Tensor) -> Tensor:
        """(B, L, d) the frozen, unprompted model's cls entering each CCMP block (warm start)."""
        with torch.no_grad():
            vit = self.backbone
            tokens = vit.embed(x)
            out, start = [], 0
            for block in self.layers:
                tokens, _, _ = vit.run_blocks(tokens, start, block)
                out.append(tokens[:, 0])
                start = block
            return torch.stack(out, dim=1)

    def _record(
        self,
        params: dict[str, Tensor],
        x: Tensor,
        seen: list[Tensor],
        client_index: Tensor,
        labels: Tensor,
        ctx: Context,
    ) -> dict[str, Tensor]:
        """This batch's per-row class sums and counts (and, with DP, largest deviations)."""
        warm = int(ctx.buffers["rounds_done"]) > 0
        feats = torch.stack(seen, 1).detach().float() if warm else self._frozen_cls(x).float()
        rows = params["shared_prompts"].shape[0]
        sums, counts = class_sums(feats, client_index, labels, rows, self.task.num_classes)
        stats = {"proto_sum": sums, "proto_count": counts}
        if self.cfg.dp_epsilon is not None:
            dev = max_deviation(feats, ctx.buffers["prototypes"], client_index, labels, rows)
            stats["max_proto_dev"] = dev  # the engine keeps the round's maximum
        return stats

    # -- server -----------------------------------------------------------------------------
    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        client_ids, stats = updates.client_ids, updates.stats
        if self.cfg.aggregation == "uniform":
            updates = replace(updates, weights=torch.ones_like(updates.weights))
        params = super().aggregate(server, updates).params  # FedAvg
        buffers = server.buffers
        if self.layers:
            counts = stats["proto_count"]  # (K, C)
            means = stats["proto_sum"] / counts.clamp(min=1)[:, None, :, None]  # (K, L, C, d)
            held = counts > 0
            if self.cfg.dp_epsilon is not None:
                means = self._noisy(means, stats["max_proto_dev"], counts, client_ids, buffers)
            cfg = self.cfg
            buffers = update_prototypes(
                buffers, means, held.to(means.dtype), cfg.prototype_period, cfg.prototype_momentum
            )
        return ServerState(params, server.personal, buffers)

    def _noisy(
        self,
        means: Tensor,
        max_dev: Tensor,
        counts: Tensor,
        client_ids: Tensor,
        buffers: dict[str, Tensor],
    ) -> Tensor:
        """Each client's uploaded prototypes plus Laplace(0, S_{c,k} / epsilon) noise."""
        samples = counts / self.local_epochs  # N_{c,k}: each sample was seen once per epoch
        scale = dp_sensitivity(max_dev, samples) / self.cfg.dp_epsilon  # (K, L, C)
        seed, t = int(buffers["noise_seed"]), int(buffers["rounds_done"])
        noisy = []
        for row, client in enumerate(client_ids.tolist()):
            gen = torch.Generator().manual_seed((seed + 1_000_003 * t + client) % 2**63)
            noisy.append(means[row] + laplace(tuple(means[row].shape), scale[row, ..., None], gen))
        return torch.stack(noisy)

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Down: weights and global prototypes; up: weights and the client's prototypes.

        A client's uploaded class means have the prototypes' shape (L, C, d), so the
        `prototypes` buffer stands for them in the byte count.
        """
        out = dict(server.params)
        if self.layers:
            out["prototypes"] = server.buffers["prototypes"]
        return out, out
