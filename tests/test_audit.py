"""The audit of a run the user already has (equiv.audit): plain PyTorch loops,
unmodified, watched through hooks; each audited optimizer step judged against
the full-batch step of its window with equiv.check's allowances."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import equiv
from equiv.auditing import AuditFailure, audit
from equiv.auditing.runs import (
    REAL_LENGTHS,
    nanogpt_loop,
    nanogpt_run,
    scaled_loss_run,
    tail_run,
    tiny_lm_and_optimizer,
    token_loader,
    windows,
)
from equiv.losses import NextTokenCrossEntropy

TOKENS = NextTokenCrossEntropy()
_loader, _windows, _model_and_optimizer = token_loader, windows, tiny_lm_and_optimizer


def _window_token_counts() -> list[list[int]]:
    return [[int(TOKENS.count(labels)) for _, labels in window] for window in _windows(_loader(REAL_LENGTHS), 2)]


def test_nanogpts_loss_over_n_is_flagged_exactly_on_windows_whose_token_counts_differ() -> None:
    watched = nanogpt_run(normalise_by_window_tokens=False)
    counts = _window_token_counts()
    assert counts == [[14, 14], [8, 2], [8, 8], [7, 8]]
    assert [window.items for window in watched.windows] == [tuple(c) for c in counts]
    assert [window.equivalent for window in watched.windows] == [len(set(c)) == 1 for c in counts]
    failing = watched.failures[0]
    assert "NOT equivalent" in failing.line() and "the full-batch one" in failing.line()
    assert "Mismatched elements" in failing.message()


def test_the_same_loop_normalising_by_the_windows_tokens_is_clean() -> None:
    watched = nanogpt_run(normalise_by_window_tokens=True)
    assert len(watched.windows) == 4 and watched, watched.summary()


def test_a_short_tail_window_divided_by_n_is_flagged_and_named() -> None:
    # 7 micro-batches of equal sample counts, N = 3: the last window holds one micro-batch
    # still divided by 3 (Lightning #19987, Accelerate's accumulate() at an epoch's end).
    watched = tail_run()
    assert [w.equivalent for w in watched.windows] == [True, True, False]
    tail = watched.windows[-1]
    assert tail.micro_batches == 1 and tail.usual_micro_batches == 3
    assert "a window of 1 where the run's others have 3" in tail.line()
    first = tail.mismatches[0]
    assert first.quantity == "update" and abs(first.update_ratio - 1 / 3) < 1e-3


def test_a_users_own_bug_hidden_by_the_loss_curve_is_found() -> None:
    # The loss is scaled by the accumulation steps before backward (as RL normalisers
    # rescaled by GA were, trl #6024): the logged loss is the right one, the gradient is N x.
    watched, logged, clean = scaled_loss_run()
    # The loss curve cannot tell: AdamW absorbs a constant gradient scale (to eps's share).
    assert max(abs(a - b) for a, b in zip(logged, clean, strict=True)) < 1e-3
    assert watched.windows and not any(w.equivalent for w in watched.windows), watched.summary()
    assert any(row.quantity == "state" for row in watched.windows[0].mismatches)  # Adam's moments hold the 2x


def test_every_audits_one_window_in_k_and_records_nothing_in_between() -> None:
    model, optimizer = _model_and_optimizer()
    with audit(model, optimizer, loss=TOKENS, every=3) as watched:
        nanogpt_loop(model, optimizer, _loader([8] * 16), 1)
    assert watched.steps == 8
    assert [w.step for w in watched.windows] == [0, 3, 6]
    assert (
        "3 of 8 optimizer steps audited (every 3): 3 judged (3 equivalent, 0 not equivalent), 5 not judged "
        "(5 not sampled)" in watched.summary()
    )


def test_stop_at_first_failure_raises_from_the_failing_step() -> None:
    model, optimizer = _model_and_optimizer()
    with pytest.raises(AuditFailure, match=r"step 1: 2 micro-batches.*NOT equivalent") as raised:
        with audit(model, optimizer, loss=TOKENS, stop_at_first_failure=True):
            nanogpt_loop(model, optimizer, _loader(REAL_LENGTHS), 2)
    assert not raised.value.window.equivalent


def test_a_scheduler_and_clipping_are_replayed_as_the_run_used_them() -> None:
    model, optimizer = _model_and_optimizer("SGD")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with audit(model, optimizer, loss=TOKENS, max_grad_norm=0.05) as watched:
        for window in _windows(_loader(REAL_LENGTHS), 2):
            tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
            for ids, labels in window:
                (TOKENS.sum(model(ids, labels), labels) / tokens).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert norm > 0.05  # the clip is active
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert len(watched.windows) == 4 and watched, watched.summary()


def test_a_loop_that_does_not_clip_is_flagged_when_the_audit_is_told_it_clips() -> None:
    model, optimizer = _model_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS, max_grad_norm=0.05) as watched:
        nanogpt_loop(model, optimizer, _loader([8] * 4), 2, normalise_by_window_tokens=True)
    assert watched.windows and not any(w.equivalent for w in watched.windows)


def test_a_run_that_clips_unannounced_is_flagged_with_the_clip_norm_to_pass() -> None:
    # The audit never guesses clipping (a constant too-small scale looks the same): it flags the step and
    # says what would explain it; told the norm, the same run is clean.
    def clipped_run(**settings: float) -> equiv.auditing.Audit:
        model, optimizer = _model_and_optimizer("SGD")
        with audit(model, optimizer, loss=TOKENS, **settings) as watched:
            for window in _windows(_loader(REAL_LENGTHS), 2):
                tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
                for ids, labels in window:
                    (TOKENS.sum(model(ids, labels), labels) / tokens).backward()
                assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05) > 0.05  # the clip is active
                optimizer.step()
                optimizer.zero_grad()
        return watched

    unannounced = clipped_run()
    assert unannounced.windows and not any(w.equivalent for w in unannounced.windows)
    assert all(
        "clipped its gradients to 0.05 (1 clip_grad_norm_ call in the window)" in w.line()
        and "audit with max_grad_norm=0.05" in w.line()
        for w in unannounced.windows
    ), unannounced.summary()
    assert clipped_run(max_grad_norm=0.05), "told the clip norm, the run is equivalent"
    assert torch.nn.utils.clip_grad_norm_.__name__ == "clip_grad_norm_"  # torch's own again once the audit closed


def test_a_shortened_update_without_clipping_gets_no_clipping_hint() -> None:
    # A constant too-small scale looks like a clip: only a clip_grad_norm_ call seen in the window is named.
    model, optimizer = _model_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in _windows(_loader(REAL_LENGTHS), 2):
            tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
            for ids, labels in window:
                (TOKENS.sum(model(ids, labels), labels) / tokens / 2).backward()  # divided by N once too often
            optimizer.step()
            optimizer.zero_grad()
    assert watched.windows and not any(w.equivalent for w in watched.windows)
    assert not any(w.hint for w in watched.windows), watched.summary()


def test_evaluation_forwards_are_not_recorded_and_the_hooks_go_on_exit() -> None:
    model, optimizer = _model_and_optimizer()
    loader = _loader(REAL_LENGTHS[:8])
    with audit(model, optimizer, loss=TOKENS) as watched:
        for window in _windows(loader, 2):
            tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
            for ids, labels in window:
                (TOKENS.sum(model(ids, labels), labels) / tokens).backward()
                with torch.no_grad():
                    model(ids)  # a logging forward: no gradient, not part of the step
            optimizer.step()
            optimizer.zero_grad()
    assert watched and all(w.micro_batches == 2 for w in watched.windows)
    assert not model._forward_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_bad_input_names_the_value() -> None:
    model, optimizer = _model_and_optimizer()
    with pytest.raises(ValueError, match=r"every must be a positive int.*0"):
        audit(model, optimizer, loss=TOKENS, every=0)
    with pytest.raises(TypeError, match="loss must offer sum"):
        audit(model, optimizer, loss=torch.nn.functional.cross_entropy)
    with pytest.raises(TypeError, match="optimizer must be"):
        audit(model, "adam", loss=TOKENS)  # type: ignore[arg-type]


def test_a_step_with_no_recorded_forward_says_what_to_check() -> None:
    model, optimizer = _model_and_optimizer()
    other, others_optimizer = _model_and_optimizer()  # the audit watches a copy the loop never calls
    with pytest.raises(ValueError, match="not the model's parameters"):  # the loop's optimizer: refused on entry
        audit(other, optimizer, loss=TOKENS)
    with pytest.raises(RuntimeError, match="saw no training-mode forward call"):
        with audit(other, others_optimizer, loss=TOKENS):
            ids, labels = next(iter(_loader([8, 8])))
            TOKENS(model(ids), labels).backward()
            others_optimizer.step()


def test_targets_that_never_reach_forward_are_asked_for() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with pytest.raises(ValueError, match="cannot find the targets"):
        with audit(model, optimizer, loss=equiv.CrossEntropy()):  # a loss written out: no torch loss call seen
            (-model(inputs).log_softmax(-1)[torch.arange(6), targets].mean()).backward()
            optimizer.step()
    # The loop's own F.cross_entropy call is seen where it is made (issue 42): no targets= needed.
    with audit(model, optimizer, loss=equiv.CrossEntropy()) as seen:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    assert seen and seen.windows[0].items == (6,)
    # Told where they are (here: the loop's own targets), it judges.
    with audit(model, optimizer, loss=equiv.CrossEntropy(), targets=lambda call: targets) as watched:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    assert watched and watched.windows[0].items == (6,)


def test_a_model_with_dropout_is_reported_inherent_not_replayed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(6, 3), torch.randint(0, 2, (6,))
    with audit(model, optimizer, loss=equiv.CrossEntropy(), targets=lambda call: targets) as watched:
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    window = watched.windows[0]
    assert window.inherent and not window.equivalent and not window.mismatches
    assert not watched and watched.failures == []
    assert "inherently not equivalent, not replayed (Dropout layer '1' (p=0.5)" in window.line()
    assert "1 inherently not equivalent" in watched.summary()


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return]


@pytest.mark.parametrize("sample_weighted", [True, False])
def test_a_regression_loop_with_float_targets_is_replayed_in_float64(sample_weighted: bool) -> None:
    # Float targets are cast with the replay (the truth in float64); uneven micro-batches
    # 2 + 5 and 1 + 4: the sample-weighted mean is exact, the mean of means is not.
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = [(torch.randn(n, 3), torch.randn(n, 1)) for n in (2, 5, 1, 4)]
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        for window in (batches[:2], batches[2:]):
            samples = sum(len(targets) for _, targets in window)
            for inputs, targets in window:
                output = model(inputs, targets)
                loss = (
                    torch.nn.functional.mse_loss(output, targets, reduction="sum") / samples
                    if sample_weighted
                    else torch.nn.functional.mse_loss(output, targets) / len(window)
                )
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [w.items for w in watched.windows] == [(2, 5), (1, 4)]
    assert [w.equivalent for w in watched.windows] == [sample_weighted] * 2, watched.summary()


def test_targets_passed_to_forward_by_keyword_are_found() -> None:
    # nanoGPT's GPT.forward(idx, targets=None) is called as model(x, targets=y) as often as model(x, y).
    from equiv.auditing.watch import default_targets

    inputs, targets = torch.zeros(2, 3), torch.ones(2)
    assert default_targets(((inputs,), {"targets": targets})) is targets
    assert default_targets(((inputs,), {"target": targets})) is targets
    assert default_targets(((inputs,), {"labels": targets, "targets": inputs})) is targets  # labels first
    with pytest.raises(ValueError, match=r"no keyword of \['labels', 'targets', 'target'\]"):
        default_targets(((inputs,), {"y": targets}))


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, inputs: Tensor, targets: Tensor | None = None) -> Tensor:
        return self.net(inputs)  # type: ignore[no-any-return]


def _autocast_run(*, per_window_items: bool) -> equiv.auditing.Audit:
    """A bfloat16 autocast loop (CPU AMP) on micro-batches of 2, 5, 3 and 4 samples, N = 2: the
    window's summed squared error over its items (correct), or each micro-batch's mean / N."""
    torch.manual_seed(0)
    model = _Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 4, generator=generator), torch.randn(n, 3, generator=generator)) for n in (2, 5, 3, 4)]
    with audit(model, optimizer, loss=equiv.MSE()) as watched:
        for start in (0, 2):
            window = data[start : start + 2]
            items = sum(targets.numel() for _, targets in window)
            for inputs, targets in window:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    output = model(inputs, targets=targets)
                loss = (
                    nn.functional.mse_loss(output.float(), targets, reduction="sum") / items
                    if per_window_items
                    else nn.functional.mse_loss(output.float(), targets) / len(window)
                )
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return watched


def test_a_correct_autocast_loop_is_judged_with_its_own_mixed_precision() -> None:
    # The floors are replayed under the autocast each forward ran in: bfloat16's rounding (~1e-4 of the
    # update here) is the run's own noise, not a mismatch; the float64 truth stays the mathematics.
    correct = _autocast_run(per_window_items=True)
    assert len(correct.windows) == 2 and correct, correct.summary()
    wrong = _autocast_run(per_window_items=False)  # a mean of uneven means, under the same autocast
    assert wrong.windows and not any(window.equivalent for window in wrong.windows), wrong.summary()
