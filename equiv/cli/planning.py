"""``equiv plan``: the number of micro-batches N recommended for a memory budget."""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import Tensor, nn

from equiv.batches import Batch
from equiv.cli.common import UsageError
from equiv.cli.inputs import load_target
from equiv.cost.planner import NothingFitsError, format_plan, plan
from equiv.cost.workloads import WORKLOADS, CountItems, LossSum, build_workload_model


def _load_plan_target(spec: str) -> tuple[nn.Module, Batch, LossSum | None, CountItems | None, int | None]:
    """A built-in workload name, or ``MODULE:FUNC`` / ``path/to/file.py:FUNC``
    where ``FUNC()`` returns ``(model, (inputs, targets))`` or
    ``(model, (inputs, targets), loss_sum)``.  Returns the model, the example
    batch, the loss and item count (None: defaults) and a default global batch."""
    if spec in WORKLOADS:
        workload = WORKLOADS[spec]
        generator = torch.Generator().manual_seed(0)
        return (
            build_workload_model(workload),
            workload.make_batch(workload.global_batch_size, generator),
            workload.loss_sum,
            workload.count_items,
            workload.global_batch_size,
        )
    if ":" not in spec:
        raise UsageError(f"target must be a built-in workload {sorted(WORKLOADS)} or MODULE:FUNC, got {spec!r}")
    func = load_target(spec)
    try:
        result = func()
    except Exception as exc:  # the user's code: say which call failed, keep the cause
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module)):
        raise UsageError(
            f"{spec}() must return (model, (inputs, targets)[, loss_sum]) with an nn.Module first, "
            f"got {type(result).__name__}"
        )
    model, batch = result[0], result[1]
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch)):
        raise UsageError(f"{spec}(): the batch must be (inputs, targets) tensors, got {type(batch).__name__}")
    return model, (batch[0], batch[1]), (result[2] if len(result) == 3 else None), None, None


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, batch, loss_sum, count_items, default_batch = _load_plan_target(args.target)
    global_batch_size = next(
        size for size in (args.global_batch_size, default_batch, int(batch[0].shape[0])) if size is not None
    )
    try:
        result = plan(
            model,
            batch,
            global_batch_size=global_batch_size,
            memory_budget_bytes=args.budget,
            loss_sum=loss_sum,
            count_items=count_items,
            device=args.device,
            candidates=args.candidates,
            repeats=args.repeats,
        )
    except NothingFitsError as exc:
        print(f"equiv plan: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0 if result.recommended_n is not None else 1
