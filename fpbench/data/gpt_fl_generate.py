"""GPT-FL's generated training set: text-to-image synthesis from the class names, and its reader.

GPT-FL (Zhang et al., CVPR 2025) writes prompts from the label names and lets a text-to-image
model (Stable Diffusion 2.1 in the paper) synthesise a labelled dataset that the server trains
on before federated training. `generate_images` does this with a local diffusers pipeline (no
download: `local_files_only`); `load_generated` reads the folder back for the `gpt-fl` method.

Layout: ``<dir>/<class name with underscores>/<00000>.png``; the reader also accepts folders
named exactly like the class or with spaces. Prompts: ``"a photo of a {class}."`` (the paper also
uses language-model-written captions; `template` changes the wording).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fpbench.data.prepared import hwc_to_chw, square_crop
from fpbench.errors import FpbenchError
from fpbench.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
INSTALL_HINT = (
    "GPT-FL image generation needs the diffusers package and a local text-to-image model: "
    "pip install diffusers transformers accelerate, download a model folder (e.g. "
    "stabilityai/stable-diffusion-2-1 with `huggingface-cli download`) and pass it as --model"
)


def clean_name(name: str) -> str:
    """A class name as words (CoOp's convention: underscores become spaces)."""
    return name.replace("_", " ").strip()


def folder_name(name: str) -> str:
    """The folder of one class in a generated set."""
    return clean_name(name).replace(" ", "_")


def class_folder(root: Path, name: str) -> Path:
    """The folder of one class: underscores, the name as given, or with spaces."""
    for candidate in (folder_name(name), name, clean_name(name)):
        if (root / candidate).is_dir():
            return root / candidate
    raise FpbenchError(
        f"no folder for class {name!r} in synthetic_dir {str(root)!r}; "
        f"expected {str(root / folder_name(name))!r} (see `fpbench data generate-gpt-fl`)"
    )


def image_files(folder: Path) -> list[Path]:
    """The image files of one class folder, sorted."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)


def check_generated(root: Path, num_classes: int) -> None:
    """Fail unless `root` holds a class folder with images for each of `num_classes` classes.

    Cheap (folder listings only), for checks made before anything is written; the class names
    are matched when the images are read (`load_generated`).

    Raises:
        FpbenchError: the folder is missing, a class folder holds no image, or there are fewer
            class folders with images than classes.
    """
    if not root.is_dir():
        raise FpbenchError(f"synthetic_dir {str(root)!r} does not exist; generate it first")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    empty = [p.name for p in folders if not image_files(p)]
    if empty:
        raise FpbenchError(
            f"synthetic_dir {str(root)!r}: class folder(s) {empty[:5]} hold no images "
            "(see `fpbench data generate-gpt-fl`)"
        )
    if len(folders) < num_classes:
        raise FpbenchError(
            f"synthetic_dir {str(root)!r} holds images for {len(folders)} classes, the dataset "
            f"has {num_classes} (see `fpbench data generate-gpt-fl`)"
        )


def load_generated(
    root: Path, class_names: list[str], size: int | None = None
) -> tuple[Tensor, Tensor]:
    """Generated images as uint8 (n, 3, S, S) and labels (n,).

    Each image is resized (bicubic) so its shorter side is `size` and centre-cropped to a
    square, as CLIP's preprocessing does, which bounds memory (Stable Diffusion writes 768 px);
    `size` None: the first image's shorter side.
    """
    from PIL import Image

    if not root.is_dir():
        raise FpbenchError(f"synthetic_dir {str(root)!r} does not exist; generate it first")
    images: list[np.ndarray] = []  # (S, S, 3) each
    labels: list[int] = []
    for label, name in enumerate(class_names):
        folder = class_folder(root, name)
        files = image_files(folder)
        if not files:
            raise FpbenchError(f"synthetic_dir {str(root)!r}: class {name!r} has no images")
        for path in files:
            with Image.open(path) as im:
                rgb = im.convert("RGB")
            size = size or min(rgb.size)
            images.append(np.asarray(square_crop(rgb, size), dtype=np.uint8))
            labels.append(label)
    if not images:
        raise FpbenchError(f"synthetic_dir {str(root)!r} holds no images")
    return hwc_to_chw(np.stack(images)), torch.tensor(labels)


def require_text_to_image(model: Path) -> None:
    """Raise FpbenchError saying what to install or download unless generation can run."""
    import importlib.util

    if importlib.util.find_spec("diffusers") is None:
        raise FpbenchError(INSTALL_HINT)
    if not model.is_dir():
        raise FpbenchError(f"text-to-image model folder {str(model)!r} not found; {INSTALL_HINT}")


def generate_images(
    class_names: list[str],
    out_dir: Path,
    model: Path,
    per_class: int,
    *,
    seed: int = 0,
    template: str = "a photo of a {}.",
    steps: int = 50,
    device: str = "auto",
) -> int:
    """Fill out_dir/<class>/ with per_class images each; returns the number written.

    Raises FpbenchError (with what to install or download) when diffusers or the model folder
    is missing. Existing files are kept, so an interrupted run resumes.
    """
    require_text_to_image(model)
    from diffusers import AutoPipelineForText2Image

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = torch.float16 if dev.startswith("cuda") else torch.float32
    pipe = AutoPipelineForText2Image.from_pretrained(
        str(model), local_files_only=True, torch_dtype=dtype
    ).to(dev)
    pipe.set_progress_bar_config(disable=True)
    written = 0
    for c, name in enumerate(class_names):
        folder = out_dir / folder_name(name)
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            path = folder / f"{i:05d}.png"
            if path.exists():
                continue
            gen = torch.Generator(dev).manual_seed(seed * 1_000_003 + c * 10_007 + i)
            prompt = template.format(clean_name(name))
            pipe(prompt, generator=gen, num_inference_steps=steps).images[0].save(path)
            written += 1
    return written
