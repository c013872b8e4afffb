"""The audit on the loops people write and the trainers' default arguments (issue 34): the Trainer's
own clip norm read, no clipping when none is set, targets seen where the loss sees them (an
``nn.Module`` criterion, a wrapped loss function), a recorded target that does not fit the loss
named, and calls made through ``model.forward``, ``torch.compile`` and Accelerate recorded."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import equiv
from equiv.auditing import audit
from equiv.auditing.runs import lightning_tail_run, tiny_lm_and_optimizer, token_loader, trainer_run, windows
from equiv.losses import NextTokenCrossEntropy

TOKENS = NextTokenCrossEntropy()


# -- 1. right on the trainers' defaults ----------------------------------------------------------

#: 16 micro-batches of 2 sequences: with gradient_accumulation_steps=4, four windows, two of them
#: with unequal real-token counts.
_SIXTEEN = [[8, 8], [8, 7], [7, 2], [3, 2], [5, 5], [5, 5], [8, 6], [2, 1]] * 2


@pytest.mark.peers("transformers", "accelerate")
def test_the_readme_callback_on_the_trainers_default_arguments_flags_no_step() -> None:
    # TrainingArguments clips at max_grad_norm=1.0 unless told otherwise, and the clip is active here:
    # the callback reads it, and says what it read.
    audited = trainer_run(loss_kwargs=True, gradient_accumulation_steps=4, max_grad_norm=None, lengths=_SIXTEEN)
    assert len(audited.windows) == 4 and audited, audited.summary()
    assert audited.max_grad_norm == 1.0
    assert audited.read is not None and audited.read.startswith("equiv audit: read from TrainingArguments: ")
    assert "max_grad_norm=1.0" in audited.read and "gradient_accumulation_steps=4" in audited.read
    assert "bf16=False" in audited.read and "model_accepts_loss_kwargs=True" in audited.read


@pytest.mark.peers("transformers", "accelerate")
def test_a_trainer_that_does_not_clip_is_not_hinted_to_clip_to_inf() -> None:
    # The Trainer measures the grad norm with clip_grad_norm_(..., inf) when it does not clip: no clip.
    audited = trainer_run(loss_kwargs=False)  # max_grad_norm=0, windows 1 and 3 flagged (transformers #37766)
    assert [w.equivalent for w in audited.windows] == [True, False, True, False], audited.summary()
    assert not any(w.hint for w in audited.windows), audited.summary()
    assert audited.read is not None and "max_grad_norm=0.0 (no clipping)" in audited.read
    assert "model_accepts_loss_kwargs=False" in audited.read


@pytest.mark.peers("transformers")
def test_the_callback_says_what_it_read_in_one_line_when_training_begins() -> None:
    from types import SimpleNamespace

    said: list[str] = []
    callback = equiv.auditing.transformers_callback(loss=TOKENS, say=said.append)
    model, optimizer = tiny_lm_and_optimizer()  # forward(input_ids, labels): no **kwargs
    args = SimpleNamespace(max_grad_norm=1.0, gradient_accumulation_steps=4, bf16=False, fp16=False)
    callback.on_train_begin(args, None, None, model=model, optimizer=optimizer)
    callback.on_train_end(args, None, None)
    assert said == [callback.audit.read]
    assert said[0].startswith(
        "equiv audit: read from TrainingArguments: max_grad_norm=1.0, "
        "gradient_accumulation_steps=4, bf16=False, fp16=False, model_accepts_loss_kwargs=False "
        "(the Trainer divides each micro-batch's mean loss by gradient_accumulation_steps"
    ), said
    told = equiv.auditing.transformers_callback(loss=TOKENS, say=None, max_grad_norm=0.5)
    told.on_train_begin(args, None, None, model=model, optimizer=optimizer)
    told.on_train_end(args, None, None)
    assert told.audit.max_grad_norm == 0.5 and "the callback's own max_grad_norm=0.5 used instead" in told.audit.read


@pytest.mark.parametrize("none", [None, 0, 0.0, math.inf])
def test_a_max_grad_norm_of_inf_zero_or_none_is_no_clipping(none: float | None) -> None:
    model, optimizer = tiny_lm_and_optimizer("SGD")
    with audit(model, optimizer, loss=TOKENS, max_grad_norm=none) as watched:
        for window in windows(token_loader([8, 8, 8, 8, 3, 3, 8, 8]), 2):
            for ids, labels in window:
                (TOKENS(model(ids, labels), labels) / 2).backward()  # a mean of uneven means: flagged
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # measures, never clips
            optimizer.step()
            optimizer.zero_grad()
    assert watched.max_grad_norm is None
    assert [w.equivalent for w in watched.windows] == [True, False], watched.summary()
    assert not any(w.hint for w in watched.windows), watched.summary()


def test_a_run_that_clamps_by_value_unannounced_is_hinted_and_told_is_clean() -> None:
    def clamped_run(**settings: float) -> equiv.auditing.Audit:
        model, optimizer = tiny_lm_and_optimizer("SGD")
        with audit(model, optimizer, loss=TOKENS, **settings) as watched:
            for window in windows(token_loader([8] * 8), 2):
                for ids, labels in window:
                    (TOKENS(model(ids, labels), labels) / 2).backward()
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01)  # Lightning's keyword
                optimizer.step()
                optimizer.zero_grad()
        return watched

    unannounced = clamped_run()
    assert unannounced.windows and not any(w.equivalent for w in unannounced.windows), unannounced.summary()
    assert all(
        "clamped its gradients to ±0.01 (1 clip_grad_value_ call in the window)" in w.line()
        and "audit with max_grad_value=0.01" in w.line()
        for w in unannounced.windows
    ), unannounced.summary()
    assert clamped_run(max_grad_value=0.01), "told the clip value, the run is equivalent"
    assert torch.nn.utils.clip_grad_value_.__module__ == "torch.nn.utils.clip_grad"  # torch's own again


def test_a_negative_max_grad_norm_is_refused_with_its_value() -> None:
    model, optimizer = tiny_lm_and_optimizer()
    with pytest.raises(ValueError, match=r"max_grad_norm must be.*-1"):
        audit(model, optimizer, loss=TOKENS, max_grad_norm=-1.0)


@pytest.mark.peers("pytorch_lightning")
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_clipping_is_read_from_the_trainer(algorithm: str) -> None:
    # gradient_clip_val=0.05 is active on every window; the callback reads it (and the algorithm). Clipped
    # to a norm, the short tail's 1/3 is clipped away (the same step as its full batch's); by value, not.
    audited = lightning_tail_run(gradient_clip_val=0.05, gradient_clip_algorithm=algorithm)
    assert [w.equivalent for w in audited.windows] == [True, True, algorithm == "norm"], audited.summary()
    assert audited.read is not None and f"gradient_clip_algorithm={algorithm}" in audited.read
    assert "gradient_clip_val=0.05" in audited.read and "accumulate_grad_batches=3" in audited.read
    assert f"replayed with max_grad_{algorithm}=0.05" in audited.read
    told = audited.max_grad_norm if algorithm == "norm" else audited.max_grad_value
    assert told == 0.05


@pytest.mark.peers("pytorch_lightning")
def test_lightning_on_its_defaults_says_it_does_not_clip() -> None:
    audited = lightning_tail_run()
    assert audited.read is not None and "gradient_clip_val=None (no clipping)" in audited.read
    assert audited.max_grad_norm is None and audited.max_grad_value is None


# -- 2. the loop people write: loss = criterion(model(x), y) ----------------------------------------


def _classifier() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batches(*sizes: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 3, generator=generator), torch.randint(0, 2, (n,), generator=generator)) for n in sizes]


def _criterion_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module, data: list[tuple[Tensor, Tensor]], n: int
) -> None:
    """The commonest loop: ``loss = criterion(model(x), y) / N``, targets never reach forward."""
    for start in range(0, len(data), n):
        for inputs, targets in data[start : start + n]:
            out = model(inputs)
            loss = criterion(out, targets) / n
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_criterion_module_hands_its_targets_to_the_audit() -> None:
    criterion = nn.CrossEntropyLoss()
    model, optimizer = _classifier()
    with audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion) as watched:
        _criterion_loop(model, optimizer, criterion, _batches(4, 4, 3, 5), 2)  # mean / N: right, then not
    assert [w.items for w in watched.windows] == [(4, 4), (3, 5)]
    assert [w.equivalent for w in watched.windows] == [True, False], watched.summary()
    assert not criterion._forward_pre_hooks and not model._forward_pre_hooks  # all gone on exit


def test_a_wrapped_loss_function_hands_its_targets_to_the_audit() -> None:
    model, optimizer = _classifier()
    with audit(model, optimizer, loss=equiv.CrossEntropy()) as watched:
        loss_fn = watched.wrap(nn.functional.cross_entropy)
        for window in (_batches(4, 4), _batches(2, 6)):
            items = sum(len(targets) for _, targets in window)
            for inputs, targets in window:
                (loss_fn(model(inputs), targets, reduction="sum") / items).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [w.items for w in watched.windows] == [(4, 4), (2, 6)]
    assert watched and len(watched.windows) == 2, watched.summary()


def test_a_criterion_called_twice_per_forward_is_named() -> None:
    criterion = nn.CrossEntropyLoss()
    model, optimizer = _classifier()
    ((inputs, targets),) = _batches(4)
    with pytest.raises(ValueError, match=r"criterion .*2 times.* 1 forward call"):
        with audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion):
            out = model(inputs)
            (criterion(out, targets) + criterion(out, targets)).backward()
            optimizer.step()


def test_a_criterion_that_is_not_a_module_is_refused_with_what_to_do() -> None:
    model, optimizer = _classifier()
    with pytest.raises(TypeError, match=r"criterion must be a torch.nn.Module.*audit.wrap"):
        audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=nn.functional.cross_entropy)  # type: ignore[arg-type]


# -- 3. a guess that does not fit the loss ----------------------------------------------------------


class Denoiser(nn.Module):
    """A diffusion model's call shape: ``model(x, t)``, ``t`` the timestep, not the target."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 6))
        self.time = nn.Embedding(10, 6)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        return self.net(x + self.time(t))  # type: ignore[no-any-return]


def _squared_error(output: Tensor, target: Tensor) -> Tensor:
    """An MSE written out by hand: no torch loss the audit sees is called."""
    return ((output - target) ** 2).mean()


def _diffusion_loop(
    criterion: nn.Module | None = None, *, by_hand: bool = False, **settings: object
) -> equiv.auditing.Audit:
    torch.manual_seed(0)
    model = Denoiser()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mse = criterion if criterion is not None else _squared_error if by_hand else nn.MSELoss()
    generator = torch.Generator().manual_seed(0)
    with audit(model, optimizer, loss=equiv.MSE(), criterion=criterion, **settings) as watched:  # type: ignore[arg-type]
        for _ in range(2):
            for _ in range(2):
                x, noise = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)
                t = torch.randint(0, 10, (4,), generator=generator)
                (mse(model(x + noise, t), noise) / 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    return watched


def test_a_timestep_taken_for_the_targets_is_a_clear_error_not_a_crash_in_the_replay() -> None:
    with pytest.raises(ValueError) as raised:
        _diffusion_loop(by_hand=True)
    text = str(raised.value)
    assert "second positional argument" in text and "shape (4,) int64" in text, text
    assert "output of shape (4, 6) float32" in text and "MSE" in text, text
    assert "criterion=" in text and "targets=" in text and "record" in text, text


def test_the_same_diffusion_loop_told_its_criterion_is_judged() -> None:
    watched = _diffusion_loop(criterion=nn.MSELoss())
    assert len(watched.windows) == 2 and watched, watched.summary()


def test_the_same_diffusion_loop_untold_is_judged_on_the_targets_its_mse_loss_received() -> None:
    # nn.MSELoss() called but not named: its F.mse_loss call is seen (issue 42), the timestep left alone.
    watched = _diffusion_loop()
    assert len(watched.windows) == 2 and watched, watched.summary()


# -- 4. calls the forward hook cannot see ------------------------------------------------------------


def _nanogpt_loop(call: object, optimizer: torch.optim.Optimizer) -> None:
    for window in windows(token_loader([8, 8, 8, 8, 3, 7, 2, 2]), 2):
        tokens = sum(int(TOKENS.count(labels)) for _, labels in window)
        for ids, labels in window:
            (TOKENS.sum(call(ids, labels), labels) / tokens).backward()  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()


def test_calls_through_model_forward_are_recorded_once() -> None:
    model, optimizer = tiny_lm_and_optimizer()
    with audit(model, optimizer, loss=TOKENS) as watched:
        _nanogpt_loop(model.forward, optimizer)
    assert [w.micro_batches for w in watched.windows] == [2] * 2 and watched, watched.summary()
    assert "forward" not in model.__dict__  # the class's forward again
    model, optimizer = tiny_lm_and_optimizer()
    with audit(model, optimizer, loss=TOKENS) as watched:
        _nanogpt_loop(model, optimizer)  # through __call__: once, not twice
    assert [w.micro_batches for w in watched.windows] == [2] * 2 and watched, watched.summary()


def test_two_audits_on_one_model_closed_in_either_order_leave_its_own_forward() -> None:
    import inspect

    model, optimizer = tiny_lm_and_optimizer()
    signature = inspect.signature(model.forward)
    first = audit(model, optimizer, loss=TOKENS).__enter__()
    second = audit(model, optimizer, loss=TOKENS).__enter__()
    assert inspect.signature(model.forward) == signature  # what the Trainer and others inspect
    _nanogpt_loop(model, optimizer)
    first.__exit__(None, None, None)
    _nanogpt_loop(model, optimizer)
    second.__exit__(None, None, None)
    assert "forward" not in model.__dict__
    assert [w.micro_batches for w in first.windows] == [2] * 2 and first, first.summary()
    assert [w.micro_batches for w in second.windows] == [2] * 4 and second, second.summary()


def test_a_model_copied_while_audited_runs_as_itself() -> None:
    import copy
    import pickle

    model, optimizer = tiny_lm_and_optimizer()
    ids, _ = next(iter(token_loader([8, 8])))
    with audit(model, optimizer, loss=TOKENS):
        twin = copy.deepcopy(model)  # an EMA copy made inside the audit
        revived = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        twin.head.weight.add_(1.0)
        revived.head.weight.add_(1.0)
        assert not torch.equal(twin(ids), model(ids)) and torch.equal(twin(ids), revived(ids))


@pytest.mark.parametrize("audited", ["the model", "the compiled module"])
def test_a_compiled_model_is_recorded(audited: str) -> None:
    # Dynamo's frontend decides whether the recording runs, the same under every backend; inductor would
    # also need a C++ compiler and builds for the CPU's kernels (it failed to compile under
    # ATEN_CPU_CAPABILITY=default here), so the test does not depend on the machine: aot_eager.
    torch._dynamo.reset()
    model, optimizer = tiny_lm_and_optimizer()
    compiled = torch.compile(model, backend="aot_eager")
    with audit(model if audited == "the model" else compiled, optimizer, loss=TOKENS) as watched:
        _nanogpt_loop(compiled, optimizer)
    assert [w.micro_batches for w in watched.windows] == [2] * 2 and watched, watched.summary()


@pytest.mark.peers("accelerate")
@pytest.mark.parametrize("through", ["call", "forward"])
def test_an_accelerate_prepared_model_is_recorded(through: str) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from equiv.auditing.trainers import torch_optimizer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, optimizer = tiny_lm_and_optimizer()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    with audit(model, torch_optimizer(optimizer), loss=TOKENS) as watched:
        _nanogpt_loop(model if through == "call" else model.forward, optimizer)
    assert [w.micro_batches for w in watched.windows] == [2] * 2 and watched, watched.summary()


def test_a_compiled_module_handed_to_the_audit_keeps_its_full_graph() -> None:
    # Handed the compiled module, the audit records before its graph: fullgraph=True compiles as it would.
    torch._dynamo.reset()
    model, optimizer = tiny_lm_and_optimizer()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with audit(compiled, optimizer, loss=TOKENS) as watched:
        _nanogpt_loop(compiled, optimizer)
    assert [w.micro_batches for w in watched.windows] == [2] * 2 and watched, watched.summary()
    assert "forward" not in model.__dict__ and compiled.forward is not None


@pytest.mark.peers("accelerate")
def test_accelerates_mixed_precision_inside_the_prepared_forward_is_recorded() -> None:
    # Accelerate enters its autocast inside the forward it sets on the model: the record carries it, so
    # the floors are replayed in the run's own mixed precision.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from equiv.auditing.trainers import torch_optimizer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    model, optimizer = tiny_lm_and_optimizer()
    model, optimizer = Accelerator(cpu=True, mixed_precision="bf16").prepare(model, optimizer)
    ids, labels = next(iter(token_loader([8, 8])))
    with audit(model, torch_optimizer(optimizer), loss=TOKENS) as watched:
        model(ids, labels)
        model.forward(ids, labels)
        assert watched._window is not None and watched._window.autocast == [("cpu", torch.bfloat16)] * 2
