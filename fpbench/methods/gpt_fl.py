"""GPT-FL: a prompt pretrained by the server on generated images, then federated as PromptFL.

GPT-FL (Zhang, Feng, Alam, Dimitriadis, Lee, Zhang, Narayanan, Avestimehr, "GPT-FL: Generative
Pre-trained Model-Assisted Federated Learning", CVPR 2025; arXiv 2306.02210), a baseline of
SDFed. The original (1) writes prompts from the label names, (2) lets a text-to-image model
synthesise a labelled dataset, (3) trains the downstream model centrally on it at the server and
(4) uses that model to initialise standard FedAvg on the private client data; no client data is
used in (1)-(3). On a frozen CLIP (as SDFed runs it) the downstream model is CoOp's context:
the server CoOp-trains it for `server_epochs` on the generated images (CoOp's recipe: SGD,
lr 0.002, momentum 0.9, batch 32), then federated training is exactly PromptFL (sample-size
weighted FedAvg of the context, global inference).

The generated images are read from `synthetic_dir` (`fpbench data generate-gpt-fl` writes it
with a local diffusers model; layout in `fpbench.data.gpt_fl_generate`); "{dataset}" in it
stands for the cell's dataset, so one suite entry names every dataset's folder. Without the
images GPT-FL would be PromptFL under another name, so a run without them stops with one line
saying how to make them (checked before a suite writes anything); `server_epochs = 0` is the
explicit opt-out (PromptFL from CoOp's init, for the offline smoke suites and tests). The
generated set is encoded once by the frozen image encoder (no augmentation) at the start of
the run. `generation` records how the set was generated (model, images per class, prompt,
steps, guidance, seed, precision): a folder whose ``generation.json`` says otherwise is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from fpbench.data.gpt_fl_generate import Generation, check_generated, check_manifest, load_generated
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.coop import CoOpConfig, CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class GPTFLConfig(CoOpConfig):
    synthetic_dir: str | None = Field(
        None, description='generated images <dir>/<class>/*.png; "{dataset}": the cell\'s dataset'
    )
    server_epochs: int = Field(50, ge=0, description="server-side CoOp epochs on generated data")
    server_lr: float = Field(0.002, gt=0)
    server_batch_size: int = Field(32, ge=1)
    generation: Generation = Field(
        Generation(),
        description="the generator settings synthetic_dir must have been made with (its "
        "generation.json; a folder without one is taken as it is)",
    )


def generated_dir(args: GPTFLConfig | dict, dataset: str) -> Path | None:
    """The folder of generated images a GPT-FL cell reads, or None with `server_epochs = 0`.

    Raises:
        FpbenchError: the images are needed but not named or not there (one line saying how to
            make them).
    """
    cfg = args if isinstance(args, GPTFLConfig) else GPTFLConfig(**args)
    if cfg.server_epochs == 0:
        return None
    how = f"fpbench data generate-gpt-fl {dataset} --out DIR --model /path/to/text-to-image"
    if not cfg.synthetic_dir:
        raise FpbenchError(
            f"gpt-fl needs generated images: run `{how}` and set synthetic_dir = DIR "
            "(or server_epochs = 0 for PromptFL without them)"
        )
    root = Path(cfg.synthetic_dir.replace("{dataset}", dataset))
    if not root.is_dir():
        raise FpbenchError(
            f"gpt-fl needs generated images in {str(root)!r}: run `{how.replace('DIR', str(root))}`"
        )
    return root


def require_generated(cells: list[Any]) -> None:
    """Fail fast, before a suite writes anything, when a GPT-FL cell lacks its images: its
    folder, or a class folder with images for every class of the cell's dataset."""
    from fpbench.registry import DATASETS

    for cell in cells:
        if cell.method.name == GPTFL.name:
            root = generated_dir(cell.method.args, cell.dataset.name)
            if root is not None:
                dataset = DATASETS.get(cell.dataset.name)
                info = dataset.info(dataset.Config(**cell.dataset.args))
                args = GPTFLConfig(**cell.method.args)
                check_generated(root, info.num_classes, args.generation)


@METHODS.register()
class GPTFL(CoOpModel):
    name = "gpt-fl"
    Config = GPTFLConfig

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        ctx = self.init_context(gen)
        root = generated_dir(self.cfg, self.task.dataset or "DATASET")
        if root is None:
            return {"ctx": ctx}
        check_manifest(root, self.cfg.generation)
        names = list(self.task.class_names)
        images, labels = load_generated(root, names, size=self.backbone.img_size)
        return {"ctx": self.pretrain(ctx, self.generated_features(images), labels, gen)}

    def generated_features(self, images: Tensor, batch_size: int = 64) -> Tensor:
        """Frozen image features (n, E) of generated uint8 images (n, 3, H, W)."""
        with torch.no_grad():
            device = self.backbone.model.logit_scale.device
            feats = [
                self.backbone.encode_image(self.backbone.preprocess(chunk.to(device)))
                for chunk in images.split(batch_size)
            ]
            return torch.cat(feats).float()

    def pretrain(self, ctx: Tensor, feats: Tensor, labels: Tensor, gen: torch.Generator) -> Tensor:
        """Server-side CoOp training of the context (M, d) on frozen features (n, E)."""
        feats, labels = F.normalize(feats.float(), dim=-1), labels.to(feats.device)
        leaf = ctx.to(feats.device).unsqueeze(0).requires_grad_(True)  # (1, M, d)
        opt = torch.optim.SGD([leaf], lr=self.cfg.server_lr, momentum=0.9)
        rows = torch.zeros(len(labels), dtype=torch.long, device=feats.device)
        for _ in range(self.cfg.server_epochs):
            order = torch.randperm(len(labels), generator=gen).to(feats.device)
            for idx in order.split(self.cfg.server_batch_size):
                logits = self.logits(feats[idx], self.text_features(leaf), rows[idx])
                loss = F.cross_entropy(logits, labels[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        return leaf.detach()[0].to(ctx.device)
