"""The collective log on its own: two ranks' logs sharing one store, in one process."""

import pytest
import torch
import torch.distributed as dist

from equiv.distributed.matching import CollectiveLog, CollectiveMismatch, _describe


def two_ranks() -> tuple[CollectiveLog, CollectiveLog]:
    store = dist.HashStore()
    return (CollectiveLog(store, 0, 2, where=lambda: "step 0"), CollectiveLog(store, 1, 2, where=lambda: "step 1"))


def test_the_same_calls_in_the_same_order_pass_and_the_later_rank_names_a_difference() -> None:
    rank0, rank1 = two_ranks()
    rank0.record("all_reduce of shape [3] float64")
    rank1.record("all_reduce of shape [3] float64")
    rank0.record("all_reduce of shape [] int64")  # first there: nothing to compare with yet, nothing waits
    with pytest.raises(CollectiveMismatch) as info:
        rank1.record("all_reduce of shape [3] float64")
    assert str(info.value) == (
        "mismatched collectives: rank 0 called all_reduce of shape [] int64 as its collective #2 (step 0); "
        "rank 1 called all_reduce of shape [3] float64 as its collective #2 (step 1)"
    )
    assert rank1.mismatch == str(info.value) and rank0.mismatch is None


def test_a_rank_still_calling_collectives_meets_the_end_of_its_peers_task() -> None:
    rank0, rank1 = two_ranks()
    rank1.end_of_task()
    with pytest.raises(
        CollectiveMismatch,
        match=r"rank 0 called barrier as its collective #1 \(step 0\); "
        r"rank 1 made no collective #1: it went on to the end of its task$",
    ):
        rank0.record("barrier")


def test_a_collective_is_fingerprinted_by_the_tensor_it_is_given() -> None:
    out, given = torch.empty(2, dtype=torch.float32), torch.empty(4, dtype=torch.float32)
    assert _describe("all_reduce", (given,), {}) == "all_reduce of shape [4] float32"
    assert _describe("reduce_scatter_tensor", (out, given), {}) == "reduce_scatter_tensor of shape [4] float32"
    assert _describe("all_gather", ([out, out], out[:1]), {}) == "all_gather of shape [1] float32"
    assert _describe("barrier", (), {}) == "barrier"
