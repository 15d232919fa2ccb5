"""Evaluation: count correct predictions per client on local tests and on the full test split.

Global-inference methods predict the test split once and every client's local accuracy is read
off those predictions by indexing. Personal and client-conditioned methods evaluate each client
with its own parameters / context.

Label space of local accuracy (`TrainConfig.local_label_space`): "all" takes the argmax over
every class; "client" masks, on a client's local test set, the logits of the classes it has no
train samples of (FedTPG's client-local classifier). Accuracy on the full test split always uses
all classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fpbench.backbones.recall import SharedStates, evaluating
from fpbench.engine.inputs import Inputs
from fpbench.engine.metrics import EvalCounts, expected_calibration_error, macro_f1
from fpbench.engine.precision import Draw, autocast, start_params
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.engine.task import Task
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Method, ServerState, as_logits


@dataclass(frozen=True)
class Predictor:
    """A set of clients' models ready to score test samples: the method, its parameter rows
    (K, ...), the context, the inputs and the batch size."""

    method: Method
    params: dict[str, Tensor]
    ctx: Context
    inputs: Inputs
    batch_size: int

    def forward(self, x: Tensor, rows: Tensor) -> Tensor:
        return as_logits(self.method.forward(self.params, x, rows, self.ctx))


@torch.no_grad()
def logits_of(model: Predictor, idx: Tensor, rows: Tensor) -> Iterator[Tensor]:
    """Logits (B, C) of test samples idx (M,), batch by batch; rows[i] = the row of sample i."""
    inputs, size = model.inputs, model.batch_size
    for start in range(0, len(idx), size):
        part = idx[start : start + size]
        x = inputs.test(part)
        with inputs.recall(x, "test", part):
            out = model.forward(x, rows[start : start + size])
        yield out


@torch.no_grad()
def _shared_logits(
    model: Predictor, block: Tensor, images: Tensor, rows: list[int], shared: SharedStates
) -> Iterator[Tensor]:
    """Logits (B, C) of the test samples `block` (S,) (preprocessed: `images`) under each of
    the given rows in turn, batch by batch, with the states the rows share kept in `shared`."""
    pos = torch.arange(len(block), device=block.device).repeat(len(rows))  # (S * R,)
    row = torch.tensor(rows, device=block.device).repeat_interleave(len(block))
    for start in range(0, len(pos), model.batch_size):
        at = pos[start : start + model.batch_size]
        whole = len(at) == len(block) and start % len(block) == 0  # one row's whole block
        x = images if whole else images[at]
        part, r = block[at], row[start : start + model.batch_size]
        with model.inputs.recall(x, "test", part, r, None, shared):
            out = model.forward(x, r)
        yield out


def predict(
    model: Predictor, idx: Tensor, rows: Tensor, allowed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Predicted labels (M,) for test samples idx (M,), and their top-1 confidences (M,) (max
    softmax, fp32); rows[i] = the param row of sample i.

    `allowed` (M, C) bool, if given, restricts sample i's argmax to the classes allowed[i].
    """
    preds, confs = [], []
    size = model.batch_size
    for start, logits in zip(range(0, len(idx), size), logits_of(model, idx, rows), strict=True):
        if allowed is not None:
            keep = allowed[start : start + size].to(logits.device)  # (B, C)
            logits = _masked(logits, keep)
        preds.append(logits.argmax(-1))
        confs.append(confidence(logits))
    if not preds:
        return idx.new_zeros(0), torch.zeros(0, device=idx.device)
    return torch.cat(preds), torch.cat(confs)


def confidence(logits: Tensor) -> Tensor:
    """Top-1 confidence (B,): the largest softmax probability of fp32 logits (B, C)."""
    return logits.float().softmax(-1).amax(-1)


def _ece(conf: Tensor, correct: Tensor) -> float:
    return expected_calibration_error(conf.cpu().numpy(), correct.cpu().numpy())


def _masked(logits: Tensor, keep: Tensor) -> Tensor:
    """fp32 logits (B, C) with the classes outside keep (B, C) at -inf."""
    return logits.float().masked_fill(~keep, float("-inf"))


def evaluate(
    method: Method,
    server: ServerState,
    task: Task,
    batch_size: int,
    inputs: Inputs | None = None,
    precision: str = "fp32",
    label_space: str = "all",
    clients: list[int] | None = None,
    full_split: str | int = "all",
) -> EvalCounts:
    """Per-client counts; `label_space` "client" restricts local predictions (module doc).

    `clients`, if given, are the only clients a personal or client-conditioned method evaluates
    (the others count zero); a global model's local counts are cheap and cover every client.
    `full_split` (`TrainConfig.full_split_clients`): which of a personal or client-conditioned
    method's participants score the full test split (`full_split_sample`); the others' full-split
    scores stay NaN.
    """
    inputs = inputs or Inputs.of(method, task)
    with autocast(task.priors.device, precision), evaluating():
        if method.inference == "global":
            return _evaluate_global(method, server, task, inputs, batch_size, label_space)
        return _evaluate_per_client(
            method, server, task, inputs, batch_size, label_space, clients, precision, full_split
        )


def full_split_sample(task: Task, full_split: str | int) -> set[int] | None:
    """The participants that score the full test split: None (all) for "all", none for
    "none", else a sample of that many (all if fewer) drawn from the federation alone, so the
    same clients at every evaluation, for every method and seed of a federation."""
    if full_split == "all":
        return None
    if full_split == "none":
        return set()
    participants = [c for c in range(task.num_clients) if not task.heldout[c]]
    if int(full_split) >= len(participants):
        return set(participants)
    rng = np.random.default_rng(derive_seed("full-split", task.num_clients))
    return {int(c) for c in rng.choice(participants, size=int(full_split), replace=False)}


def client_classes(task: Task) -> Tensor:
    """(N, C) bool: the classes each client has train samples of (all, for one without any)."""
    return task.priors > 0


def _evaluate_global(
    method: Method,
    server: ServerState,
    task: Task,
    inputs: Inputs,
    batch_size: int,
    label_space: str = "all",
) -> EvalCounts:
    data = task.data
    zero = torch.zeros(1, dtype=torch.long)
    draws = _draws(method, task, inputs, None, "fp32")
    params = start_params(method, server, zero, task.priors.device, training=False, draws=draws)
    model = Predictor(
        method, params, Context(training=False, buffers=server.buffers), inputs, batch_size
    )
    everything = torch.arange(len(data.test_labels), device=data.test_labels.device)
    rows = torch.zeros_like(everything)
    if label_space == "all":
        pred, conf = predict(model, everything, rows)
        correct = pred == data.test_labels
        local = [correct[idx] for idx in task.test_idx]
        local_conf = [conf[idx] for idx in task.test_idx]
    else:  # one forward: the test split's logits, masked per client for the local sets
        batches = logits_of(model, everything, rows)
        empty = everything.new_zeros(0, data.num_classes, dtype=torch.float)
        logits = torch.cat([b.float() for b in batches] or [empty])  # (M, C)
        pred, conf = logits.argmax(-1), confidence(logits)
        correct = pred == data.test_labels
        classes = client_classes(task)  # (N, C)
        masked = [
            _masked(logits[idx], classes[c].expand(len(idx), -1))
            for c, idx in enumerate(task.test_idx)
        ]
        local = [
            m.argmax(-1) == data.test_labels[idx]
            for m, idx in zip(masked, task.test_idx, strict=True)
        ]
        local_conf = [confidence(m) for m in masked]
    return EvalCounts(
        correct_local=torch.stack([c.sum() for c in local]).cpu().numpy(),
        total_local=np.array([len(idx) for idx in task.test_idx]),
        heldout=task.heldout.numpy(),
        global_acc=np.array([correct.float().mean().item()]),
        global_total=len(correct),
        f1_global=np.array([_f1(pred, data.test_labels, data.num_classes)]),
        ece_local=np.array([_ece(f, c) for f, c in zip(local_conf, local, strict=True)]),
        ece_global=np.array([_ece(conf, correct)]),
    )


def _f1(pred: Tensor, labels: Tensor, num_classes: int) -> float:
    return macro_f1(pred.cpu().numpy(), labels.cpu().numpy(), num_classes)


def _evaluate_per_client(
    method: Method,
    server: ServerState,
    task: Task,
    inputs: Inputs,
    batch_size: int,
    label_space: str = "all",
    only: list[int] | None = None,
    precision: str = "fp32",
    full_split: str | int = "all",
) -> EvalCounts:
    """Each client with its own parameters / context, many clients per batch.

    Clients are evaluated in chunks: the chunk's parameters are stacked (K, ...) and the local
    test sets are concatenated with each sample's row, so one forward serves several clients,
    as in lockstep training. The participants' scores on the full test split (`_full_split`)
    then share the work their models share.
    """
    data = task.data
    heldout_ok = method.inference in ("client-conditioned", "personal-deploys")
    clients = [
        c
        for c in (range(task.num_clients) if only is None else only)
        if heldout_ok or not task.heldout[c]
    ]
    correct_local = np.zeros(task.num_clients, dtype=np.int64)
    global_acc = np.full(task.num_clients, np.nan)
    f1_global = np.full(task.num_clients, np.nan)
    ece_local = np.full(task.num_clients, np.nan)
    ece_global = np.full(task.num_clients, np.nan)
    classes = client_classes(task) if label_space == "client" else None  # (N, C)
    scored = full_split_sample(task, full_split)
    chunk = max(1, batch_size // 32)
    chunks: list[_Chunk] = []
    for start in range(0, len(clients), chunk):
        ids = torch.tensor(clients[start : start + chunk])
        draws = _draws(method, task, inputs, ids, precision)
        params = start_params(method, server, ids, task.priors.device, training=False, draws=draws)
        ctx = Context(
            training=False, priors=task.priors[ids.to(task.priors.device)], buffers=server.buffers
        )
        allowed = None if classes is None else classes[ids.to(classes.device)]  # (K, C)
        participants = [
            row
            for row, c in enumerate(ids.tolist())
            if not task.heldout[c] and (scored is None or c in scored)
        ]
        model = Predictor(method, params, ctx, inputs, batch_size)
        if participants:
            chunks.append(_Chunk(ids, model, participants, allowed))
        alone = [row for row in range(len(ids)) if row not in participants]
        if alone:  # the others score their local test samples here
            local = [task.test_idx[c] for c in ids[alone].tolist()]
            mask = None if allowed is None else allowed[alone]
            correct, confs = _correct(model, local, mask, alone)
            for k, c in enumerate(ids[alone].tolist()):
                correct_local[c] = int(correct[k].sum())
                ece_local[c] = _ece(confs[k], correct[k])
    for c, (pred, conf, local) in _full_split(chunks, inputs, batch_size).items():
        hit = pred == data.test_labels
        global_acc[c] = hit.float().mean().item()
        f1_global[c] = _f1(pred, data.test_labels, data.num_classes)
        ece_global[c] = _ece(conf, hit)
        local_pred, local_conf = local
        right = local_pred == data.test_labels[task.test_idx[c]]
        correct_local[c] = int(right.sum())
        ece_local[c] = _ece(local_conf, right)
    return EvalCounts(
        correct_local=correct_local,
        total_local=np.array([len(idx) for idx in task.test_idx]),
        heldout=task.heldout.numpy(),
        global_acc=global_acc,
        global_total=len(data.test_labels),
        heldout_applicable=heldout_ok,
        f1_global=f1_global,
        ece_local=ece_local,
        ece_global=ece_global,
    )


@dataclass(frozen=True)
class _Chunk:
    """Clients evaluated together: their ids (K,), their models, the rows among them that score
    the full test split, and the classes each may predict locally ((K, C) bool, or None: all)."""

    ids: Tensor
    model: Predictor
    rows: list[int]
    allowed: Tensor | None


def _full_split(
    chunks: list[_Chunk], inputs: Inputs, batch_size: int
) -> dict[int, tuple[Tensor, Tensor, tuple[Tensor, Tensor]]]:
    """Each listed client's predictions (M,) and confidences (M,) on the full test split, and
    those on its local test samples (restricted to the chunk's allowed classes, if given),
    taken from the same logits.

    The split is scored a block of `batch_size` samples at a time, by every chunk's clients
    in turn, each block's images preprocessed once; the backbone keeps, per sample, the states
    that the first client computes and reuses them for every client whose own are exactly
    equal (`fpbench.backbones.recall.SharedStates`): the work the clients' models share is
    done once per sample, the rest per client. The values are those of one client at a time.
    """
    task = inputs.task
    labels = task.data.test_labels
    device = labels.device
    clients = [int(ch.ids[row]) for ch in chunks for row in ch.rows]
    allowed = [None if ch.allowed is None else ch.allowed[row] for ch in chunks for row in ch.rows]
    first = np.cumsum([0] + [len(ch.rows) for ch in chunks]).tolist()
    # outputs allocated once, before the loop: small long-lived pieces allocated between the
    # loop's large temporaries would fragment the CPU heap (glibc), growing the process by
    # about the size of the logits at every (chunk, block)
    preds = torch.empty(len(clients), len(labels), dtype=torch.long, device=device)
    confs = torch.empty(len(clients), len(labels), device=device)
    sizes = [len(task.test_idx[c]) for c in clients]
    offset = dict(zip(clients, np.cumsum([0, *sizes]).tolist()[:-1], strict=True))
    filled = dict.fromkeys(clients, 0)
    local: Tensor | None = None  # every client's logits of its local samples, in block order
    mine = _local_positions(chunks, task.test_idx, batch_size)
    for n, block in enumerate(torch.arange(len(labels), device=device).split(batch_size)):
        images = inputs.test(block)
        shared = SharedStates(block, len(labels))
        span = slice(int(block[0]), int(block[-1]) + 1)
        for j, ch in enumerate(chunks):
            batches = _shared_logits(ch.model, block, images, ch.rows, shared)
            logits = torch.cat([part.float() for part in batches])  # (R * S, C), row-major
            if local is None:
                local = logits.new_empty(sum(sizes), logits.shape[1])
            pred, conf = logits.argmax(-1).split(len(block)), confidence(logits).split(len(block))
            for k, (row, part) in enumerate(zip(ch.rows, logits.split(len(block)), strict=True)):
                c, i = int(ch.ids[row]), first[j] + k
                preds[i, span], confs[i, span] = pred[k], conf[k]
                if (c, n) in mine:
                    start = offset[c] + filled[c]
                    local[start : start + len(mine[c, n])] = part[mine[c, n]]
                    filled[c] += len(mine[c, n])
    out: dict[int, tuple[Tensor, Tensor, tuple[Tensor, Tensor]]] = {}
    for i, (c, size) in enumerate(zip(clients, sizes, strict=True)):
        if local is None or not size:  # no local test samples
            out[c] = (preds[i], confs[i], (preds[i][:0], confs[i][:0]))
            continue
        order = task.test_idx[c].argsort().argsort()  # block order -> test_idx order
        logits = local[offset[c] : offset[c] + size][order.to(device)]  # (n_c, C)
        if allowed[i] is not None:
            logits = _masked(logits, allowed[i].to(logits.device))
        out[c] = (preds[i], confs[i], (logits.argmax(-1), confidence(logits)))
    return out


def _local_positions(
    chunks: list[_Chunk], test_idx: list[Tensor], batch_size: int
) -> dict[tuple[int, int], Tensor]:
    """(client, block) -> the positions in that block of the client's local test samples, in
    ascending order, for the chunks' listed clients (blocks of `batch_size` samples)."""
    out: dict[tuple[int, int], Tensor] = {}
    for ch in chunks:
        for row in ch.rows:
            c = int(ch.ids[row])
            idx = test_idx[c].sort().values
            blocks, counts = torch.unique_consecutive(idx // batch_size, return_counts=True)
            for b, group in zip(blocks.tolist(), idx.split(counts.tolist()), strict=True):
                out[c, b] = group % batch_size
    return out


def _draws(
    method: Method, task: Task, inputs: Inputs, ids: Tensor | None, precision: str
) -> Callable[[ExitStack], Draw]:
    """The clients `ids`' `draw` for `Method.client_params`, made from the stack that holds
    what it enters: `draw(n)` gives one fixed batch of n train samples of each client (its
    first batch of `client_batches` seeded by "adapt" and the client), recalled as any train
    batch, with gradients enabled and the evaluation's autocast. Nothing is drawn unless it
    is called; it raises where there is no client data: a task of clients without local data
    (an evaluation mode's other set) or a global model (`ids` None)."""

    def make(held: ExitStack) -> Draw:
        def draw(n: int) -> tuple[Tensor, Tensor, Tensor]:
            if task.no_local_data is not None:
                raise FpbenchError(
                    f"method {method.name} adapts on each client's data before it is scored; "
                    f"{task.no_local_data} scores clients without local data: use another method"
                )
            if ids is None:
                raise FpbenchError(
                    f"method {method.name} draws client data before it is scored, but its "
                    'inference is "global" (one model for every client): declare "personal"'
                )
            held.enter_context(torch.enable_grad())
            held.enter_context(autocast(task.priors.device, precision))
            batches = [
                (
                    client_batches(task.train_idx[c], n, derive_seed("adapt", c))
                    or [task.train_idx[c]]
                )[0]
                for c in ids.tolist()
            ]
            idx, rows = _flat(batches)
            x = inputs.train(idx)
            held.enter_context(inputs.recall(x, "train", idx))
            return x, task.data.train_labels[idx], rows

        return draw

    return make


def _correct(
    model: Predictor,
    idx: list[Tensor],
    allowed: Tensor | None = None,
    rows: list[int] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per k: a bool tensor of which of the test samples idx[k] param row rows[k] (default k)
    predicts right, and the confidences of those predictions.

    `allowed` (K, C) bool, if given, restricts the k-th predictions to the classes allowed[k].
    """
    preds, confs = _predicted(model, idx, allowed, rows)
    labels = model.inputs.task.data.test_labels
    return [p == labels[i] for p, i in zip(preds, idx, strict=True)], confs


def _predicted(
    model: Predictor,
    idx: list[Tensor],
    allowed: Tensor | None = None,
    rows: list[int] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per k: the labels param row rows[k] (default k) predicts for its test samples idx[k]
    and their confidences (see `_correct`)."""
    flat, part = _flat(idx)
    mask = None if allowed is None else allowed[part.to(allowed.device)]  # (M, C)
    at = part if rows is None else torch.tensor(rows, device=part.device)[part]
    pred, conf = predict(model, flat, at, mask)
    sizes = [len(t) for t in idx]
    return list(pred.split(sizes)), list(conf.split(sizes))


def _flat(parts: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The K index tensors concatenated (M,), and the part k of each element (M,)."""
    flat = torch.cat(parts)
    sizes = torch.tensor([len(t) for t in parts], device=flat.device)
    return flat, torch.repeat_interleave(torch.arange(len(parts), device=flat.device), sizes)
