"""Metric definitions (SGPT sec. 5.2.1, PEP-FedPT sec. 5), as pure functions on per-client counts.

* `acc_local` (per client): accuracy on the client's local test set.
* `acc_local_mean` / `acc_local_worst`: mean / minimum of `acc_local` over participating clients
  (clients with an empty local test set are left out); `acc_local_p05/p10/p15`: the 5/10/15th
  percentiles (numpy's linear interpolation), PEP-FedPT's lower-tail view of "worst".
* `acc_global`: accuracy on the full test split; for personal and client-conditioned methods
  each client's model is scored on it and the mean over participating clients is reported
  (SGPT: "the mean accuracy made by each client over all testing images").
* `acc_pooled`: correct / total over the union of the local test sets (what SGPT's code calls
  "global accuracy").
* `acc_heldout_mean` / `acc_heldout_worst`: the same on held-out clients, which never train;
  not applicable (absent) for personal methods, except those that say what they deploy to a new
  client (`inference = "personal-deploys"`, e.g. P-PT: the initial prompts and the federated head).
* `clients_untrained` (personal methods, `train.unseen_clients = "exclude"`, the default): the
  participating clients not yet sampled in any round. They have no trained personal parameters
  (pFedPG / pFedHN would give them a random head or embedding), so they are left out of every
  local and per-client global metric above, and counted here.
* `acc_domain_<d>`: for domain partitions, the mean local accuracy of the participating clients
  of domain d (SGPT / PEP-FedPT / SDFed per-domain columns).
* `acc_profile_<name>`: in a model-heterogeneous run, the same for the clients of a profile.
* `f1_macro_global`: macro F1 on the full test split (TPFL Figs. 2-3), averaged over clients
  like `acc_global`; F1 is averaged over the classes present in the labels or the predictions.
* `ece_local` (per client) / `ece_heldout` / `ece_local_mean` / `ece_heldout_mean` / `ece_global`:
  expected calibration error (Guo et al., ICML 2017) beside the accuracy of the same name, from
  the evaluation's logits: top-1 confidence (max softmax, over the classes the prediction may
  take) in 15 equal-width bins (lo, hi], ECE = sum_b |B_b| / n * |acc(B_b) - conf(B_b)|.
* `params_trainable`: shared parameters plus one client's personal ones, stored once (round 0).
* `<name>_last10`: the mean of an aggregate over the last 10 evaluated rounds (the papers' figure).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (5, 10, 15)
ECE_BINS = 15
SUMMARY_SUFFIX = "_last"


@dataclass(frozen=True)
class EvalCounts:
    """Per-client evaluation counts of one round (arrays over all N clients)."""

    correct_local: np.ndarray  # (N,) correct predictions on each local test set
    total_local: np.ndarray  # (N,) local test set sizes
    heldout: np.ndarray  # (N,) bool
    global_acc: np.ndarray  # (N,) per-client accuracy on the full test split, or (1,) if global
    global_total: int  # size of the full test split
    heldout_applicable: bool = True
    f1_global: np.ndarray | None = None  # macro F1 on the full test split, shaped as global_acc
    untrained: np.ndarray | None = None  # (N,) bool: participating clients left out (unseen)
    ece_local: np.ndarray | None = None  # (N,) ECE on each local test set (nan: empty)
    ece_global: np.ndarray | None = None  # ECE on the full test split, shaped as global_acc


MetricRow = tuple[int | None, str, float, int | None]  # client_id, name, value, count


def client_rows(ev: EvalCounts) -> list[MetricRow]:
    """Per-client rows: acc_local / acc_heldout, plus acc_global for per-client models."""
    rows: list[MetricRow] = []
    skip = _untrained(ev)
    for c in range(len(ev.total_local)):
        if ev.total_local[c] == 0 or (ev.heldout[c] and not ev.heldout_applicable) or skip[c]:
            continue
        name = "heldout" if ev.heldout[c] else "local"
        n = int(ev.total_local[c])
        rows.append((c, f"acc_{name}", float(ev.correct_local[c] / n), n))
        if ev.ece_local is not None and not np.isnan(ev.ece_local[c]):
            rows.append((c, f"ece_{name}", float(ev.ece_local[c]), n))
    if len(ev.global_acc) > 1:
        for name, values in (("acc_global", ev.global_acc), ("ece_global", ev.ece_global)):
            if values is None:
                continue
            rows += [
                (c, name, float(a), ev.global_total)
                for c, a in enumerate(values)
                if not ev.heldout[c] and not skip[c] and not np.isnan(a)
            ]
    return rows


def _untrained(ev: EvalCounts) -> np.ndarray:
    """(N,) bool: the clients excluded as never trained (none when not marked)."""
    none = np.zeros(len(ev.total_local), dtype=bool)
    return none if ev.untrained is None else ev.untrained.astype(bool)


def aggregates(ev: EvalCounts) -> dict[str, float]:
    """The per-round aggregate metrics (client_id NULL rows)."""
    has_test = ev.total_local > 0
    skip = _untrained(ev)
    part = has_test & ~ev.heldout & ~skip
    acc = ev.correct_local[part] / ev.total_local[part]
    out: dict[str, float] = {}
    if ev.untrained is not None:
        out["clients_untrained"] = float(skip.sum())
    if acc.size:
        out["acc_local_mean"] = float(acc.mean())
        out["acc_local_worst"] = float(acc.min())
        for q in PERCENTILES:
            out[f"acc_local_p{q:02d}"] = float(np.percentile(acc, q))
        out["acc_pooled"] = float(ev.correct_local[part].sum() / ev.total_local[part].sum())
    glob = ev.global_acc if len(ev.global_acc) == 1 else ev.global_acc[~ev.heldout & ~skip]
    glob = glob[~np.isnan(glob)]
    if glob.size:
        out["acc_global"] = float(glob.mean())
    for name, values in (("f1_macro_global", ev.f1_global), ("ece_global", ev.ece_global)):
        if values is not None:
            per = values if len(values) == 1 else values[~ev.heldout & ~skip]
            per = per[~np.isnan(per)]
            if per.size:
                out[name] = float(per.mean())
    if ev.ece_local is not None and (ece := ev.ece_local[part & ~np.isnan(ev.ece_local)]).size:
        out["ece_local_mean"] = float(ece.mean())
    held = has_test & ev.heldout
    if held.any() and ev.heldout_applicable:
        hacc = ev.correct_local[held] / ev.total_local[held]
        out["acc_heldout_mean"] = float(hacc.mean())
        out["acc_heldout_worst"] = float(hacc.min())
        if ev.ece_local is not None and (ece := ev.ece_local[held & ~np.isnan(ev.ece_local)]).size:
            out["ece_heldout_mean"] = float(ece.mean())
    return out


def expected_calibration_error(
    conf: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS
) -> float:
    """ECE of top-1 confidences conf (M,) and hits correct (M,) in `bins` equal-width bins
    (lo, hi] of [0, 1]: sum over bins of |B| / M * |accuracy(B) - mean confidence(B)|; nan if M = 0.
    """
    conf, hit = np.asarray(conf, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    if conf.size == 0:
        return float("nan")
    which = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)  # (lo, hi]
    gap = np.bincount(which, weights=hit - conf, minlength=bins)  # sum of (hit - conf) per bin
    return float(np.abs(gap).sum() / conf.size)


def macro_f1(pred: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """Unweighted mean over classes of F1 = 2 tp / (2 tp + fp + fn), over the classes that occur
    in `labels` or `pred` (scikit-learn's "macro" average)."""
    pred, labels = np.asarray(pred, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    tp = np.bincount(labels[pred == labels], minlength=num_classes)
    n_pred = np.bincount(pred, minlength=num_classes)
    n_true = np.bincount(labels, minlength=num_classes)
    present = (n_pred + n_true) > 0
    f1 = 2 * tp[present] / (n_pred[present] + n_true[present])
    return float(f1.mean()) if f1.size else float("nan")


def summary(history: list[dict[str, float]], window: int) -> dict[str, float]:
    """Mean of each aggregate over the last `window` evaluated rounds: `<name>_last<window>`."""
    recent = history[-window:]
    names = sorted({k for h in recent for k in h})
    out = {}
    for name in names:
        values = [h[name] for h in recent if name in h]
        out[f"{name}{SUMMARY_SUFFIX}{window}"] = float(np.mean(values))
    return out


def domain_key(name: str) -> str:
    """The `<d>` of `acc_domain_<d>`: lowercase, runs of other characters as one hyphen."""
    return re.sub(r"[^0-9a-z]+", "-", name.lower()).strip("-")


def domain_accuracies(
    ev: EvalCounts,
    client_domains: Sequence[int | None],
    domain_names: Sequence[str] | None,
    prefix: str = "acc_domain_",
) -> dict[str, float]:
    """`acc_domain_<d>`: mean local accuracy of the participating clients of domain d.

    Clients without a domain (label-skew partitions), held-out clients, excluded untrained
    clients and clients with an empty local test set are left out, as in `acc_local_mean`; so
    is a domain left without clients. Any other grouping of clients works the same with its
    own `prefix` (model heterogeneity's `acc_profile_<name>`).
    """
    if not domain_names:
        return {}
    dom = np.array([-1 if d is None else d for d in client_domains])  # (N,)
    part = (ev.total_local > 0) & ~ev.heldout & ~_untrained(ev)
    out = {}
    for d, name in enumerate(domain_names):
        mine = part & (dom == d)
        if mine.any():
            acc = ev.correct_local[mine] / ev.total_local[mine]
            out[f"{prefix}{domain_key(name)}"] = float(acc.mean())
    return out


def params_trainable(params: Mapping[str, Any], personal: Mapping[str, Any]) -> int:
    """Trainable parameters of a method: every shared tensor plus one client's personal rows.

    Args:
        params: the server's shared tensors (no client axis).
        personal: per-client tables (N, ...); one row of each counts.
    """
    shared = sum(math.prod(t.shape) for t in params.values())
    own = sum(math.prod(t.shape[1:]) for t in personal.values())
    return int(shared + own)
