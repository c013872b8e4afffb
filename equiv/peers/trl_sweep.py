"""``equiv sweep trl``: TRL's trainers that accumulate, each built tiny, trained with
``gradient_accumulation_steps`` over uneven item counts and audited (issue 45).

Every subject is a trainer (and a ``loss_type`` where it has several) on the one-layer Llama and the
character tokenizer of :mod:`equiv.peers.trl` (nothing downloaded), SGD without clipping, float32 on the
CPU.  Its optimizer steps are audited by :func:`equiv.auditing.transformers_callback` (TRL's trainers are
transformers Trainers) against the objective the trainer documents with full-batch normalisation
(:mod:`equiv.peers.trl_objectives`; DPO, Reward: per pair; KTO: per example; SFT, GKD, distillation: per
token; GRPO: per loss type, :class:`equiv.losses.policy.GRPOObjective`): each micro-batch
``compute_loss`` receives is recorded and the window replayed in float64 from its start weights.  Item
counts are uneven by construction: the preference data sets hold 7 items in micro-batches of 2 with
``gradient_accumulation_steps=2``, so the second window holds 2 + 1 items (the Trainer ends a window at an
epoch's end); the token-level ones hold texts of unequal lengths.

A trainer whose loss is not an item-weighted sum of the window's items gets a row saying why instead of a
verdict (KTO's ``kto``: a KL estimate over each micro-batch; DPO's ``aot``: pairs sorted within the batch).
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from equiv.auditing.replay import Call
from equiv.auditing.trainers import transformers_callback
from equiv.auditing.watch import Audit
from equiv.losses.items import Loss
from equiv.losses.policy import GRPO_LOSS_TYPES, GRPOObjective
from equiv.peers import trl as peers_trl
from equiv.peers.sweep_rows import SweepRow
from equiv.peers.trl_objectives import (
    DPO_PAIR_LOSSES,
    DPOChosenNLL,
    DPOPairs,
    GeneralizedJSD,
    KTOExamples,
    RewardPairs,
)
from equiv.results.witness import Witness

__all__ = ["SUBJECTS", "Subject", "preamble", "run_subject", "subjects"]

#: the preference data: 7 items, micro-batches of 2, GA=2: windows of 2 + 2 and 2 + 1 items
PROMPTS = ["ab", "cd", "efg", "h a", "bb", "gc", "da"]
CHOSEN = ["a", "bcd", "ab", "h", "cc", "ga b", "e"]
REJECTED = ["bb", "c", "dddd", "ge", "f", "a", "hhh"]
#: the Trainer arguments every subject shares beside peers_trl's (SGD, no clipping, float32, CPU)
ACCUMULATION: dict[str, Any] = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 2}


class SubjectFailed(Exception):
    """A subject's own failure, with where it happened ("building the trainer", "training")."""

    def __init__(self, where: str, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [""])[0]
        super().__init__(f"{where}: {type(error).__name__}: {first}")


@contextlib.contextmanager
def _stage(where: str) -> Iterator[None]:
    try:
        yield
    except SubjectFailed:
        raise
    except Exception as error:  # a subject's failure becomes its row's reason, never the sweep's
        raise SubjectFailed(where, error) from error


@dataclass(frozen=True)
class Subject:
    """One row of the sweep: how to run it, or why it cannot be judged."""

    name: str
    family: str
    #: the run: (the audit, what was run); None with a reason
    run: Callable[[], tuple[Audit, dict[str, Any]]] | None = None
    reason: str = ""
    setup: dict[str, Any] = field(default_factory=dict)


def _same(output: Any) -> Any:
    return output


def _tensors(inputs: dict[str, Any]) -> dict[str, Tensor]:
    return {key: value for key, value in inputs.items() if isinstance(value, Tensor)}


def _audited_training(
    build: Callable[[list[Any]], Any],
    loss: Loss | GRPOObjective,
    call_model: Callable[[nn.Module, Call], Any],
    targets: Callable[[Call], Tensor],
    keep: Callable[[Any, dict[str, Any]], dict[str, Tensor]] = lambda trainer, inputs: _tensors(inputs),
) -> Audit:
    """Train the trainer ``build(callbacks)`` makes, audited by the transformers callback: each micro-batch
    ``compute_loss`` receives in training recorded (``keep`` picks its tensors, adding what the loss needs
    that the trainer holds, e.g. a teacher's log-probabilities) and replayed as ``call_model``."""
    callback = transformers_callback(
        say=None, loss=loss, call_model=call_model, targets=targets, output=_same, record_forward=False
    )
    with _stage("building the trainer"), peers_trl._quiet():
        trainer = build([callback])
    compute_loss = trainer.compute_loss

    def recording(model: nn.Module, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
        if model.training and torch.is_grad_enabled() and callback.audit is not None:
            callback.audit.record(keep(trainer, inputs))
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = recording
    trainer.add_callback(_trainer_setting_callback(callback, trainer))
    with _stage("training"), peers_trl._quiet():
        trainer.train()
    if callback.audit is None:
        raise SubjectFailed("training", RuntimeError("the trainer never began training"))
    audit: Audit = callback.audit
    return audit


def _setting_at_fault(
    trainer: Any, fallback: Callable[[Witness], str | None] | None
) -> Callable[[Witness], str | None]:
    """The TRL setting a failing window's witness points at: GKD's on-policy ``lmbda`` (a token count taken
    before generation), else what the transformers callback reads from the trainer (``loss_is_scaled_for_ga``,
    trl PR #5710)."""
    name = type(trainer).__name__
    on_policy = float(getattr(trainer, "lmbda", 0.0) or 0.0)

    def at_fault(witness: Witness) -> str | None:
        if on_policy > 0 and witness.normaliser.startswith("uniform scale"):
            return (
                f"{name} lmbda={on_policy}: the Trainer counts num_items_in_batch on the data set's labels before "
                "on-policy generation replaces them, and the loss divides the generated tokens' sum by that count "
                "(trl #4719's normaliser, stale)"
            )
        return None if fallback is None else fallback(witness)

    return at_fault


def _trainer_setting_callback(callback: Any, trainer: Any) -> Any:
    from transformers import TrainerCallback

    class _TrainerSetting(TrainerCallback):  # type: ignore[misc,unused-ignore]
        """Runs after the audit's callback has started the audit: tells it the trainer's own setting."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if callback.audit is not None:
                callback.audit.setting_at_fault = _setting_at_fault(trainer, callback.audit.setting_at_fault)

    return _TrainerSetting()


def _batch(call: Call) -> dict[str, Tensor]:
    batch: dict[str, Tensor] = call[0][0]
    return batch


def _token_log_probs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Each next token's log-probability under the model class's own forward (``B × (T-1)``)."""
    logits = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return F.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _completion_log_probs(model: nn.Module, call: Call) -> Tensor:
    """DPO / KTO: each completion token's log-probability, zero elsewhere (``B × (T-1)``)."""
    batch = _batch(call)
    logps = _token_log_probs(model, batch["input_ids"], batch["attention_mask"])
    return logps * batch["completion_mask"][:, 1:].to(logps.dtype)


def _sequence_log_probs(model: nn.Module, call: Call) -> Tensor:
    return _completion_log_probs(model, call).sum(-1)


def _dpo_targets(call: Call) -> Tensor:
    batch = _batch(call)
    lengths = batch["completion_mask"].sum(-1).to(torch.float64)
    chosen, rejected = lengths.chunk(2)
    ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    return torch.stack([ref_chosen.to(torch.float64), ref_rejected.to(torch.float64), chosen, rejected], dim=1)


def _common_args(output_dir: str, **extra: Any) -> dict[str, Any]:
    return {"output_dir": output_dir, "seed": 0, **ACCUMULATION, **peers_trl._TRAINER_ARGS, **extra}


def _setup(trainer: str, config: dict[str, Any], data: str) -> dict[str, Any]:
    return {
        "trainer": trainer,
        "config": {**ACCUMULATION, **{k: v for k, v in config.items() if k != "output_dir"}},
        "model": "LlamaForCausalLM, 1 layer, hidden 16, 2 heads, vocabulary 11 (equiv.peers.trl.tiny_policy)",
        "data": data,
        "optimizer": "SGD lr=0.1, constant, max_grad_norm=0 (the audit sees the gradient's scale)",
    }


_PAIRS = f"{len(PROMPTS)} preference pairs, micro-batches of 2: windows of 2+2 and 2+1 pairs"


def _dpo(loss_type: str) -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    extra: dict[str, Any] = {"loss_type": [loss_type], "precompute_ref_log_probs": True}
    if loss_type == "exo_pair":
        extra["label_smoothing"] = 1e-3  # EXO needs ε > 0 (DPOConfig refuses 0)
    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir, **extra)
        with _stage("building the config"):
            config = DPOConfig(**args)
        loss: Loss = (
            DPOChosenNLL()
            if loss_type == "sft"
            else DPOPairs(loss_type, beta=config.beta, label_smoothing=config.label_smoothing)
        )
        data = Dataset.from_dict({"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED})
        audit = _audited_training(
            _tiny_trainer(DPOTrainer, config, data),
            loss,
            _completion_log_probs if loss_type == "sft" else _sequence_log_probs,
            _dpo_targets,
        )
    return audit, _setup("DPOTrainer", args, _PAIRS)


def _tiny_trainer(trainer_class: Any, config: Any, data: Any) -> Callable[[list[Any]], Any]:
    """A TRL trainer of the tiny policy and tokenizer on ``data``, built with the callbacks it is given."""
    return lambda callbacks: trainer_class(
        model=peers_trl.tiny_policy(),
        args=config,
        train_dataset=data,
        processing_class=peers_trl.tiny_tokenizer(),
        callbacks=callbacks,
    )


def _kto() -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir, loss_type="apo_zero_unpaired", precompute_ref_log_probs=True)
        with _stage("building the config"):
            config = KTOConfig(**args)
        labels = [True, False, True, True, False, False, True]
        data = Dataset.from_dict({"prompt": PROMPTS, "completion": CHOSEN, "label": labels})
        loss = KTOExamples(
            beta=config.beta, desirable_weight=config.desirable_weight, undesirable_weight=config.undesirable_weight
        )
        audit = _audited_training(
            _tiny_trainer(KTOTrainer, config, data),
            loss,
            _sequence_log_probs,
            lambda call: torch.stack([_batch(call)["ref_logps"], _batch(call)["label"]], dim=1).to(torch.float64),
        )
    return audit, _setup("KTOTrainer", args, "7 examples (4 desirable), micro-batches of 2: windows of 2+2 and 2+1")


def _reward_model() -> nn.Module:
    from transformers import LlamaForSequenceClassification

    config: Any = peers_trl.tiny_policy().config
    config.num_labels = 1
    torch.manual_seed(0)
    model: nn.Module = LlamaForSequenceClassification(config)
    return model


def _rewards(model: nn.Module, call: Call) -> Tensor:
    batch = _batch(call)
    output = type(model).forward(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    rewards: Tensor = output.logits.reshape(-1)
    return rewards


def _reward() -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir)
        with _stage("building the config"):
            config = RewardConfig(**args)
        chosen = [prompt + " " + completion for prompt, completion in zip(PROMPTS, CHOSEN, strict=True)]
        rejected = [prompt + " " + completion for prompt, completion in zip(PROMPTS, REJECTED, strict=True)]
        data = Dataset.from_dict({"chosen": chosen, "rejected": rejected})
        audit = _audited_training(
            lambda callbacks: RewardTrainer(
                model=_reward_model(),
                args=config,
                train_dataset=data,
                processing_class=peers_trl.tiny_tokenizer(),
                callbacks=callbacks,
            ),
            RewardPairs(),
            _rewards,
            lambda call: torch.zeros(_batch(call)["input_ids"].shape[0] // 2, 1, dtype=torch.float64),
        )
    setup = _setup("RewardTrainer", args, _PAIRS)
    setup["model"] = "LlamaForSequenceClassification (num_labels=1) of equiv.peers.trl.tiny_policy's config"
    return audit, setup


def _student_logits(model: nn.Module, call: Call) -> Tensor:
    """GKD: the student's logits at the positions predicting each token (``B × (T-1) × V``)."""
    batch = _batch(call)
    output = type(model).forward(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits: Tensor = output.logits[:, :-1]
    return logits


def _with_teacher(trainer: Any, inputs: dict[str, Any]) -> dict[str, Tensor]:
    """GKD's micro-batch as trained (after any on-policy generation), with the teacher's log-probabilities."""
    kept = {key: inputs[key] for key in ("input_ids", "attention_mask", "labels")}
    teacher = trainer.teacher_model
    with torch.no_grad():
        logits = type(teacher).forward(teacher, input_ids=kept["input_ids"], attention_mask=kept["attention_mask"])
        kept["teacher_log_probs"] = F.log_softmax(logits.logits[:, :-1].float(), dim=-1)
    return kept


def _gkd_targets(call: Call) -> Tensor:
    batch = _batch(call)
    trained = (batch["labels"][:, 1:] != -100).to(torch.float64).unsqueeze(-1)
    return torch.cat([batch["teacher_log_probs"].to(torch.float64), trained], dim=-1)


CONVERSATIONS = list(zip(PROMPTS, CHOSEN, strict=True))


def _gkd(lmbda: float) -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir, lmbda=lmbda, max_new_tokens=4)
        with _stage("building the config"):
            config = GKDConfig(**args)
        tokenizer = peers_trl.tiny_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        messages = [
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            for prompt, answer in CONVERSATIONS
        ]
        audit = _audited_training(
            lambda callbacks: GKDTrainer(
                model=peers_trl.tiny_policy(),
                teacher_model=peers_trl.tiny_policy(seed=1),
                args=config,
                train_dataset=Dataset.from_dict({"messages": messages}),
                processing_class=tokenizer,
                callbacks=callbacks,
            ),
            GeneralizedJSD(beta=config.beta),
            _student_logits,
            _gkd_targets,
            _with_teacher,
        )
    setup = _setup("trl.experimental.gkd.GKDTrainer", args, "7 conversations (prompt, answer), micro-batches of 2")
    setup["teacher"] = "equiv.peers.trl.tiny_policy(seed=1)"
    return audit, setup


def _distillation_logits(model: nn.Module, call: Call) -> Tensor:
    """DistillationTrainer: the student's logits at the positions predicting each completion token."""
    batch = _batch(call)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    width = batch["completion_ids"].shape[1]
    out: Tensor = logits[:, -width - 1 : -1]
    return out


def _with_distillation_teacher(trainer: Any, inputs: dict[str, Any]) -> dict[str, Tensor]:
    if "tool_mask" in inputs:
        raise ValueError("the audit's distillation objective does not reproduce tool masks")
    kept = {key: inputs[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    with torch.no_grad():
        logits = _distillation_logits(trainer.teacher_model, ((kept,), {}))
        kept["teacher_log_probs"] = F.log_softmax(logits.float() / trainer.temperature, dim=-1)
    return kept


def _distillation_targets(call: Call) -> Tensor:
    batch = _batch(call)
    trained = batch["completion_mask"].to(torch.float64).unsqueeze(-1)
    return torch.cat([batch["teacher_log_probs"].to(torch.float64), trained], dim=-1)


def _distillation() -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir, max_completion_length=6)
        with _stage("building the config"):
            config = DistillationConfig(**args)
        audit = _audited_training(
            lambda callbacks: DistillationTrainer(
                model=peers_trl.tiny_policy(),
                teacher_model=peers_trl.tiny_policy(seed=1),
                args=config,
                train_dataset=Dataset.from_dict({"prompt": peers_trl.PROMPTS[:8]}),
                processing_class=peers_trl.tiny_tokenizer(),
                callbacks=callbacks,
            ),
            GeneralizedJSD(beta=config.beta, temperature=config.temperature),
            _distillation_logits,
            _distillation_targets,
            _with_distillation_teacher,
        )
    setup = _setup("DistillationTrainer", args, "8 prompts, completions generated (up to 6 tokens, unequal lengths)")
    setup["teacher"] = "equiv.peers.trl.tiny_policy(seed=1)"
    return audit, setup


def _async_grpo() -> tuple[Audit, dict[str, Any]]:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    with tempfile.TemporaryDirectory() as output_dir:
        args = _common_args(output_dir)
        with _stage("building the config"):
            config = AsyncGRPOConfig(**args)
        with _stage("building the model"):  # AsyncGRPOTrainer takes a model path only: the tiny model saved
            policy: Any = peers_trl.tiny_policy()
            policy.save_pretrained(output_dir + "/model")
            peers_trl.tiny_tokenizer().save_pretrained(output_dir + "/model")
        audit = _audited_training(
            lambda callbacks: AsyncGRPOTrainer(
                model=output_dir + "/model",
                reward_funcs=[peers_trl.reward_a],
                args=config,
                train_dataset=Dataset.from_dict({"prompt": peers_trl.PROMPTS}),
                callbacks=callbacks,
            ),
            peers_trl.GRPOObjective("dapo", epsilon_low=0.2, epsilon_high=0.2, max_completion_length=8),
            lambda model, call: peers_trl.completion_log_probs(model, _batch(call), 1.0),
            lambda call: peers_trl.pack(_batch(call)),
        )
    return audit, _setup("trl.experimental.async_grpo.AsyncGRPOTrainer", args, "the GRPO prompts")


def _grpo(loss_type: str, setting: peers_trl.Setting) -> tuple[Audit, dict[str, Any]]:
    with _stage("training"):
        audit = peers_trl.grpo_run(loss_type, setting, hypotheses=())["documented"]
    config = {
        "loss_type": loss_type,
        "per_device_train_batch_size": setting.per_device_train_batch_size,
        "gradient_accumulation_steps": setting.gradient_accumulation_steps,
        "steps_per_generation": setting.steps_per_generation,
        "num_generations": setting.num_generations,
        "max_completion_length": 8,
        "max_steps": setting.max_steps,
        "beta": 0.0,
    }
    return audit, {
        "trainer": "GRPOTrainer",
        "config": config,
        "model": "LlamaForCausalLM, 1 layer (equiv.peers.trl.tiny_policy)",
        "data": "12 prompts, completions generated (unequal lengths), reward equiv.peers.trl.reward_a",
        "optimizer": "SGD lr=0.1, constant, max_grad_norm=0",
        "objective": GRPO_LOSS_TYPES[loss_type][1],
    }


def _sft(loss_type: str) -> tuple[Audit, dict[str, Any]]:
    with _stage("training"):
        audit = peers_trl.sft_run(loss_type)
    return audit, {
        "trainer": "SFTTrainer",
        "config": {"loss_type": loss_type, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        "model": "LlamaForCausalLM, 1 layer (equiv.peers.trl.tiny_policy)",
        "data": "12 texts of unequal lengths (equiv.peers.trl.SFT_TEXTS), padded",
        "optimizer": "SGD lr=0.1, constant, max_grad_norm=0",
    }


#: DPO loss types that are not a sum over the window's pairs, and why
DPO_NOT_ITEM_WEIGHTED = {
    loss_type: f"DPO loss_type={loss_type!r} sorts the micro-batch's log-ratios against each other (AOT, arXiv "
    "2406.05882): a pair's loss depends on the other pairs of its micro-batch, so it is no item-weighted sum of the "
    "window's pairs and has no full-batch form equiv can declare"
    for loss_type in ("aot", "aot_unpaired")
}
KTO_NOT_ITEM_WEIGHTED = (
    "KTO loss_type='kto' subtracts a KL reference point z0 estimated over each micro-batch's mismatched pairs "
    "(detached, KTOTrainer._compute_loss): the window's full batch would estimate it over the window, which no "
    "re-weighting of per-item losses gives, so it has no item-weighted full-batch form equiv can declare"
)
BNPO_LOCAL = (
    "GRPO loss_type='bnpo' normalises by the local batch's tokens by design (GRPOConfig docs: results vary with the "
    "local batch size): not a full-batch objective, nothing to judge it against"
)
#: the known-buggy GRPO setting (trl #6024): a generation batch spanning two windows
GRPO_SPG = peers_trl.SPG_ABOVE_GA


def _all_subjects() -> list[Subject]:
    listed = [Subject(f"DPOTrainer[{lt}]", "DPO", functools.partial(_dpo, lt)) for lt in (*DPO_PAIR_LOSSES, "sft")]
    listed += [Subject(f"DPOTrainer[{lt}]", "DPO", reason=reason) for lt, reason in DPO_NOT_ITEM_WEIGHTED.items()]
    listed += [
        Subject("KTOTrainer[apo_zero_unpaired]", "KTO", _kto),
        Subject("KTOTrainer[kto]", "KTO", reason=KTO_NOT_ITEM_WEIGHTED),
        Subject("RewardTrainer", "Reward", _reward),
        Subject("SFTTrainer[nll]", "SFT", lambda: _sft("nll")),
        Subject("SFTTrainer[dft]", "SFT", lambda: _sft("dft")),
        Subject("GKDTrainer[lmbda=0]", "GKD / distillation", lambda: _gkd(0.0)),
        Subject("GKDTrainer[lmbda=0.5]", "GKD / distillation", lambda: _gkd(0.5)),
        Subject("DistillationTrainer", "GKD / distillation", _distillation),
        Subject("AsyncGRPOTrainer", "async GRPO", _async_grpo),
        Subject("GRPOTrainer[bnpo]", "GRPO", reason=BNPO_LOCAL),
        Subject(
            "GRPOTrainer[dapo/steps_per_generation=4]",
            "GRPO",
            lambda: _grpo("dapo", GRPO_SPG),
            setup={"upstream": "trl #6024"},
        ),
    ]
    listed += [
        Subject(f"GRPOTrainer[{lt}]", "GRPO", functools.partial(_grpo, lt, peers_trl.DEFAULT))
        for lt in GRPO_LOSS_TYPES
        if lt != "bnpo"
    ]
    listed += [Subject(f"GRPOTrainer[{lt}]", "GRPO", reason=why) for lt, why in peers_trl.NOT_MEASURED.items()]
    return sorted(listed, key=lambda subject: (subject.family, subject.name))


SUBJECTS: dict[str, Subject] = {subject.name: subject for subject in _all_subjects()}


def subjects(options: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Every subject (name, family) in a fixed order: by family, then name."""
    return [(subject.name, subject.family) for subject in SUBJECTS.values()]


def run_subject(subject: str, options: dict[str, Any] | None = None) -> SweepRow:
    """One subject trained and audited: its row (the audit's ``to_dict()``, or why it could not run; a
    subject's own failure never raises).  A name not in :data:`SUBJECTS` is a ``ValueError``."""
    if subject not in SUBJECTS:
        raise ValueError(f"unknown TRL sweep subject {subject!r}; expected one of: {', '.join(SUBJECTS)}")
    entry = SUBJECTS[subject]
    if entry.run is None:
        return SweepRow(subject, entry.family, reason=entry.reason, setup=dict(entry.setup))
    try:
        audit, setup = entry.run()
    except SubjectFailed as failed:
        return SweepRow(subject, entry.family, reason=str(failed), setup=dict(entry.setup))
    except ImportError as error:  # a trainer this TRL does not have
        return SweepRow(subject, entry.family, reason=f"importing the trainer: {type(error).__name__}: {error}")
    return SweepRow(subject, entry.family, audit=audit.to_dict(), setup={**entry.setup, **setup})


def preamble() -> str:
    """How the report's verdicts were made, and the releases (the report's own first lines)."""
    releases = ", ".join(f"{package} {version}" for package, version in peers_trl.versions().items())
    return (
        f"Measured with {releases}, on the CPU, one thread (`tox -e sweep-trl`; regenerate with `equiv sweep trl "
        "--out reports/sweep-trl.md`). Every trainer trains a one-layer Llama built from a config (a character "
        "tokenizer built locally, nothing downloaded) with `gradient_accumulation_steps=2` over uneven item counts, "
        "SGD without clipping, and is audited by `equiv.auditing.transformers_callback`: each micro-batch "
        "`compute_loss` receives is recorded, and each optimizer step is replayed in float64 from its start weights "
        "as the full-batch step of the objective the trainer documents (DPO, Reward: per pair; KTO: per example; "
        "SFT, GKD, distillation: per token; GRPO: per its `loss_type`), then the trainer's float32 update is judged "
        "against it with allowances derived from floating-point error. A NOT is that float64 computation's finding; "
        "its witness gives the weight each micro-batch's loss sum got beside the full batch's. A trainer whose loss "
        "is no item-weighted sum of its items gets the reason instead of a verdict."
    )
