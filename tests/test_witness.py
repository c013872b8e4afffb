"""The witness (issue 44): the weights a run gave each micro-batch's loss sum, recovered and named.

Real steps: a float64 nn.Linear over a token-level cross-entropy (uneven token counts per micro-batch, a causal
shift), each buggy loop accumulating its gradient as users write it, the g_i from a separate replay of each
micro-batch's loss SUM.  The weights each loop applied are computed from the loop's own divisors, never typed in.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from equiv.judging.witness import (
    NAMING_TOLERANCE,
    Recovered,
    name_normaliser,
    recover_weights,
    witness,
)
from equiv.results.witness import NOT_A_REWEIGHTING, NOT_IDENTIFIABLE, UNEXPLAINED, Witness
from equiv.zoo.kinds import KINDS, NORMALISERS, Window

DIM, VOCAB, LENGTH = 6, 7, 5


@dataclass
class MicroBatch:
    inputs: Tensor  # (rows, LENGTH, DIM)
    labels: Tensor  # (rows, LENGTH), -100 ignored

    @property
    def rows(self) -> int:
        return int(self.labels.shape[0])

    @property
    def items(self) -> int:
        """Tokens predicted after the causal shift."""
        return int((self.labels[:, 1:] != -100).sum())

    @property
    def counted_before_the_shift(self) -> int:
        return int((self.labels != -100).sum())


def _micro_batches(rows: Sequence[int], seed: int = 0) -> list[MicroBatch]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for count in rows:
        inputs = torch.randn(count, LENGTH, DIM, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)
        ignored = torch.rand(count, LENGTH, generator=generator) < 0.35
        ignored[:, 0] = False  # the first label is never predicted, so always "counted before the shift"
        ignored[:, 1] = False  # every row predicts at least one token
        out.append(MicroBatch(inputs, labels.masked_fill(ignored, -100)))
    return out


def _model(seed: int = 1, dim: int = DIM, vocab: int = VOCAB) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(dim, vocab).double()


def _loss_sum(model: nn.Module, batch: MicroBatch) -> Tensor:
    logits = model(batch.inputs)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels[:, 1:].reshape(-1), reduction="sum")


def _flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()  # type: ignore[union-attr]


def _replayed(model: nn.Module, batches: Sequence[MicroBatch]) -> list[Tensor]:
    """The float64 g_i: each micro-batch's loss SUM differentiated on its own (the witness's replay)."""
    grads = []
    for batch in batches:
        parts = torch.autograd.grad(_loss_sum(model, batch), list(model.parameters()))
        grads.append(torch.cat([p.reshape(-1) for p in parts]))
    return grads


def _loop(model: nn.Module, batches: Sequence[MicroBatch], loss_of: Callable[[int, MicroBatch], Tensor]) -> Tensor:
    """A loop's accumulated gradient: loss_of(i, batch).backward() for each micro-batch."""
    model.zero_grad(set_to_none=True)
    for i, batch in enumerate(batches):
        loss_of(i, batch).backward()
    return _flat_grad(model)


def _mean(model: nn.Module, batch: MicroBatch) -> Tensor:
    logits = model(batch.inputs)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels[:, 1:].reshape(-1))  # mean over items


ROWS = (2, 3, 1, 4)  # uneven: token counts differ by micro-batch


def _assert_recovered(found: Witness, applied: Sequence[float]) -> None:
    assert found.run is not None
    for run, want in zip(found.run, applied, strict=True):
        assert abs(run - want) <= NAMING_TOLERANCE * abs(want), (found.run, applied)


def _check(
    accumulated: Tensor,
    batches: Sequence[MicroBatch],
    applied: Sequence[float],
    model: nn.Module,
    **naming: object,
) -> Witness:
    recovered = recover_weights(_replayed(model, batches), accumulated)
    found = witness(recovered, [b.items for b in batches], **naming)  # type: ignore[arg-type]
    _assert_recovered(found, applied)
    return found


def test_the_correct_loop_is_named_the_full_batch() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    total = sum(b.items for b in batches)
    accumulated = _loop(model, batches, lambda i, b: _loss_sum(model, b) / total)
    found = _check(accumulated, batches, [1 / total] * len(batches), model, configured_n=len(batches))
    assert found.normaliser == "full batch"
    assert found.ratio() == pytest.approx(1.0, rel=1e-6)


def test_a_mean_of_micro_batch_means_is_named() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    k = len(batches)
    accumulated = _loop(model, batches, lambda i, b: _mean(model, b) / k)
    applied = [1 / (k * b.items) for b in batches]
    found = _check(accumulated, batches, applied, model, configured_n=k)
    assert found.normaliser == "mean of means"
    assert found.formula == "1/(k n_i)"


def test_a_sum_of_micro_batch_means_never_divided_is_named_with_its_clause() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    accumulated = _loop(model, batches, lambda i, b: _mean(model, b))
    applied = [1 / b.items for b in batches]
    found = _check(accumulated, batches, applied, model, configured_n=len(batches))
    assert found.normaliser == "sum without division"
    total = sum(b.items for b in batches)
    average = sum(total / b.items for b in batches) / len(batches)
    assert found.ratio() == pytest.approx(average, rel=1e-3)
    assert found.clause() == (
        f"each micro-batch's mean summed, never divided: weights 1/n_i, the full batch 1/N — x{average:.1f} on average"
    )


def test_a_tail_window_divided_by_the_configured_n_is_named() -> None:
    model, batches = _model(), _micro_batches(ROWS[:3])  # 3 micro-batches of a configured 4
    configured = 4
    accumulated = _loop(model, batches, lambda i, b: _mean(model, b) / configured)
    applied = [1 / (configured * b.items) for b in batches]
    found = _check(accumulated, batches, applied, model, configured_n=configured)
    assert found.normaliser == "tail divided by N"
    # Without the configured N (or a full window) it is not this kind: no kind is claimed that cannot apply.
    assert "tail" not in _check(accumulated, batches, applied, model, configured_n=None).normaliser


@pytest.mark.parametrize("ranks", [(0, 0, 1, 1), (0, 1, 2, 0, 1, 2)], ids=["2 ranks", "3 ranks"])
def test_a_per_rank_mean_is_named(ranks: tuple[int, ...]) -> None:
    model, batches = _model(), _micro_batches((2, 3, 1, 4, 2, 1)[: len(ranks)], seed=3)
    world = len(set(ranks))
    rank_items = {r: sum(b.items for b, br in zip(batches, ranks, strict=True) if br == r) for r in set(ranks)}
    gradients = []
    for rank in sorted(rank_items):  # each rank normalises by its own tokens; DDP averages the ranks' gradients
        mine = [b for b, br in zip(batches, ranks, strict=True) if br == rank]
        gradients.append(_loop(model, mine, lambda i, b: _loss_sum(model, b) / rank_items[rank]))  # noqa: B023
    accumulated = sum(gradients) / world
    applied = [1 / (world * rank_items[r]) for r in ranks]
    found = _check(accumulated, batches, applied, model, configured_n=len(batches), ranks=ranks)  # type: ignore[arg-type]
    assert found.normaliser == "per-rank mean"
    assert found.ranks == ranks


def test_labels_counted_before_the_shift_are_named_off_by_one_per_row() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    before = sum(b.counted_before_the_shift for b in batches)
    assert before == sum(b.items + b.rows for b in batches)
    accumulated = _loop(model, batches, lambda i, b: _loss_sum(model, b) / before)
    found = _check(
        accumulated, batches, [1 / before] * len(batches), model, configured_n=4, rows=[b.rows for b in batches]
    )
    assert found.normaliser == "count off by one per row"
    # Without the rows the same weights are only a uniform scale, with its factor.
    plain = _check(accumulated, batches, [1 / before] * len(batches), model, configured_n=4)
    assert plain.normaliser.startswith("uniform scale x")


@pytest.mark.parametrize("factor", [0.5, 8.0], ids=["world size twice", "loss scale left in"])
def test_a_uniform_scale_is_named_with_its_factor(factor: float) -> None:
    model, batches = _model(), _micro_batches(ROWS)
    total = sum(b.items for b in batches)
    accumulated = _loop(model, batches, lambda i, b: _loss_sum(model, b) / total * factor)
    found = _check(accumulated, batches, [factor / total] * len(batches), model, configured_n=4)
    assert found.normaliser == f"uniform scale x{factor:.3g}"
    assert found.formula == f"{factor:.3g}/N"


def test_clipping_once_is_the_full_batch_in_direction() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    total = sum(b.items for b in batches)
    model.zero_grad(set_to_none=True)
    for b in batches:
        (_loss_sum(model, b) / total).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    scale = min(1.0, 0.05 / (norm + 1e-6))
    assert scale < 0.9  # the clip acts
    accumulated = _flat_grad(model)
    applied = [scale / total] * len(batches)
    assert _check(accumulated, batches, applied, model, configured_n=4).normaliser.startswith("uniform scale")
    assert _check(accumulated, batches, applied, model, configured_n=4, clipped=True).normaliser == "full batch"


def test_the_running_gradient_clipped_after_every_micro_batch_is_a_re_weighting_no_normaliser_explains() -> None:
    # transformers #986: clip_grad_norm_ inside the accumulation loop.  Every clip scales the running sum, so the
    # gradient stays a re-weighting (earlier micro-batches clipped more often): the weights are recovered exactly,
    # and no normaliser explains them, even compared in direction.
    model, batches = _model(), _micro_batches(ROWS)
    total = sum(b.items for b in batches)
    model.zero_grad(set_to_none=True)
    applied = [0.0] * len(batches)
    for i, b in enumerate(batches):
        (_loss_sum(model, b) / total).backward()
        applied[i] = 1 / total
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.03))
        applied = [w * min(1.0, 0.03 / (norm + 1e-6)) for w in applied]
    accumulated = _flat_grad(model)
    found = _check(accumulated, batches, applied, model, configured_n=4)
    assert found.normaliser == UNEXPLAINED and found.residual < 1e-6
    assert _check(accumulated, batches, applied, model, configured_n=4, clipped=True).normaliser == UNEXPLAINED


def test_clipping_each_tensor_per_micro_batch_is_not_a_re_weighting() -> None:
    # Each parameter tensor clipped on its own after every micro-batch (a per-tensor or per-shard norm): the
    # weight and the bias are scaled differently, which no weighting of whole micro-batch gradients gives.
    model, batches = _model(), _micro_batches(ROWS)
    total = sum(b.items for b in batches)
    model.zero_grad(set_to_none=True)
    for b in batches:
        (_loss_sum(model, b) / total).backward()
        for parameter in model.parameters():
            torch.nn.utils.clip_grad_norm_([parameter], 0.02)
    recovered = recover_weights(_replayed(model, batches), _flat_grad(model))
    for clipped in (False, True):
        found = witness(recovered, [b.items for b in batches], configured_n=4, clipped=clipped)
        assert found.normaliser == NOT_A_REWEIGHTING and found.residual > 0.05
        assert "not a re-weighting" in found.clause()


def test_fewer_parameters_than_micro_batches_is_not_identifiable() -> None:
    model = _model(dim=1, vocab=1)
    torch.manual_seed(0)
    xs = [torch.randn(3, 1, dtype=torch.float64) for _ in range(4)]  # 2 parameters, 4 micro-batches
    grads = []
    for x in xs:
        parts = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
        grads.append(torch.cat([p.reshape(-1) for p in parts]))
    accumulated = sum(grads) / 12
    recovered = recover_weights(grads, accumulated)
    assert recovered.weights is None and recovered.rank <= 2
    found = witness(recovered, [3, 3, 3, 3], configured_n=4)
    assert found.normaliser == NOT_IDENTIFIABLE and found.run is None
    assert found.to_dict()["run"] is None and "not identifiable" in found.clause()


def test_a_residual_past_naming_is_said_as_such_not_as_dependent_gradients() -> None:
    # Two orthogonal micro-batch gradients (full rank), the run's gradient their sum plus 1 % of something
    # else (a low-precision run's rounding, say): under the 5 % residual tolerance, but it moves the solved
    # weights past the 0.1 % naming may trust.  The clause says that, not "linearly dependent".
    first, second, other = torch.eye(3, dtype=torch.float64)
    accumulated = first + second + 0.01 * math.sqrt(2) * other
    recovered = recover_weights([first, second], accumulated)
    assert recovered.weights is not None and recovered.rank == 2 and not recovered.identifiable
    found = witness(recovered, [1, 1], configured_n=2)
    assert found.normaliser == NOT_IDENTIFIABLE and found.run is None
    assert "1.00% of the run's gradient is no re-weighting" in found.clause()
    assert "linearly dependent" not in found.clause()


def test_duplicated_micro_batches_are_not_identifiable() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    batches = [*batches, batches[0]]
    total = sum(b.items for b in batches)
    accumulated = _loop(model, batches, lambda i, b: _loss_sum(model, b) / total)
    recovered = recover_weights(_replayed(model, batches), accumulated)
    assert not recovered.identifiable
    found = witness(recovered, [b.items for b in batches], configured_n=5)
    assert found.normaliser == NOT_IDENTIFIABLE and found.residual < 1e-6  # still exactly in the span


def test_per_parameter_gradients_and_missing_ones_give_the_flat_answer() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    k = len(batches)
    accumulated = _loop(model, batches, lambda i, b: _mean(model, b) / k)
    flat = recover_weights(_replayed(model, batches), accumulated)
    sizes = [p.numel() for p in model.parameters()]
    split = [[*g.split(sizes), None] for g in _replayed(model, batches)]  # an unused parameter: None
    pieces = recover_weights(split, [*accumulated.float().split(sizes), None])  # the run's float32 gradient
    assert flat.weights is not None and pieces.weights is not None
    for a, b in zip(flat.weights, pieces.weights, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_an_all_reduce_over_two_shards_equals_the_unsharded_solve() -> None:
    model, batches = _model(), _micro_batches(ROWS)
    k = len(batches)
    grads = _replayed(model, batches)
    accumulated = _loop(model, batches, lambda i, b: _mean(model, b) / k)
    # Off the micro-batches' span (10 %), so that each shard alone has its own least-squares answer.
    noise = torch.randn(accumulated.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    accumulated = accumulated + 0.1 * accumulated.norm() * noise / noise.norm()
    whole = recover_weights(grads, accumulated)
    cut = grads[0].numel() // 3
    shards = [([g[:cut] for g in grads], accumulated[:cut]), ([g[cut:] for g in grads], accumulated[cut:])]
    # Two "ranks" as threads: each all-reduce sums in place what both hand in, as torch.distributed.all_reduce does.
    barrier, handed = threading.Barrier(2), [[], []]  # type: ignore[var-annotated]
    results: list[Recovered | None] = [None, None]

    def rank(index: int) -> None:
        calls = 0

        def all_reduce(tensor: Tensor) -> None:
            nonlocal calls
            handed[index].append(tensor.clone())
            barrier.wait()
            tensor.copy_(handed[0][calls] + handed[1][calls])
            calls += 1
            barrier.wait()

        results[index] = recover_weights(*shards[index], all_reduce=all_reduce)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert whole.weights is not None
    for result in results:
        assert result is not None and result.weights is not None
        for a, b in zip(result.weights, whole.weights, strict=True):
            assert a == pytest.approx(b, rel=1e-9)
        assert result.rank == whole.rank and result.residual == pytest.approx(whole.residual, rel=1e-9)
    # One shard alone is another (wrong) answer: the all-reduce is what makes them agree.
    alone = recover_weights(*shards[0])
    assert alone.weights is not None and alone.weights != pytest.approx(whole.weights, rel=1e-3)


def test_synthetic_weights_and_an_orthogonal_residual_are_recovered() -> None:
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(200, generator=generator, dtype=torch.float64) for _ in range(5)]
    weights = [0.3, -0.1, 2.0, 0.7, 1.1]
    exact = sum(w * g for w, g in zip(weights, grads, strict=True))
    stacked = torch.stack(grads)
    noise = torch.randn(200, generator=generator, dtype=torch.float64)
    noise -= stacked.T @ torch.linalg.solve(stacked @ stacked.T, stacked @ noise)  # orthogonal to every g_i
    noise *= 0.2 * exact.norm() / noise.norm()
    recovered = recover_weights(grads, exact + noise)
    assert recovered.weights == pytest.approx(weights, rel=1e-9)
    assert recovered.residual == pytest.approx(0.2 / math.sqrt(1 + 0.2**2), rel=1e-6)
    assert witness(recovered, [1, 2, 3, 4, 5], configured_n=5).normaliser == NOT_A_REWEIGHTING


def test_an_even_split_says_every_normaliser_that_fits() -> None:
    # Even token counts make the mean of means the full batch: both are named, not one picked silently.
    counts = [8.0, 8.0, 8.0]
    naming = name_normaliser([1 / 24] * 3, counts, configured_n=3)
    assert naming.fits == ("full batch", "mean of means") and naming.name == "full batch or mean of means"
    assert "mean of means" in naming.means


def test_every_kind_of_equiv_check_is_a_normaliser_of_the_same_name() -> None:
    # One table: the witness names a window of equiv check's kinds by the kind's name, with weights of sums
    # equal to the kind's weights of means / n_i.
    by_name = {normaliser.name: normaliser for normaliser in NORMALISERS}
    window_counts = [3.0, 5.0, 2.0]
    for kind in KINDS:
        sums = by_name[kind.name].weights(Window(tuple(window_counts), configured_n=4))
        assert sums == pytest.approx(
            [m / c for m, c in zip(kind.weights(window_counts, 4), window_counts, strict=True)]
        )


def test_to_dict_has_exactly_the_documented_shape() -> None:
    found = witness(Recovered((0.5, 0.25), 1e-9, 3.0, 2, 1e-9), [2, 4], configured_n=2)
    assert found.normaliser == "sum without division"
    assert found.to_dict() == {
        "run": [0.5, 0.25],
        "full_batch": [1 / 6, 1 / 6],
        "residual": 1e-9,
        "normaliser": "sum without division",
    }


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: name_normaliser([0.1, 0.2], [1.0], configured_n=2), "items has 1 counts, expected 2"),
        (lambda: name_normaliser([0.1], [0.0], configured_n=1), "items must be positive"),
        (lambda: name_normaliser([0.1], [1.0], configured_n=0), "configured_n must be at least 1"),
        (lambda: name_normaliser([0.1], [1.0], configured_n=1, ranks=[0, 1]), "ranks has 2 entries, expected 1"),
        (lambda: recover_weights([], torch.zeros(3)), "gradients is empty"),
        (lambda: recover_weights([torch.zeros(3)], torch.zeros(4)), "tensor 0 has [3, 4] elements"),
        (lambda: recover_weights([[torch.zeros(3)]], [torch.zeros(3), None]), "gradients[0] has 1 tensors, expected 2"),
    ],
)
def test_bad_input_is_named_in_one_line(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        call()
    assert message in str(raised.value) and "\n" not in str(raised.value)
