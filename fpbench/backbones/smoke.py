"""Offline pretraining of the `vit-smoke` backbone, cached once per recipe.

The smoke suite needs a frozen backbone whose features are useful but not perfect, and that
prompts can improve on, without any download. fpbench makes one itself: a small timm ViT
(`SMOKE_ARCH`: 32 px input, 8 px patches, width 128, 4 blocks, 4 heads, MLP ratio 2) is trained
by supervised classification on the synthetic dataset (`fpbench.data.synthetic`) with a
pretraining seed (1000) whose classes are unrelated to those of the suites (seed 0, 1, ...).
The data use the "pair" layout with a random cue: two objects per image, and a background tint
says which one is the label, so the backbone learns to read the cued object. The suites' images
carry no tint, and a prompt can learn to supply it.

Recipe (`SmokeRecipe`): full fine-tuning of the ViT plus a linear head on the cls token, AdamW
with linear warm-up and cosine decay, batches of 64 drawn with replacement, a fixed torch
seed, no augmentation (every synthetic sample already draws its own nuisances), 64 classes of
100 images. Only the backbone weights are kept: a timm state_dict without the head, saved as
`.pth`, which timm's file loader (`pretrained_cfg_overlay=dict(file=...)`) reads.

Cache: `<cache_dir>/vit-smoke-<recipe>-<numerics>.pth`, where cache_dir defaults to
`$FPBENCH_CACHE` or `~/.cache/fpbench`, the first hash covers the whole recipe (architecture,
data, optimisation) and the second everything else that decides the weights' bits: the thread
count, the CPU's kernel set, the torch, timm and numpy versions and this module's format
(`PRETRAIN_FORMAT`). So weights trained differently are never reused silently: the backbone is
trained for them. The file is written atomically (temporary file + `os.replace`) under an
exclusive `fcntl.flock` on `<file>.lock`, so concurrent processes train it once.

Pretraining resumes after an interruption (Ctrl-C, kill -9): every `SAVE_EVERY` steps the
model, optimiser, schedule and random state go to `<file>.partial` (atomically), which the next
attempt continues from; the result is tensor-identical to an uninterrupted pretraining.

Training always runs on the CPU and is deterministic for a given recipe and thread count
(tensor-identical across runs). Measured on 2 CPU cores: about 35 s. On new classes (synthetic
seed 0, 20 classes, 60 train / 30 test images each, pair layout without cue, the smoke suite's
data), trained centrally with Adam: a linear head on the frozen cls gets 33% (60 epochs), 10
VPT-shallow prompts plus the head 42% (40 epochs). The earlier one-object recipe (256 classes
of 25, two style domains) gave the head 36-40% and prompts no gain.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fpbench.determinism import deterministic
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch

SMOKE_TIMM_NAME = "test_vit"
SMOKE_ARCH: dict[str, Any] = dict(
    img_size=32,
    patch_size=8,
    embed_dim=128,
    depth=4,
    num_heads=4,
    mlp_ratio=2.0,
    dynamic_img_size=False,
)
PRETRAIN_FORMAT = 2  # bump when the pretraining code changes its result for the same recipe
SAVE_EVERY = 100  # steps between the partial states a pretraining resumes from
SMOKE_MEAN = (0.5, 0.5, 0.5)
SMOKE_STD = (0.5, 0.5, 0.5)

Progress = Callable[[int, int, float], None]  # (step, total_steps, loss)


@dataclass(frozen=True)
class SmokeRecipe:
    """Everything that determines the pretrained weights (hashed into the cache file name).

    Attributes:
        arch: timm architecture overrides of `timm_name`.
        timm_name: timm model the architecture overrides apply to.
        num_classes: Synthetic pretraining classes.
        num_coarse: Synthetic coarse groups (classes of a group share colours).
        train_per_class: Synthetic train images per class.
        num_domains: Synthetic style domains.
        layout: Synthetic layout ("pair": two objects per image).
        cue: Synthetic cue ("random": a tint says which object is the label).
        noise: Synthetic pixel noise sd.
        data_seed: Synthetic seed (suites use small seeds; this one is far from them).
        steps: Optimiser steps.
        batch_size: Images per step.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps before the cosine decay.
        torch_seed: Seed of the head/backbone init and of the batch order.
    """

    arch: dict[str, Any] = field(default_factory=lambda: dict(SMOKE_ARCH), hash=False)
    timm_name: str = SMOKE_TIMM_NAME
    num_classes: int = 64
    num_coarse: int = 64
    train_per_class: int = 100
    num_domains: int = 1
    layout: str = "pair"
    cue: str = "random"
    noise: float = 0.05
    data_seed: int = 1000
    steps: int = 1200
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_steps: int = 20
    torch_seed: int = 0

    def digest(self) -> str:
        """A short stable hash of the recipe."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def default_cache_dir() -> Path:
    """`$FPBENCH_CACHE`, else `~/.cache/fpbench`."""
    return Path(os.environ.get("FPBENCH_CACHE") or Path.home() / ".cache" / "fpbench")


def ensure_pretrained(
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    recipe: SmokeRecipe | None = None,
) -> Path:
    """Path of the cached vit-smoke weights, pretraining them first if absent.

    Args:
        cache_dir: Cache folder (default: `default_cache_dir()`).
        progress: Called as progress(step, total_steps, loss) while training.
        recipe: Override of the default recipe (tests use a tiny one).
    """
    recipe = recipe or SmokeRecipe()
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = folder / f"vit-smoke-{recipe.digest()}-{numerics_digest()}.pth"
    if path.is_file():
        return path
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(path.with_name(path.name + ".lock")):
            if not path.is_file():  # another process may have finished while we waited
                partial = path.with_name(path.name + ".partial")
                _save_atomic(pretrain(recipe, progress, partial=partial), path)
                partial.unlink(missing_ok=True)
    except OSError as err:
        raise FpbenchError(
            f"cannot write the vit-smoke weights cache {str(folder)!r} ({err.strerror or err}); "
            "set FPBENCH_CACHE to a writable folder"
        ) from err
    return path


def numerics(threads: int | None = None) -> dict[str, Any]:
    """What besides the recipe decides the pretrained weights' bits (`threads`: the count the
    pretraining computes with, default this process's)."""
    import numpy
    import timm

    return {
        "threads": threads or torch.get_num_threads(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "numpy": numpy.__version__,
        "format": PRETRAIN_FORMAT,
    }


def numerics_digest(threads: int | None = None) -> str:
    """A short stable hash of `numerics(threads)`."""
    text = json.dumps(numerics(threads), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _save_atomic(state_dict: dict[str, Any], path: Path) -> None:
    buffer = io.BytesIO()  # saving to a buffer keeps the bytes independent of the tmp name
    torch.save(state_dict, buffer)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(buffer.getvalue())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pretrain(
    recipe: SmokeRecipe,
    progress: Progress | None = None,
    *,
    partial: Path | None = None,
    save_every: int | None = None,
) -> dict[str, torch.Tensor]:
    """Train the recipe's ViT + linear head; return the backbone state_dict (no head).

    `partial`: where the state is saved every `save_every` steps (default `SAVE_EVERY`) and
    resumed from.
    """
    import timm

    images, labels = _pretraining_data(recipe)
    with torch.random.fork_rng(devices=[]), deterministic(True):  # the same file everywhere
        torch.manual_seed(recipe.torch_seed)
        model = timm.create_model(recipe.timm_name, num_classes=recipe.num_classes, **recipe.arch)
        _train(model, images, labels, recipe, progress, partial, save_every or SAVE_EVERY)
    model.reset_classifier(0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pretraining_data(recipe: SmokeRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized float train images (N, 3, S, S) and labels (N,) of the pretraining classes."""
    from fpbench.backbones.vit import preprocess_images
    from fpbench.data.synthetic import Synthetic

    size = int(recipe.arch.get("img_size", 32))
    cfg = Synthetic.Config(
        num_classes=recipe.num_classes,
        image_size=size,
        train_per_class=recipe.train_per_class,
        test_per_class=recipe.num_domains,
        num_coarse=recipe.num_coarse,
        num_domains=recipe.num_domains,
        layout=recipe.layout,
        cue=recipe.cue,
        noise=recipe.noise,
        seed=recipe.data_seed,
    )
    data = Synthetic.load(cfg, default_cache_dir())
    return preprocess_images(data.train_images, size, SMOKE_MEAN, SMOKE_STD), data.train_labels


def _train(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    recipe: SmokeRecipe,
    progress: Progress | None,
    partial: Path | None = None,
    save_every: int = SAVE_EVERY,
) -> None:
    """AdamW with warm-up + cosine decay on seeded random batches (global RNG already seeded),
    from the state in `partial` where there is one, saving it there every `save_every` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, recipe))
    start = _resume(partial, model, opt, sched, recipe)
    model.train()
    for step in range(start, recipe.steps):
        if partial is not None and step > start and step % save_every == 0:
            state = {
                "recipe": recipe.digest(),
                "step": step,
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": torch.get_rng_state(),
            }
            _save_atomic(state, partial)
        idx = torch.randint(0, labels.shape[0], (recipe.batch_size,))  # (b,)
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if progress is not None:
            progress(step + 1, recipe.steps, loss.item())
    model.eval()


def _resume(
    partial: Path | None,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    recipe: SmokeRecipe,
) -> int:
    """Load the saved state into the training objects; the step to go on from (0: none)."""
    if partial is None or not partial.is_file():
        return 0
    try:
        state = torch.load(partial, weights_only=True)
        step = int(state["step"])
        parts = state["model"], state["opt"], state["sched"], state["rng"]
    except Exception:  # noqa: BLE001 - unreadable (cut short by a full disk): start over
        return 0
    if state.get("recipe") != recipe.digest():
        return 0
    model.load_state_dict(parts[0])
    opt.load_state_dict(parts[1])
    sched.load_state_dict(parts[2])
    torch.set_rng_state(parts[3])
    return step


def _lr_factor(step: int, recipe: SmokeRecipe) -> float:
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    span = max(1, recipe.steps - recipe.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - recipe.warmup_steps) / span)))
