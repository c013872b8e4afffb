"""Verdicts on accumulation people actually use.

These pin today's behaviour: if a peer changes, a test fails (rather than the
peers report silently changing).  Accelerate and Lightning tests need the
extras (`pip install equiv[peers]`) and skip with a reason without them.
Each adapter pins one number an outside script can reproduce with the library
alone (the toy: x = 1..8, y = 2x, w = 0, MSE, SGD lr 0.02).
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import equiv
from equiv.adapters import (
    MindSporeAccumulator,
    MindSporeAccuStepsWithLossScale,
    MindSporeGradAccumulation,
    MindSporeGradientAccumulation,
    textbook_step,
    torchtitan_step,
)
from equiv.cases.standard import TOY_CASE
from equiv.judging.runs import run_candidate
from equiv.judging.trajectories import update_gap
from equiv.peers.catalogue import CONFIGURATIONS, EPOCH_RUNS, TRAINER_RUNS
from equiv.peers.results import Cell, Chart, PeerRow, PeersResults, Situation
from equiv.peers.runs import EpochRun, Measure, TokenRun, classify_step, measure, measure_epochs, windows
from equiv.peers.search import smallest_counterexample
from equiv.reporting.peers import render_peers
from equiv.results.verdict import TensorDiff
from equiv.zoo.bugs import clip_per_micro_batch, unscaled_sum

EVEN = CONFIGURATIONS["equal splits, SGD"]
ADAM = CONFIGURATIONS["equal splits, Adam"]
UNEVEN = CONFIGURATIONS["uneven splits 1+4+7"]
TOKENS = CONFIGURATIONS["token loss, causal LM, equal splits"]
CLIPPED = CONFIGURATIONS["clipping (active), equal splits"]
LOSS_SCALED = CONFIGURATIONS["loss scale, overflow in micro-batch 1 of 3"]
MID_EPOCH = EPOCH_RUNS["mid-epoch windows: 9 micro-batches, N=3"]
LONG_TAIL = EPOCH_RUNS["tail of a long epoch: 7 micro-batches, N=3 (Lightning #19987)"]
SHORT_EPOCH = EPOCH_RUNS["epoch shorter than N: 2 micro-batches, N=3, 2 epochs (Lightning #21808)"]
TWO_EPOCHS = EPOCH_RUNS["epoch boundary: 7 micro-batches, N=3, 2 epochs"]
#: The toy's 8 samples as 3+3+2, one window of N=3: sum of per-micro-batch means of x^2 is
#: 14/3 + 77/3 + 113/2, so loss / N gives w = 0.02 * 4 * (that / 3) = 2.315556 where full batch gives 2.04.
TOY_UNEVEN = TOY_CASE.replace(micro_batch_sizes=(3, 3, 2))
#: The toy as one epoch of 8 micro-batches of one sample, N=3: windows 3+3+2.
TOY_EPOCH = EpochRun(TOY_CASE.replace(micro_batch_sizes=(1,) * 8), 3)
#: Why a test of an optional peer skips (one reason for the module: one ``-ra`` line).
PEERS_EXTRA = (
    "needs the peers extra: accelerate, pytorch-lightning, transformers 5.x (pip install equiv[peers]; tox -e peers)"
)


def toy_w(candidate: object) -> float:
    """w after the toy's one step, computed in float64."""
    snapshots = run_candidate(TOY_UNEVEN, candidate, torch.float64)  # type: ignore[arg-type]
    return float(snapshots[1].params["weight"])


def first_update_mismatch(candidate: object, case: equiv.Case) -> TensorDiff:
    verdict = equiv.check(candidate, case)  # type: ignore[arg-type]
    assert verdict.status == "not_equivalent", verdict.message()
    first = verdict.first_mismatch
    assert first is not None and first.quantity == "update"
    return first


def test_textbook_loop_passes_equal_splits_and_fails_uneven_ones_with_two_micro_batches() -> None:
    assert equiv.check(textbook_step, EVEN)
    assert equiv.check(textbook_step, CLIPPED)
    assert first_update_mismatch(textbook_step, UNEVEN).step == 1
    shrunk, _ = smallest_counterexample(textbook_step)
    assert shrunk is not None
    assert len(shrunk.micro_batch_sizes) == 2 and len(set(shrunk.micro_batch_sizes)) == 2


def test_textbook_loop_averages_token_means_in_the_causal_lm() -> None:
    # Equal numbers of sequences, unequal numbers of real tokens: the 2024 transformers bug class.
    assert first_update_mismatch(textbook_step, TOKENS).step == 1
    assert equiv.check(equiv.accumulator_step, TOKENS)


@pytest.mark.parametrize(
    "case", [EVEN, ADAM, UNEVEN, TOKENS, CLIPPED], ids=["even", "adam", "uneven", "tokens", "clip"]
)
def test_torchtitan_style_loop_is_exact_everywhere(case: equiv.Case) -> None:
    equiv.check(torchtitan_step, case).assert_ok()


def test_mindspore_r13_port_sums_without_scaling() -> None:
    # N=3 times the gradient: SGD's update is 3x (relative error 2) ...
    assert abs(first_update_mismatch(MindSporeGradientAccumulation(), EVEN).max_rel_diff - 2.0) < 1e-6
    # ... and under Adam only eps sees it: caught in the float64 tier.
    verdict = equiv.check(MindSporeGradientAccumulation(), ADAM)
    assert any(d.tier == "exact" and d.quantity == "update" for d in verdict.mismatches)


def test_mindspore_2_port_cannot_clip_and_misses_short_tails() -> None:
    assert equiv.check(MindSporeAccumulator(), EVEN)
    # The notebook's Accumulator has no clipping: a clipping case does not apply to it (not a failure).
    verdict = equiv.check(MindSporeAccumulator(), CLIPPED)
    assert verdict.status == "not_applicable", verdict.message()
    assert verdict.not_applicable == (
        "MindSporeAccumulator() takes no max_grad_norm (the case sets max_grad_norm=0.01)",
    )
    # accumulate_step=4 with 3 micro-batches per window: the counter never reaches the step in the first window.
    assert first_update_mismatch(MindSporeAccumulator(4), EVEN).max_rel_diff == 1.0


def test_accelerate_averages_micro_batch_means_on_the_toy_and_its_recipe_does_not() -> None:
    accelerate = pytest.importorskip("equiv.adapters.accelerate", reason=PEERS_EXTRA)
    assert abs(toy_w(accelerate.AccelerateStep()) - 0.02 * 4 * (14 / 3 + 77 / 3 + 113 / 2) / 3) < 1e-12
    assert round(toy_w(accelerate.AccelerateStep()), 5) == 2.31556
    # The guide's variable-size recipe (num_items_in_batch, loss * N) lands on the full-batch 2.04.
    assert abs(toy_w(accelerate.AccelerateVariableSizeStep()) - 2.04) < 1e-12
    assert equiv.check(accelerate.AccelerateStep(), EVEN)
    assert equiv.check(accelerate.AccelerateStep(), CLIPPED)
    assert equiv.check(accelerate.AccelerateVariableSizeStep(), UNEVEN)
    assert equiv.check(accelerate.AccelerateVariableSizeStep(), TOKENS)


def test_accelerate_one_dataloader_divides_the_epoch_tail_by_n() -> None:
    accelerate = pytest.importorskip("equiv.adapters.accelerate", reason=PEERS_EXTRA)
    assert measure_epochs(accelerate.AccelerateStep(3), MID_EPOCH).equivalent  # the mid-epoch counter is right
    tail = measure_epochs(accelerate.AccelerateStep(3), LONG_TAIL)
    assert tail.failure_name() == "tail divided by N" and tail.gap is not None
    assert tail.gap.step == 3 and abs(tail.gap.scale - 1 / 3) < 1e-9  # one micro-batch of a window of 3
    # The toy, one sample per micro-batch, one DataLoader, N=3: the 2-sample tail scaled by 2/3.
    assert abs(measure_epochs(accelerate.AccelerateStep(3), TOY_EPOCH).gap.scale - 2 / 3) < 1e-9  # type: ignore[union-attr]
    # Without sync_with_dataloader the tail is never stepped.
    missed = measure_epochs(accelerate.AccelerateStep(3, sync_with_dataloader=False), LONG_TAIL)
    assert missed.steps == (2, 3) and missed.failure_name() == "window boundary"
    for run in (LONG_TAIL, SHORT_EPOCH, TWO_EPOCHS, TOY_EPOCH):
        assert measure_epochs(accelerate.AccelerateVariableSizeStep(3), run).equivalent


def test_lightning_one_fit_divides_the_epoch_tail_by_n_and_averages_token_means() -> None:
    lightning = pytest.importorskip("equiv.adapters.lightning", reason=PEERS_EXTRA)
    assert equiv.check(lightning.LightningStep(), EVEN)
    assert equiv.check(lightning.LightningStep(), CLIPPED)  # clips once, after accumulation
    assert round(toy_w(lightning.LightningStep()), 5) == 2.31556
    assert classify_step(lightning.LightningStep(), TOKENS).failure_name() == "mean of means"  # Lightning #20350
    assert measure_epochs(lightning.LightningStep(3), MID_EPOCH).equivalent
    tail = measure_epochs(lightning.LightningStep(3), LONG_TAIL)  # Lightning #19987
    assert tail.failure_name() == "tail divided by N" and tail.gap is not None and abs(tail.gap.scale - 1 / 3) < 1e-9
    short = measure_epochs(lightning.LightningStep(3), SHORT_EPOCH)  # Lightning #21808: steps every epoch
    assert short.steps == (2, 2) and short.gap is not None and abs(short.gap.scale - 2 / 3) < 1e-9


def test_transformers_trainer_is_exact_with_num_items_in_batch_and_averages_token_means_without() -> None:
    # 5.x: the release the peers extra installs (4.45.2 is measured in tox -e peers-transformers445).
    pytest.importorskip("transformers", minversion="5.0", reason=PEERS_EXTRA)
    from equiv.adapters.transformers import TrainerRun

    def trainer_measure(run: TokenRun) -> Measure:
        return measure(
            lambda model, optimizer, micro: TrainerRun(run.n).train(model, optimizer, micro, epochs=run.epochs), run
        )

    uneven = TRAINER_RUNS["uneven token counts, tail of a long epoch: 7 micro-batches, N=3"]
    exact = trainer_measure(uneven)
    assert exact.equivalent  # the window's token count reaches the loss, tail included
    # Equivalent as equiv.check calls it: the float64 run differs from the full batch only by float32
    # rounding (Llama's RMSNorm and transformers' loss compute in float32), the float32 run matches.
    assert exact.note is not None and exact.note.startswith("float32-sized differences inside the float64 run")
    fallback = trainer_measure(dataclasses.replace(uneven, loss_kwargs=False))  # transformers #37766
    assert fallback.failure_name() == "mean of means" and fallback.gap is not None and fallback.gap.step == 1
    # 8, 4 and 14 target tokens: each micro-batch's mean weighted 1/3 instead of 8/26, 4/26, 14/26.
    assert 0.5 < fallback.gap.cosine < 0.999


def test_mindspore_r13_port_leaks_a_partial_window_into_the_next_epoch() -> None:
    # 7 micro-batches, mini_steps=3, 2 epochs: k restarts at 0 each epoch but grad_sum is not cleared,
    # so epoch 2's first window also carries epoch 1's last micro-batch; 4 steps instead of 6.
    leak = measure_epochs(MindSporeGradientAccumulation(3), TWO_EPOCHS)
    assert leak.steps == (4, 6)
    assert leak.failure_name() == "sum without division + window boundary"
    assert leak.gap is not None and abs(leak.gap.scale - 3.0) < 1e-9 and leak.gap.cosine > 0.999


def scales(candidate: object, case: equiv.Case) -> list[float]:
    """The GradScaler's scale after each step of the candidate's float64 run."""
    snapshots = run_candidate(case, candidate, torch.float64)  # type: ignore[arg-type]
    return [float(s.optimizer_state["grad_scaler:scale"]) for s in snapshots]


def test_mindspore_r26_grad_accumulation_recuts_the_batch_and_averages_its_slices() -> None:
    # Model.train's _TrainGradAccuStepCell multiplies by 1 / micro_size: exact on equal slices of a sample mean,
    # and the window's own split does not matter (1+4+7 is re-cut into 4+4+4).
    assert equiv.check(MindSporeGradAccumulation(), EVEN)
    assert equiv.check(MindSporeGradAccumulation(), UNEVEN)
    # The toy's 3+3+2 re-cut by micro_size=2 into 4+4: the full-batch w = 2.04, where loss / N gives 2.31556.
    assert abs(toy_w(MindSporeGradAccumulation(2)) - 2.04) < 1e-12
    # micro_size=3 cannot cut 8 samples: MindSpore's _MicroBatch refuses it.
    with pytest.raises(equiv.CandidateError, match=r"input\(8\) must be divided by micro size\(3\)"):
        toy_w(MindSporeGradAccumulation())
    # Token means of equal-sized slices with unequal token counts: a mean of means.
    assert classify_step(MindSporeGradAccumulation(), TOKENS).failure_name() == "mean of means"


def test_mindspore_loss_scaled_ports_skip_the_overflowing_window_once_but_sum_without_division() -> None:
    # Step 1's first micro-batch overflows: both ports skip the whole window and halve the scale once,
    # as the full batch does (1024 -> 512) ...
    full = [1024.0, 1024.0, 512.0, 512.0]
    assert scales(equiv.accumulator_step, LOSS_SCALED) == full
    for port in (MindSporeAccuStepsWithLossScale(), MindSporeGradAccumulation()):
        assert scales(port, LOSS_SCALED) == full
        # ... but neither divides by N under loss scaling: SGD's step 0 is 3x the full-batch one.
        assert abs(first_update_mismatch(port, LOSS_SCALED).max_rel_diff - 2.0) < 1e-6
        measured = classify_step(port, LOSS_SCALED)
        assert measured.failure_name() == "sum without division" and measured.gap is not None
        assert abs(measured.gap.scale - 3.0) < 1e-9
    # With a fixed scale_sense (no GradScaler) the ORed flag alone decides: a window whose FIRST micro-batch
    # overflows is skipped (assigning the flag from the last micro-batch would step on NaN), and the next
    # window, flag reset, steps.
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    window = [(torch.ones(2, 2), torch.ones(2, 1)) for _ in range(3)]
    overflowing = [(torch.full((2, 2), float("inf")), torch.ones(2, 1)), *window[1:]]
    port = MindSporeAccuStepsWithLossScale()
    port(model, optimizer, overflowing, torch.nn.functional.mse_loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    port(model, optimizer, window, torch.nn.functional.mse_loss)
    assert all(
        bool(torch.isfinite(p).all()) and not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
    )
    # Peers without a grad scaler are not asked (not applicable, never a failure).
    verdict = equiv.check(MindSporeAccumulator(), LOSS_SCALED)
    assert verdict.status == "not_applicable"
    assert verdict.not_applicable == ("MindSporeAccumulator() takes no grad_scaler (the case sets loss_scale=1024.0)",)


def test_failures_are_named_by_kind() -> None:
    assert classify_step(textbook_step, UNEVEN).failure_name() == "mean of means"
    assert classify_step(unscaled_sum, EVEN).failure_name() == "sum without division"
    assert classify_step(clip_per_micro_batch, CLIPPED).failure_name() == "per-micro-batch clipping"
    assert classify_step(equiv.accumulator_step, UNEVEN).gap is None
    # Adam's first step is about lr * sign(g): a flipped step is "2 relative" but reads as a sign flip here.
    before, full = torch.zeros(3), torch.tensor([0.01, -0.01, 0.01])
    flipped = update_gap(1, before, -full, full)
    assert flipped.relative == 2.0 and abs(flipped.cosine + 1) < 1e-12 and "sign flipped" in flipped.describe()


def test_stateful_adapters_start_afresh_for_each_run() -> None:
    # One adapter object checked twice: the second run must not inherit the counter.
    adapter = MindSporeAccumulator()
    assert equiv.check(adapter, EVEN) and equiv.check(adapter, EVEN)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MindSporeGradientAccumulation(0), "mini_steps must be a positive int or None, got 0"),
        (lambda: MindSporeAccumulator(-1), "accumulate_step must be a positive int or None, got -1"),
        (lambda: MindSporeGradAccumulation(0), "micro_size must be a positive int or None, got 0"),
        (lambda: MindSporeAccuStepsWithLossScale(0), "accumulation_steps must be a positive int or None, got 0"),
    ],
    ids=["mini_steps", "accumulate_step", "micro_size", "accumulation_steps"],
)
def test_bad_adapter_arguments_name_the_value(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_a_missing_peer_is_named_by_the_package_that_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers present without accelerate: the Trainer cannot train, and the report
    # must name accelerate (it once said "transformers is not installed").
    import importlib.util

    from equiv.peers import catalogue

    installed = {"transformers", "pytorch_lightning"}
    monkeypatch.setattr(
        catalogue.importlib.util,
        "find_spec",
        lambda name, *args: importlib.machinery.ModuleSpec(name, None) if name in installed else None,
    )
    reasons = catalogue.not_measured()
    assert reasons == {
        "Accelerate": "accelerate is not installed (pip install equiv[peers])",
        "the transformers Trainer": "accelerate is not installed, which the transformers Trainer needs "
        "(pip install equiv[peers])",
    }


def _full_batch_loop(scale: float) -> object:
    """A drive over one epoch that takes the full-batch step of every window, its loss times ``scale``."""

    def drive(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro: list) -> None:  # type: ignore[type-arg]
        for window in windows(len(micro), LONG_TAIL.n):
            optimizer.zero_grad(set_to_none=True)
            (LONG_TAIL.full_batch_loss(model, [micro[i] for i in window]) * scale).backward()
            optimizer.step()

    return drive


def test_whole_runs_judge_a_float32_sized_difference_as_equiv_check_does() -> None:
    # One factor of (1 + 1e-9): far past float64 rounding (the exact tier flags it) but within float32's
    # roundoff term, and the float32 run matches: a precision note, as equiv.check says of such a step.
    nudged = measure(_full_batch_loop(1 + 1e-9), LONG_TAIL)  # type: ignore[arg-type]
    assert nudged.equivalent and nudged.note is not None and "float32-sized" in nudged.note
    # (1 + 1e-3) is past float32 rounding in both tiers: a mathematical mismatch is never a note.
    off = measure(_full_batch_loop(1 + 1e-3), LONG_TAIL)  # type: ignore[arg-type]
    assert not off.equivalent and off.note is None and off.gap is not None and off.gap.step == 1
    assert off.first is not None and off.first.tier == "exact" and off.first.ratio > 1
    assert abs(off.gap.scale - (1 + 1e-3)) < 1e-6 and off.failure_name() == "unclassified"
    # The same loop without the factor: no difference past any allowance, so no note either.
    clean = measure(_full_batch_loop(1.0), LONG_TAIL)  # type: ignore[arg-type]
    assert clean.equivalent and clean.note is None and clean.scales == pytest.approx((1.0, 1.0, 1.0))


def test_a_saved_cell_with_a_key_it_does_not_know_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['tolerance'\]"):
        Cell.from_dict({"outcome": "equivalent", "tolerance": "1e-5"})
    with pytest.raises(ValueError, match="got 'same'"):
        Cell(outcome="same")


def test_the_saved_transformers_4452_rows_read_as_cells() -> None:
    # reports/peers-trainer-4.45.2.json (tox -e peers-transformers445) is rendered by tox -e peers.
    saved = json.loads((Path(__file__).parent.parent / "reports" / "peers-trainer-4.45.2.json").read_text())
    assert saved["transformers"] == "4.45.2"
    for _, cells in saved["rows"]:
        read = {column: Cell.from_dict(cell) for column, cell in cells.items()}
        assert set(read) == set(TRAINER_RUNS)
        assert read["uneven token counts, one window: 3 micro-batches, N=3"].failure == "mean of means"


def test_the_report_starts_with_a_table_read_at_a_glance_and_charts_measured_numbers() -> None:
    results = PeersResults(
        versions={"torch": "2.13.0"},
        not_measured={},
        situations=[
            Situation("tail of a long epoch", "run: epoch tail", "run", "7 micro-batches, N=3"),
            Situation("equal splits, SGD", "equal, SGD", "window", "`Case()`"),
        ],
        rows=[
            PeerRow(
                "Lightning",
                cells={
                    "tail of a long epoch": Cell(
                        "not equivalent", failure="tail divided by N", detail="step 3: update 0.333x"
                    ),
                    "equal splits, SGD": Cell("equivalent"),
                },
            ),
            PeerRow(
                "Recipe",
                cells={
                    "tail of a long epoch": Cell("equivalent"),
                    "equal splits, SGD": Cell("not applicable", detail="takes no clip"),
                },
            ),
        ],
        kinds=[("tail divided by N", "a short window divided by N")],
        known=[],
        charts=[
            Chart(
                "Update per window",
                "Update per window, epoch tail",
                "window",
                ("1 (3)", "2 (3)", "3 (1)"),
                "update / full-batch update",
                (("Lightning", (1.0, 1.0, 0.333)), ("Recipe", (1.0, 1.0, 1.0))),
            )
        ],
    )
    text = render_peers(results)
    first_table = next(line for line in text.split("\n\n") if line.startswith("| implementation")).splitlines()
    assert [name.strip() for name in first_table[0].split("|")[2:4]] == ["run: epoch tail", "equal, SGD"]
    assert [line.split("|")[1].strip() for line in first_table[2:]] == ["Lightning", "Recipe"]  # one line per peer
    assert "✗ (tail divided by N)" in first_table[2] and "✓" in first_table[2] and "n/a" in first_table[3]
    assert (
        text.index("## At a glance") < text.index("## How a verdict is reached") < text.index("step 3: update 0.333x")
    )
    assert "xychart-beta" in text and "    bar [1, 1, 0.333]" in text and "    line [1, 1, 1]" in text
