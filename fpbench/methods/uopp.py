"""UOPP: a federated prompt plus server-aggregated class prototypes, read by adaptive dual heads.

UOPP, "Unified Optimized Prototype Prompt" (Ma'sum, Pratama, Liu, Habibullah, Kowalczyk,
"Federated Few-Shot Class-Incremental Learning", ICLR 2025), a baseline of SDFed. The original
(continual, ViT) has task-wise prompts trained by the clients and FedAvg'd, class prototypes
computed by the clients and aggregated by the server (static prototypes of the base classes from
the frozen model, dynamic ones of each few-shot task's new classes, rectified towards the
population mean), and two heads at inference, a prompt-trained classifier and a prototype
classifier, combined adaptively per sample.

Adaptation to non-continual few-shot prompt learning on a frozen CLIP (one task, so one prompt):

* prompt: a CoOp text context trained with CLIP's cross-entropy and FedAvg'd by sample size;
  the prompt head is CoOp's logits;
* prototypes: each client sends its per-class sums and counts of frozen image features (a
  text prompt does not change image features, so static and dynamic prototypes coincide and
  a client's sums never change: the server adds each client's sums once, the first time it
  participates); the server's prototype of class c is the count-weighted mean over all
  clients seen so far, normalised. The original's rectification (a meta-learned neural ODE
  that moves few-shot prototypes towards the base-session statistics) needs a base session and
  is not reproduced: pooling every client's samples is the rectification available here;
* dual heads: prototype logits exp(logit_scale) * cos(f, p_c); each sample takes the head that
  is more confident (ties: the prompt head). Image-prototype cosines spread far wider than
  image-text ones, so at CLIP's logit scale the raw prototype softmax nearly always wins and the
  prompt would barely matter; each head's confidence is therefore calibrated: the max softmax
  probability of its logits standardised per sample (zero mean, unit std over the classes it
  scores), which reads how far the top class stands out of the head's own spread. Classes
  without a prototype score 0 and are left out of the prototype head's statistics. Training is
  the prompt head's cross-entropy (prototypes are not trained).

Inference is global (one prompt, one prototype set). Defaults: CoOp's 16 context tokens (SDFed
runs every baseline at 8, set in the suite).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output, ServerState, Updates
from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


def class_sums(
    feats: Tensor, labels: Tensor, client_index: Tensor, rows: int, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Per-row class sums (K, C, E) and counts (K, C) of features (B, E)."""
    slot = client_index * num_classes + labels  # (B,)
    sums = feats.new_zeros(rows * num_classes, feats.shape[-1]).index_add_(0, slot, feats)
    counts = feats.new_zeros(rows * num_classes).index_add_(
        0, slot, torch.ones_like(slot, dtype=feats.dtype)
    )
    return sums.view(rows, num_classes, -1), counts.view(rows, num_classes)


def calibrated_confidence(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """Max softmax probability (B,) of logits (B, C) standardised per row over `valid` (C,)."""
    if valid is None:
        valid = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    kept = logits[:, valid]  # (B, C')
    z = (kept - kept.mean(-1, keepdim=True)) / kept.std(-1, unbiased=False, keepdim=True).clamp(
        min=1e-12
    )
    return z.softmax(-1).amax(-1)


def dual_head(prompt_logits: Tensor, proto_logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """Per sample, the logits (B, C) of the head with the larger calibrated confidence.

    `valid` (C,) marks the classes the prototype head scores (those with a prototype).
    """
    conf_prompt = calibrated_confidence(prompt_logits)  # (B,)
    conf_proto = calibrated_confidence(proto_logits, valid)
    use_proto = (conf_proto > conf_prompt).unsqueeze(-1)  # (B, 1)
    return torch.where(use_proto, proto_logits, prompt_logits)


@METHODS.register()
class UOPP(CoOpModel):
    name = "uopp"

    def init_params(self, gen: torch.Generator) -> ServerState:
        params = super().init_params(gen)
        c, e, n = self.task.num_classes, self.backbone.embed_dim, self.task.num_clients
        buffers = {
            "prototypes": torch.zeros(c, e),  # normalised, zero where no class sample was seen
            "proto_sum": torch.zeros(c, e),
            "proto_count": torch.zeros(c),
            "proto_seen": torch.zeros(n),  # clients whose sums are already in proto_sum
        }
        return ServerState(params, {}, buffers)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """The dual head's logits; in training, the prompt head's logits and the batch's class
        sums and counts of frozen features (`proto_sum` (K, C, E), `proto_count` (K, C))."""
        feats = self.image_features(x)  # (B, E)
        if ctx.labels is not None:
            rows, c = params["ctx"].shape[0], self.task.num_classes
            sums, counts = class_sums(feats.detach(), ctx.labels, client_index, rows, c)
            logits = self.logits(feats, self.text_features(params["ctx"]), client_index)
            return Output(logits, stats={"proto_sum": sums, "proto_count": counts})
        prompt_logits = self.logits(feats, self.text_features(params["ctx"]), client_index)
        if ctx.training:
            return prompt_logits
        protos = ctx.buffers["prototypes"].to(feats.dtype)  # (C, E)
        proto_logits = self.backbone.logit_scale * feats @ protos.T  # (B, C)
        valid = protos.abs().sum(-1) > 0  # (C,)
        if int(valid.sum()) < 2:  # no prototype head to speak of yet
            return prompt_logits
        return dual_head(prompt_logits, proto_logits, valid)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """FedAvg of the prompt; first-time participants' class sums join the prototypes."""
        trained, client_ids, stats = updates.params, updates.client_ids, updates.stats
        state = super().aggregate(server, updates)
        buf = dict(server.buffers)
        new = (1 - buf["proto_seen"][client_ids]).to(trained["ctx"].dtype)  # (K,)
        if "proto_sum" in stats:
            # a round of E epochs adds every sample E times: the mean is unchanged
            buf["proto_sum"] = buf["proto_sum"] + torch.tensordot(new, stats["proto_sum"], dims=1)
            buf["proto_count"] = buf["proto_count"] + new @ stats["proto_count"]
            buf["proto_seen"] = buf["proto_seen"].index_fill(0, client_ids, 1.0)
        mean = buf["proto_sum"] / buf["proto_count"].clamp(min=1).unsqueeze(-1)  # (C, E)
        buf["prototypes"] = F.normalize(mean, dim=-1)
        return ServerState(state.params, state.personal, buf)

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Down: prompt and prototypes. Up: prompt and class sums/counts (first round only,
        counted every round here as an upper bound)."""
        down = {"ctx": server.params["ctx"], "prototypes": server.buffers["prototypes"]}
        up = {
            "ctx": server.params["ctx"],
            "proto_sum": server.buffers["proto_sum"],
            "proto_count": server.buffers["proto_count"],
        }
        return down, up
