"""What ``equiv.audit`` takes at entry and what it follows around the step (issue 42):
the optimizer wrappers users hold (Accelerate, Lightning, any ``.optimizer``), optimizers
whose step needs a closure, a step called with a closure, the LR scheduler stepped per
micro-batch, and the refusal of the sharding layouts the audit does not replay (HSDP)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import equiv
from equiv.auditing.ranks import sharding_refusal
from equiv.cases.case import UNSUPPORTED_OPTIMIZERS
from equiv.outcomes import Outcome

Batch = tuple[torch.Tensor, torch.Tensor]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _loader(sizes: tuple[int, ...] = (4,) * 8) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in sizes]


class _Holder:
    """A wrapper as a user's own trainer keeps one: the optimizer as ``.optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer


def _opened(model: nn.Module, optimizer: Any, criterion: nn.Module) -> tuple[equiv.auditing.Audit, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = equiv.audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion)
    return audit, [str(warning.message) for warning in caught if "equiv audit" in str(warning.message)]


# -- item 5: the wrappers users hold ------------------------------------------------------


def _accelerate_run(
    per_micro_batch: Callable[[Any], None] | None = None, sizes: tuple[int, ...] = (4,) * 8
) -> tuple[equiv.auditing.Audit, list[str]]:
    """Accelerate's own accumulation loop (``accelerator.accumulate``, mean loss, ``accelerator.backward``
    dividing by the accumulation steps, the prepared scheduler stepped every iteration)."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    criterion = nn.CrossEntropyLoss()
    audit, said = _opened(model, optimizer, criterion)
    with audit:
        for x, y in _loader(sizes):
            with accelerator.accumulate(model):
                accelerator.backward(criterion(model(x), y))
                optimizer.step()
                (per_micro_batch or (lambda prepared: prepared.step()))(scheduler)
                optimizer.zero_grad()
    return audit, said


@pytest.mark.peers("accelerate")
def test_an_accelerated_optimizer_is_unwrapped_said_once_and_its_real_steps_audited() -> None:
    audit, said = _accelerate_run()
    # the wrapper's step() skips the inner AdamW on accumulation micro-steps: 8 micro-batches, 4 steps
    assert audit.steps == 4 and audit.judged == 4 and audit, audit.summary()
    assert all(window.micro_batches == 2 and window.note is None for window in audit.windows), audit.summary()
    assert len(said) == 1 and "AdamW inside the AcceleratedOptimizer" in said[0], said


@pytest.mark.peers("accelerate")
def test_an_accelerate_loop_with_uneven_micro_batches_is_flagged() -> None:
    # the mean of each micro-batch divided by 2 weighs a 1-sample micro-batch as much as a 7-sample one
    audit, _ = _accelerate_run(sizes=(7, 1) * 4)
    assert audit.status is Outcome.NOT_EQUIVALENT and len(audit.failures) == 4, audit.summary()


@pytest.mark.peers("accelerate")
def test_accelerates_scheduler_stepped_num_processes_times_by_design_is_one_advance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import accelerate.scheduler

    class TwoProcesses:  # split_batches=False on 2 processes: the wrapper steps its scheduler twice per step
        num_processes = 2

    monkeypatch.setattr(accelerate.scheduler, "AcceleratorState", TwoProcesses)
    audit, _ = _accelerate_run()
    assert audit and audit.judged == 4 and all(window.note is None for window in audit.windows), audit.summary()


@pytest.mark.peers("accelerate")
def test_the_scheduler_inside_accelerates_stepped_per_micro_batch_is_flagged() -> None:
    audit, _ = _accelerate_run(per_micro_batch=lambda prepared: prepared.scheduler.step())
    assert audit.status is Outcome.NOT_EQUIVALENT, audit.summary()
    assert "LambdaLR stepped 2 times in this window" in audit.failures[-1].line(), audit.summary()


@pytest.mark.peers("accelerate")
def test_accelerates_scheduler_stepped_twice_per_iteration_is_flagged_naming_both() -> None:
    audit, _ = _accelerate_run(per_micro_batch=lambda prepared: (prepared.step(), prepared.step()))
    assert audit.status is Outcome.NOT_EQUIVALENT, audit.summary()
    assert "LambdaLR (in an AcceleratedScheduler) stepped 2 times" in audit.failures[-1].line(), audit.summary()


@pytest.mark.peers("pytorch_lightning")
def test_a_lightning_optimizer_is_unwrapped() -> None:
    from pytorch_lightning.core.optimizer import LightningOptimizer

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    audit, said = _opened(model, LightningOptimizer(optimizer), nn.CrossEntropyLoss())
    assert audit.optimizer is optimizer
    assert len(said) == 1 and "SGD inside the LightningOptimizer" in said[0], said


def test_nested_wrappers_are_unwrapped_and_the_run_audited() -> None:
    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    audit, said = _opened(model, _Holder(_Holder(optimizer)), criterion)
    assert audit.optimizer is optimizer and len(said) == 1 and "_Holder in _Holder" in said[0], said
    with audit:
        _train(model, optimizer, criterion)
    assert audit and audit.judged == 4, audit.summary()


@pytest.mark.parametrize(
    "given, named",
    [
        (object(), "got a object"),
        (_Holder(object()), "its .optimizer chain ends at a object"),
        (_Holder(None), "got a _Holder"),
    ],
)
def test_what_is_not_an_optimizer_or_a_wrapper_of_one_is_refused_by_name(given: Any, named: str) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer") as raised:
        equiv.audit(_model(), given, loss=equiv.CrossEntropy())
    assert named in str(raised.value) and "\n" not in str(raised.value)


def test_a_loop_of_wrappers_and_a_scheduler_are_refused() -> None:
    looped = _Holder(None)
    looped.optimizer = looped
    with pytest.raises(TypeError, match="got a _Holder"):
        equiv.audit(_model(), looped, loss=equiv.CrossEntropy())
    model = _model()
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(TypeError, match="got a StepLR, a learning-rate scheduler: pass the optimizer it schedules"):
        equiv.audit(model, scheduler, loss=equiv.CrossEntropy())


# -- item 6: closures ------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [lambda optimizer: optimizer, _Holder])
def test_lbfgs_is_refused_at_entry_with_the_checks_reason(wrap: Callable[[Any], Any]) -> None:
    model = _model()
    with pytest.raises(ValueError, match="does not support optimizer LBFGS") as raised:
        equiv.audit(model, wrap(torch.optim.LBFGS(model.parameters())), loss=equiv.CrossEntropy())
    assert UNSUPPORTED_OPTIMIZERS["LBFGS"] in str(raised.value)


def test_a_custom_optimizer_whose_step_needs_a_closure_is_refused() -> None:
    class NeedsClosure(torch.optim.SGD):
        def step(self, closure: Callable[[], Any]) -> Any:  # type: ignore[override]
            return super().step(closure)

    model = _model()
    with pytest.raises(ValueError, match="NeedsClosure: its step\\(closure\\) needs a closure"):
        equiv.audit(model, NeedsClosure(model.parameters(), lr=0.1), loss=equiv.CrossEntropy())


def _closure_run(before_step: int, zero_in_closure: bool) -> equiv.auditing.Audit:
    """SGD stepped with a closure that runs the window's last ``2 - before_step`` micro-batches."""
    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader()
    with equiv.audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion) as audit:
        for start in range(0, len(loader), 2):
            window = loader[start : start + 2]
            for x, y in window[:before_step]:
                (criterion(model(x), y) / 2).backward()

            def closure(rest: list[Batch] = window[before_step:]) -> torch.Tensor:
                if zero_in_closure:
                    optimizer.zero_grad()
                total = torch.zeros(())
                for x, y in rest:
                    loss = criterion(model(x), y) / 2
                    loss.backward()
                    total = total + loss.detach()
                return total

            optimizer.step(closure)
            optimizer.zero_grad()
    return audit


def test_a_step_with_a_closure_is_judged_on_the_micro_batches_it_ran() -> None:
    whole = _closure_run(before_step=0, zero_in_closure=True)  # torch's docs' closure: zero_grad, forward, backward
    assert whole and whole.judged == 4 and whole.windows[0].micro_batches == 2, whole.summary()
    kept = _closure_run(before_step=1, zero_in_closure=False)  # one micro-batch before, one in the closure
    assert kept and kept.judged == 4, kept.summary()


def test_a_closure_that_discards_the_micro_batches_before_the_step_is_flagged() -> None:
    lost = _closure_run(before_step=1, zero_in_closure=True)  # the first micro-batch's gradient zeroed
    assert lost.status is Outcome.NOT_EQUIVALENT and len(lost.failures) == 4, lost.summary()


# -- item 12: the LR schedule per optimizer step ------------------------------------------------


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    on_micro_batch: Callable[[], None] = lambda: None,
    on_step: Callable[[], None] = lambda: None,
) -> None:
    loader = _loader()
    for index, (x, y) in enumerate(loader):
        (criterion(model(x), y) / 2).backward()
        on_micro_batch()
        if index % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            on_step()


def _scheduled(
    make: Callable[[torch.optim.Optimizer], Any],
    per_micro_batch: bool,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.SGD,
    step: Callable[[Any], None] = lambda scheduler: scheduler.step(),
) -> equiv.auditing.Audit:
    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    scheduler = make(optimizer)
    with equiv.audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion) as audit:
        _train(
            model,
            optimizer,
            criterion,
            on_micro_batch=(lambda: step(scheduler)) if per_micro_batch else lambda: None,
            on_step=(lambda: None) if per_micro_batch else lambda: step(scheduler),
        )
    return audit


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step)),
    "OneCycleLR": lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=20),
    "SequentialLR": lambda optimizer: torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9),
        ],
        milestones=[2],
    ),
    "ChainedScheduler": lambda optimizer: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9),
        ]
    ),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_scheduler_stepped_once_per_optimizer_step_passes(name: str) -> None:
    audit = _scheduled(SCHEDULES[name], per_micro_batch=False)
    assert audit and audit.judged == 4 and all(window.note is None for window in audit.windows), audit.summary()


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_scheduler_stepped_per_micro_batch_is_flagged_naming_it_and_the_count(name: str) -> None:
    audit = _scheduled(SCHEDULES[name], per_micro_batch=True)
    assert audit.status is Outcome.NOT_EQUIVALENT and len(audit.failures) == 4, audit.summary()
    line = audit.failures[0].line()
    assert f"the LR scheduler {name} stepped 2 times in this window" in line and "not per micro-batch" in line, line


def test_reduce_lr_on_plateau_stepped_per_micro_batch_is_flagged_where_it_cuts_the_rate() -> None:
    audit = _scheduled(
        lambda optimizer: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0),
        per_micro_batch=True,
        step=lambda scheduler: scheduler.step(1.0),
    )  # a flat metric
    assert audit.status is Outcome.NOT_EQUIVALENT, audit.summary()
    assert "ReduceLROnPlateau stepped 2 times" in audit.failures[0].line()


def test_a_constant_schedule_stepped_per_micro_batch_passes_with_a_note() -> None:
    audit = _scheduled(
        lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), per_micro_batch=True
    )
    assert audit and audit.judged == 4, audit.summary()
    assert all(window.note is not None and "LambdaLR stepped 2 times" in window.line() for window in audit.windows)
    assert audit.windows[0].to_dict()["note"] == audit.windows[0].note


def test_a_scheduler_of_another_optimizer_is_not_counted() -> None:
    model, criterion = _model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(_model().parameters(), lr=0.1), lambda s: 1 / (1 + s))
    with equiv.audit(model, optimizer, loss=equiv.CrossEntropy(), criterion=criterion) as audit:
        _train(model, optimizer, criterion, on_micro_batch=other.step)
    assert audit and audit.judged == 4, audit.summary()


@pytest.mark.peers("transformers", "accelerate")
def test_the_transformers_trainer_with_a_warmup_schedule_passes() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    rows = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(8)]
    args = TrainingArguments(
        output_dir="/tmp/equiv-entry-trainer",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        lr_scheduler_type="linear",
        warmup_steps=1,
        learning_rate=1e-2,
    )
    callback = equiv.auditing.transformers_callback(loss=equiv.NextTokenCrossEntropy(), say=None)
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=rows, callbacks=[callback]).train()
    assert callback.audit is not None and callback.audit and callback.audit.judged == 2, callback.audit.summary()


# -- item 8: the sharding layouts refused -------------------------------------------------------


def test_the_hsdp_refusal_says_what_is_unsupported_and_what_to_run() -> None:
    from torch.distributed.tensor import Replicate, Shard

    text = sharding_refusal("0.weight", (Replicate(), Shard(0)), (2, 2), 4, by_fsdp=True)
    assert "HSDP" in text and "does not support yet" in text and "fully_shard over a 1-D mesh of every rank" in text
    assert "do not each hold" not in text and "engine='tp'" not in text, text
    sub_mesh = sharding_refusal("0.weight", (Shard(0),), (2,), 4, by_fsdp=True)
    assert "FSDP2 on a mesh of 2 of the 4 ranks" in sub_mesh and "engine='tp'" not in sub_mesh, sub_mesh
    tensor_parallel = sharding_refusal("0.weight", (Shard(0),), (2,), 2, by_fsdp=False)
    assert "tensor parallelism" in tensor_parallel and "equiv.check_distributed" in tensor_parallel
