"""Bugs that need several ranks or dynamic loss scaling to exist.

Like :mod:`equiv.zoo.bugs`, each follows the candidate contract and is wrong in one
way, named for it.  The DDP ones receive a ``DistributedDataParallel`` model
(see :mod:`equiv.checking.distributed`); the FSDP2 ones a model ``fully_shard``-ed
per layer and at the root (``check_distributed(..., engine="fsdp2")``), listed
in :data:`FSDP2_BUGS` with the sharding policy they run under and what the
check must find; the loss-scaling one a ``grad_scaler``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from equiv.accumulator import Accumulator, accumulator_step
from equiv.batches import MicroBatches
from equiv.losses import item_count, loss_sum_and_count
from equiv.outcomes import Outcome
from equiv.zoo.orthogonalising_bugs import updates_averaged_over_ranks

__all__ = [
    "DISTRIBUTED_BUGS",
    "FSDP2_BUGS",
    "LOSS_SCALE_BUGS",
    "RAGGED_TOKEN_STEPS",
    "SEARCH_ZOO",
    "Fsdp2Entry",
    "SearchEntry",
    "bfloat16_buffer_before_sync",
    "bfloat16_buffer_local_mean",
    "bfloat16_compressed_all_reduce",
    "bfloat16_sharded_buffer",
    "clip_shard_with_local_norm",
    "float32_buffer_before_sync",
    "float32_sharded_buffer",
    "forward_outside_no_sync",
    "global_item_count",
    "local_mean_per_rank",
    "local_mean_per_rank_fsdp2",
    "local_token_mean_per_rank",
    "no_sync_missing",
    "overflow_checked_on_last_micro_batch",
    "scale_made_in_the_default_dtype",
    "skip_backward_without_real_tokens",
    "sum_over_ranks_divided_by_global_tokens",
    "sync_disabled_on_last_micro_batch",
    "sync_every_micro_batch",
    "upstream_report",
]


def _sample_weighted_backward(
    model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor], index: int, rank_samples: int
) -> None:
    inputs, targets = micro_batches[index]
    (loss_fn(model(inputs), targets) * len(targets) / rank_samples).backward()


def local_mean_per_rank(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each rank normalises by its OWN sample count and DDP averages the ranks:
    a mean of rank means, wrong whenever ranks hold different numbers of
    samples (the per-device normalisation behind transformers #34191)."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    rank_samples = sum(len(targets) for _, targets in micro_batches)
    for index in range(len(micro_batches) - 1):
        with model.no_sync():
            _sample_weighted_backward(model, micro_batches, loss_fn, index, rank_samples)
    _sample_weighted_backward(model, micro_batches, loss_fn, len(micro_batches) - 1, rank_samples)
    optimizer.step()


def local_token_mean_per_rank(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Each rank back-propagates its summed loss over its OWN item count (real
    tokens, for a token loss) and DDP averages the ranks: a mean of per-rank token
    means.  The GA=1 shortcut of torchtune PR #2980, exact only "when every rank
    contributed the same number of tokens", which padded instruction data rarely
    does; transformers #34242 before ``average_tokens_across_devices``."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    rank_items = sum(item_count(loss_fn, targets) for _, targets in micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum / rank_items).backward()
    optimizer.step()


def global_item_count(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct, for contrast: the item count all-reduced across ranks once per
    window, every micro-batch's summed loss over that global count (times the
    world size, which DDP's averaging divides out), the sync on the last
    micro-batch only.  torchtitan PR #2206's ``loss_sum / global_valid_tokens``;
    exact with ragged token counts, and with a rank or micro-batch of none."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    items = torch.tensor(float(sum(item_count(loss_fn, targets) for _, targets in micro_batches)), dtype=torch.float64)
    dist.all_reduce(items)
    scale = dist.get_world_size() / float(items)
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum * scale).backward()
    optimizer.step()


def skip_backward_without_real_tokens(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Skips the backward of a micro-batch with no real token (its token mean is
    NaN), as karpathy/nanochat PR #623 and EleutherAI/bergson PR #461 do to avoid a
    NaN loss; weighted by the all-reduced global count otherwise.  On one process
    that is harmless (such a micro-batch's gradient is zero), but under FSDP2 the
    backward is a collective: the rank that skips it makes fewer all-gathers and
    reduce-scatters than its peers, so the ranks fall out of step the first time a
    micro-batch with no real token lands on some ranks only.  Under DDP only the
    last micro-batch's backward syncs: skipping that one, the rank makes one
    gradient all-reduce fewer than its peers."""
    optimizer.zero_grad(set_to_none=True)
    counts = [int(item_count(loss_fn, targets)) for _, targets in micro_batches]
    total = torch.tensor(sum(counts), dtype=torch.float64)
    dist.all_reduce(total)
    world = dist.get_world_size()
    for index, ((inputs, targets), count) in enumerate(zip(micro_batches, counts, strict=True)):
        with _sync_on_last_only(model, index == len(micro_batches) - 1):
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            if count == 0:
                continue  # BUG: a collective the other ranks make
            (loss_sum * (world / float(total))).backward()
    optimizer.step()


@contextlib.contextmanager
def _sync_on_last_only(model: nn.Module, last: bool) -> Iterator[None]:
    """DDP's ``no_sync`` or FSDP2's gradient-sync switch: sync on the last micro-batch only."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        yield
    elif last:
        yield
    else:
        assert isinstance(model, DistributedDataParallel)
        with model.no_sync():
            yield


def _global_weighted_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    forward_in_no_sync: bool | None,
) -> None:
    """Correctly weighted by the global sample count (equal-shard assumption
    removed by an all-reduce of the count); ``forward_in_no_sync`` None: no
    no_sync at all; False: only the backward inside no_sync."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    samples = torch.tensor(sum(len(targets) for _, targets in micro_batches), dtype=torch.float64)
    torch.distributed.all_reduce(samples)
    world = torch.distributed.get_world_size()
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        scale = len(targets) * world / float(samples)
        if forward_in_no_sync is None or last:
            (loss_fn(model(inputs), targets) * scale).backward()
        else:
            output = model(inputs)  # DDP decides here, outside no_sync, that this backward all-reduces
            with model.no_sync():
                (loss_fn(output, targets) * scale).backward()
    optimizer.step()


def no_sync_missing(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Numerically right, but all-reduces after every micro-batch: N times the
    communication of a window (no ``no_sync``)."""
    _global_weighted_step(model, optimizer, micro_batches, loss_fn, forward_in_no_sync=None)


def forward_outside_no_sync(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """``no_sync`` wraps only the backward, so DDP still all-reduces every
    micro-batch: it decides at forward time (accelerate #1726)."""
    _global_weighted_step(model, optimizer, micro_batches, loss_fn, forward_in_no_sync=False)


def overflow_checked_on_last_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    grad_scaler: torch.amp.GradScaler,
    max_grad_norm: float | None = None,
) -> None:
    """The overflow flag assigned instead of OR-accumulated (MindSpore r1.3's
    parallel-mode loss-scale tutorial ORs it over the window as ``accu_overflow``)
    (``overflow = this_micro_batch`` for ``accu_overflow |= ...``): a micro-batch
    that overflowed before the last is dropped, and the window steps on the
    rest instead of being skipped.  Correctly weighted otherwise."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    total = sum(len(targets) for _, targets in micro_batches)
    sums = [torch.zeros_like(p) for p in params]
    overflow = False
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets) * len(targets) / total
        grads = torch.autograd.grad(grad_scaler.scale(loss), params)
        overflow = not all(bool(torch.isfinite(g).all()) for g in grads)  # BUG: '=' where the tutorial ORs
        if not overflow:
            torch._foreach_add_(sums, list(grads))
    for p, total_grad in zip(params, sums, strict=True):
        p.grad = total_grad
    if overflow:  # only the last micro-batch's flag decides
        p_grad = params[0].grad
        assert p_grad is not None
        p_grad.fill_(float("inf"))  # let GradScaler see the overflow it was told about
    grad_scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    grad_scaler.step(optimizer)
    grad_scaler.update()


# ---------------------------------------------------------------------- FSDP2
def sync_every_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Numerically right, but every micro-batch's backward reduce-scatters
    (FSDP2 syncs by default): N reduce-scatters per unit per window, against
    one with ``set_requires_gradient_sync(False)`` on all but the last.  The
    trade: gradients stay sharded between micro-batches instead of being held
    unsharded on every rank."""
    assert isinstance(model, FSDPModule)
    accumulator = Accumulator(model, optimizer, max_grad_norm=max_grad_norm)
    for inputs, targets in micro_batches:  # no accumulator.micro_batch(last=...): sync stays on
        loss_sum, items = loss_sum_and_count(loss_fn, model(inputs), targets)
        accumulator.backward(loss_sum, items=items)
    accumulator.step()


def _globally_weighted_fsdp2_backward(
    model: nn.Module, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor], *, sync_last: bool
) -> None:
    """Each micro-batch's summed loss weighted by world / global item count
    (FSDP2's reduce-scatter averages over ranks), gradient sync off for all
    but the last micro-batch, and off for that one too unless ``sync_last``."""
    total = torch.tensor(sum(int(item_count(loss_fn, targets)) for _, targets in micro_batches), dtype=torch.int64)
    dist.all_reduce(total)
    world = dist.get_world_size()
    for index, (inputs, targets) in enumerate(micro_batches):
        model.set_requires_gradient_sync(sync_last and index == len(micro_batches) - 1)  # type: ignore[operator]
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum * (world / float(total))).backward()


def sync_disabled_on_last_micro_batch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Gradient sync off for every micro-batch, the last one too (switched
    back on only after the loop, once its backward has run: FSDP2 reads the
    flag in the backward).  No reduce-scatter at all: no rank ever gets a
    sharded gradient, the optimizer steps nothing, and the unsharded
    gradients pile up inside FSDP from window to window."""
    assert isinstance(model, FSDPModule)
    optimizer.zero_grad(set_to_none=True)
    _globally_weighted_fsdp2_backward(model, micro_batches, loss_fn, sync_last=False)
    model.set_requires_gradient_sync(True)  # BUG: too late, the last backward has run
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()


def local_mean_per_rank_fsdp2(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Each rank normalises by its OWN sample count and FSDP's reduce-scatter
    averages the ranks: a mean of rank means, wrong whenever ranks hold
    different numbers of samples (transformers #34191's per-device
    normalisation).  Syncs once per window and clips with the global norm."""
    assert isinstance(model, FSDPModule)
    optimizer.zero_grad(set_to_none=True)
    rank_samples = sum(len(targets) for _, targets in micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        (loss_fn(model(inputs), targets) * len(targets) / rank_samples).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()


def clip_shard_with_local_norm(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Weighted by the global item count and synced once per window, but
    clipped with the norm of this rank's gradient SHARD: every rank scales its
    shard by a different coefficient, none of them the full-batch one.  (The
    norm of a sharded gradient needs the shards' squares summed over ranks,
    which ``clip_grad_norm_`` on the DTensors does and FSDP1's
    ``FullyShardedDataParallel.clip_grad_norm_`` exists for.)"""
    assert isinstance(model, FSDPModule)
    optimizer.zero_grad(set_to_none=True)
    _globally_weighted_fsdp2_backward(model, micro_batches, loss_fn, sync_last=True)
    if max_grad_norm is not None:
        shards = [p.grad.to_local() for p in model.parameters() if isinstance(p.grad, DTensor)]
        local_norm = torch.nn.utils.get_total_norm(shards, 2.0)  # BUG: this rank's shard only
        torch._foreach_mul_(shards, torch.clamp(max_grad_norm / (local_norm + 1e-6), max=1.0))
    optimizer.step()


# ------------------------------------------- the accumulation buffer's precision
def _buffered_ddp_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    buffer_dtype: torch.dtype,
    *,
    global_count: bool = True,
) -> None:
    """Globally weighted micro-batch gradients (summed loss x world / all-reduced item
    count; with ``global_count`` False, over this rank's own count: a mean of rank means)
    accumulated in the step's own buffer of ``buffer_dtype`` under ``no_sync``,
    the buffer written into ``.grad`` before the last micro-batch's backward, whose
    DDP all-reduce (once per window) then reduces the window's whole gradient."""
    assert isinstance(model, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)
    items = torch.tensor(float(sum(item_count(loss_fn, targets) for _, targets in micro_batches)), dtype=torch.float64)
    if global_count:
        dist.all_reduce(items)
    scale = (dist.get_world_size() if global_count else 1) / float(items)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p, dtype=buffer_dtype) for p in params]
    for inputs, targets in micro_batches[:-1]:
        with model.no_sync():
            loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
            (loss_sum * scale).backward()
        for param, buffer in zip(params, buffers, strict=True):
            if param.grad is not None:
                buffer += param.grad.to(buffer_dtype)
                param.grad = None
    for param, buffer in zip(params, buffers, strict=True):
        param.grad = buffer.to(param.dtype)  # DDP's sync adds the last micro-batch to it, then averages
    inputs, targets = micro_batches[-1]
    loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
    (loss_sum * scale).backward()
    optimizer.step()


def bfloat16_buffer_before_sync(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Accumulates the micro-batch gradients in its own bfloat16 buffer under DDP's
    ``no_sync`` (to save memory) and hands it to DDP's one all-reduce per window:
    correctly weighted, but every gradient keeps 8 bits between micro-batches
    (Megatron-FSDP's bf16 gradient accumulation at 3.5e-5 relative where float32
    buffers agree to 2.7e-8, ISEEKYAN #149).  A precision finding: it fails a
    user with float32 master weights and gradients, passes bfloat16 training."""
    _buffered_ddp_step(model, optimizer, micro_batches, loss_fn, torch.bfloat16)


def float32_buffer_before_sync(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct, for contrast: :func:`bfloat16_buffer_before_sync` with a float32
    buffer (Megatron's float32 main-grad buffers): exact in float32 training, a
    passing float32-sized note inside equiv's float64 run."""
    _buffered_ddp_step(model, optimizer, micro_batches, loss_fn, torch.float32)


def bfloat16_buffer_local_mean(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """:func:`bfloat16_buffer_before_sync` normalised by each rank's OWN item count
    (transformers #34191's per-device mean): a mathematical mismatch computed in
    bfloat16, which stays one with the bfloat16 lifted (never a precision finding)."""
    _buffered_ddp_step(model, optimizer, micro_batches, loss_fn, torch.bfloat16, global_count=False)


def _buffered_fsdp2_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    buffer_dtype: torch.dtype,
    max_grad_norm: float | None,
) -> None:
    """Every micro-batch reduce-scattered (gradient sync on), its gradient shard
    added into the step's own sharded buffer of ``buffer_dtype`` (Megatron-FSDP's
    main-grad buffer), the step on the buffer: globally weighted (summed loss x
    world / all-reduced item count, which the reduce-scatter's average divides out)."""
    assert isinstance(model, FSDPModule)
    optimizer.zero_grad(set_to_none=True)
    total = torch.tensor(sum(int(item_count(loss_fn, targets)) for _, targets in micro_batches), dtype=torch.int64)
    dist.all_reduce(total)
    scale = dist.get_world_size() / float(total)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p, dtype=buffer_dtype) for p in params]
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum * scale).backward()
        for param, buffer in zip(params, buffers, strict=True):
            if param.grad is not None:
                buffer += param.grad.to(buffer_dtype)
                param.grad = None
    for param, buffer in zip(params, buffers, strict=True):
        param.grad = buffer.to(param.dtype)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    optimizer.step()


def bfloat16_sharded_buffer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """FSDP2: each micro-batch's gradient shard accumulated in a bfloat16 buffer
    after its reduce-scatter, as Megatron-FSDP does with bfloat16 main grads
    (ISEEKYAN #149): a precision finding for float32 master weights and gradients."""
    _buffered_fsdp2_step(model, optimizer, micro_batches, loss_fn, torch.bfloat16, max_grad_norm)


def float32_sharded_buffer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """Correct, for contrast: :func:`bfloat16_sharded_buffer` with float32 main grads."""
    _buffered_fsdp2_step(model, optimizer, micro_batches, loss_fn, torch.float32, max_grad_norm)


def bfloat16_compressed_all_reduce(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """:func:`global_item_count` with DDP's ``bf16_compress_hook``: each window's
    gradient is cast to bfloat16 for the all-reduce and summed in bfloat16
    (communication halved).  Another bfloat16 rounding of the gradient, once per
    window: a precision finding, like a bfloat16 accumulation buffer."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    assert isinstance(model, DistributedDataParallel)
    model.register_comm_hook(None, bf16_compress_hook)
    global_item_count(model, optimizer, micro_batches, loss_fn)


@dataclass(frozen=True, slots=True)
class Fsdp2Entry:
    """An FSDP2 zoo entry: a step, the sharding policy it runs under, and what
    ``check_distributed(candidate, dcase, engine="fsdp2", mp_policy=mp_policy)``
    must find."""

    candidate: Callable[..., Any]
    #: The ``fully_shard`` MixedPrecisionPolicy (None: full precision).
    mp_policy: MixedPrecisionPolicy | None = None
    #: NOT_EQUIVALENT, PRECISION (mathematically right, off by the policy's
    #: 16-bit arithmetic) or EQUIVALENT (right, at a cost).
    expected: Outcome = Outcome.NOT_EQUIVALENT
    #: One line for reports.
    what: str = ""
    #: The upstream report it reproduces ("": see :func:`upstream_report`).
    upstream: str = ""


#: name -> FSDP2 entry, for suites and reports.  The clipping bug needs a case
#: that clips (``max_grad_norm``) to show; the others take it too.
FSDP2_BUGS: dict[str, Fsdp2Entry] = {
    "sync_disabled_on_last_micro_batch": Fsdp2Entry(
        sync_disabled_on_last_micro_batch, what="no reduce-scatter at all: nothing steps"
    ),
    "local_mean_per_rank_fsdp2": Fsdp2Entry(local_mean_per_rank_fsdp2, what="mean of rank means (uneven shards)"),
    "clip_shard_with_local_norm": Fsdp2Entry(clip_shard_with_local_norm, what="each shard clipped with its own norm"),
    # The reference accumulator itself, sharded with a 16-bit reduce_dtype:
    # FSDP2 then also accumulates the unsharded gradients between micro-batches
    # in bfloat16 (what trl #2175 reported against FSDP1's mixed precision).
    "bfloat16_reduce": Fsdp2Entry(
        accumulator_step,
        MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
        expected=Outcome.PRECISION,
        what="accumulator_step under MixedPrecisionPolicy(reduce_dtype=bfloat16)",
        upstream="trl #2175 (under FSDP1's mixed precision)",
    ),
    "sync_every_micro_batch": Fsdp2Entry(
        sync_every_micro_batch, expected=Outcome.EQUIVALENT, what="equivalent, N reduce-scatters per unit per window"
    ),
}


# ------------------------------------------------ correct real-world steps
def scale_made_in_the_default_dtype(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: MicroBatches, loss_fn: Callable[..., Tensor]
) -> None:
    """Correct under DDP (each summed loss times world / global sample count,
    one all-reduce per window), but the count is a tensor made without a
    dtype: float32, torch's default, so world / count is rounded to float32
    inside the float64 run too."""
    optimizer.zero_grad(set_to_none=True)
    samples = torch.tensor(float(sum(len(targets) for _, targets in micro_batches)))  # no dtype
    dist.all_reduce(samples)
    scale = dist.get_world_size() / samples
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
            (loss_fn(model(inputs), targets) * len(targets) * scale).backward()
    optimizer.step()


def sum_over_ranks_divided_by_global_tokens(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    loss_fn: Callable[..., Tensor],
    *,
    max_grad_norm: float | None = None,
) -> None:
    """torchtitan's recipe (pytorch/torchtitan #2206): FSDP2 sums gradients over
    ranks (divide factor 1.0) and each micro-batch's summed loss is divided by
    the count of valid tokens over every rank's whole window, all-reduced once.
    The factor is set on every FSDP module, as torchtitan's
    ``disable_fsdp_gradient_division`` does: on the root alone it leaves the
    layers averaging."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    optimizer.zero_grad(set_to_none=True)
    global_valid_tokens = torch.tensor(sum(int(item_count(loss_fn, y)) for _, y in micro_batches))
    dist.all_reduce(global_valid_tokens)
    for inputs, targets in micro_batches:
        loss_sum, _ = loss_sum_and_count(loss_fn, model(inputs), targets)
        (loss_sum / global_valid_tokens).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)
    optimizer.step()


@dataclass(frozen=True, slots=True)
class SearchEntry:
    """A step for the distributed search (:func:`equiv.verify_distributed`):
    what the search must conclude without a hand-picked split."""

    step: Callable[..., Any]
    engine: str
    #: The models the search draws (``"mlp"``: per-sample mean; ``"tokens"``: padded sequences).
    models: tuple[str, ...]
    #: EQUIVALENT (nothing found), NOT_EQUIVALENT, PRECISION (a failing precision finding:
    #: bfloat16 arithmetic inside the step), or STEP_ERROR (a rank hung or made
    #: mismatched collectives on some split).
    expected: Outcome
    #: The upstream report or recipe it reproduces ("" for equiv's own zoo).
    upstream: str
    what: str
    #: The optimizers the search draws (``verify_distributed(optimizers=...)``); ``("Muon",)`` on a bias-free MLP.
    optimizers: tuple[str, ...] = ("SGD", "Adam")


#: The report of bfloat16 gradient accumulation against float32 buffers (3.5e-5 vs 2.7e-8 relative).
_MEGATRON_FSDP_BF16 = "Megatron-FSDP, ISEEKYAN #149"

#: The distributed zoo as the search meets it: every bug found, every correct step passing.
SEARCH_ZOO: dict[str, SearchEntry] = {
    "accumulator_step (DDP)": SearchEntry(
        accumulator_step, "ddp", ("mlp", "tokens"), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "local_mean_per_rank": SearchEntry(
        local_mean_per_rank,
        "ddp",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "transformers #34191 / #34242",
        "each rank's own sample mean, averaged by DDP",
    ),
    "local_token_mean_per_rank": SearchEntry(
        local_token_mean_per_rank,
        "ddp",
        ("tokens",),
        Outcome.NOT_EQUIVALENT,
        "torchtune PR #2980",
        "the GA=1 shortcut: each rank's own token mean",
    ),
    "global_item_count": SearchEntry(
        global_item_count,
        "ddp",
        ("tokens",),
        Outcome.EQUIVALENT,
        "torchtitan PR #2206",
        "summed loss / all-reduced global token count",
    ),
    "scale_made_in_the_default_dtype": SearchEntry(
        scale_made_in_the_default_dtype,
        "ddp",
        ("mlp",),
        Outcome.EQUIVALENT,
        "",
        "correct, with a float32 scale factor (a precision note in the float64 run)",
    ),
    "no_sync_missing": SearchEntry(
        no_sync_missing,
        "ddp",
        ("mlp",),
        Outcome.STEP_ERROR,
        "",
        "all-reduce every micro-batch: ranks with other micro-batch counts wait on each other",
    ),
    "forward_outside_no_sync": SearchEntry(
        forward_outside_no_sync,
        "ddp",
        ("mlp",),
        Outcome.STEP_ERROR,
        "accelerate #1726",
        "no_sync around the backward only: the same extra all-reduces",
    ),
    "skip_backward_without_real_tokens (DDP)": SearchEntry(
        skip_backward_without_real_tokens,
        "ddp",
        ("tokens",),
        Outcome.STEP_ERROR,
        "karpathy/nanochat PR #623; EleutherAI/bergson PR #461",
        "backward skipped for a micro-batch with no real token: the rank makes one gradient all-reduce fewer",
    ),
    "accumulator_step (FSDP2)": SearchEntry(
        accumulator_step, "fsdp2", ("mlp", "tokens"), Outcome.EQUIVALENT, "", "the reference accumulator"
    ),
    "sum_over_ranks_divided_by_global_tokens": SearchEntry(
        sum_over_ranks_divided_by_global_tokens,
        "fsdp2",
        ("tokens",),
        Outcome.EQUIVALENT,
        "torchtitan PR #2206",
        "divide factor 1.0, summed loss / all-reduced global token count",
    ),
    "skip_backward_without_real_tokens": SearchEntry(
        skip_backward_without_real_tokens,
        "fsdp2",
        ("tokens",),
        Outcome.STEP_ERROR,
        "karpathy/nanochat PR #623; EleutherAI/bergson PR #461",
        "backward skipped for a micro-batch with no real token: ranks' collectives fall out of step",
    ),
    "sync_disabled_on_last_micro_batch": SearchEntry(
        sync_disabled_on_last_micro_batch,
        "fsdp2",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "",
        "gradient sync switched back on after the last backward",
    ),
    "local_mean_per_rank_fsdp2": SearchEntry(
        local_mean_per_rank_fsdp2,
        "fsdp2",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "transformers #34191",
        "each rank's own sample mean, averaged by the reduce-scatter",
    ),
    "clip_shard_with_local_norm": SearchEntry(
        clip_shard_with_local_norm,
        "fsdp2",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "",
        "each gradient shard clipped with its own norm",
    ),
    # The accumulation buffer's precision: a precision finding (bfloat16_arithmetic), failing
    # float32 master weights and gradients, never a mathematical mismatch nor a silent pass.
    "bfloat16_buffer_before_sync": SearchEntry(
        bfloat16_buffer_before_sync,
        "ddp",
        ("mlp",),
        Outcome.PRECISION,
        _MEGATRON_FSDP_BF16,
        "its own bfloat16 accumulation buffer, handed to DDP's one all-reduce per window",
    ),
    "float32_buffer_before_sync": SearchEntry(
        float32_buffer_before_sync,
        "ddp",
        ("mlp",),
        Outcome.EQUIVALENT,
        "",
        "the same with a float32 buffer (a float32-sized note in the float64 run)",
    ),
    "bfloat16_sharded_buffer": SearchEntry(
        bfloat16_sharded_buffer,
        "fsdp2",
        ("mlp",),
        Outcome.PRECISION,
        _MEGATRON_FSDP_BF16,
        "each micro-batch reduce-scattered, its gradient shard accumulated in bfloat16",
    ),
    "bfloat16_compressed_all_reduce": SearchEntry(
        bfloat16_compressed_all_reduce,
        "ddp",
        ("tokens",),
        Outcome.PRECISION,
        "",
        "DDP's bf16_compress_hook: the window's gradient all-reduced in bfloat16",
    ),
    # Muon (torch.optim.Muon) drawn on a bias-free MLP: it orthogonalises each weight's update, so it must be fed
    # the window's whole averaged gradient (issue 46).
    "accumulator_step (DDP, Muon)": SearchEntry(
        accumulator_step, "ddp", ("mlp",), Outcome.EQUIVALENT, "", "the reference accumulator, Muon", ("Muon",)
    ),
    # Under FSDP2 Muon orthogonalises the DTensor matrix whole; a per-rank mean it is fed is as wrong as under SGD.
    "accumulator_step (FSDP2, Muon)": SearchEntry(
        accumulator_step, "fsdp2", ("mlp",), Outcome.EQUIVALENT, "", "the reference accumulator, Muon", ("Muon",)
    ),
    "local_mean_per_rank_fsdp2 (Muon)": SearchEntry(
        local_mean_per_rank_fsdp2,
        "fsdp2",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "transformers #34191",
        "each rank's own sample mean, averaged by the reduce-scatter, Muon",
        ("Muon",),
    ),
    "updates_averaged_over_ranks": SearchEntry(
        updates_averaged_over_ranks,
        "ddp",
        ("mlp",),
        Outcome.NOT_EQUIVALENT,
        "DeepSpeed #7807; Megatron-LM PR #6425",
        "Muon on each rank's own gradient, the updated weights then averaged over the ranks",
        ("Muon",),
    ),
}

#: name -> candidate, for suites and reports.
#: Ragged real-token counts across ranks (padded sequences): the GA=1 shortcut that
#: divides by each rank's own tokens, and the correct all-reduced global count, with
#: what a check must find (the distributed search draws the token model for them).
RAGGED_TOKEN_STEPS: dict[str, tuple[Callable[..., Any], Outcome]] = {
    "local_token_mean_per_rank": (local_token_mean_per_rank, Outcome.NOT_EQUIVALENT),
    "global_item_count": (global_item_count, Outcome.EQUIVALENT),
}
DISTRIBUTED_BUGS: dict[str, Callable[..., Any]] = {
    "local_mean_per_rank": local_mean_per_rank,
    "no_sync_missing": no_sync_missing,
    "forward_outside_no_sync": forward_outside_no_sync,
}
LOSS_SCALE_BUGS: dict[str, Callable[..., Any]] = {
    "overflow_checked_on_last_micro_batch": overflow_checked_on_last_micro_batch,
}


def upstream_report(step: Callable[..., Any]) -> str:
    """The upstream report ``step`` reproduces, from :data:`SEARCH_ZOO` ("" if none)."""
    return next((entry.upstream for entry in SEARCH_ZOO.values() if entry.step is step and entry.upstream), "")
