"""Run configs: the validated pydantic models of a cell (`RunConfig` and its parts), each run
hashed to a `run_key`; `fpbench.suites` reads suite files into them."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

MAX_LABEL = 100


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_CROP_KEYS = ("crop", "crop_scale", "crop_ratio")


class Augment(_Strict):
    """On-device training augmentation (none by default; SGPT's reference code on Office, CoOp's
    random-resized-crop and flip)."""

    hflip: bool = Field(False, description="random horizontal flip, p = 0.5")
    rotate: float = Field(
        0.0, ge=0, le=180, description="random rotation, uniform in +-this many degrees"
    )
    crop: bool = Field(
        False,
        description="random resized crop (torchvision's RandomResizedCrop, as CoOp / Dassl "
        "train): a box of crop_scale of the image's area and crop_ratio aspect, resized back "
        "to the image size (bicubic); before the flip",
    )
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="the crop's share of the image area, uniform in this range"
    )
    crop_ratio: tuple[float, float] = Field(
        (3 / 4, 4 / 3), description="the crop's aspect ratio (w / h), log-uniform in this range"
    )

    @model_validator(mode="after")
    def _ranges(self) -> Augment:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(
                f"augment.crop_scale needs 0 < low <= high <= 1, got {self.crop_scale}"
            )
        lo, hi = self.crop_ratio
        if not 0 < lo <= hi:
            raise ValueError(f"augment.crop_ratio needs 0 < low <= high, got {self.crop_ratio}")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset_crop(self, handler: Any) -> dict[str, Any]:
        """The crop settings are dumped only with the crop on: a run without it keeps the stored
        config, run key and protocol paths it had before they existed."""
        out = handler(self)
        if not self.crop:
            for key in _CROP_KEYS:
                del out[key]
        return out

    @property
    def active(self) -> bool:
        return self.hflip or self.rotate > 0 or self.crop


class TrainConfig(_Strict):
    """Federated schedule and local optimisation, shared by every method."""

    rounds: int = Field(10, ge=1, description="communication rounds")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients per round")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of each round's sampled clients that fail to report: "
        "max(1, floor((1 - dropout) * sampled)) report (FLiP's count), drawn from the seed alone "
        "(the same for every partition and method); the others neither train nor count that round",
    )
    local_epochs: int = Field(1, ge=1, description="local epochs per phase")
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum / Adam beta1")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(None, gt=0, description="per-client gradient-norm clip")
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr multiplier per round (exponential)")
    lr_schedule: Literal["exp", "cosine", "cosine-local"] = Field(
        "exp",
        description="exp: lr * lr_decay**round; cosine: anneal lr to 0 over the rounds; "
        "cosine-local: anneal it over each round's local epochs (per epoch, from lr)",
    )
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds")
    eval_last: int = Field(10, ge=0, description="also evaluate each of the last this many rounds")
    summary_window: int = Field(10, ge=1, description="`*_last10` = mean over this many evals")
    eval_batch_size: int = Field(256, ge=1)
    local_label_space: Literal["all", "client"] = Field(
        "all",
        description="local accuracy over all classes, or only the classes the client trains on",
    )
    max_local_steps: int | None = Field(
        None, ge=1, description="cap on a client's optimiser steps per round (all epochs)"
    )
    unseen_clients: Literal["exclude", "score"] = Field(
        "exclude",
        description="personal methods' participating clients not yet sampled in any round: "
        "exclude them from local metrics (their count is `clients_untrained`) or score them "
        "with their untrained personal parameters",
    )
    full_split_clients: Literal["all", "none"] | Annotated[int, Field(ge=1)] = Field(
        "all",
        description="personal and client-conditioned methods: whose models score the full test "
        "split (acc_global, f1_macro_global, ece_global): every participating client, a seeded "
        "sample of this many (the same clients at every evaluation), or none (those metrics are "
        "then not computed); a global model scores it once either way",
    )
    augment: Augment = Field(Augment(), description="training augmentation, on the device")
    aggregation_weights: Literal["train_size", "domain_size"] = Field(
        "train_size",
        description="FedAvg client weights: the client's train size, or its domain's full "
        "train-list size shared equally by the domain's clients (SGPT reference code on "
        "Office-Caltech10 / DomainNet, whose clients train on a subset)",
    )
    adam_beta2: float = Field(
        0.999, gt=0, lt=1, description="Adam's beta2 (FedCLIP's code: 0.98); dumped only where set"
    )
    adam_eps: float = Field(
        1e-8, gt=0, description="Adam's epsilon (FedCLIP's code: 1e-6); dumped only where set"
    )
    centralized: bool = Field(
        False,
        description="the centralized reference row: every round one client holding the union "
        "of the round's clients' train data trains local_epochs over it (the same samples and "
        "epochs as the federation; a global method only); evaluated like the federated rows",
    )
    validation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of each client's train samples carved off (seeded) as its "
        "validation set, scored in place of the test split (`fpbench tune`); 0: the test split",
    )

    @model_serializer(mode="wrap")
    def _drop_unset_centralized(self, handler: Any) -> dict[str, Any]:
        """`centralized`, `adam_beta2` and `adam_eps` are dumped only where set: other runs'
        stored configs, run keys and protocol paths stay what they were before the fields
        existed."""
        out = handler(self)
        for key, default in _DUMPED_WHERE_SET.items():
            if key in out and out[key] == default:
                del out[key]
        return out


_DUMPED_WHERE_SET = {"centralized": False, "adam_beta2": 0.999, "adam_eps": 1e-8, "validation": 0.0}


class RuntimeConfig(_Strict):
    """How a run executes; not part of its identity (the numbers do not depend on it)."""

    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    executor: Literal["reference", "lockstep"] = "lockstep"
    lockstep_samples: int | None = Field(
        None,
        ge=1,
        description="most samples in one lockstep forward: a step's client batches are cut at "
        "client boundaries into chunks of at most this many (a client's batch alone may be more), "
        "whose backward passes add to the same per-client gradients before the one optimiser "
        "step; bounds the activations held at once; None: one forward over all of them",
    )
    precision: Literal["auto", "fp32", "bf16", "bf16-frozen"] = Field(
        "auto",
        description="auto: bf16 autocast on CUDA, fp32 on CPU; bf16-frozen: bf16 autocast and a "
        "ViT's frozen blocks held and computed in bf16 end to end (faster; a bf16 residual "
        "stream)",
    )
    compile: bool = Field(False, description="torch.compile the backbone's blocks")
    cache_features: bool | Literal["memory"] = Field(
        True,
        description="compute frozen features and queries once per sample, when first needed, "
        "and keep them in memory and on disk (true), in this process's memory only "
        '("memory"), or not at all (false: every batch computes them anew)',
    )
    feature_cache_dir: str | None = Field(
        None,
        description="where frozen features and queries are kept on disk, keyed by what "
        "determines them (see fpbench.engine.frozen_cache); None: the `frozen` folder of "
        "fpbench's cache ($FPBENCH_CACHE, else ~/.cache/fpbench); `fpbench cache info` shows it",
    )
    frozen_precision: Literal["fp32", "tf32", "bf16"] = Field(
        "fp32",
        description="precision of the frozen passes (Select queries, cached features), whatever "
        "the run's: fp32; tf32 (TF32 matrix products on CUDA, fp32 elsewhere); bf16 (autocast). "
        "Measured on an H100 (ViT-B/16, random weights, 8,192 fake CIFAR-100 queries, 20 keys): "
        "tf32 is 3.4x faster and changes the nearest key of 0.11% of the samples (SGPT's "
        "Select) and 0.05% (FGPT's key choice); bf16 is 6.2x faster and changes 1.2% and 0.7% "
        "(scripts/gpu/step_probe.py)",
    )
    deterministic: bool = Field(
        True,
        description="deterministic kernels: results bit-identical across processes, resumes, "
        "launchers and client executors on one machine; false is faster and may differ in the "
        "last bits, which training amplifies (see fpbench.determinism)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads a cell computes with; unset: in deterministic mode the count of "
        "the `fpbench run` process for every launcher on this machine (CPU matrix kernels split "
        "their work by threads, which changes the last bits), else the worker's share",
    )
    cpu_linear: Literal["onednn", "blas"] = Field(
        "onednn",
        description="the frozen backbone's fp32 linear layers on the CPU: oneDNN (about 2x "
        "PyTorch's default MKL on AMD CPUs) or blas (PyTorch's default); equal up to rounding",
    )


class Component(_Strict):
    """A registered component by name, its validated args, and the label shown in tables."""

    name: str
    label: str
    args: dict[str, Any] = Field(default_factory=dict)


class StrategyRef(_Strict):
    """A federation strategy (`fpbench.strategies`) by name and its validated settings."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)


class MethodRef(Component):
    """The method (a learner) and, optionally, the strategy that federates it."""

    strategy: StrategyRef | None = Field(
        None, description="the federation strategy; None: the method's own (FedAvg by default)"
    )


Triple = tuple[float, float, float]


class BackboneRef(_Strict):
    name: str = "vit-smoke"
    weights: str | None = Field(None, description="local weights file; None: hub or built-in")
    mean: Triple | None = Field(
        None,
        description="input normalisation mean; None: the backbone's own. SGPT's reference code "
        "uses CIFAR-100 statistics (0.5071, 0.4865, 0.4409) on CIFAR and (0, 0, 0) (no "
        "normalisation) on Office-Caltech10 and DomainNet",
    )
    std: Triple | None = Field(
        None,
        description="input normalisation std; None: the backbone's own (reference code: "
        "(0.2673, 0.2564, 0.2762) on CIFAR, (1, 1, 1) on Office-Caltech10 and DomainNet)",
    )

    @model_validator(mode="after")
    def _both_or_neither(self) -> BackboneRef:
        if (self.mean is None) != (self.std is None):
            raise ValueError("backbone.mean and backbone.std go together: give both or neither")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"backbone.std must be positive, got {self.std}")
        return self


# fields added after run keys were first stored: at their default they are left out of the
# identity, so the keys of runs made before them stay the same
_LATER_FIELDS: dict[tuple[str, str], Any] = {
    ("train", "lr_schedule"): "exp",
    ("train", "local_label_space"): "all",
    ("backbone", "mean"): None,
    ("backbone", "std"): None,
    ("train", "max_local_steps"): None,
    ("train", "unseen_clients"): "score",  # the behaviour before the field existed
    ("train", "augment"): Augment().model_dump(mode="json"),
    ("train", "aggregation_weights"): "train_size",
    ("train", "dropout"): 0.0,
    ("train", "full_split_clients"): "all",
}

# component args added after run keys were first stored, per (component, registered name, arg):
# at their default they are left out of the identity, as `_LATER_FIELDS` are
_LATER_ARGS: dict[tuple[str, str, str], Any] = {
    ("partition", "disjoint-classes", "blocks"): "array-split",
    ("partition", "dirichlet", "scheme"): "niid-bench",
    ("dataset", "office31", "resize"): "squash",
    ("dataset", "officehome", "resize"): "squash",
    ("method", "gpt-fl", "generation"): {  # fpbench.data.gpt_fl_generate.Generation()
        "model": "stable-diffusion-2-1",
        "per_class": 100,
        "template": "a photo of a {}.",
        "steps": 50,
        "guidance_scale": 7.5,
        "seed": 0,
        "precision": "auto",
    },
}


# the local-training settings a client profile may set for its clients
PROFILE_TRAIN_KEYS = frozenset(
    {"batch_size", "local_epochs", "max_local_steps", "optimizer", "lr", "momentum",
     "weight_decay", "grad_clip"}
)  # fmt: skip


class Profile(_Strict):
    """A class of clients in a model-heterogeneous run: their backbone and local budget."""

    name: str = Field(min_length=1, max_length=MAX_LABEL, pattern=r"^[A-Za-z0-9_.-]+$")
    clients: int = Field(ge=1, description="how many clients have this profile")
    backbone: BackboneRef | None = Field(None, description="None: the run's backbone")
    train: dict[str, Any] = Field(
        default_factory=dict, description=f"overrides of {sorted(PROFILE_TRAIN_KEYS)}"
    )

    @model_validator(mode="after")
    def _train_keys(self) -> Profile:
        unknown = sorted(set(self.train) - PROFILE_TRAIN_KEYS)
        if unknown:
            raise ValueError(
                f"profile {self.name!r}: train keys {unknown} cannot vary per client; "
                f"valid: {sorted(PROFILE_TRAIN_KEYS)}"
            )
        return self


class ModelHet(_Strict):
    """Model heterogeneity (SDFed appendix B): client profiles with their own backbones.

    Clients are assigned to profiles in id order (the first `clients` ids to the first profile,
    and so on). Clients of one backbone share one method instance and server state; after each
    round, `share = "shared"` averages every shared parameter whose shape agrees across
    backbones (e.g. 512-wide CLIP text prompts), weighted by the participants' train sizes,
    which is FedAvg over all participants; `"per_backbone"` keeps one federation per backbone.
    """

    profiles: tuple[Profile, ...] = Field(min_length=1)
    share: Literal["shared", "per_backbone"] = "shared"

    @model_validator(mode="after")
    def _unique_names(self) -> ModelHet:
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"model_het.profiles names must be unique, got {names}")
        return self

    @property
    def num_clients(self) -> int:
        return sum(p.clients for p in self.profiles)


EVAL_MODES = ("base2novel", "cross-dataset", "leave-one-domain-out")


class Evaluation(_Strict):
    """An evaluation mode beside the global / personal / held-out-client metrics (CoOp's and
    CoCoOp's generalisation protocols; `fpbench.engine.eval_modes` says how each is scored).

    * `base2novel`: the run trains and is scored on the base classes (the first ceil(C/2)
      labels); the novel classes (the rest, re-indexed) are scored on their own test images with
      a classifier over their own class names: `acc_base`, `acc_novel`, `acc_hm`.
    * `cross-dataset`: the run trains on its dataset; each of `targets` is scored on its test
      split with its class names: `acc_xd_<label>`, and their mean `acc_xd_mean`.
    * `leave-one-domain-out`: the run trains on every domain but `domain`, whose test images
      are scored: `acc_lodo`.
    """

    mode: Literal["base2novel", "cross-dataset", "leave-one-domain-out"]
    targets: tuple[Component, ...] = Field(
        (), description="cross-dataset: the target datasets ({ name, label, args })"
    )
    domain: str | None = Field(
        None,
        description="leave-one-domain-out: the held-out domain's name (as the dataset names it)",
    )

    @model_validator(mode="before")
    @classmethod
    def _target_labels(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("targets"), list | tuple):
            targets = [
                {**t, "label": t.get("label", t.get("name"))} if isinstance(t, dict) else t
                for t in data["targets"]
            ]
            data = {**data, "targets": targets}
        return data

    @model_validator(mode="after")
    def _mode_settings(self) -> Evaluation:
        cross, lodo = self.mode == "cross-dataset", self.mode == "leave-one-domain-out"
        if cross != bool(self.targets):
            raise ValueError("evaluation.targets: given for, and only for, mode 'cross-dataset'")
        if lodo != (self.domain is not None):
            raise ValueError(
                "evaluation.domain: given for, and only for, mode 'leave-one-domain-out'"
            )
        labels = [t.label for t in self.targets]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation.targets labels must be unique, got {labels}")
        for label in labels:
            if len(label) > MAX_LABEL or not re.fullmatch(r"[A-Za-z0-9_.-]+", label):
                raise ValueError(f"evaluation.targets label {label!r}: use letters, digits, _.-")
        return self


class RunConfig(_Strict):
    """The fully resolved config of one run (one cell of a suite)."""

    suite: str
    seed: int
    dataset: Component
    partition: Component
    method: MethodRef
    backbone: BackboneRef = BackboneRef()
    train: TrainConfig = TrainConfig()
    model_het: ModelHet | None = None
    evaluation: Evaluation | None = Field(None, description="an evaluation mode (Evaluation)")
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _profile_train(self) -> RunConfig:
        for profile in self.model_het.profiles if self.model_het else ():
            try:
                self.profile_train(profile)
            except ValidationError as e:
                raise ValueError(f"model_het profile {profile.name!r}: {first_error(e)}") from None
        return self

    def profile_train(self, profile: Profile) -> TrainConfig:
        """The train config of a profile's clients: the run's, with the profile's overrides."""
        return TrainConfig(**{**self.train.model_dump(), **profile.train})

    def identity(self) -> dict[str, Any]:
        """Everything that determines the results (the runtime section does not)."""
        out = self.model_dump(mode="json", exclude={"runtime"})
        for (section, key), default in _LATER_FIELDS.items():
            if out[section][key] == default:
                del out[section][key]
        for (section, name, key), default in _LATER_ARGS.items():
            args = out[section]["args"]
            if out[section]["name"] == name and key in args and args[key] == default:
                del args[key]
        if out["method"]["strategy"] is None:  # added later: the method's own federation
            del out["method"]["strategy"]
        for later in ("model_het", "evaluation"):  # added later: absent keeps the older keys
            if out[later] is None:
                del out[later]
        return out

    @property
    def run_key(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Suite(_Strict):
    name: str
    description: str = ""
    path: str
    cells: tuple[RunConfig, ...]


def first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    got = (
        f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    )
    return f"{loc}: {err['msg']}{got}"
