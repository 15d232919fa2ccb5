"""FedMVP: visual prompts written by cross-attention of the image patches to the class
attribute descriptions, scored against those descriptions.

FedMVP (Singha, Roy, Mehrotra, Jha, Abdar, Banerjee, Ricci, "FedMVP: Federated Multi-modal
Visual Prompt Tuning for Vision-Language Models", ICCV 2025, arXiv:2504.20860; official code
github.com/mainaksingha01/FedMVP, read at commit 246800e). A language model wrote a few
attribute descriptions for every class (the official `attributes/<dataset>.json`,
{class name: [descriptions]}). Each becomes the sentence "{prefix} {class}, {suffix}which ..."
(`model/descriptors.py`), cut to its first 77 characters, and the frozen CLIP text encoder
gives its normalised feature t (E). With the image's patch tokens X (N, w, after the
positional embedding) and the M = sum_c D_c description features T (M, E) of all classes:

    V = T W_t^T + b_t                                   (M, w)   the text as values
    A = MHA(LN(X), LN_ctx(V), V)                        (N, w)   4 heads, keys LN_ctx(V)
    H = A + FF(A),  FF(a) = W_2 (u * gelu(g)) + b_2,  [u, g] = W_1 LN_ff(a) + b_1  (GEGLU)
    P = adaptive average pool of H over the N patches to 4 tokens           (4, w)

P is appended after the patch tokens before `ln_pre` (MaPLe's shallow vision prompt) and the
image feature f (normalised) scores class c by exp(logit_scale) * mean_d f . t_{c,d}. Training
adds alpha * (1 - cos(f, z)), z the frozen CLIP feature of the horizontally flipped image. The
trained tensors (W_t, b_t, the two layer norms, the attention and the feed-forward) are
FedAvg'd with a uniform mean over the clients that trained (the official server); inference
is global.

The official client's LoRA stage (`federated/client.py:91-101`): once a client's loss falls
below 0.5, it freezes the attention block (the layer norms, the attention and the
feed-forward; W_t, b_t still train) and trains rank-8 factors that put each input of the
attention through x + x A B (queries before LN, keys before LN_ctx, values), A and B both
N(0, 0.02^2). The switch is for good; the server averages every tensor (a frozen block and
unused factors count as the client got them) and its model never applies LoRA, so scoring
is without it. fpbench keeps which clients switched in a server buffer (`lora_on`) and, where
none has, leaves the factors out of local training.

Defaults from the official code: LoRA threshold 0.5 (`federated/client.py:74`) and rank 8
(`model/FedMVP.py:154`), alpha 10 (`config/defaults.py:101`, `Launch_FL.py:106`), 4
heads (`model/FedMVP.py:205`), 4 prompt tokens (`model/FedMVP.py:104`), feed-forward width 4w
(`model/FedMVP.py:65`), PyTorch's default inits (`nn.Linear`, `nn.MultiheadAttention`,
`nn.LayerNorm`). The official widths are ViT-B/16's (768, 512); fpbench reads them from the
backbone. Its per-dataset prefix and suffix are in `TEMPLATES` (EuroSAT, which the official
table lacks, gets "a photo of a"; OfficeHome and DomainNet, whose official prefixes name the
image's domain, which the forward does not know, too); OfficeHome's keys and values are the
raw descriptions, as the official code uses there.

Declared readings (also in `fpbench/report/method_readings.py`):
* the flip: the official code flips the whole batch with probability 1/2 at each step (torch's
  global RNG); fpbench's forward is deterministic, so `flip = "expected"` (default) takes that
  coin's expectation, 1 - (cos(f, z) + cos(f, z_flipped)) / 2; "always" and "never" are the
  two outcomes;
* the LoRA switch: the official client compares the loss of its round's last batch with the
  threshold (`lora_threshold`, 0.5); fpbench the round's mean training loss over the client's
  samples (recorded by the forward, read by `aggregate`). The official freeze comes before
  the switching round's step, which then moves W_t, b_t alone: fpbench's server counts that
  round's attention block as the client got it; `lora_threshold = None` never switches;
* the official client forwards every batch of a round but steps once, on the last batch's
  loss (`federated/client.py:88-111`); fpbench's engine steps on every batch (the suites'
  recipe); `train.max_local_steps = 1` comes closest to the official schedule (one step a
  round, on the round's first batch);
* the descriptions are read by path, never shipped: `attributes_dir`, or the folder named by
  $FPBENCH_FEDMVP_ATTRIBUTES (e.g. the official checkout's `attributes/`). A class without
  descriptions is an error unless `missing_descriptions = "class-name"`, which gives it the
  one empty description (the sentence "{prefix} {class}, which has ", as the official code
  does for an empty list): the offline smoke suites set it for their synthetic classes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
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
from fpbench.methods.helpers import init_linear, weighted_mean
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP

ENV_VAR = "FPBENCH_FEDMVP_ATTRIBUTES"
SOURCE = "the attributes/ folder of github.com/mainaksingha01/FedMVP"
MAX_CHARS = 77  # the official code cuts each sentence to its first 77 characters

# fpbench dataset -> (official attributes file stem, prefix, suffix, raw keys and values)
TEMPLATES: dict[str, tuple[str, str, str, bool]] = {
    "caltech101": ("caltech101", "a photo of a", "", False),
    "flowers102": ("oxford_flowers", "a photo of a", "a type of flower, ", False),
    "ucf101": ("ucf101", "a photo of a person doing", "", False),
    "oxford-pets": ("oxford_pets", "a photo of a", "a type of pet, ", False),
    "food101": ("food101", "a photo of a", "a type of food, ", False),
    "dtd": ("dtd", "a photo of a", "a type of texture, ", False),
    "stanford-cars": ("stanford_cars", "a photo of a", "", False),
    "eurosat": ("eurosat", "a photo of a", "", False),
    "officehome": ("officehome", "a photo of a", "", True),
    "domainnet10": ("domainnet", "a photo of a", "", False),
}

# parameter names of the prompt net (no client axis in init_params)
NAMES = (
    "text_w", "text_b", "norm_w", "norm_b", "norm_ctx_w", "norm_ctx_b", "attn_in_w",
    "attn_in_b", "attn_out_w", "attn_out_b", "ff_norm_w", "ff_norm_b", "ff1_w", "ff1_b",
    "ff2_w", "ff2_b",
)  # fmt: skip
FROZEN_BY_LORA = NAMES[2:]  # the cross-attention block (not W_t, b_t): frozen once LoRA is on
LORA = ("lora_qa", "lora_qb", "lora_ka", "lora_kb", "lora_va", "lora_vb")


class FedMVPConfig(MethodConfig):
    alpha: float = Field(10.0, ge=0, description="weight of the flip-consistency term (10)")
    n_prompts: int = Field(4, ge=1, description="visual prompt tokens pooled from the patches (4)")
    heads: int = Field(4, ge=1, description="heads of the cross-attention (official: 4)")
    ff_mult: int = Field(4, ge=1, description="feed-forward width as a multiple of w (4)")
    flip: Literal["expected", "always", "never"] = Field(
        "expected", description="the official coin flip's expectation, or one of its outcomes"
    )
    lora_threshold: float | None = Field(
        0.5, description="a client switches to LoRA once a round's mean loss is below (None: never)"
    )
    lora_rank: int = Field(8, ge=1, description="rank of the LoRA factors (official: 8)")
    aggregation: Literal["uniform", "size"] = Field(
        "uniform", description="server mean: uniform over trained clients (official) or by size"
    )
    attributes_dir: str | None = Field(
        None, description=f"folder of <dataset>.json descriptions; None: ${ENV_VAR}"
    )
    missing_descriptions: Literal["error", "class-name"] = Field(
        "error", description="a class without descriptions: error, or one empty description"
    )


def descriptor_clause(d: str) -> str:
    """The official rule turning a description into a relative clause."""
    if d.startswith("a"):  # "a", "an" and any word starting with a (as the official test)
        return f"which is {d}"
    if d.startswith(("has", "often", "typically", "may", "can")):
        return f"which {d}"
    if d.startswith("used"):
        return f"which is {d}"
    return f"which has {d}"


def sentence(prefix: str, name: str, suffix: str, d: str) -> str:
    """One description's sentence, cut to 77 characters."""
    return f"{prefix} {name}, {suffix}{descriptor_clause(d)}"[:MAX_CHARS]


def attributes_folder(cfg: FedMVPConfig) -> Path | None:
    folder = cfg.attributes_dir or os.environ.get(ENV_VAR)
    return Path(folder).expanduser() if folder else None


def _read(path: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FpbenchError(f"fedmvp: cannot read attribute descriptions {path}: {err}") from err
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(s, str) for s in v) for v in data.values()
    ):
        raise FpbenchError(f"fedmvp: {path} is not {{class name: [descriptions]}}")
    return data


def _loose(name: str) -> str:
    """A class name for matching: underscores as spaces, single-spaced, lower case."""
    return " ".join(name.replace("_", " ").split()).lower()


def class_descriptions(
    cfg: FedMVPConfig, dataset: str, class_names: tuple[str, ...]
) -> list[list[str]]:
    """Each class's raw descriptions (a class with none: [""]), from the dataset's file: the
    key equal to the name with underscores as spaces (the official match), else the one equal
    up to case and spacing."""
    stem = TEMPLATES.get(dataset, (dataset.replace("-", "_"),))[0]
    folder = attributes_folder(cfg)
    path = folder / f"{stem}.json" if folder else None
    lenient = cfg.missing_descriptions == "class-name"
    found = _read(path) if path is not None and path.is_file() else None
    if found is None and not lenient:
        where = (
            f"{path} does not exist" if path else f"neither attributes_dir nor ${ENV_VAR} is set"
        )
        raise FpbenchError(
            f"fedmvp needs attribute descriptions of the {dataset!r} classes ({where}): point "
            f"attributes_dir or ${ENV_VAR} at a folder holding {stem}.json "
            f"({{class name: [descriptions]}}), e.g. {SOURCE}"
        )
    loose = {_loose(k): v for k, v in (found or {}).items()}
    out, missing = [], []
    for name in class_names:
        descs = (found or {}).get(name.replace("_", " "), loose.get(_loose(name)))
        if descs is None:
            missing.append(name)
        out.append(list(descs) if descs else [""])
    if missing and not lenient:
        raise FpbenchError(
            f"fedmvp: {path} has no descriptions of {len(missing)} classes: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    return out


def require_descriptions(cells: list) -> None:
    """Fail fast, before a suite writes anything, when a FedMVP cell that needs descriptions
    has no readable attributes file for its dataset (its classes are checked when it starts)."""
    for cell in cells:
        if cell.method.name == FedMVP.name:
            cfg = FedMVPConfig(**cell.method.args)
            if cfg.missing_descriptions == "error":
                class_descriptions(cfg, cell.dataset.name, ())


def layer_norm(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return F.layer_norm(x, w.shape, w, b, 1e-5)


def cross_attention(q: Tensor, k: Tensor, v: Tensor, p: dict[str, Tensor], heads: int) -> Tensor:
    """Multi-head attention of queries q (n, N, w) to one set of keys k and values v (M, w)."""
    n, length, w = q.shape
    wq, wk, wv = p["attn_in_w"].chunk(3)
    bq, bk, bv = p["attn_in_b"].chunk(3)
    dh = w // heads
    q = F.linear(q, wq, bq).view(n, length, heads, dh).transpose(1, 2)  # (n, h, N, dh)
    k = F.linear(k, wk, bk).view(-1, heads, dh).transpose(0, 1)  # (h, M, dh)
    v = F.linear(v, wv, bv).view(-1, heads, dh).transpose(0, 1)
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)  # (n, h, N, M)
    out = (att @ v).transpose(1, 2).reshape(n, length, w)
    return F.linear(out, p["attn_out_w"], p["attn_out_b"])


def feed_forward(a: Tensor, p: dict[str, Tensor]) -> Tensor:
    """W_2 (u * gelu(g)) + b_2 with [u, g] = W_1 LN(a) + b_1 (GEGLU)."""
    u, g = F.linear(layer_norm(a, p["ff_norm_w"], p["ff_norm_b"]), p["ff1_w"], p["ff1_b"]).chunk(
        2, dim=-1
    )
    return F.linear(u * F.gelu(g), p["ff2_w"], p["ff2_b"])


def lora(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """x + x A B."""
    return x + x @ a @ b


def visual_prompts(
    p: dict[str, Tensor],
    patches: Tensor,
    text: Tensor,
    heads: int,
    n_prompts: int,
    with_lora: bool = False,
) -> Tensor:
    """One client's prompts (n, P, w) from patch tokens (n, N, w) and description features
    text (M, E); `with_lora`: the attention's three inputs through x + x A B first."""
    values = F.linear(text, p["text_w"], p["text_b"])
    queries, keys = patches, values
    if with_lora:
        queries = lora(patches, p["lora_qa"], p["lora_qb"])
        keys = lora(values, p["lora_ka"], p["lora_kb"])
        values = lora(values, p["lora_va"], p["lora_vb"])
    keys = layer_norm(keys, p["norm_ctx_w"], p["norm_ctx_b"])  # the official PreNorm: keys only
    a = cross_attention(layer_norm(queries, p["norm_w"], p["norm_b"]), keys, values, p, heads)
    h = a + feed_forward(a, p)
    return F.adaptive_avg_pool1d(h.transpose(1, 2), n_prompts).transpose(1, 2)


def patch_tokens(clip: PromptedCLIP, x: Tensor) -> Tensor:
    """The ViT's patch tokens (B, N, w) after the positional embedding, before `ln_pre`."""
    visual = clip.model.visual
    t = visual.conv1(x)
    t = t.reshape(t.shape[0], t.shape[1], -1).permute(0, 2, 1)  # (B, N, w)
    return t + visual.positional_embedding[1:].to(t.dtype)


@METHODS.register()
class FedMVP(Method):
    name = "fedmvp"
    Config = FedMVPConfig
    backbone_family: ClassVar[str] = "clip"

    def __init__(self, cfg: FedMVPConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        from fpbench.backbones.clip import PromptedCLIP, check_vit, vision_width

        super().__init__(cfg, backbone, task)
        if not isinstance(backbone, PromptedCLIP):
            raise FpbenchError(
                "method fedmvp needs a ViT CLIP backbone (clip-test, clip-vit-b16), got "
                f"{getattr(backbone, 'name', type(backbone).__name__)}"
            )
        check_vit(backbone, self.name)
        if len(task.class_names) != task.num_classes:
            raise FpbenchError("method fedmvp needs the dataset's class names")
        self.width = vision_width(backbone)
        if self.width % cfg.heads:
            raise FpbenchError(f"fedmvp: heads = {cfg.heads} must divide the width {self.width}")
        self.descriptions = class_descriptions(cfg, task.dataset, task.class_names)
        self._text: dict[str, tuple[Tensor, Tensor]] = {}

    def sentences(self) -> tuple[list[list[str]], list[str]]:
        """Each class's scoring sentences, and the key/value texts of all classes in order."""
        _, prefix, suffix, raw = TEMPLATES.get(self.task.dataset, ("", "a photo of a", "", False))
        names = [n.replace("_", " ") for n in self.task.class_names]
        scored = [
            [sentence(prefix, name, suffix, d) for d in descs]
            for name, descs in zip(names, self.descriptions, strict=True)
        ]
        if raw:
            return scored, [d[:MAX_CHARS] for descs in self.descriptions for d in descs]
        return scored, [s for group in scored for s in group]

    def encode(self, texts: list[str]) -> Tensor:
        """Normalised frozen CLIP text features (n, E) of sentences."""
        with torch.no_grad():
            clip = self.backbone
            return F.normalize(clip.encode_text(clip.tokenize(texts)).float(), dim=-1)

    def text_features(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """Class weights (C, E), the mean of each class's normalised description features, and
        the normalised key/value features (M, E); computed once per device, frozen."""
        key = str(device)
        if key not in self._text:
            scored, keys = self.sentences()
            flat = [s for group in scored for s in group]
            feats = self.encode(flat)
            weights = torch.stack([t.mean(0) for t in feats.split([len(g) for g in scored])])
            kv = feats if keys == flat else self.encode(keys)
            self._text[key] = (weights.to(device), kv.to(device))
        return self._text[key]

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The block's weights; with LoRA, its factors and the buffer `lora_on` (N,): which
        clients train LoRA."""
        w, e, m = self.width, self.backbone.embed_dim, self.cfg.ff_mult
        text_w, text_b = init_linear(gen, w, e)
        bound = math.sqrt(6.0 / (w + 3 * w))  # xavier_uniform of the (3w, w) in-projection
        attn_in_w = (torch.rand(3 * w, w, generator=gen) * 2 - 1) * bound
        attn_out_w, _ = init_linear(gen, w, w)
        ff1_w, ff1_b = init_linear(gen, 2 * m * w, w)
        ff2_w, ff2_b = init_linear(gen, w, m * w)
        ones, zeros = torch.ones(w), torch.zeros(w)
        out = {}
        if self.cfg.lora_threshold is not None:  # N(0, 0.02^2), both factors (official)
            r = self.cfg.lora_rank
            for name in LORA:
                shape = (w, r) if name.endswith("a") else (r, w)
                out[name] = torch.randn(*shape, generator=gen) * 0.02
        params = out | {
            "text_w": text_w, "text_b": text_b,
            "norm_w": ones.clone(), "norm_b": zeros.clone(),
            "norm_ctx_w": ones.clone(), "norm_ctx_b": zeros.clone(),
            "attn_in_w": attn_in_w, "attn_in_b": torch.zeros(3 * w),
            "attn_out_w": attn_out_w, "attn_out_b": zeros.clone(),
            "ff_norm_w": ones.clone(), "ff_norm_b": zeros.clone(),
            "ff1_w": ff1_w, "ff1_b": ff1_b, "ff2_w": ff2_w, "ff2_b": ff2_b,
        }  # fmt: skip
        buffers = {}
        if self.cfg.lora_threshold is not None:
            buffers["lora_on"] = torch.zeros(self.task.num_clients, dtype=torch.bool)
        return ServerState(params, buffers=buffers)

    def prompts(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Each sample's visual prompts (B, P, w), made with its client's prompt net."""
        patches = patch_tokens(self.backbone, x).float()
        _, text = self.text_features(x.device)
        parts, order = [], []
        on, cfg = params.get("lora_on"), self.cfg
        for k in client_index.unique().tolist():
            sel = (client_index == k).nonzero().squeeze(1)
            one = {n: params[n][k] for n in NAMES}
            with_lora = on is not None and bool(on[k])
            if with_lora:  # the attention block frozen, its inputs through the LoRA factors
                one |= {n: one[n].detach() for n in FROZEN_BY_LORA}
                one |= {n: params[n][k] for n in LORA}
            parts.append(
                visual_prompts(one, patches[sel], text, cfg.heads, cfg.n_prompts, with_lora)
            )
            order.append(sel)
        return torch.cat(parts)[torch.argsort(torch.cat(order))]

    def image_features(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Normalised prompted image features (B, E)."""
        from fpbench.backbones.clip import encode_image_deep

        shallow = self.prompts(params, x, client_index)
        return F.normalize(encode_image_deep(self.backbone, x, shallow).float(), dim=-1)

    def consistency(self, feats: Tensor, x: Tensor) -> Tensor:
        """1 - cos(f, z) per sample (B,), z the frozen feature of the flipped image (its
        expectation over the official coin with flip = "expected")."""
        from fpbench.backbones.recall import recalled

        clip, flip = self.backbone, self.cfg.flip
        with torch.no_grad():
            z = [] if flip == "always" else [clip.encode_image(x)]
            if flip != "never":  # a value of the images alone: kept by the frozen store
                z.append(recalled("cls-hflip", lambda t: clip.model.encode_image(t.flip(-1)), x))
        cos = [(feats * F.normalize(t.float(), dim=-1)).sum(-1) for t in z]
        return 1.0 - sum(cos) / len(cos)

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Adds `lora_on` (K,), never trained, once any client switched to LoRA (in training
        only: the official server's model never applies LoRA); before, the LoRA factors are
        left out (nothing would train them). Decided on the whole federation, so that every
        grouping of the round's clients gets the same tensors."""
        out = super().client_params(server, client_ids, training, draw)
        if "lora_on" in server.buffers:
            on = server.buffers["lora_on"]
            if training and bool(on.any()):
                out["lora_on"] = on[client_ids.to(on.device)]
            else:
                out = {n: v for n, v in out.items() if n not in LORA}
        return out

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", tuple(n for n in names if n != "lora_on"), local_epochs)]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits; in training, the consistency term as the auxiliary loss and, with the LoRA
        stage, each row's summed loss and sample count (`loss_sum`, `samples`, (K,)): what
        `aggregate` decides the switch by."""
        weights, _ = self.text_features(x.device)
        feats = self.image_features(params, x, client_index)
        logits = self.backbone.logit_scale * feats @ weights.T
        if not ctx.training:
            return logits
        aux = self.cfg.alpha * self.consistency(feats, x)
        if self.cfg.lora_threshold is None or ctx.labels is None:
            return Output(logits, aux)
        with torch.no_grad():
            loss = F.cross_entropy(logits, ctx.labels, reduction="none") + aux
            k = len(params["text_w"])
            stats = {
                "loss_sum": loss.new_zeros(k).index_add(0, client_index, loss),
                "samples": loss.new_zeros(k).index_add(0, client_index, torch.ones_like(loss)),
            }
        return Output(logits, aux, stats)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """The mean of the trained tensors; a client whose round's mean loss is below
        `lora_threshold` switches to LoRA. A client on LoRA after the round counts the attention
        block as it got it (frozen, the switching round's step included, as the official freeze
        comes before its backward), one not on LoRA in it counts the LoRA factors so."""
        ids, trained = updates.client_ids, dict(updates.params)
        on = server.buffers.get("lora_on")
        if on is not None:
            was = now = on[ids.to(on.device)]
            if "loss_sum" in updates.stats:
                mean = updates.stats["loss_sum"] / updates.stats["samples"].clamp(min=1)
                now = was | (mean.to(on.device) < self.cfg.lora_threshold)
            for names, keep in ((FROZEN_BY_LORA, now), (LORA, ~was)):
                for n in (n for n in names if n in trained):
                    old = server.params[n].unsqueeze(0).to(trained[n].device)
                    rows = keep.view(-1, *[1] * (old.dim() - 1)).to(trained[n].device)
                    trained[n] = torch.where(rows, old, trained[n])
        w = updates.weights.float() if self.cfg.aggregation == "size" else torch.ones(len(ids))
        w = w / w.sum()
        params = {}
        for n, old in server.params.items():  # a round without LoRA leaves its factors out
            t = trained.get(n)
            params[n] = old if t is None else weighted_mean(t, w.to(t.device, t.dtype))
        new = ServerState(params, server.personal, dict(server.buffers))
        if on is not None:
            new.buffers = {**new.buffers, "lora_on": on.index_copy(0, ids.to(on.device), now)}
        return new
