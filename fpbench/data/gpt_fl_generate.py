"""GPT-FL's generated training set: text-to-image synthesis from the class names, and its reader.

GPT-FL (Zhang et al., CVPR 2025) writes prompts from the label names and lets a text-to-image
model (Stable Diffusion 2.1 in the paper) synthesise a labelled dataset that the server trains
on before federated training. `generate_images` does this with a local diffusers pipeline (no
download: `local_files_only`); `load_generated` reads the folder back for the `gpt-fl` method.

Layout: ``<dir>/<class name with underscores>/<00000>.png``; the reader also accepts folders
named exactly like the class or with spaces. Prompts: ``"a photo of a {class}."`` (the paper also
uses language-model-written captions; `template` changes the wording).

The generator's settings (`Generation`: model, images per class, prompt template, denoising
steps, guidance scale, seed, precision) are written beside the images as ``generation.json``;
gpt-fl's `generation` setting names the ones a run expects, so they are part of its config (and
its protocol), and a folder generated otherwise is refused (`check_generated`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


MANIFEST = "generation.json"


class Generation(BaseModel):
    """How GPT-FL's synthetic set is generated (recorded in the set's ``generation.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "stable-diffusion-2-1",
        description="the text-to-image model's name (its local folder's name; GPT-FL: Stable "
        "Diffusion 2.1)",
    )
    per_class: int = Field(100, ge=1, description="images per class")
    template: str = Field("a photo of a {}.", description="prompt; {} is the class name")
    steps: int = Field(50, ge=1, description="denoising steps")
    guidance_scale: float = Field(7.5, ge=0, description="classifier-free guidance scale")
    seed: int = Field(0, ge=0, description="image i of class c: seed * 1000003 + c * 10007 + i")
    precision: Literal["auto", "fp16", "fp32"] = Field(
        "auto", description="the pipeline's dtype; auto: fp16 on CUDA, fp32 on the CPU"
    )


def read_manifest(root: Path) -> Generation | None:
    """The settings a generated folder was made with, or None for a folder without them."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        return Generation.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as e:
        raise FpbenchError(
            f"{path}: not a generation manifest ({str(e).splitlines()[0]})"
        ) from None


def check_manifest(root: Path, want: Generation) -> None:
    """Fail when `root` was generated with other settings than `want` (a folder without a
    manifest, generated outside fpbench, is taken as it is)."""
    got = read_manifest(root)
    if got is None or got == want:
        return
    differ = {
        k: (v, getattr(want, k)) for k, v in got.model_dump().items() if v != getattr(want, k)
    }
    shown = ", ".join(f"{k} = {g!r} (expected {w!r})" for k, (g, w) in differ.items())
    raise FpbenchError(
        f"synthetic_dir {str(root)!r} was generated with {shown}: regenerate it or set "
        "gpt-fl's generation to match"
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


def check_generated(root: Path, num_classes: int, generation: Generation | None = None) -> None:
    """Fail unless `root` holds a class folder with images for each of `num_classes` classes
    (and, given `generation`, was made with those settings: `check_manifest`).

    Cheap (folder listings only), for checks made before anything is written; the class names
    are matched when the images are read (`load_generated`).

    Raises:
        FpbenchError: the folder is missing, a class folder holds no image, or there are fewer
            class folders with images than classes.
    """
    if not root.is_dir():
        raise FpbenchError(f"synthetic_dir {str(root)!r} does not exist; generate it first")
    if generation is not None:
        check_manifest(root, generation)
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
    guidance_scale: float = 7.5,
    precision: str = "auto",
    device: str = "auto",
) -> int:
    """Fill out_dir/<class>/ with per_class images each; returns the number written.

    The settings (`Generation`, the model named by its folder) go to out_dir/generation.json
    first. Raises FpbenchError (with what to install or download) when diffusers or the model
    folder is missing, or when out_dir was begun with other settings. Existing files are kept,
    so an interrupted run resumes.
    """
    require_text_to_image(model)
    gen_cfg = Generation(
        model=Path(model).resolve().name, per_class=per_class, template=template, steps=steps,
        guidance_scale=guidance_scale, seed=seed, precision=precision,  # type: ignore[arg-type]
    )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    check_manifest(out_dir, gen_cfg)
    (out_dir / MANIFEST).write_text(json.dumps(gen_cfg.model_dump(mode="json"), indent=1) + "\n")
    from diffusers import AutoPipelineForText2Image

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    half = precision == "fp16" or (precision == "auto" and dev.startswith("cuda"))
    dtype = torch.float16 if half else torch.float32
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
            pipe(
                prompt, generator=gen, num_inference_steps=steps, guidance_scale=guidance_scale
            ).images[0].save(path)
            written += 1
    return written
