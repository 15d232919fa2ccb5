"""What frozen per-sample values are keyed by, the precision they are computed in, and their
files on disk.

A frozen value (a Select query's cls, a cls feature; `fpbench.backbones.recall`) depends on
the backbone and its weights, the images and how they are preprocessed, the layer read, the
precision of the pass, and the numerics of the machine that computed it (device, PyTorch
version, deterministic mode, and on the CPU its thread count and linear backend: they change
the last bits). `frozen_key` spells all of it out; a unit's files are named by the key's hash
and hold the key itself, so an entry is used only where its stored key is the one asked for.

An entry is one `torch.save`d dict: a marker, the format, the key, the values' SHA-256 and the
values (fp32, on the CPU). It is written to a temporary file and renamed into place, so a reader
sees a whole file or none; one that does not load, whose key differs, or whose values do not
hash to the stored digest is ignored (and recomputed and rewritten by the caller).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import uuid
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fpbench.data.base import ImageDataset

FORMAT = 1  # bump when the values' meaning or the entry's layout changes
MARKER = "fpbench-frozen-values"
SUFFIX = ".pt"
FrozenPrecision = Literal["fp32", "tf32", "bf16"]


# module -> (digest, ((name, weak reference to the tensor, its version), ...))
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer of `model` (names, dtypes, shapes and bytes);
    kept for the module until one of its tensors is replaced (by identity, not by `id`, which a
    new tensor may reuse) or changed in place (its version)."""
    state = model.state_dict(keep_vars=True)  # the module's own tensors, not fresh detached ones
    found = _DIGESTS.get(model)
    if found is not None and len(found[1]) == len(state):
        same = all(
            name == n and ref() is t and version == t._version
            for (n, ref, version), (name, t) in zip(found[1], state.items(), strict=True)
        )
        if same:
            return found[0]
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(_bytes(t))
    digest = h.hexdigest()
    _DIGESTS[model] = (digest, tuple((n, weakref.ref(t), t._version) for n, t in state.items()))
    return digest


def _bytes(t: Tensor) -> memoryview:
    """The raw bytes of t, copied to the CPU (contiguous)."""
    flat = t.detach().reshape(-1).contiguous()
    return memoryview(flat.view(torch.uint8).cpu().numpy()) if flat.numel() else memoryview(b"")


def numerics(device: torch.device, precision: FrozenPrecision) -> dict[str, Any]:
    """What, besides the inputs, sets the bits of a frozen pass computed now on `device`."""
    from fpbench.backbones import frozen_linear

    out: dict[str, Any] = {
        "precision": effective_precision(precision, device),
        "torch": torch.__version__,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    if device.type == "cuda":
        out["device"] = f"cuda:{torch.cuda.get_device_name(device)}"
        out["cuda"] = torch.version.cuda
    else:
        out["device"] = f"{device.type}:{_cpu_name()}"
        out["threads"] = torch.get_num_threads()
        out["cpu_linear"] = frozen_linear._backend
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1] for line in f if line.startswith("model name"))
            return next(names).strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def effective_precision(precision: FrozenPrecision, device: torch.device) -> str:
    """The precision a frozen pass computes in: TF32 exists only on CUDA (fp32 elsewhere)."""
    return "fp32" if precision == "tf32" and device.type != "cuda" else precision


@contextmanager
def frozen_precision(precision: FrozenPrecision, device: torch.device) -> Iterator[None]:
    """Compute a frozen pass in `precision`, whatever autocast the run has on.

    fp32: float32 products (PyTorch's default float32 matmul precision); tf32: float32 inputs,
    TF32 matrix products on CUDA; bf16: bf16 autocast. The old settings come back."""
    precision = effective_precision(precision, device)  # type: ignore[assignment]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        if precision == "bf16":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield
        else:
            with torch.autocast(device.type, enabled=False):
                yield
    finally:
        torch.set_float32_matmul_precision(before)


def preprocessing(backbone: nn.Module) -> dict[str, Any]:
    """How `backbone.preprocess` turns uint8 images into its input."""
    return {
        "type": type(backbone).__name__,  # the resize rule (ViT: bilinear; CLIP: bicubic + crop)
        "size": int(getattr(backbone, "img_size", 0)),
        "mean": [float(v) for v in backbone.mean],  # type: ignore[union-attr]
        "std": [float(v) for v in backbone.std],  # type: ignore[union-attr]
    }


def frozen_key(
    backbone: nn.Module,
    data: ImageDataset,
    split: str,
    feature: str,
    precision: FrozenPrecision,
    batch_size: int,
    device: torch.device,
) -> str:
    """The key of a split's frozen values (a unit adds its samples): canonical JSON."""
    key = {
        "format": FORMAT,
        "backbone": str(getattr(backbone, "name", type(backbone).__name__)),
        "weights": weights_digest(backbone),
        "preprocess": preprocessing(backbone),
        "data": {"name": data.name, "digest": data.fingerprint(), "split": split},
        "feature": feature,
        "batch_size": batch_size,
        "numerics": numerics(device, precision),
    }
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def entry_path(folder: Path, key: str, kind: str) -> Path:
    """Where the entry of `key` lives: `<folder>/<kind>/<hash of key>.pt`."""
    return folder / safe_name(kind) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}{SUFFIX}"


def safe_name(text: str) -> str:
    """A folder name from free text (letters, digits, '.', '_', '-' kept)."""
    out = "".join(c if c.isalnum() or c in "._-" else "_" for c in text).strip("._")
    return out[:80] or "misc"


def values_digest(values: Tensor) -> str:
    return hashlib.sha256(_bytes(values)).hexdigest()


def read_entry(path: Path, key: str) -> Tensor | None:
    """The values kept at `path` for `key` (on the CPU), or None where the file is missing,
    unreadable, truncated, written for another key, or its values do not match their digest."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # truncated or corrupt: not ours to trust
        return None
    if not (
        isinstance(entry, dict)
        and entry.get("marker") == MARKER
        and entry.get("format") == FORMAT
        and entry.get("key") == key
        and isinstance(entry.get("values"), Tensor)
    ):
        return None
    values = entry["values"]
    return values if entry.get("sha256") == values_digest(values) else None


def write_entry(path: Path, key: str, values: Tensor) -> bool:
    """Keep `values` for `key` at `path` (atomically: a temporary file renamed into place);
    False (with a warning) where the folder cannot be written."""
    values = values.detach().cpu().contiguous()
    entry = {
        "marker": MARKER,
        "format": FORMAT,
        "key": key,
        "sha256": values_digest(values),
        "values": values,
    }
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(entry, tmp)
        tmp.replace(path)
        return True
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = (e.strerror if isinstance(e, OSError) else None) or str(e).splitlines()[0]
        warnings.warn(
            f"cannot keep frozen values in {str(path.parent)!r} ({why}); they stay in memory "
            "for this process only",
            stacklevel=2,
        )
        return False
