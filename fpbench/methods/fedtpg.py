"""FedTPG: a shared network that generates the CoOp context from the class names' CLIP features.

FedTPG (Qiu, Li, Mummadi, Ganesh, Li, Peng, Lin, "Text-driven Prompt Generation for
Vision-Language Models in Federated Learning", ICLR 2024, arXiv 2310.06123). A prompt
generator maps the classes to be told apart to one generic context:

    T = normalise(CLIP.encode_text(name_c)) for each class c of the set     (frozen, bare names)
    H = MHA(query = LN_q(Q), key = value = LN_kv(T))    (4 heads; no residual from Q)
    H = H + FF(H),   FF = LN -> Linear(d, 8d) -> GEGLU (a * gelu(g)) -> Linear(4d, d)
    ctx = H  (n_ctx x d): the context of "SOT ctx_1..ctx_n name . EOT" for every class

with learnable queries Q (n_ctx x d, N(0, 0.02^2)). The logits are exp(logit_scale) *
cos(f, t_c) over the set's classes. A client trains on its own classes (the generator sees
their names, the cross-entropy is over them: FedTPG's client-local label space); the server
averages the whole generator uniformly over the clients of the round (`aggregation = "size"`
weights by train size); no client keeps anything, so inference is global: at evaluation the
generator sees every class of the dataset. This is the method's own federation.

Defaults from the official code (boschresearch/FedTPG, `model/prompt_net.py`, `model/FedTPG.py`,
`config/defaults.py`, commit f141c29): 4 context tokens, one context layer, no self-attention
stack (`DEPTH = 0`, the only depth fpbench implements), 4 heads, PyTorch's default inits
(queries N(0, 0.02^2), xavier-uniform packed q/k/v projections with zero biases, Linear
defaults, LayerNorm ones and zeros). Official optimiser: SGD lr 3e-3, momentum 0.9, weight
decay 1e-5, per-round cosine over 500 rounds, 1 local epoch, batch 200, 8 shots, no augmentation:
the recipe the suite flip-compare-own runs (benchmarks/protocols/recipes.toml; flip-compare
runs FLiP's common recipe, declared). Readings: the generator runs in fp32 (the official casts it to
fp16); the key/value
width is CLIP's joint width (the official hard-codes 512, which is ViT-B/16's; RN50's is 1024).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, ServerState, Updates
from fpbench.methods.coop import CoOpModel
from fpbench.methods.helpers import init_linear, weighted_mean
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class FedTPGConfig(MethodConfig):
    n_ctx: int = Field(4, ge=1, le=70, description="generated context tokens (official: 4)")
    heads: int = Field(4, ge=1, description="cross-attention heads (official: 4)")
    ff_mult: int = Field(4, ge=1, description="feed-forward width multiple (official: 4)")
    aggregation: Literal["uniform", "size"] = Field(
        "uniform", description="server mean: uniform over the round's clients (official) or size"
    )


def layer_norm(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """LayerNorm over the last dim with per-client affine w, b (K, d) for x (K, ..., d)."""
    shape = (w.shape[0],) + (1,) * (x.dim() - 2) + (w.shape[-1],)
    return F.layer_norm(x, x.shape[-1:]) * w.view(shape) + b.view(shape)


def linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """x (K, n, i) through per-client weights w (K, o, i), biases b (K, o)."""
    return torch.einsum("kni,koi->kno", x, w) + b.unsqueeze(1)


def generate(p: dict[str, Tensor], text: Tensor, keep: Tensor, heads: int) -> Tensor:
    """Contexts (K, n, d) from the generator parameters p (K, ...), class text features
    text (C, dk) and which classes each client's generator sees, keep (K, C) bool."""
    k, n, d = p["queries"].shape
    q = linear(layer_norm(p["queries"], p["ln_q_w"], p["ln_q_b"]), p["q_w"], p["q_b"])
    kv = layer_norm(text.unsqueeze(0).expand(k, -1, -1), p["ln_kv_w"], p["ln_kv_b"])
    key, value = linear(kv, p["k_w"], p["k_b"]), linear(kv, p["v_w"], p["v_b"])  # (K, C, d)
    hd = d // heads
    q, key, value = (t.reshape(k, t.shape[1], heads, hd).transpose(1, 2) for t in (q, key, value))
    scores = q @ key.transpose(-1, -2) / math.sqrt(hd)  # (K, h, n, C)
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    h = (scores.softmax(-1) @ value).transpose(1, 2).reshape(k, n, d)
    h = linear(h, p["out_w"], p["out_b"])  # no residual from the queries
    a, g = linear(layer_norm(h, p["ff_ln_w"], p["ff_ln_b"]), p["ff1_w"], p["ff1_b"]).chunk(2, -1)
    return h + linear(a * F.gelu(g), p["ff2_w"], p["ff2_b"])


@METHODS.register()
class FedTPG(CoOpModel):
    name = "fedtpg"
    Config = FedTPGConfig

    def __init__(self, cfg: MethodConfig, backbone, task) -> None:
        super().__init__(cfg, backbone, task)
        if backbone.ctx_dim % cfg.heads:
            raise FpbenchError(
                f"fedtpg: heads = {cfg.heads} must divide the text width {backbone.ctx_dim}"
            )

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        """The official construction order: queries, out_proj (its bias then zeroed), packed
        q/k/v (xavier), the feed-forward Linears; LayerNorms ones and zeros."""
        d, dk, m = self.backbone.ctx_dim, self.backbone.embed_dim, self.cfg.ff_mult
        p = {"queries": torch.randn(self.cfg.n_ctx, d, generator=gen) * 0.02}
        p["out_w"], _ = init_linear(gen, d, d)
        p["out_b"] = torch.zeros(d)
        if dk == d:  # one packed (3d, d) matrix, as torch's MultiheadAttention holds it
            bound = math.sqrt(6.0 / (d + 3 * d))
            qkv = (torch.rand(3 * d, d, generator=gen) * 2 - 1) * bound
            p["q_w"], p["k_w"], p["v_w"] = qkv.chunk(3)
        else:
            for name, fan_in in (("q_w", d), ("k_w", dk), ("v_w", dk)):
                bound = math.sqrt(6.0 / (d + fan_in))
                p[name] = (torch.rand(d, fan_in, generator=gen) * 2 - 1) * bound
        for name in ("q_b", "k_b", "v_b"):
            p[name] = torch.zeros(d)
        p["ff1_w"], p["ff1_b"] = init_linear(gen, 2 * m * d, d)
        p["ff2_w"], p["ff2_b"] = init_linear(gen, d, m * d)
        for name, width in (("ln_q", d), ("ln_kv", dk), ("ff_ln", d)):
            p[f"{name}_w"], p[f"{name}_b"] = torch.ones(width), torch.zeros(width)
        return p

    def name_features(self) -> Tensor:
        """Normalised frozen CLIP features (C, E) of the bare class names (cached)."""
        held = self._fixed_text.get("names")
        if held is None:
            names = [n.replace("_", " ") for n in self.task.class_names]
            with torch.no_grad():
                ids = self.backbone.tokenize(names)
                text = F.normalize(self.backbone.encode_text(ids).float(), dim=-1)
            held = self._fixed_text["names"] = (ids, text)
        return held[1]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        k, c = params["queries"].shape[0], self.task.num_classes
        keep = torch.ones(k, c, dtype=torch.bool, device=x.device)
        if ctx.training and ctx.priors is not None:
            keep = ctx.priors.to(x.device) > 0  # (K, C): each client's own classes
        text = self.text_features(generate(params, self.name_features(), keep, self.cfg.heads))
        logits = self.logits(self.image_features(x), text, client_index)
        if ctx.training:  # the client-local label space: cross-entropy over its own classes
            logits = logits.masked_fill(~keep[client_index], float("-inf"))
        return logits

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        if self.cfg.aggregation == "size":
            return super().aggregate(server, updates)
        k = len(updates.client_ids)
        first = next(iter(updates.params.values()))
        w = torch.full((k,), 1.0 / k, dtype=first.dtype, device=first.device)
        params = {n: weighted_mean(updates.params[n], w) for n in server.params}
        return ServerState(params, server.personal, server.buffers)
