"""The data root, the prepared cache and the shared machinery of the real (on-disk) datasets.

Layout under the data root (``--root DIR`` / ``--data-root DIR``, else ``$FPBENCH_DATA``, else
``./data``)::

    <root>/cifar-10-batches-py/ ...        each dataset's native files, where its docs say
    <root>/prepared/<name>-<key>.pt        the prepared cache: uint8 tensors + names (torch.save)

A real dataset is prepared once: its native files are decoded (and resized where the images
differ in size) into uint8 tensors and saved as one file keyed by the dataset's config; `load`
memory-maps that file. `load` prepares on first use when the native files are there; when they
are not, it raises `FpbenchError` naming what to download and where to put it. Nothing is
downloaded unless `prepare(..., download=True)` is asked for (``fpbench data prepare --download``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.stages import report

ENV_VAR = "FPBENCH_DATA"
DEFAULT_ROOT = Path("data")
PREPARED_DIR = "prepared"
FORMAT = 1  # bump when the prepared file's contents change meaning

Progress = Callable[[str, int, int], None]  # (what, done, total)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp"}  # image files in raw class folders
_TENSORS = ("train_images", "train_labels", "test_images", "test_labels")


def data_root(root: str | Path | None = None) -> Path:
    """The data root: `root` if given, else $FPBENCH_DATA, else ./data."""
    if root is not None:
        return Path(root).expanduser()
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ROOT).expanduser()


def no_progress(what: str, done: int, total: int) -> None:
    del what, done, total


class RealConfig(BaseModel):
    """Base of the real datasets' configs: strict and frozen (it keys the prepared cache)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # settings added after prepared files were first keyed: left out of the key at their default
    later_fields: ClassVar[dict[str, Any]] = {}


@dataclass(frozen=True)
class Status:
    """Where a dataset stands under a root: `prepared`, `raw` (native files only) or `missing`."""

    name: str
    state: str
    where: Path
    hint: str


class RealDataset:
    """Shared `load` / `prepare` / `status` of a dataset read from native files.

    A subclass sets `name`, `Config`, `hint` (what to download, one line) and implements
    `raw_dir(root)` (where the native files live), `raw_present(root)`, `info(cfg)`, `build(cfg,
    root, progress)` (decode the native files) and, with `downloadable = True`, `download(root)`.
    """

    name: ClassVar[str]
    Config: ClassVar[type[RealConfig]]
    hint: ClassVar[str]
    downloadable: ClassVar[bool] = False

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        raise NotImplementedError

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        raise NotImplementedError

    @classmethod
    def info(cls, cfg: Any) -> DatasetInfo:
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: Any, root: Path, progress: Progress) -> ImageDataset:
        raise NotImplementedError

    @classmethod
    def download(cls, root: Path) -> None:
        raise FpbenchError(f"dataset {cls.name!r} cannot be downloaded automatically: {cls.hint}")

    @classmethod
    def missing(cls, root: Path) -> FpbenchError:
        auto = f" (or run `fpbench data prepare {cls.name} --download`)" if cls.downloadable else ""
        return FpbenchError(
            f"dataset {cls.name!r} not found under {cls.raw_dir(root)}: {cls.hint}{auto}"
        )

    @classmethod
    def cache_path(cls, cfg: Any, root: Path) -> Path:
        return prepared_path(root, cls.name, cfg)

    @classmethod
    def status(cls, root: Path) -> Status:
        """Present / missing under `root` (any prepared file of this dataset counts)."""
        root = Path(root)
        if any((root / PREPARED_DIR).glob(f"{cls.name}-*.pt")):
            state = "prepared"
        else:
            state = "raw" if cls.raw_present(root) else "missing"
        return Status(cls.name, state, cls.raw_dir(root), cls.hint)

    @classmethod
    def prepare(
        cls,
        cfg: Any,
        root: Path,
        *,
        download: bool = False,
        force: bool = False,
        progress: Progress = no_progress,
    ) -> Path:
        """Decode the native files into the prepared cache once; returns the cache file."""
        path = cls.cache_path(cfg, root)
        if path.is_file() and not force:
            return path
        if not cls.raw_present(root):
            if not download:
                raise cls.missing(root)
            cls.download(root)
            if not cls.raw_present(root):
                raise cls.missing(root)
        try:
            data = cls.build(cfg, root, progress)
        except (KeyError, IndexError, TypeError, ValueError) as e:  # a native file not as expected
            raise FpbenchError(
                f"malformed {cls.name} files under {cls.raw_dir(root)}: {type(e).__name__}: {e}"
            ) from None
        save_prepared(data, path, cfg)
        return path

    @classmethod
    def load(cls, cfg: Any, root: Path) -> ImageDataset:
        """The prepared dataset (preparing it first when only the native files exist)."""
        root = Path(root)
        path = cls.cache_path(cfg, root)
        if not path.is_file():
            cls.prepare(cfg, root, progress=report)  # shown by `fpbench run` as it goes
        return load_prepared(path)


def real_dataset(name: str) -> type[RealDataset] | None:
    """The registered dataset class `name` if it is read from files, else None (generated)."""
    from fpbench.registry import DATASETS

    cls = DATASETS.get(name)
    return cls if isinstance(cls, type) and issubclass(cls, RealDataset) else None


def dataset_state(name: str, root: Path) -> str:
    """`prepared`, `raw`, `missing`, or `built-in` for generated datasets (e.g. synthetic)."""
    cls = real_dataset(name)
    return cls.status(Path(root)).state if cls else "built-in"


def require_present(names: Sequence[str], root: Path) -> None:
    """Fail fast, before any run starts, when one of these datasets is missing under `root`."""
    for name in dict.fromkeys(names):
        cls = real_dataset(name)
        if cls is not None and cls.status(Path(root)).state == "missing":
            raise cls.missing(Path(root))


# ---- the prepared cache ----------------------------------------------------------------------


def config_key(cfg: BaseModel) -> str:
    later = getattr(cfg, "later_fields", {})
    dumped = cfg.model_dump(mode="json")
    drop = {k for k, v in later.items() if dumped.get(k) == v}
    blob = f"{FORMAT}:{cfg.model_dump_json(exclude=drop or None)}"
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def prepared_path(root: Path, name: str, cfg: BaseModel) -> Path:
    return Path(root) / PREPARED_DIR / f"{name}-{config_key(cfg)}.pt"


def save_prepared(data: ImageDataset, path: Path, cfg: BaseModel) -> None:
    """Write `data` as one torch file (atomically: a partial write never looks prepared)."""
    _check_consistent(data)
    payload: dict[str, Any] = {"format": FORMAT, "config": cfg.model_dump_json()}
    for f in fields(ImageDataset):
        value = getattr(data, f.name)
        payload[f.name] = value.contiguous() if isinstance(value, torch.Tensor) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_prepared(path: Path) -> ImageDataset:
    """Read a prepared file, memory-mapped (fast; pages are read as they are used)."""
    try:
        payload = torch.load(path, mmap=True, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and how to fix it
        raise FpbenchError(
            f"unreadable prepared file {path} ({e}); delete it and prepare again"
        ) from None
    if payload.get("format") != FORMAT:
        raise FpbenchError(f"prepared file {path} has an old format; delete it and prepare again")
    known = {f.name for f in fields(ImageDataset)}
    return ImageDataset(**{k: v for k, v in payload.items() if k in known})


def _check_consistent(data: ImageDataset) -> None:
    for split in ("train", "test"):
        x, y = getattr(data, f"{split}_images"), getattr(data, f"{split}_labels")
        if x.dtype != torch.uint8 or x.ndim != 4 or x.shape[1] != 3 or x.shape[0] != y.shape[0]:
            raise ValueError(f"{data.name}: {split} images must be uint8 (N, 3, H, W), N labels")


# ---- native-file helpers ---------------------------------------------------------------------


def read_pickle(path: Path) -> Any:
    """A pickle as the mirrors ship it: Python 2's (byte-string keys, kept as bytes) or 3's.

    Raises:
        FpbenchError: naming the file, when it cannot be read or is not a pickle.
    """
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="bytes")
    except Exception as e:  # truncated, not a pickle, unknown classes: one line with the file
        raise FpbenchError(f"malformed dataset file {path}: not a readable pickle ({e})") from None


def pickle_field(record: Any, key: str, path: Path) -> Any:
    """`record[key]` of a pickled dict whose keys are bytes (Python 2) or str (Python 3)."""
    if not isinstance(record, dict):
        raise FpbenchError(
            f"malformed dataset file {path}: expected a pickled dict, got {type(record).__name__}"
        )
    for k in (key, key.encode()):
        if k in record:
            return record[k]
    have = ", ".join(sorted(k.decode() if isinstance(k, bytes) else str(k) for k in record))
    raise FpbenchError(f"malformed dataset file {path}: no {key!r} entry (it has: {have})")


def text(value: Any) -> str:
    """A pickled name as str, whether Python 2 stored it as bytes or Python 3 as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def hwc_to_chw(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) or (N, H, W) -> (N, 3, H, W) uint8 tensor (grey repeated)."""
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8))
    if x.ndim == 3:
        x = x[..., None].expand(-1, -1, -1, 3)
    return x.permute(0, 3, 1, 2).contiguous()


def pad_to(images: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad (N, 3, h, w) images symmetrically to (N, 3, size, size) (MNIST-style 28 -> 32)."""
    h, w = images.shape[-2:]
    top, left = (size - h) // 2, (size - w) // 2
    out = torch.zeros(*images.shape[:-2], size, size, dtype=images.dtype)
    out[..., top : top + h, left : left + w] = images
    return out


def square_crop(img: Any, size: int) -> Any:
    """A PIL image with its shorter side resized to `size` (bicubic), then a centred square crop.

    CLIP's test transform; images already of shorter side `size` are only cropped.
    """
    from PIL import Image

    w, h = img.size
    scale = size / min(w, h)
    new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
    if (new_w, new_h) != (w, h):
        img = img.resize((new_w, new_h), Image.BICUBIC)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return img.crop((left, top, left + size, top + size))


def image_files(folder: Path) -> list[Path]:
    """The image files directly in `folder`, sorted (none when it does not exist)."""
    return sorted(p for p in folder.glob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def decode_image(path: Path, size: int | None, crop: bool = False) -> np.ndarray:
    """One image file -> uint8 (H, W, 3), made size x size if given.

    `crop` False: resized to the square (PIL bilinear); True: `square_crop` (keeps the aspect).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(path)
    except (OSError, UnidentifiedImageError) as e:
        raise FpbenchError(f"cannot read image {path}: {e}") from None
    with img:
        if size is not None and img.format == "JPEG":
            img.draft("RGB", (size, size))  # decode at a reduced scale, never below `size`
        rgb = img.convert("RGB")
        if size is not None and crop:
            rgb = square_crop(rgb, size)
        elif size is not None and rgb.size != (size, size):
            rgb = rgb.resize((size, size), Image.BILINEAR)
        return np.asarray(rgb, dtype=np.uint8)


def decode_images(
    paths: Sequence[Path],
    size: int | None,
    progress: Progress,
    what: str,
    workers: int = 8,
    crop: bool = False,
) -> torch.Tensor:
    """Decode image files in parallel threads -> uint8 (N, 3, S, S); all must share one size.

    `size` and `crop` as in `decode_image`.
    """
    out: list[np.ndarray] = []
    progress(what, 0, len(paths))
    with ThreadPoolExecutor(max_workers=max(1, min(workers, os.cpu_count() or 1))) as pool:
        for start, chunk in _chunks(paths, 512):
            out.extend(pool.map(lambda p: decode_image(p, size, crop), chunk))
            progress(what, start + len(chunk), len(paths))
    if not out:
        return torch.zeros(0, 3, size or 1, size or 1, dtype=torch.uint8)
    shapes = {a.shape for a in out}
    if len(shapes) > 1:
        raise FpbenchError(f"{what}: images differ in size {sorted(shapes)[:3]}; set image_size")
    return hwc_to_chw(np.stack(out))


def _chunks(items: Sequence[Path], n: int) -> Iterator[tuple[int, Sequence[Path]]]:
    for start in range(0, len(items), n):
        yield start, items[start : start + n]


def sample_per_group(
    groups: np.ndarray, per_group: int | None, seed: int, stream: int = 0
) -> np.ndarray:
    """Sorted indices keeping `per_group` random samples of each group value (all if None)."""
    if per_group is None:
        return np.arange(groups.size)
    rng = np.random.default_rng([seed, stream])
    keep = []
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        keep.append(rng.choice(idx, size=min(per_group, idx.size), replace=False))
    return np.sort(np.concatenate(keep))


def split_train_test(
    n: int, test_fraction: float, seed: int, strata: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded train/test split of range(n), stratified by `strata` (e.g. domain*C + class).

    Each stratum gives round(test_fraction * size) samples to test (at least one when it has two).
    """
    strata = np.zeros(n, dtype=np.int64) if strata is None else strata
    rng = np.random.default_rng([seed, 7])
    test = []
    for s in np.unique(strata):
        idx = rng.permutation(np.flatnonzero(strata == s))
        k = int(np.floor(test_fraction * idx.size + 0.5))
        k = max(k, 1) if idx.size > 1 and test_fraction > 0 else k
        test.append(idx[:k])
    test_idx = np.sort(np.concatenate(test)) if test else np.empty(0, np.int64)
    mask = np.ones(n, dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask), test_idx


def download_archive(url: str, root: Path, md5: str | None = None) -> None:
    """Download and extract an archive into `root` with torchvision's checked downloader."""
    from torchvision.datasets.utils import download_and_extract_archive

    root.mkdir(parents=True, exist_ok=True)
    download_and_extract_archive(url, download_root=str(root), md5=md5, remove_finished=True)
