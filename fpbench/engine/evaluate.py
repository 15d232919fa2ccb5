"""Evaluation: count correct predictions per client on local tests and on the full test split.

Global-inference methods predict the test split once and every client's local accuracy is read
off those predictions by indexing. Personal and client-conditioned methods evaluate each client
with its own parameters / context.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fpbench.engine.inputs import Inputs
from fpbench.engine.metrics import EvalCounts
from fpbench.engine.task import Task
from fpbench.methods.base import Context, Method, ServerState


@torch.no_grad()
def predict(method: Method, params: dict[str, Tensor], inputs: Inputs, idx: Tensor,
            rows: Tensor, ctx: Context, batch_size: int) -> Tensor:
    """Predicted labels (M,) for test samples idx (M,); rows[i] = the param row of sample i."""
    preds = []
    for start in range(0, len(idx), batch_size):
        x = inputs.test(idx[start:start + batch_size])
        logits = method.forward(params, x, rows[start:start + batch_size], ctx)
        preds.append(logits.argmax(-1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=idx.device)


def evaluate(method: Method, server: ServerState, task: Task, batch_size: int,
             inputs: Inputs | None = None) -> EvalCounts:
    inputs = inputs or Inputs(method.backbone, task, method.frozen_input, cache=None,
                              batch_size=batch_size)
    if method.inference == "global":
        return _evaluate_global(method, server, task, inputs, batch_size)
    return _evaluate_per_client(method, server, task, inputs, batch_size)


def _evaluate_global(method: Method, server: ServerState, task: Task, inputs: Inputs,
                     batch_size: int) -> EvalCounts:
    data = task.data
    params = method.eval_params(server, torch.zeros(1, dtype=torch.long))
    ctx = Context(training=False, buffers=server.buffers)
    everything = torch.arange(len(data.test_labels), device=data.test_labels.device)
    rows = torch.zeros_like(everything)
    correct = predict(method, params, inputs, everything, rows, ctx, batch_size) \
        == data.test_labels
    return EvalCounts(
        correct_local=np.array([int(correct[idx].sum()) for idx in task.test_idx]),
        total_local=np.array([len(idx) for idx in task.test_idx]),
        heldout=task.heldout.numpy(),
        global_acc=np.array([correct.float().mean().item()]),
        global_total=len(correct),
    )


def _evaluate_per_client(method: Method, server: ServerState, task: Task, inputs: Inputs,
                         batch_size: int) -> EvalCounts:
    data = task.data
    applicable_heldout = method.inference == "client-conditioned"
    n = task.num_clients
    correct_local = np.zeros(n, dtype=np.int64)
    global_acc = np.full(n, np.nan)
    for c in range(n):
        if task.heldout[c] and not applicable_heldout:
            continue
        ids = torch.tensor([c])
        params = method.eval_params(server, ids)
        ctx = Context(training=False, priors=task.priors[ids.to(task.priors.device)],
                      buffers=server.buffers)
        idx = task.test_idx[c]
        rows = torch.zeros(len(idx), dtype=torch.long, device=idx.device)
        pred = predict(method, params, inputs, idx, rows, ctx, batch_size)
        correct_local[c] = int((pred == data.test_labels[idx]).sum())
        if not task.heldout[c]:
            everything = torch.arange(len(data.test_labels), device=idx.device)
            pred = predict(method, params, inputs, everything, torch.zeros_like(everything), ctx,
                           batch_size)
            global_acc[c] = (pred == data.test_labels).float().mean().item()
    return EvalCounts(
        correct_local=correct_local,
        total_local=np.array([len(idx) for idx in task.test_idx]),
        heldout=task.heldout.numpy(),
        global_acc=global_acc,
        global_total=len(data.test_labels),
        heldout_applicable=applicable_heldout,
    )
