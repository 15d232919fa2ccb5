"""Populations: the clients that share a backbone, and so a method instance and a server state.

A homogeneous run is one population holding every client. A model-heterogeneous run
(`RunConfig.model_het`, SDFed appendix B) has one population per distinct backbone. Its clients
train profile by profile (a `Cohort`: a profile's clients with their own local budget of batch
size, epochs and step cap), all participants of a cohort in lockstep; the population's method
aggregates its own participants. With `share = "shared"`, every shared parameter whose shape
agrees across the populations is then replaced by the mean of their aggregates weighted by their
participants' total weight, which for size-weighted FedAvg is FedAvg over all participants.
Parameters whose shapes differ (e.g. anything as wide as the image features) stay per backbone.

Evaluation runs per population on its clients; their counts are merged, a global model's
test-split accuracy becomes each of its clients' `acc_global`, and `acc_profile_<name>` is the
mean local accuracy of a profile's participating clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from fpbench.engine.inputs import Inputs
from fpbench.engine.metrics import EvalCounts
from fpbench.engine.scoring import Target
from fpbench.methods.base import Method, ServerState
from fpbench.specs import ModelHet, TrainConfig
from fpbench.strategies import FedAvg, Strategy

SEP = "/"  # population key / parameter name, in a packed server state


@dataclass(frozen=True)
class Cohort:
    """Clients that train alike: a profile's clients (or every client) and their train config."""

    name: str | None  # the profile's name; None in a homogeneous run
    clients: tuple[int, ...]
    train: TrainConfig


@dataclass
class Population:
    """Clients of one backbone: their method instance, inputs and cohorts."""

    key: str  # "" in a homogeneous run
    method: Method
    inputs: Inputs
    cohorts: tuple[Cohort, ...]
    targets: tuple[Target, ...] = ()  # the evaluation mode's scored sets (`eval_modes`)
    strategy: Strategy = field(default_factory=FedAvg)  # how its server state is federated

    @property
    def clients(self) -> list[int]:
        return sorted(c for cohort in self.cohorts for c in cohort.clients)


def pack(servers: dict[str, ServerState]) -> ServerState:
    """One server state holding every population's (names prefixed `key/`; as is for one)."""
    if list(servers) == [""]:
        return servers[""]

    def merged(part: str) -> dict[str, Tensor]:
        return {
            f"{key}{SEP}{name}": t
            for key, s in servers.items()
            for name, t in getattr(s, part).items()
        }

    return ServerState(merged("params"), merged("personal"), merged("buffers"))


def unpack(server: ServerState, keys: list[str]) -> dict[str, ServerState]:
    """The inverse of `pack`."""
    if keys == [""]:
        return {"": server}

    def part(d: dict[str, Tensor], key: str) -> dict[str, Tensor]:
        prefix = f"{key}{SEP}"
        return {n[len(prefix) :]: t for n, t in d.items() if n.startswith(prefix)}

    return {
        k: ServerState(part(server.params, k), part(server.personal, k), part(server.buffers, k))
        for k in keys
    }


def shared_names(servers: dict[str, ServerState]) -> list[str]:
    """Shared parameters every population has, with the same shape in all of them."""
    states = list(servers.values())
    if len(states) < 2:
        return []
    first = states[0].params
    return [
        n
        for n, t in first.items()
        if all(n in s.params and s.params[n].shape == t.shape for s in states[1:])
    ]


def share(servers: dict[str, ServerState], weights: dict[str, float]) -> dict[str, ServerState]:
    """Average the shared parameters across populations, weighted by `weights` (those without
    participants this round weigh 0); a round with no weight at all changes nothing."""
    total = sum(weights.values())
    names = shared_names(servers)
    if total <= 0 or not names:
        return servers
    mean = {
        n: sum(servers[k].params[n] * (w / total) for k, w in weights.items() if w > 0)
        for n in names
    }
    return {
        k: ServerState({**s.params, **{n: mean[n].clone() for n in names}}, s.personal, s.buffers)
        for k, s in servers.items()
    }


def start_shared(servers: dict[str, ServerState]) -> dict[str, ServerState]:
    """Give every population the first population's initial values of the parameters they share."""
    return share(servers, {k: float(i == 0) for i, k in enumerate(servers)})


def merge_counts(parts: list[tuple[EvalCounts, list[int]]]) -> EvalCounts:
    """One run's counts from each population's counts over its own clients.

    With a single population of every client, its counts are returned unchanged. Otherwise each
    client's local counts come from its population, and `global_acc` becomes per client: a global
    model's test-split accuracy is given to each of its population's clients.
    """
    if len(parts) == 1:
        return parts[0][0]
    first = parts[0][0]
    n = len(first.total_local)
    correct = np.zeros(n, dtype=np.int64)
    global_acc = np.full(n, np.nan)
    f1 = np.full(n, np.nan)
    ece_local, ece_global = np.full(n, np.nan), np.full(n, np.nan)
    for counts, clients in parts:
        idx = np.asarray(clients, dtype=np.int64)
        correct[idx] = counts.correct_local[idx]
        global_acc[idx] = _per_client(counts.global_acc, idx)
        if counts.f1_global is not None:
            f1[idx] = _per_client(counts.f1_global, idx)
        if counts.ece_local is not None:
            ece_local[idx] = counts.ece_local[idx]
        if counts.ece_global is not None:
            ece_global[idx] = _per_client(counts.ece_global, idx)
    return EvalCounts(
        correct_local=correct,
        total_local=first.total_local,
        heldout=first.heldout,
        global_acc=global_acc,
        global_total=first.global_total,
        heldout_applicable=first.heldout_applicable,
        f1_global=f1,
        ece_local=ece_local,
        ece_global=ece_global,
    )


def _per_client(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """A population's per-client values at idx; a global model's one value for each of them."""
    return np.full(len(idx), values[0]) if len(values) == 1 else values[idx]


def client_profiles(het: ModelHet) -> list[int]:
    """Each client's profile index: profiles take client ids in order."""
    return [i for i, p in enumerate(het.profiles) for _ in range(p.clients)]


def participants(cohort: Cohort, round_clients: list[int]) -> list[int]:
    """This round's clients that belong to `cohort`, in the round's order."""
    mine = set(cohort.clients)
    return [c for c in round_clients if c in mine]
