"""FedMix: the first-order approximation of global mixup with clients' shared mean images.

FedMix (Yoon, Shin, Hwang, Yang; "FedMix: Approximation of Mixup under Mean Augmented Federated
Learning", ICLR 2021), on VPT-shallow prompts and a linear head over a frozen ViT, as the FedMix
baseline of SGPT and FGPT (who tune prompts and head in place of FedMix's whole CNN).

Once, before training, every trainable (not held-out) client shares the mean of its train images
(rounded to 8 bits, at native resolution) and of its one-hot labels (its class prior); held-out
clients share nothing. FedMix's mean batch here is a client's whole train set (one mean per
client, the setting of the paper's CIFAR experiments as reproduced in Flower's FedMix baseline).

Client: with mixing ratio lam, mean pair (x_bar, y_bar) and local sample (x, y), global mixup's
loss l(f((1 - lam) x + lam x_bar), (1 - lam) y + lam y_bar), expanded to first order in lam at
(1 - lam) x and dropping the lam^2 term, is

    (1 - lam) l(f(x'), y) + lam l(f(x'), y_bar) + lam (1 - lam) <d l(f(x'), y) / d x', x_bar>

with x' = (1 - lam) x (in the model's normalised input space, where the images are mixed).
The objective is linear in (x_bar, y_bar), so FedMix's random pairing of local samples with
received means is, in expectation, the pairing with their average: that average (over all
sharing clients) is used, which has the same expected gradient without the pairing noise and
keeps the two executors identical. The input-gradient term needs a double backward through the
frozen ViT, which runs with PyTorch's math attention kernel (the fused ones have none).

Server: FedAvg of prompts and head by client train size.

Communication: prompts and head each round; in the first round also the mean images and labels
(down: every sharing client's; up: one client's own). In FedMix every client uploads its mean
before training, so for partial participation the first round's upload is under-counted.

Default: lam = 0.1, FedMix's CIFAR-100 setting (0.05 for CIFAR-10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output, ServerState, Updates
from fpbench.methods.fedvpt import VPTConfig, VPTModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class FedMixConfig(VPTConfig):
    mix_ratio: float = Field(0.1, gt=0, lt=1, description="mixup ratio lambda of FedMix")


def fedmix_loss(
    logits: Tensor, x_in: Tensor, y: Tensor, mix_image: Tensor, mix_label: Tensor, lam: float
) -> Tensor:
    """Per-sample FedMix loss (B,) from logits (B, C) of the scaled inputs x_in = (1 - lam) x.

    `x_in` (B, ...) must require grad and `logits` depend on it; `mix_image` is the received mean
    image (same shape as one input), `mix_label` (C,) the mean label.
    """
    log_p = F.log_softmax(logits, dim=-1)  # (B, C)
    ce_own = F.nll_loss(log_p, y, reduction="none")  # (B,)
    ce_mean = -(log_p * mix_label.to(log_p.dtype)).sum(-1)  # (B,)
    # samples are independent, so the gradient of the sum is each sample's own input gradient
    (grad_x,) = torch.autograd.grad(ce_own.sum(), x_in, create_graph=True)  # (B, ...)
    taylor = grad_x.flatten(1) @ mix_image.flatten().to(grad_x.dtype)  # (B,)
    return (1 - lam) * ce_own + lam * ce_mean + lam * (1 - lam) * taylor


@METHODS.register()
class FedMix(VPTModel):
    name = "fedmix"
    Config = FedMixConfig

    def init_params(self, gen: torch.Generator) -> ServerState:
        return ServerState(super().init_params(gen), buffers=self.shared_means())

    def shared_means(self) -> dict[str, Tensor]:
        """What the clients share once: mean images and labels, and their averages."""
        task = self.task
        if task.train_images is None or task.train_idx is None or task.heldout is None:
            raise FpbenchError(
                "fedmix needs the clients' train images in TaskInfo (train_images, train_idx, "
                "heldout); build it with fpbench.engine.build.build_method"
            )
        sharing = [c for c in range(task.num_clients) if not task.heldout[c]]
        sharing = [c for c in sharing if len(task.train_idx[c])]
        images = torch.stack(
            [_mean_image(task.train_images, task.train_idx[c]) for c in sharing]
        )  # (M, 3, H, W) uint8
        labels = task.class_priors[sharing].float()  # (M, C)
        mix_image = sum(self.backbone.preprocess(ims).sum(0) for ims in images.split(256))
        mix_image = mix_image / len(images)  # (3, S, S) in the model's input space
        return {
            "mean_images": images,
            "mean_labels": labels,
            "mix_image": mix_image,
            "mix_label": labels.mean(0),
            "means_sent": torch.zeros((), dtype=torch.bool),
        }

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """FedVPT's logits; in training, the FedMix loss alone (its logits are of the scaled
        inputs, not of x: none are returned)."""
        if ctx.labels is None:
            return super().forward(params, x, client_index, ctx)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        lam = self.cfg.mix_ratio
        x_in = ((1 - lam) * x).detach().requires_grad_()  # (B, 3, S, S)
        with sdpa_kernel(SDPBackend.MATH):  # double backward needs the math attention kernel
            logits = super().forward(params, x_in, client_index, ctx)
            loss = fedmix_loss(
                logits, x_in, ctx.labels, ctx.buffers["mix_image"], ctx.buffers["mix_label"], lam
            )
        return Output(None, loss=loss)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        new = super().aggregate(server, updates)
        sent = torch.ones_like(server.buffers["means_sent"])
        return ServerState(new.params, new.personal, {**new.buffers, "means_sent": sent})

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        if bool(server.buffers["means_sent"]):
            return server.params, server.params
        means = {k: server.buffers[k] for k in ("mean_images", "mean_labels")}
        own = {k: v[:1] for k, v in means.items()}  # one client's own mean
        return {**server.params, **means}, {**server.params, **own}


def _mean_image(images: Tensor, idx: Tensor) -> Tensor:
    """Mean of images[idx] (3, H, W), rounded to uint8 as an image is sent."""
    total = torch.zeros(images.shape[1:], dtype=torch.float64, device=images.device)
    for chunk in idx.split(1024):
        total += images[chunk].double().sum(0)
    return (total / len(idx)).round().clamp(0, 255).to(torch.uint8)
