"""The audit on every setting a run's own loss carries (issue 42): a criterion's options (label
smoothing, class weights, ignore_index, reduction) read, and the loss derived from it; the loop's
``torch.nn.functional`` loss seen without a wrap; and models that compute their own loss (lingua-,
Megatron- and FunASR-style), whose ``call_model=`` says what the loss takes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import equiv
from equiv.auditing import audit
from equiv.auditing.watch import Audit

CLASSES = 4
#: unequal micro-batches (and unequal weights within them): a per-micro-batch mean is not the window's
SIZES = (6, 2, 5, 1)
Batch = tuple[Tensor, Tensor]


def _classifier(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def _batches(ignored: int | None = None, seed: int = 1) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for size in SIZES:
        x = torch.randn(size, 3, generator=generator)
        y = torch.randint(0, CLASSES, (size,), generator=generator)
        if ignored is not None:
            y[: size // 2] = ignored  # the first half of each micro-batch not counted
        batches.append((x, y))
    return batches


def _window_items(window: Sequence[Batch], loss_of: Any) -> float:
    counter = getattr(loss_of, "items", None)
    return float(sum(counter(y) for _, y in window)) if counter is not None else float(len(window))


def _run(loss_of: Any, batches: Sequence[Batch] | None = None, **settings: Any) -> Audit:
    model, optimizer = _classifier()
    batches = _batches() if batches is None else batches
    with audit(model, optimizer, **settings) as watched:
        for start in range(0, len(batches), 2):
            window = batches[start : start + 2]
            total = _window_items(window, loss_of)
            for x, y in window:
                loss_of(model(x), y, total).backward()
            optimizer.step()
            optimizer.zero_grad()
    return watched


class _Summed:
    """A correct loop: the criterion's sum over each micro-batch divided by the window's items."""

    def __init__(self, criterion: Callable[[Tensor, Tensor], Tensor], items: Callable[[Tensor], Any]) -> None:
        self.criterion, self.items = criterion, items

    def __call__(self, output: Tensor, y: Tensor, total: float) -> Tensor:
        return self.criterion(output, y) / total


def _per_micro_batch_mean(criterion: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor, float], Tensor]:
    """The bug: each micro-batch's own mean, divided by the number of micro-batches."""

    def loss(output: Tensor, y: Tensor, total: float) -> Tensor:
        return criterion(output, y) / 2

    return loss


def _verdicts(watched: Audit) -> list[bool]:
    return [window.equivalent for window in watched.windows]


# -- 2. the criterion's own options ----------------------------------------------------------------


def test_a_label_smoothed_criterion_with_a_plain_loss_is_one_line_naming_both() -> None:
    model, optimizer = _classifier()
    with pytest.raises(
        ValueError,
        match=r"^loss=CrossEntropy\(\) and criterion=CrossEntropyLoss\("
        r"label_smoothing=0\.1\) disagree \(label_smoothing 0 against 0\.1\)",
    ) as raised:
        audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=nn.CrossEntropyLoss(label_smoothing=0.1))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "options",
    [
        {"label_smoothing": 0.1},
        {"weight": torch.tensor([0.2, 1.0, 3.0, 0.5])},
        {"ignore_index": 2},
        {"weight": torch.tensor([0.2, 1.0, 3.0, 0.5]), "label_smoothing": 0.2, "ignore_index": 1},
    ],
)
def test_the_loss_derived_from_a_criterion_passes_a_correct_run_and_flags_a_per_micro_batch_mean(
    options: dict[str, Any],
) -> None:
    summing = nn.CrossEntropyLoss(reduction="sum", **options)
    derived = equiv.CrossEntropy(**{"ignore_index": -100, **options})

    def items(y: Tensor) -> float:
        return float(derived.count(y))

    correct = _run(_Summed(summing, items), criterion=summing)
    assert _verdicts(correct) == [True, True], correct.summary()
    meaning = nn.CrossEntropyLoss(**options)
    buggy = _run(_per_micro_batch_mean(meaning), criterion=meaning)
    assert _verdicts(buggy) == [False, False], buggy.summary()


def test_class_weights_count_each_item_by_its_weight_as_torch_divides() -> None:
    weight = torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=torch.float64)
    output = torch.randn(7, CLASSES, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 3, 2, -100, 1])
    loss = equiv.CrossEntropy(weight=weight, ignore_index=-100, label_smoothing=0.1)
    expected = F.cross_entropy(output, target, weight=weight, label_smoothing=0.1)
    assert torch.allclose(loss.sum(output, target) / loss.count(target), expected)
    assert float(loss.count(target)) == pytest.approx(float(weight[target[target != -100]].sum()))
    tokens = equiv.TokenCrossEntropy(weight=weight)
    assert torch.allclose(
        tokens.sum(output[None], target[None]) / tokens.count(target[None]),
        F.cross_entropy(output, target, weight=weight),
    )


def test_a_criterion_given_alone_names_the_loss_and_loss_given_alongside_that_agrees_is_kept() -> None:
    model, optimizer = _classifier()
    derived = audit(model, optimizer, criterion=nn.CrossEntropyLoss(label_smoothing=0.05, ignore_index=3))
    assert repr(derived.loss) == "CrossEntropy(ignore_index=3, label_smoothing=0.05)"
    assert isinstance(audit(model, optimizer, criterion=nn.MSELoss(reduction="sum")).loss, equiv.MSE)
    named = equiv.TokenCrossEntropy()
    assert audit(model, optimizer, loss=named, criterion=nn.CrossEntropyLoss()).loss is named

    class Logged(nn.CrossEntropyLoss):  # a subclass is read as the torch loss it is
        pass

    with pytest.raises(ValueError, match=r"criterion=Logged\(label_smoothing=0\.2\) disagree"):
        audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=Logged(label_smoothing=0.2))


def test_nll_loss_on_log_probabilities_is_cross_entropy_with_its_weights() -> None:
    weight = torch.tensor([0.2, 1.0, 3.0, 0.5])
    summing = nn.NLLLoss(weight=weight, reduction="sum")
    derived = equiv.CrossEntropy(weight=weight, ignore_index=-100)

    def correct(output: Tensor, y: Tensor, total: float) -> Tensor:
        return summing(F.log_softmax(output, -1), y) / total

    correct.items = lambda y: float(derived.count(y))  # type: ignore[attr-defined]
    assert _verdicts(_run(correct, criterion=summing)) == [True, True]

    meaning = nn.NLLLoss(weight=weight)
    buggy = _run(lambda output, y, total: meaning(F.log_softmax(output, -1), y) / 2, criterion=meaning)
    assert _verdicts(buggy) == [False, False], buggy.summary()


def test_a_criterion_equiv_cannot_express_is_refused_by_name() -> None:
    model, optimizer = _classifier()
    with pytest.raises(ValueError, match=r"^criterion=BCEWithLogitsLoss\(\): equiv ships no loss that computes it"):
        audit(model, optimizer, criterion=nn.BCEWithLogitsLoss())
    with pytest.raises(ValueError, match=r"^loss=MSE\(\) and criterion=L1Loss\(\) disagree"):
        audit(model, optimizer, loss=equiv.MSE(), criterion=nn.L1Loss())
    with pytest.raises(ValueError, match=r"the one is cross-entropy, the other mse"):
        audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=nn.MSELoss())
    with pytest.raises(ValueError, match=r"^criterion=_Own\(\) is not one of torch's losses"):
        audit(model, optimizer, criterion=_Own())
    with pytest.raises(TypeError, match=r"needs loss= .* or criterion="):
        audit(model, optimizer)


class _Own(nn.Module):
    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target)


def test_a_mse_criterion_summed_over_the_window_passes_and_its_per_micro_batch_mean_is_flagged() -> None:
    batches = [(x, torch.randn(len(x), CLASSES)) for x, _ in _batches()]
    summing = nn.MSELoss(reduction="sum")
    correct = _Summed(summing, lambda y: y.numel())
    assert _verdicts(_run(correct, batches, criterion=summing)) == [True, True]
    meaning = nn.MSELoss()
    assert _verdicts(_run(_per_micro_batch_mean(meaning), batches, criterion=meaning)) == [False, False]


# -- 7. functional losses without a wrap ----------------------------------------------------------


def test_the_commonest_functional_loop_is_audited_unchanged() -> None:
    def correct(output: Tensor, y: Tensor, total: float) -> Tensor:
        return F.cross_entropy(output, y, reduction="sum") / total

    correct.items = len  # type: ignore[attr-defined]
    passed = _run(correct, loss=equiv.CrossEntropy())
    assert _verdicts(passed) == [True, True], passed.summary()
    flagged = _run(lambda output, y, total: F.cross_entropy(output, y) / 2, loss=equiv.CrossEntropy())
    assert _verdicts(flagged) == [False, False], flagged.summary()
    assert torch.overrides._get_current_function_mode() is None  # the mode left with the audit


def test_a_functional_loop_with_options_reads_them_and_a_metric_on_a_detached_output_is_not_recorded() -> None:
    weight = torch.tensor([0.2, 1.0, 3.0, 0.5])
    loss = equiv.CrossEntropy(weight=weight, label_smoothing=0.1, ignore_index=1)

    def correct(output: Tensor, y: Tensor, total: float) -> Tensor:
        F.cross_entropy(output.detach(), y)  # a metric: not the training loss, not recorded
        return F.cross_entropy(output, y, weight, ignore_index=1, label_smoothing=0.1, reduction="sum") / total

    correct.items = lambda y: float(loss.count(y))  # type: ignore[attr-defined]
    assert _verdicts(_run(correct, loss=loss)) == [True, True]
    with pytest.raises(
        ValueError,
        match=r"^loss=CrossEntropy\(\) and the loop's F\.cross_entropy\("
        r"label_smoothing=0\.1\) disagree \(label_smoothing 0 against 0\.1\)",
    ):
        _run(lambda output, y, total: F.cross_entropy(output, y, label_smoothing=0.1), loss=equiv.CrossEntropy())
    assert torch.overrides._get_current_function_mode() is None  # restored on the exception too


def test_a_functional_mse_loop_is_audited_unchanged() -> None:
    batches = [(x, torch.randn(len(x), CLASSES)) for x, _ in _batches()]

    def correct(output: Tensor, y: Tensor, total: float) -> Tensor:
        return F.mse_loss(output, y, reduction="sum") / total

    correct.items = lambda y: y.numel()  # type: ignore[attr-defined]
    assert _verdicts(_run(correct, batches, loss=equiv.MSE())) == [True, True]
    flagged = _run(lambda output, y, total: F.mse_loss(output, y) / 2, batches, loss=equiv.MSE())
    assert _verdicts(flagged) == [False, False]


def test_wrap_and_a_criterion_with_the_functional_mode_record_each_target_once() -> None:
    def wrapped_run(make: Callable[[Audit], Callable[[Tensor, Tensor, float], Tensor]], **settings: Any) -> Audit:
        model, optimizer = _classifier()
        batches = _batches()
        with audit(model, optimizer, **settings) as watched:
            loss_of = make(watched)
            for start in range(0, len(batches), 2):
                window = batches[start : start + 2]
                for x, y in window:
                    loss_of(model(x), y, float(sum(len(b) for _, b in window))).backward()
                optimizer.step()
                optimizer.zero_grad()
        return watched

    def wrapped(watched: Audit) -> Callable[[Tensor, Tensor, float], Tensor]:
        loss_fn = watched.wrap(F.cross_entropy)
        return lambda output, y, total: loss_fn(output, y, reduction="sum") / total

    assert _verdicts(wrapped_run(wrapped, loss=equiv.CrossEntropy())) == [True, True]
    summing = nn.CrossEntropyLoss(reduction="sum")
    assert _verdicts(
        wrapped_run(
            lambda w: lambda output, y, total: summing(output, y) / total, loss=equiv.CrossEntropy(), criterion=summing
        )
    ) == [True, True]


VOCAB, SEQ = 11, 5
#: real tokens per sequence, per micro-batch of two sequences: unequal across the micro-batches
REAL = ((5, 4), (2, 1), (5, 5), (3, 1))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def logits(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(tokens)))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.logits(tokens)


def _token_batches(seed: int = 3) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for lengths in REAL:
        tokens = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=generator)
        labels = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=generator)
        for row, length in enumerate(lengths):
            labels[row, length:] = -100
        batches.append((tokens, labels))
    return batches


def _lm_run(
    model: nn.Module,
    loss_of: Callable[[Any, Tensor, Tensor, float], Tensor],
    *,
    forward: Callable[[nn.Module, Tensor, Tensor], Any] | None = None,
    next_token: bool = False,
    **settings: Any,
) -> Audit:
    """Two windows of two micro-batches; ``real``: the window's real (next-token, ``next_token``) targets."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = _token_batches()
    with audit(model, optimizer, **settings) as watched:
        for start in range(0, len(batches), 2):
            window = batches[start : start + 2]
            real = float(sum(int((labels[:, 1:] if next_token else labels).ne(-100).sum()) for _, labels in window))
            for tokens, labels in window:
                out = model(tokens) if forward is None else forward(model, tokens, labels)
                loss_of(out, labels, tokens, real).backward()
            optimizer.step()
            optimizer.zero_grad()
    return watched


def test_a_token_lm_with_a_flattened_functional_cross_entropy_is_audited_unchanged() -> None:
    def correct(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100, reduction="sum") / real

    def buggy(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100) / 2

    torch.manual_seed(0)
    passed = _lm_run(_TinyLM(), correct, loss=equiv.TokenCrossEntropy())
    assert _verdicts(passed) == [True, True], passed.summary()
    torch.manual_seed(0)
    flagged = _lm_run(_TinyLM(), buggy, loss=equiv.TokenCrossEntropy())
    assert _verdicts(flagged) == [False, False], flagged.summary()


def test_a_causal_lm_loop_shifting_its_own_labels_is_audited_with_next_token_cross_entropy() -> None:
    def correct(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        shifted = labels[:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), shifted, reduction="sum") / real

    def buggy(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)) / 2

    torch.manual_seed(0)
    passed = _lm_run(_TinyLM(), correct, loss=equiv.NextTokenCrossEntropy(), next_token=True)
    assert _verdicts(passed) == [True, True], passed.summary()
    torch.manual_seed(0)
    flagged = _lm_run(_TinyLM(), buggy, loss=equiv.NextTokenCrossEntropy())
    assert _verdicts(flagged) == [False, False], flagged.summary()


def test_a_token_lm_with_its_criterion_alone_is_audited() -> None:
    summing = nn.CrossEntropyLoss(reduction="sum")

    def correct(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return summing(logits.view(-1, VOCAB), labels.view(-1)) / real

    meaning = nn.CrossEntropyLoss()

    def buggy(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return meaning(logits.view(-1, VOCAB), labels.view(-1)) / 2

    torch.manual_seed(0)
    passed = _lm_run(_TinyLM(), correct, criterion=summing)
    assert _verdicts(passed) == [True, True], passed.summary()
    torch.manual_seed(0)
    flagged = _lm_run(_TinyLM(), buggy, criterion=meaning)
    assert _verdicts(flagged) == [False, False], flagged.summary()


def test_a_compiled_model_with_a_functional_loss_is_audited() -> None:
    torch.manual_seed(0)
    model = _TinyLM()
    compiled = torch.compile(model, backend="eager")

    def correct(logits: Tensor, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / real

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = _token_batches()
    with audit(compiled, optimizer, loss=equiv.TokenCrossEntropy()) as watched:  # type: ignore[arg-type]
        for start in range(0, len(batches), 2):
            window = batches[start : start + 2]
            real = float(sum(int((labels != -100).sum()) for _, labels in window))
            for tokens, labels in window:
                correct(compiled(tokens), labels, tokens, real).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert _verdicts(watched) == [True, True], watched.summary()


# -- 4. models that compute their own loss -----------------------------------------------------------


class _LinguaStyle(_TinyLM):
    """lingua's ``forward(token_values, target)``: per-token losses when a target is given."""

    def forward(self, tokens: Tensor, target: Tensor | None = None) -> Tensor:
        logits = self.logits(tokens)
        if target is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)


class _MegatronStyle(_TinyLM):
    """Megatron's loss_func shape: ``(summed loss, {'lm loss': ...}, number of tokens)``."""

    def forward(self, tokens: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:  # type: ignore[override]
        losses = F.cross_entropy(self.logits(tokens).flatten(0, 1), labels.flatten(), reduction="none")
        mask = labels.flatten() != -100
        summed, tokens_counted = (losses * mask).sum(), mask.sum()
        return summed, {"lm loss": summed.detach() / tokens_counted}, tokens_counted


class _FunASRStyle(_TinyLM):
    """FunASR's ``forward(speech, speech_lengths, text, text_lengths)``: ``(loss, stats, weight)``,
    the loss a mean over the batch's real tokens, its stats a dict, its weight the batch size."""

    def forward(
        self,
        speech: Tensor,
        speech_lengths: Tensor,
        text: Tensor,  # type: ignore[override]
        text_lengths: Tensor,
    ) -> tuple[Tensor, dict[str, Any], Tensor]:
        loss = F.cross_entropy(self.logits(speech).flatten(0, 1), text.flatten(), ignore_index=-100)
        stats = {"loss": loss.detach(), "acc": None, "batch_size": speech.shape[0]}
        return loss, stats, torch.tensor(speech.shape[0])


def _logits_of(model: nn.Module, call: Any) -> Tensor:
    """What the user hands the audit's loss: the model's logits of the recorded call's tokens."""
    assert isinstance(model, _TinyLM)
    return model.logits(call[0][0])


def _funasr_forward(model: nn.Module, tokens: Tensor, labels: Tensor) -> Any:
    lengths = (labels != -100).sum(-1)
    return model(tokens, lengths, labels, lengths)


@pytest.mark.parametrize("style", ["lingua", "megatron", "funasr"])
def test_a_model_computing_its_own_loss_is_judged_on_what_call_model_returns(style: str) -> None:
    models = {"lingua": _LinguaStyle, "megatron": _MegatronStyle, "funasr": _FunASRStyle}
    settings: dict[str, Any] = {"loss": equiv.TokenCrossEntropy(), "call_model": _logits_of}
    forward: Callable[[nn.Module, Tensor, Tensor], Any] = lambda model, tokens, labels: model(tokens, labels)  # noqa: E731
    if style == "funasr":
        forward, settings["targets"] = _funasr_forward, (lambda call: call[0][2])

    def correct(out: Any, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        if style == "lingua":
            return (out * (labels != -100)).sum() / real
        if style == "megatron":
            return out[0] / real
        return out[0] * (labels != -100).sum() / real  # FunASR's mean times its tokens: the sum

    def buggy(out: Any, labels: Tensor, tokens: Tensor, real: float) -> Tensor:
        if style == "lingua":
            return (out * (labels != -100)).sum() / (labels != -100).sum() / 2
        if style == "megatron":
            return out[0] / out[2] / 2
        return out[0] / 2

    torch.manual_seed(0)
    passed = _lm_run(models[style](), correct, forward=forward, **settings)
    assert _verdicts(passed) == [True, True], passed.summary()
    torch.manual_seed(0)
    flagged = _lm_run(models[style](), buggy, forward=forward, **settings)
    assert _verdicts(flagged) == [False, False], flagged.summary()


def test_a_call_model_whose_output_does_not_fit_the_loss_is_one_line() -> None:
    torch.manual_seed(0)
    with pytest.raises(
        ValueError,
        match=r"^the targets \(a tensor of shape \(2, 5\)\) do not fit the loss: "
        r"CrossEntropy\(\) on what call_model / output returned",
    ):
        _lm_run(
            _LinguaStyle(),
            lambda out, labels, tokens, real: out.sum() / real,
            forward=lambda model, tokens, labels: model(tokens, labels),
            loss=equiv.CrossEntropy(),
            call_model=lambda model, call: model.logits(call[0][0])[:, 0],
        )


def test_two_audits_closed_out_of_order_leave_no_mode_behind() -> None:
    model, optimizer = _classifier()
    batches = _batches()
    first = audit(model, optimizer, loss=equiv.CrossEntropy())
    second = audit(model, optimizer, loss=equiv.CrossEntropy())
    first.__enter__()
    second.__enter__()
    for start in range(0, len(batches), 2):
        for x, y in batches[start : start + 2]:
            F.cross_entropy(model(x), y, reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()
        assert len(torch.overrides._get_current_function_mode_stack()) == 2  # one each, however many steps
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert torch.overrides._get_current_function_mode_stack() == []
    assert len(first.windows) == len(second.windows) == 2
