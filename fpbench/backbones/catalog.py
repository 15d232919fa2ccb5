"""The registered backbones' recipes: which timm or open_clip model, which weights, how they load.

`BackboneSpec` (a timm ViT) and `ClipSpec` (an open_clip CLIP) are what `fpbench.registry.BACKBONES`
holds. Their `create` builds the frozen model (`PromptedViT`, `PromptedCLIP`) through the library's
own weight-loading path: hub weights, a local file, fpbench's self-pretrained `vit-smoke`
weights, or a seeded random init. This module imports no torch, timm or open_clip until a
backbone is built, so registering the backbones and loading a suite stay light.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fpbench.backbones.smoke import (
    SMOKE_ARCH,
    SMOKE_MEAN,
    SMOKE_STD,
    SMOKE_TIMM_NAME,
    default_cache_dir,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch

if TYPE_CHECKING:
    from timm.models.vision_transformer import VisionTransformer
    from torch import nn

    from fpbench.backbones.clip import PromptedCLIP
    from fpbench.backbones.vit import PromptedViT

_TINY_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "fpbench-clip-test": {
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 16, "layers": 2, "width": 32, "patch_size": 8,
                       "head_width": 16},
        "text_cfg": _TINY_TEXT,
    },
    "fpbench-clip-test-rn": {
        "embed_dim": 32,
        "quick_gelu": True,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
        "text_cfg": _TINY_TEXT,
    },
}  # fmt: skip


@dataclass(frozen=True)
class BackboneSpec:
    """A registered ViT backbone: which timm model, which weights, which normalization.

    Attributes:
        name: Registry name (e.g. "vit-b16-in21k").
        timm_name: timm model name, with pretrained tag where it matters.
        timm_kwargs: Extra `timm.create_model` arguments (architecture overrides).
        description: One line for `fpbench list backbones`.
        pretrained: "hub" (timm / Hugging Face hub), "smoke" (fpbench's own offline
            pretraining, see `fpbench.backbones.smoke`) or "none" (seeded random init).
        mean: Normalization mean override (default: timm's pretrained_cfg).
        std: Normalization std override (default: timm's pretrained_cfg).
        seed: Seed of the random init (used before any weights are loaded).
    """

    name: str
    timm_name: str
    timm_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    description: str = ""
    pretrained: Literal["hub", "smoke", "none"] = "none"
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    seed: int = 0

    def create(
        self,
        weights: str | Path | None = None,
        cache_dir: Path | None = None,
        pretrained: bool = True,
    ) -> PromptedViT:
        """Build the frozen `PromptedViT`; see `fpbench.backbones.create_backbone`."""
        if not pretrained:
            model = self._timm(pretrained=False)
        elif weights is not None:
            model = self._from_file(Path(weights).expanduser())
        elif self.pretrained == "hub":
            model = self._from_hub()
        elif self.pretrained == "smoke":
            from fpbench.backbones import smoke

            model = self._from_file(smoke.ensure_pretrained(cache_dir))
        else:
            model = self._timm(pretrained=False)
        from fpbench.backbones.vit import PromptedViT

        return PromptedViT(model, name=self.name, mean=self.mean, std=self.std)

    def missing(self, weights: str | None, reachable: Callable[[], bool]) -> str | None:
        """What `create` would miss to build this backbone (its message), else None.

        Loads nothing: a named file must exist; hub weights must be in the Hugging Face cache
        `create` reads, or the hub reachable (`reachable`, asked only then) to download them.
        """
        if weights is not None:
            return _missing_file(Path(weights).expanduser().absolute(), self.name)
        if self.pretrained != "hub" or _hub_cached_file(self.timm_name) is not None:
            return None  # built offline (seeded or fpbench's own pretraining), or cached
        return None if reachable() else self._download_hint("no network, or HF_HUB_OFFLINE is set")

    def _timm(self, **kwargs: Any) -> VisionTransformer:
        """timm.create_model with a seeded init that leaves the global RNG untouched."""
        import timm

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return timm.create_model(self.timm_name, num_classes=0, **self.timm_kwargs, **kwargs)

    def _from_file(self, path: Path) -> VisionTransformer:
        """Load a local weights file through timm's `pretrained_cfg_overlay=dict(file=...)`."""
        if (missing := _missing_file(path, self.name)) is not None:
            raise FpbenchError(missing)
        overlay: dict[str, Any] = {"file": str(path), "custom_load": path.suffix == ".npz"}
        if self.pretrained != "hub":
            overlay["num_classes"] = 0  # fpbench's own files have no head: load strictly
        try:
            return self._timm(pretrained=True, pretrained_cfg_overlay=overlay)
        except Exception as err:  # unreadable file, wrong format or wrong architecture
            raise FpbenchError(
                f"weights file {str(path)!r} does not fit backbone {self.name} "
                f"({self.timm_name}): {_first_line(err)}"
            ) from err

    def _from_hub(self) -> VisionTransformer:
        """Download (or reuse cached) hub weights; fail fast and clearly when offline."""
        cached = _hub_cached_file(self.timm_name)
        if cached is not None and _hub_offline():
            return self._from_file(cached)  # no network call at all
        if cached is None and not _hub_reachable():
            raise FpbenchError(self._download_hint("no network, or HF_HUB_OFFLINE is set"))
        try:
            return self._timm(pretrained=True)
        except Exception as err:  # any hub / network failure ends up here
            raise FpbenchError(self._download_hint(_first_line(err))) from err

    def _download_hint(self, why: str) -> str:
        return (
            f"the weights for {self.name} ({self.timm_name}) could not be downloaded ({why}); "
            "run once with network access, or give a local file in the suite: "
            f'backbone = {{ name = "{self.name}", weights = "PATH" }}'
        )


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it only at import time)."""
    import huggingface_hub.constants as hf

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return hf.HF_HUB_OFFLINE or flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_cached_file(timm_name: str) -> Path | None:
    """The hub weights file of a timm model if it is already in the Hugging Face cache."""
    import timm
    from huggingface_hub import try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(timm_name)
    repo = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not repo:
        return None
    names = [getattr(cfg, "hf_hub_filename", None), "model.safetensors", "pytorch_model.bin"]
    for name in filter(None, names):
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return Path(found)
    return None


def _missing_file(path: Path, name: str) -> str | None:
    """The message for a `backbone.weights` file that is not there, else None."""
    if path.is_file():
        return None
    return (
        f"backbone weights file {str(path)!r} for {name} does not exist; "
        "fix backbone.weights in the suite"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so an offline machine fails in seconds.

    Under an HTTP(S) proxy the probe is skipped (the proxy decides).
    """
    if _hub_offline():
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    import huggingface_hub.constants as hf

    url = urllib.parse.urlparse(hf.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class ClipSpec:
    """A registered CLIP backbone.

    Attributes:
        name: Registry name (e.g. "clip-vit-b16").
        model_name: open_clip architecture (OpenAI weights need the -quickgelu variants).
        description: One line for `fpbench list backbones`.
        pretrained: "openai" (open_clip's pretrained `tag`, or a local file), "seeded" (a tiny
            config: a seeded random init saved once to the cache and loaded from that file) or
            "file" (only a local weights file).
        tag: open_clip's pretrained tag ("openai", "laion2b_s34b_b79k", ...).
        hf_repo: Hugging Face repo of the open_clip weights, for the offline cache lookup.
        own_tokenizer: the architecture's own tokenizer (else ViT-B-16's, as OpenAI's CLIPs).
        seed: Seed of the random init.
    """

    name: str
    model_name: str
    description: str = ""
    pretrained: Literal["openai", "seeded", "file"] = "seeded"
    tag: str = "openai"
    hf_repo: str = ""
    own_tokenizer: bool = False
    seed: int = 0

    def create(
        self,
        weights: str | Path | None = None,
        cache_dir: Path | None = None,
        pretrained: bool = True,
    ) -> PromptedCLIP:
        """Build the frozen `PromptedCLIP`; see `fpbench.backbones.create_backbone`."""
        import open_clip

        _register_tiny_configs(cache_dir)
        if not pretrained:
            model = self._random()
        elif weights is not None:
            model = self._from_file(Path(weights).expanduser())
        elif self.pretrained == "seeded":
            model = self._from_file(self._seeded_file(cache_dir))
        elif self.pretrained == "file":
            raise FpbenchError(self._tagless())
        else:
            model = self._from_openai()
        from fpbench.backbones.clip import PromptedCLIP, openai_tokenizer

        own = self.own_tokenizer
        tokenizer = open_clip.get_tokenizer(self.model_name) if own else openai_tokenizer()

        return PromptedCLIP(model, name=self.name, tokenizer=tokenizer)

    def missing(self, weights: str | None, reachable: Callable[[], bool]) -> str | None:
        """What `create` would miss to build this backbone (its message), else None.

        Loads nothing: a named file must exist; OpenAI-tagged weights must be in the Hugging
        Face cache `create` reads, or the hub reachable (`reachable`, asked only then).
        """
        if weights is not None:
            return _missing_file(Path(weights).expanduser().absolute(), self.name)
        if self.pretrained == "file":
            return self._tagless()
        if self.pretrained == "seeded" or hf_cached_file(self.hf_repo) is not None:
            return None
        return None if reachable() else self._download_hint("no network, or HF_HUB_OFFLINE is set")

    def _tagless(self) -> str:
        return (
            f"{self.name} names no pretrained tag: give backbone.weights = PATH, or a tag "
            f"(open_clip:{self.model_name}@TAG; `open_clip.list_pretrained()` lists them)"
        )

    def _random(self) -> nn.Module:
        import open_clip

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return open_clip.create_model(self.model_name, pretrained=None)

    def _seeded_file(self, cache_dir: Path | None) -> Path:
        """The tiny model's seeded random weights, saved once as a state_dict file."""
        import open_clip

        cfg = json.dumps([TINY_CONFIGS.get(self.model_name), self.seed, open_clip.__version__])
        key = hashlib.sha256(cfg.encode()).hexdigest()[:12]
        path = (cache_dir or default_cache_dir()) / f"{self.name}-{key}.pth"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(self._random().state_dict(), tmp)
            tmp.replace(path)
        return path

    def _from_file(self, path: Path) -> nn.Module:
        import open_clip

        if (missing := _missing_file(path, self.name)) is not None:
            raise FpbenchError(missing)
        try:  # OpenAI's TorchScript archives (.pt) cannot load with weights_only=True
            return open_clip.create_model(
                self.model_name, pretrained=str(path), weights_only=path.suffix != ".pt"
            )
        except Exception as err:
            raise FpbenchError(
                f"weights file {str(path)!r} does not fit backbone {self.name} "
                f"({self.model_name}): {_first_line(err)}"
            ) from err

    def _from_openai(self) -> nn.Module:
        import open_clip

        cached = hf_cached_file(self.hf_repo)
        if cached is not None:
            return self._from_file(cached)
        if not _hub_reachable():
            raise FpbenchError(self._download_hint("no network, or HF_HUB_OFFLINE is set"))
        try:
            return open_clip.create_model(self.model_name, pretrained=self.tag)
        except Exception as err:
            raise FpbenchError(self._download_hint(_first_line(err))) from err

    def _download_hint(self, why: str) -> str:
        import open_clip

        cfg = open_clip.get_pretrained_cfg(self.model_name, self.tag) or {}
        url = f"https://huggingface.co/{self.hf_repo}/resolve/main/open_clip_model.safetensors"
        return (
            f"the {self.tag} weights of {self.name} ({self.model_name}) are missing ({why}); "
            f"download {url} (or {cfg.get('url', 'the OpenAI .pt archive')}) and set "
            f'backbone = {{ name = "{self.name}", weights = "PATH" }} in the suite'
        )


def hf_cached_file(repo: str) -> Path | None:
    """The open_clip weights of a Hugging Face repo if already in the local hub cache."""
    if not repo:
        return None
    from huggingface_hub import try_to_load_from_cache

    for name in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
        found = try_to_load_from_cache(repo, name)
        if isinstance(found, str):
            return Path(found)
    return None


def _register_tiny_configs(cache_dir: Path | None) -> None:
    """Make the tiny configs known to open_clip by its public `add_model_config` (once)."""
    import open_clip

    missing = [n for n in TINY_CONFIGS if n not in open_clip.list_models()]
    if not missing:
        return
    folder = (cache_dir or default_cache_dir()) / "open_clip_configs"
    folder.mkdir(parents=True, exist_ok=True)
    for name in missing:
        path = folder / f"{name}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(TINY_CONFIGS[name], indent=1))
        tmp.replace(path)
        open_clip.add_model_config(path)


CLIP_SPECS = (
    ClipSpec(
        name="clip-test",
        model_name="fpbench-clip-test",
        description="Test-sized CLIP (ViT 16 px, width 32, 2+2 layers), seeded random weights",
    ),
    ClipSpec(
        name="clip-test-rn",
        model_name="fpbench-clip-test-rn",
        description="Test-sized CLIP (ModifiedResNet 32 px, width 8), seeded random weights",
    ),
    ClipSpec(
        name="clip-vit-b16",
        model_name="ViT-B-16-quickgelu",
        description="CLIP ViT-B/16, OpenAI weights (QuickGELU)",
        pretrained="openai",
        hf_repo="timm/vit_base_patch16_clip_224.openai",
    ),
    ClipSpec(
        name="clip-rn50",
        model_name="RN50-quickgelu",
        description="CLIP RN50, OpenAI weights (QuickGELU)",
        pretrained="openai",
        hf_repo="timm/resnet50_clip.openai",
    ),
)

VIT_TEST_ARCH = dict(
    img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
    dynamic_img_size=False,
)  # fmt: skip

VIT_SPECS = (
    BackboneSpec(
        name="vit-test",
        timm_name="test_vit",
        timm_kwargs=VIT_TEST_ARCH,
        description="Test-sized ViT (16 px, 2 blocks, width 32), seeded random init",
        pretrained="none",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
    ),
    BackboneSpec(
        name="vit-smoke",
        timm_name=SMOKE_TIMM_NAME,
        timm_kwargs=SMOKE_ARCH,
        description="Small ViT (32 px, 4 blocks, width 128) pretrained offline on synthetic data",
        pretrained="smoke",
        mean=SMOKE_MEAN,
        std=SMOKE_STD,
    ),
    BackboneSpec(
        name="vit-ti16-d4",
        timm_name="vit_tiny_patch16_224",
        timm_kwargs={"depth": 4},
        description="ViT-Ti/16 cut to 4 blocks (224 px, width 192), seeded random init or a "
        "weights file: the tiny side-by-side setting with the official SGPT code",
        pretrained="none",
    ),
    BackboneSpec(
        name="vit-b16-in21k",
        timm_name="vit_base_patch16_224.orig_in21k",
        description="ViT-B/16, original Google ImageNet-21k weights (SGPT/FGPT/PEP-FedPT)",
        pretrained="hub",
    ),
    BackboneSpec(
        name="vit-b16-augreg-in21k",
        timm_name="vit_base_patch16_224.augreg_in21k",
        description="ViT-B/16, AugReg ImageNet-21k weights",
        pretrained="hub",
    ),
    BackboneSpec(
        name="vit-s16-augreg-in21k",
        timm_name="vit_small_patch16_224.augreg_in21k",
        description="ViT-S/16, AugReg ImageNet-21k weights",
        pretrained="hub",
    ),
)
