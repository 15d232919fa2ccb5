"""The method interface: stacked client parameters, one forward, a few hooks.

`Method` below is the whole interface on one page: what a method must write, then each optional
declaration and hook with its default. The types a hook takes or returns come first; the
building blocks methods share (initialisers, per-client heads) are in `fpbench.methods.helpers`.

Every trainable tensor carries a leading client axis K and every sample carries the index of its
row (`client_index`). The same forward then serves K = 1 (the reference executor) and K = all
clients of a round (the lockstep executor). The engine owns loops, optimisers, batching,
evaluation and storage; a method owns its parameters and its math.

A forward takes preprocessed images and calls `self.backbone` directly. It declares no frozen
work: the backbone recalls what depends on nothing the current phase trains
(`fpbench.backbones.recall`). It returns its outputs (`Output`: logits, an auxiliary loss, the
statistics it records, in training its own loss where it has one) and writes into nothing;
what the engine hands it (`Context`) is read-only.

How the clients are federated is the cell's strategy (`fpbench.strategies`): FedAvg through
`aggregate` by default. The rules an author needs beyond these types are on one page,
docs/method-interface.md; the decisions behind the interface are in git history.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, model_validator

from fpbench.lazy import F, torch
from fpbench.methods.helpers import weighted_mean

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones import PromptedViT

# the documented values of `Method.inference` (an author writes one of the strings)
Inference = Literal["global", "client-conditioned", "personal", "personal-deploys"]


class MethodConfig(BaseModel):
    """Base of every method's typed, frozen config.

    A config with named settings (e.g. a paper's ablation rows) sets `PRESETS` (name -> field
    values) and declares the field `preset: str | None = None`; `preset = "name"` then applies
    that row. Fields given explicitly win over the preset's, and the stored config keeps the
    preset's name and every resolved value.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.PRESETS and "preset" not in cls.model_fields:
            raise TypeError(f"{cls.__name__} sets PRESETS: declare `preset: str | None = None`")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not cls.PRESETS or not isinstance(data, dict) or data.get("preset") is None:
            return data
        if data["preset"] not in cls.PRESETS:
            raise ValueError(f"unknown preset {data['preset']!r}; valid: {', '.join(cls.PRESETS)}")
        return {**cls.PRESETS[data["preset"]], **data}


@dataclass(frozen=True)
class TaskInfo:
    """What a method may know about the federation when it builds its parameters.

    `class_names` are the classes this instance scores, which are not always the dataset's:
    under an evaluation mode (`fpbench.engine.eval_modes`) the engine builds a second instance
    over other names (a base-to-novel split's novel classes, a cross-dataset target's) and hands
    it the trained server state. A method that builds its text classifier from these names, with
    trained tensors whose shapes do not depend on the class count, works in those modes as is.
    """

    num_classes: int
    num_clients: int
    class_priors: Tensor  # (N, C) each client's train label distribution
    train_sizes: Tensor  # (N,) each client's number of train samples
    class_names: tuple[str, ...] = ()  # the dataset's class names (CLIP text prompts need them)
    dataset: str = ""  # the dataset's registry name (GPT-FL's generated-image folder)
    # The clients' train images, only for methods whose clients share a summary of their data
    # once before training (FedMix's mean images); None where the caller does not provide them.
    train_images: Tensor | None = None  # (n, 3, H, W) uint8, the whole train split
    train_idx: tuple[Tensor, ...] | None = None  # per client: its indices into train_images
    heldout: Tensor | None = None  # (N,) bool: held-out clients never train nor share
    train_labels: Tensor | None = None  # (n,) labels of train_images (PEP-FedPT's warm start)
    # No test split: a metric that needs it reads the engine's `test` in `round_metrics`.
    coarse_of_class: Tensor | None = None  # (C,) coarse class of each class; None: no hierarchy


@dataclass(frozen=True)
class Updates:
    """One round's results of the K clients that trained, each stacked along dim 0."""

    params: dict[str, Tensor]  # their trained parameters (K, ...)
    client_ids: Tensor  # (K,)
    weights: Tensor  # (K,) aggregation weights (train sizes, see train.aggregation_weights)
    stats: dict[str, Tensor] = field(default_factory=dict)  # what their forwards counted


class Output(NamedTuple):
    """A forward's outputs: its logits, a per-sample auxiliary loss that training adds to their
    cross-entropy (e.g. SGPT's key loss), the statistics it records, and, for an objective other
    than cross-entropy plus a term, the per-sample training loss itself; a forward with nothing
    else to say returns bare logits.

    `loss` is read in training only (the engine hands the forward `ctx.labels`): given, it
    replaces cross-entropy and `aux_loss`, so a forward gives one or the other (both: an
    error), and `logits` may then be None where the objective does not make them (Per-FedAvg's
    meta-step scores only half its batch). Outside training a forward returns logits.

    `stats` are per-row values (K, ...) that the engine adds up over the round's steps (those
    named `max_*`: their elementwise maximum) and hands `aggregate` in `Updates.stats`, e.g.
    SGPT's selection counts.
    """

    logits: Tensor | None  # (B, C); None only beside `loss` in training
    aux_loss: Tensor | None = None  # (B,); None: nothing to add
    stats: Mapping[str, Tensor] | None = None  # name -> (K, ...); None: nothing recorded
    loss: Tensor | None = None  # (B,) the training loss; None: cross-entropy (+ aux_loss)


def as_logits(out: Tensor | Output) -> Tensor:
    """The logits of a forward's result, whichever form it takes."""
    logits = out.logits if isinstance(out, Output) else out
    if logits is None:
        raise ValueError("the forward returned no logits (Output.logits is None)")
    return logits


def training_loss(out: Tensor | Output, labels: Tensor) -> tuple[Tensor, Mapping[str, Tensor]]:
    """The per-sample training loss (B,) of a forward's result on a batch with `labels`, and
    the statistics it records: `Output.loss` where given, else the cross-entropy of the logits
    plus `aux_loss`. What the engine averages per client."""
    if not isinstance(out, Output):
        return F.cross_entropy(out, labels, reduction="none"), {}
    stats = {} if out.stats is None else out.stats
    if out.loss is not None:
        if out.aux_loss is not None:
            raise ValueError(
                "a forward returned both `loss` and `aux_loss`: add the term to `loss`"
            )
        if out.loss.shape != labels.shape:
            raise ValueError(
                f"Output.loss must be per sample, shape {tuple(labels.shape)}; "
                f"got {tuple(out.loss.shape)}"
            )
        return out.loss, stats
    if out.logits is None:
        raise ValueError("the forward returned neither logits nor a training loss (Output.loss)")
    ce = F.cross_entropy(out.logits, labels, reduction="none")
    return (ce if out.aux_loss is None else ce + out.aux_loss), stats


@dataclass(frozen=True)
class Phase:
    """One block of local training: which parameters train, for how many epochs, and which of
    them train with their own optimiser instead of the run's `train` settings.

    `optimizers` maps a tensor's name to its settings, as a plain dict: `optimizer` ("sgd" or
    "adam") and `lr` (required), `momentum` and `weight_decay` (default 0), e.g. TPFL's pixel
    prompt `{"optimizer": "sgd", "lr": 40.0, "momentum": 0.9}`. Its lr follows the run's
    schedule: it is scaled by the same per-round factor as `train.lr`.

    Blocks below the first prompt a phase trains are kept for the phase by the backbone, found
    from the prompts' `requires_grad` (`fpbench.backbones.recall`): nothing to declare."""

    name: str
    trainable: tuple[str, ...]
    epochs: int
    optimizers: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def __post_init__(self) -> None:
        for name, settings in self.optimizers.items():
            keys = set(settings)
            if not {"optimizer", "lr"} <= keys <= {"optimizer", "lr", "momentum", "weight_decay"}:
                raise ValueError(
                    f"phase {self.name!r}: the optimiser of {name!r} takes optimizer and lr, "
                    f"optionally momentum and weight_decay; got {sorted(keys)}"
                )
            if settings["optimizer"] not in ("sgd", "adam"):
                raise ValueError(
                    f"phase {self.name!r}: unknown optimizer {settings['optimizer']!r}"
                )


@dataclass
class ServerState:
    """Global parameters (no client axis), per-client personal tables (N, ...) and buffers."""

    params: dict[str, Tensor]
    personal: dict[str, Tensor] = field(default_factory=dict)
    buffers: dict[str, Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {"params": self.params, "personal": self.personal, "buffers": self.buffers}

    @classmethod
    def from_state_dict(cls, state: dict[str, dict[str, Tensor]]) -> ServerState:
        return cls(state["params"], state["personal"], state["buffers"])

    def to(self, device: torch.device) -> ServerState:
        """The same state with every tensor on `device`."""
        move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
        return ServerState(move(self.params), move(self.personal), move(self.buffers))


@dataclass(frozen=True)
class Context:
    """Per-call information the forward may use; read-only (a new one per batch).

    `priors` are the class priors of the K rows (client-conditioned methods use them);
    `buffers` are the server's buffers; `earlier` are the statistics (`Output.stats`) of the
    clients trained before this call in the same round, summed: always empty in lockstep,
    filled one client after another by the reference executor (for methods whose reference
    code lets a client see its predecessors, e.g. SGPT's "sequential" counts).
    `labels` are the batch's labels (B,) in the engine's training step, for forwards that
    record per-class statistics or return their own training loss (`Output.loss`); None at
    evaluation.
    """

    training: bool
    phase: str = "eval"
    labels: Tensor | None = None  # (B,)
    priors: Tensor | None = None  # (K, C)
    buffers: Mapping[str, Tensor] = field(default_factory=lambda: MappingProxyType({}))
    earlier: Mapping[str, Tensor] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        for name in ("buffers", "earlier"):  # read-only views, whatever the caller passed
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))


class Method:
    """The interface a method implements; the engine calls its hooks.

    Required: `name`, `init_params` and `forward`. Everything else is optional and has a default
    below: declarations (class attributes) and hooks for training, the server and evaluation.
    `self.cfg`, `self.backbone` and `self.task` are provided; helpers live in
    `fpbench.methods.helpers`. Nothing declares frozen work: the backbone finds it (see
    `fpbench.backbones.recall`).
    """

    # -- required: every method writes these -----------------------------------------------------
    name: ClassVar[str]  # the registry name, e.g. "sgpt"

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor] | ServerState:
        """Initial values of every trainable tensor, without the client axis; or, where the
        server keeps more (buffers, per-client rows, another state), the whole `ServerState`.

        Either way, the tensors named in `personal` that sit among the params are copied into one
        row per client (`ServerState.personal`), the rest stay global; a returned state's own
        `personal` rows and `buffers` are kept as they are. A method that only adds buffers
        returns `ServerState(params, buffers=...)`."""
        raise NotImplementedError

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits (B, C) for preprocessed images x; the row of sample i is client_index[i].
        In training (`ctx.labels` given) it may return `Output(logits, aux_loss)` to add a term
        to the cross-entropy, or `Output(logits, loss=...)` for another objective."""
        raise NotImplementedError

    # -- optional declarations, with their defaults ----------------------------------------------
    Config: ClassVar[type[MethodConfig]] = MethodConfig  # the method's own settings
    # how clients are scored: "global" (one model for all), "client-conditioned" (a model made
    # for each client, new ones included), "personal" (each client's own; held-out clients are
    # not applicable), "personal-deploys" (personal, and its evaluation `client_params` of a
    # client that never trained is what it deploys to a new one: held-out clients are scored)
    inference: ClassVar[Inference] = "global"
    personal: ClassVar[frozenset[str]] = frozenset()  # parameter names kept per client
    # the backbone its forward needs: a prompted ViT, or CLIP (image and text towers)
    backbone_family: ClassVar[Literal["vit", "clip"]] = "vit"

    # -- optional hooks: local training ----------------------------------------------------------
    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """The K clients' parameters, stacked (K, ...): what local training starts from, or
        (`training=False`) what they are evaluated with; default the same for both.

        `draw`, at evaluation only (None in training and for callers without client data):
        `draw(n)` returns one fixed batch of n train samples of each of the K clients, as
        (x, y, client_index), for a method that adapts before it is scored (Per-FedAvg's
        step); a method that does not call it loads nothing. This hook runs outside autocast
        on the server state's device; from the first `draw` on, until it returns, gradients
        are enabled, the evaluation's autocast applies and the batch is recalled as a train
        batch. The batch is on the evaluation device, which may not be the server's: adapt
        there (`p.to(x.device)`). `draw` raises `FpbenchError` where no client data exists
        (an evaluation mode's other set; a global method's one model)."""
        k = len(client_ids)
        out = {
            name: p.unsqueeze(0).expand(k, *p.shape).clone() for name, p in server.params.items()
        }
        out.update({name: t[client_ids].clone() for name, t in server.personal.items()})
        return out

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        """The local schedule over the parameter `names`; default one phase training all."""
        return [Phase("local", names, local_epochs)]

    # -- optional hooks: the server --------------------------------------------------------------
    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """New server state from the round's `updates`; default FedAvg by their weights, with
        personal tensors written back to the clients' rows."""
        trained, client_ids, weights = updates.params, updates.client_ids, updates.weights
        w = (weights / weights.sum()).to(next(iter(trained.values())).dtype)
        params = {name: weighted_mean(trained[name], w) for name in server.params}
        personal = {
            name: t.index_copy(0, client_ids, trained[name].detach())
            for name, t in server.personal.items()
        }
        return ServerState(params, personal, server.buffers)

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Tensors (down, up) exchanged per participating client (default: global params)."""
        return server.params, server.params

    def round_metrics(
        self,
        server: ServerState,
        test: Callable[[Callable[[Tensor], Tensor]], tuple[Tensor, Tensor]] | None = None,
    ) -> dict[str, float]:
        """Method-specific scalars stored every round after aggregation (default: none).

        `test` is the engine's view of the test split, for diagnostics that score on it:
        `test(fn)` runs fn: (B, 3, S, S) -> (B, ...) over its preprocessed images, without
        gradients and with frozen work recalled as in evaluation, and returns (fn's outputs
        (M, ...), the labels (M,)); never the images themselves. None: no (or an empty) test
        split."""
        return {}

    # -- provided: what a method calls, never overrides ------------------------------------------
    def __init__(self, cfg: MethodConfig, backbone: PromptedViT, task: TaskInfo) -> None:
        self.cfg = cfg
        self.backbone = backbone
        self.task = task

    def init_server(self, gen: torch.Generator) -> ServerState:
        """The server's state before round 1 (what the engine calls), from `init_params`."""
        init = self.init_params(gen)
        state = init if isinstance(init, ServerState) else ServerState(init)
        n = self.task.num_clients
        rows = {
            k: v.unsqueeze(0).repeat(n, *[1] * v.dim())
            for k, v in state.params.items()
            if k in self.personal
        }
        if both := sorted(rows.keys() & state.personal.keys()):
            raise ValueError(f"{self.name}.init_params: {both} given both as params and as rows")
        shared = {k: v for k, v in state.params.items() if k not in self.personal}
        return ServerState(shared, {**state.personal, **rows}, state.buffers)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls).get("client_params")
        if own is not None and not _takes_draw(own):
            raise TypeError(
                f"{cls.__name__}.client_params must take `draw=None` (the clients' train data "
                "at evaluation) and pass it on: client_params(server, client_ids, training, draw)"
            )


def _takes_draw(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "draw" or p.kind is p.VAR_KEYWORD for p in params)
