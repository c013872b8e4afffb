"""TRL's trainers under gradient accumulation, driven as their users drive them
and judged by equiv's audit (:mod:`equiv.auditing`).

What a user writes, here on a one-layer Llama built from a config (float32:
TRL 1.16's fused LM head, ``trl/kernels/chunked_logprob.py``, takes log-probs in
float32 whatever the model's dtype, so a float64 run would differ from its
float64 replay by float32 rounding on every step; the audit judges the float32
update in the noise tier, with float32 floors) with a character tokenizer built
locally, on CPU, with a reward function of our own (nothing downloaded)::

    args = GRPOConfig(loss_type=..., gradient_accumulation_steps=N, steps_per_generation=S, ...)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=prompts,
                          processing_class=tokenizer)
    trainer.train()

Every optimizer step is audited: the trainer's micro-batches (completion ids,
masks, advantages, old log-probs: what ``compute_loss`` receives) are recorded
as they pass, and the audit replays the window in float64 from the window-start
weights with :class:`GRPOObjective`, the full-batch objective the loss type
documents, computed from the recorded tensors independently of the trainer's
normalisation, then judges the update the trainer applied with the derived
allowances of ``equiv.check``.  The documented normalisers, read from TRL's
``GRPOConfig`` docstring and ``GRPOTrainer._compute_loss`` (1.9.0 to 1.16.0):

* ``grpo``, ``sapo``: mean over a sequence's tokens, then over the sequences;
* ``luspo``: a sequence-level ratio, the sequence's loss times its length, mean over the sequences;
* ``dr_grpo``: sum over tokens / (sequences × ``max_completion_length``);
* ``dapo`` (the default), ``cispo``: sum over tokens / the active tokens of the
  *global accumulated batch* (the optimizer step's window);
* ``bnpo``: the active tokens of the *local* batch, by design ("results may
  slightly vary depending on the local batch size"): not a full-batch objective,
  reported as such, with its distance from the window's token mean;
* ``vespo`` (sequence-level Gamma weights) is not reproduced here: not measured.

A step that is not equivalent is explained by the same judge: the run is also
audited against each hypothesis of :data:`HYPOTHESES` (a per-micro-batch
normaliser the trainer might use instead), and the kind named is the one under
which every window is equivalent.  The optimizer is SGD without clipping, so an
update is the gradient scaled by the learning rate and a mis-scaled normaliser
shows as the update's size (AdamW's first step and clipping would hide it).

Needs ``trl`` (extra ``trl``); it is imported only when a run is made.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import math
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from equiv.auditing.replay import Call, WindowAudit
from equiv.auditing.trainers import torch_optimizer
from equiv.auditing.watch import Audit, audit
from equiv.losses import NextTokenCrossEntropy
from equiv.losses.policy import GRPO_LOSS_TYPES, GRPOObjective

__all__ = [
    "DEFAULT",
    "GRPO_LOSS_TYPES",
    "HYPOTHESES",
    "LITE_PPO_EQUAL",
    "SETTINGS",
    "SPG_ABOVE_GA",
    "SPG_ABOVE_GA_EQUAL",
    "SPG_BELOW_GA",
    "SPG_BELOW_GA_EQUAL",
    "SPG_WITHOUT_GA",
    "GRPOObjective",
    "Setting",
    "grpo_row",
    "grpo_run",
    "results",
    "sft_row",
    "sft_run",
    "tiny_policy",
    "tiny_tokenizer",
    "write_results",
]

#: The characters of the tokenizer's vocabulary, after <pad> (0) and <eos> (1).
CHARACTERS = "abcdefgh "
PROMPTS = ["ab", "cd", "efg", "h a", "bb", "gc", "da", "fe", "ha", "ge", "cab", "db"]


def tiny_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel model), built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def tiny_policy(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A one-layer Llama over the tokenizer's vocabulary, built from a config (float32: see the module's docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(CHARACTERS) + 2,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model = model.to(dtype)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def reward_a(completions: list[str], **kwargs: Any) -> list[float]:
    """Our reward: the completion's count of 'a', plus a tenth of its length (advantages of both signs)."""
    return [float(completion.count("a")) + 0.1 * len(completion) for completion in completions]


@dataclass(frozen=True, slots=True)
class Setting:
    """The accumulation a run uses."""

    name: str
    gradient_accumulation_steps: int
    #: None: TRL's default (steps_per_generation = gradient_accumulation_steps)
    steps_per_generation: int | None
    max_steps: int
    per_device_train_batch_size: int = 4
    num_generations: int = 4
    #: every completion max_completion_length long (generation_kwargs min_new_tokens): every
    #: micro-batch, window and generation batch then holds the same number of tokens
    equal_lengths: bool = False

    @property
    def generation_steps(self) -> int:
        return self.steps_per_generation or self.gradient_accumulation_steps


DEFAULT = Setting("GA=2, steps_per_generation=GA (the default)", 2, None, 3)
#: trl #6024's first example (the sampler diagram in grpo_trainer.py): a generation batch spans two windows
SPG_ABOVE_GA = Setting("GA=2, steps_per_generation=4", 2, 4, 4)
#: trl #6024's second kind: a window spans two generation batches
SPG_BELOW_GA = Setting("GA=4, steps_per_generation=2", 4, 2, 2)
#: the control: the generation batch spans two steps without accumulation (a normaliser error here is not accumulation's)
SPG_WITHOUT_GA = Setting("GA=1, steps_per_generation=2 (no accumulation)", 1, 2, 2, per_device_train_batch_size=8)
#: trl #6024's two settings where every window holds the same number of tokens: its rescaling is then exact
SPG_ABOVE_GA_EQUAL = Setting("GA=2, steps_per_generation=4, completions all max length", 2, 4, 4, equal_lengths=True)
SPG_BELOW_GA_EQUAL = Setting("GA=4, steps_per_generation=2, completions all max length", 4, 2, 2, equal_lengths=True)
#: trl #6024's second example (the Lite PPO reproduction's steps_per_generation=8, GA=32), one optimizer step
LITE_PPO_EQUAL = Setting("GA=32, steps_per_generation=8, completions all max length", 32, 8, 1, equal_lengths=True)
SETTINGS = (DEFAULT, SPG_ABOVE_GA, SPG_BELOW_GA, SPG_WITHOUT_GA, SPG_ABOVE_GA_EQUAL, SPG_BELOW_GA_EQUAL, LITE_PPO_EQUAL)

#: Loss types TRL offers that this module does not reproduce, and why.
NOT_MEASURED = {
    "vespo": "its sequence-level Gamma weights (GRPOTrainer.get_gamma_weights) are not reproduced by equiv's objective"
}

#: hypothesis -> (the kind, the per-micro-batch normaliser n_i as a function of (micro-batch, GA, steps_per_generation));
#: the trainer's window loss is then Σ_i sum_i / n_i.
Normaliser = Callable[[dict[str, Tensor], int, int], float]
HYPOTHESES: dict[str, tuple[str, Normaliser]] = {
    "generation batch tokens": (
        "normaliser is the generation batch's token count (num_items_in_batch spans steps_per_generation "
        "micro-batches, not the window's gradient_accumulation_steps): update scaled by window tokens / "
        "generation-batch tokens",
        lambda batch, ga, spg: float(batch["num_items_in_batch"]),
    ),
    "generation batch tokens x GA/spg": (
        "normaliser is the generation batch's token count × GA / steps_per_generation (trl #6024's rescaling: the "
        "token count expected in a window, the window's own only when the generation batch's windows hold equal "
        "numbers of tokens)",
        lambda batch, ga, spg: float(batch["num_items_in_batch"]) * ga / spg,
    ),
    "local tokens": (
        "each micro-batch normalised by its own active tokens, then divided by gradient_accumulation_steps "
        "(a mean of micro-batch token means)",
        lambda batch, ga, spg: float(batch["completion_mask"].sum().clamp(min=1)) * ga,
    ),
}

_TOKEN_NORMALISED = ("dapo", "cispo", "bnpo")


#: the tensors of GRPOTrainer's micro-batch the objective needs
_KEPT = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "num_items_in_batch",
)


def _micro_batch(inputs: dict[str, Any]) -> dict[str, Tensor]:
    if "tool_mask" in inputs:
        raise ValueError("the audit's GRPO objective does not reproduce tool masks")
    return {key: inputs[key] for key in _KEPT if isinstance(inputs.get(key), Tensor)}


def pack(batch: dict[str, Tensor], normaliser: float = math.nan, accumulation: int = 1) -> Tensor:
    """The objective's targets: (4, B, T) of the completion mask, the advantages
    (broadcast along the tokens), the old log-probs (NaN: none) and, at [3, 0, 0]
    and [3, 1, 0], a per-micro-batch normaliser and the accumulation steps."""
    mask = batch["completion_mask"].to(torch.float64)
    advantages = batch["advantages"].to(torch.float64)
    advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand_as(mask)
    old = batch.get("old_per_token_logps")
    old = torch.full_like(mask, math.nan) if old is None else old.to(torch.float64)
    extra = torch.zeros_like(mask)
    extra[0, 0], extra[1, 0] = normaliser, float(accumulation)
    return torch.stack([mask, advantages, old, extra])


def completion_log_probs(model: nn.Module, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """The completion tokens' log-probabilities under ``model`` (temperature applied, as TRL does), from the
    model class's own ``forward`` (TRL replaces the instance's with a fused LM head that a copy cannot replay)."""
    completion_ids = batch["completion_ids"]
    input_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    output = type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    width = completion_ids.shape[1]
    logits = output.logits[:, -width - 1 : -1] / temperature
    return F.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


class _Recorder:
    """A transformers ``TrainerCallback`` body starting one audit per objective when training begins."""

    def __init__(
        self, objectives: dict[str, tuple[Any, Callable[[Call], Tensor]]], call_model: Callable[[nn.Module, Call], Any]
    ) -> None:
        self.objectives, self.call_model = objectives, call_model
        self.audits: dict[str, Audit] = {}

    def start(self, model: nn.Module, optimizer: Any) -> None:
        for name, (objective, targets) in self.objectives.items():
            self.audits[name] = audit(
                model,
                torch_optimizer(optimizer),
                loss=objective,
                targets=targets,
                output=lambda out: out,
                call_model=self.call_model,
                record_forward=False,
            ).__enter__()

    def record(self, batch: dict[str, Tensor]) -> None:
        for watching in self.audits.values():
            watching.record(batch)

    def stop(self) -> None:
        for watching in self.audits.values():
            watching.__exit__(None, None, None)


def _callback(recorder: _Recorder) -> Any:
    from transformers import TrainerCallback

    class _TrlAudit(TrainerCallback):  # type: ignore[misc,unused-ignore]
        def on_train_begin(
            self,
            args: Any,
            state: Any,
            control: Any,
            model: nn.Module | None = None,
            optimizer: Any = None,
            **kwargs: Any,
        ) -> None:
            if model is None or optimizer is None:
                raise RuntimeError("the trainer began training without handing its model and optimizer to callbacks")
            recorder.start(model, optimizer)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            recorder.stop()

    return _TrlAudit()


def _quiet() -> contextlib.ExitStack:
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def grpo_run(
    loss_type: str, setting: Setting, *, seed: int = 0, hypotheses: Sequence[str] | None = None
) -> dict[str, Audit]:
    """``GRPOTrainer`` trained for ``setting.max_steps`` optimizer steps with
    ``loss_type``, every step audited against the documented objective
    (``"documented"``) and against each hypothesis (default: every one that
    applies to a token-normalised loss type)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    if hypotheses is None:
        hypotheses = tuple(HYPOTHESES) if loss_type in _TOKEN_NORMALISED else ()
    with tempfile.TemporaryDirectory() as output_dir, _quiet():
        args = _grpo_config(loss_type, setting, output_dir, seed)
        objectives = _objectives(loss_type, setting, args, hypotheses)
        recorder = _Recorder(objectives, lambda model, call: completion_log_probs(model, call[0][0], 1.0))
        # enough prompts for every window in one epoch (the Trainer ends a window at an epoch's end)
        needed = setting.gradient_accumulation_steps * setting.per_device_train_batch_size * setting.max_steps
        dataset = Dataset.from_dict({"prompt": PROMPTS * -(-needed // (setting.num_generations * len(PROMPTS)))})
        reward: Any = reward_a
        trainer: Any = GRPOTrainer(
            model=tiny_policy(seed),
            reward_funcs=[reward],
            args=args,
            train_dataset=dataset,
            processing_class=tiny_tokenizer(),
            callbacks=[_callback(recorder)],
        )
        _audited(trainer, recorder, _micro_batch)
        trainer.train()
    return recorder.audits


#: The Trainer arguments every run here shares: SGD at a constant rate, no clipping, float32
#: on the CPU, nothing saved, logged or reported.
_TRAINER_ARGS: dict[str, Any] = {
    "learning_rate": 0.1,
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "max_grad_norm": 0.0,
    "use_cpu": True,
    "bf16": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_strategy": "no",
    "disable_tqdm": True,
}


def _grpo_config(loss_type: str, setting: Setting, output_dir: str, seed: int) -> Any:
    """``GRPOConfig`` of a run: ``setting``'s accumulation, SGD at a constant rate, no clipping,
    no KL term, one iteration per generation, float32 on the CPU, nothing saved or logged."""
    from trl import GRPOConfig

    extra: dict[str, Any] = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    if setting.equal_lengths:
        extra["generation_kwargs"] = {"min_new_tokens": 8}
    if loss_type == "cispo":
        extra["epsilon_high"] = 5.0  # the MiniMax-M1 / ScaleRL setting TRL's docs cite
    return GRPOConfig(
        output_dir=output_dir,
        loss_type=loss_type,
        beta=0.0,
        num_iterations=1,
        per_device_train_batch_size=setting.per_device_train_batch_size,
        num_generations=setting.num_generations,
        gradient_accumulation_steps=setting.gradient_accumulation_steps,
        steps_per_generation=setting.steps_per_generation,
        max_completion_length=8,
        max_steps=setting.max_steps,
        temperature=1.0,
        seed=seed,
        **_TRAINER_ARGS,
        **extra,
    )


def _objectives(
    loss_type: str, setting: Setting, args: Any, hypotheses: Sequence[str]
) -> dict[str, tuple[Any, Callable[[Call], Tensor]]]:
    """What each audit replays the window against, with its targets: the documented objective
    (``"documented"``) and each hypothesis's per-micro-batch normaliser."""
    ga, spg = setting.gradient_accumulation_steps, setting.generation_steps
    eps_low, eps_high = args.epsilon, args.epsilon_high if args.epsilon_high is not None else args.epsilon
    settings: dict[str, Any] = {
        "epsilon_low": eps_low,
        "epsilon_high": eps_high,
        "max_completion_length": 8,
        "sapo_temperature_pos": args.sapo_temperature_pos,
        "sapo_temperature_neg": args.sapo_temperature_neg,
    }

    def documented_targets(call: Call) -> Tensor:
        return pack(call[0][0])

    def hypothesis_targets(name: str) -> Callable[[Call], Tensor]:
        normaliser = HYPOTHESES[name][1]
        return lambda call: pack(call[0][0], normaliser(call[0][0], ga, spg), ga)

    objectives: dict[str, tuple[Any, Callable[[Call], Tensor]]] = {
        "documented": (GRPOObjective(loss_type, **settings), documented_targets)
    }
    for name in hypotheses:
        objectives[name] = (GRPOObjective(loss_type, per_micro_batch=True, **settings), hypothesis_targets(name))
    return objectives


def _sft_call(model: nn.Module, call: Call) -> Any:
    """A recorded SFT micro-batch replayed through the model class's own forward (logits, no fused head)."""
    batch = call[0][0]
    kwargs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}
    return type(model).forward(model, **kwargs, use_cache=False).logits


def _sft_targets(call: Call) -> Tensor:
    labels: Tensor = call[0][0]["labels"]
    return labels


def _audited(trainer: Any, recorder: _Recorder, keep: Callable[[dict[str, Any]], dict[str, Tensor]]) -> None:
    """Record each micro-batch ``trainer.compute_loss`` receives in training (what the step
    back-propagates), then let the trainer compute its loss as it does."""
    compute_loss = trainer.compute_loss

    def recording(model: nn.Module, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
        if model.training and torch.is_grad_enabled():
            recorder.record(keep(inputs))
        return compute_loss(model, inputs, *rest, **kwargs)

    trainer.compute_loss = recording


class DFTObjective(NextTokenCrossEntropy):
    """SFTTrainer's ``loss_type="dft"`` (Dynamic Fine-Tuning): each token's NLL weighted by its
    probability, detached; items are the real next-token targets."""

    def sum(self, output: Tensor, target: Tensor) -> Tensor:
        logits, labels = output[:, :-1], target[:, 1:]
        real = labels != self.ignore_index
        logps = F.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (-(logps * logps.exp().detach()) * real).sum()


SFT_TEXTS = ["ab", "abcdefgh", "ca", "hgfedcba ab", "d", "fe ga", "bbbbbbb", "ac", "gh", "a b c d e", "e", "hh"]


def sft_run(loss_type: str = "nll", *, gradient_accumulation_steps: int = 2, seed: int = 0) -> Audit:
    """``SFTTrainer`` on texts of unequal lengths (micro-batches of 2, padded), audited
    against the window's token mean of the NLL (``"nll"``) or of DFT's weighted NLL (``"dft"``)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    objective = NextTokenCrossEntropy() if loss_type == "nll" else DFTObjective()
    recorder = _Recorder({"documented": (objective, _sft_targets)}, _sft_call)
    with tempfile.TemporaryDirectory() as output_dir, _quiet():
        args = SFTConfig(
            output_dir=output_dir,
            loss_type=loss_type,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_steps=3,
            seed=seed,
            **_TRAINER_ARGS,
            packing=False,
            dataset_text_field="text",
        )
        trainer: Any = SFTTrainer(
            model=tiny_policy(seed),
            args=args,
            train_dataset=Dataset.from_dict({"text": SFT_TEXTS}),
            processing_class=tiny_tokenizer(),
            callbacks=[_callback(recorder)],
        )
        _audited(
            trainer, recorder, lambda inputs: {key: value for key, value in inputs.items() if isinstance(value, Tensor)}
        )
        trainer.train()
    return recorder.audits["documented"]


# -- rows: verdict, kind, magnitude --------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {}
    for package in ("trl", "transformers", "accelerate", "torch"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def _scales(windows: Sequence[WindowAudit]) -> dict[str, list[float]]:
    """Per step past its allowance, its first update row's size along the full batch's and cosine."""
    rows = [
        next((row for row in window.mismatches if row.quantity == "update"), window.mismatches[0])
        for window in windows
        if window.mismatches
    ]
    return {"update_ratios": [row.update_ratio for row in rows], "cosines": [row.cosine for row in rows]}


def _magnitude(windows: Sequence[WindowAudit]) -> str:
    """The update's size along the full batch's and its cosine, over the windows past their allowance
    (the first update row of each, as the audit's line shows it); the worst allowance use otherwise."""
    rows = [
        next((row for row in window.mismatches if row.quantity == "update"), window.mismatches[0])
        for window in windows
        if window.mismatches
    ]
    if not rows:
        worst = max((window.worst.ratio for window in windows if window.worst is not None), default=0.0)
        return f"within the allowance (worst {worst:.2g} of it)"
    ratios = [row.update_ratio for row in rows]
    cosines = [row.cosine for row in rows]
    span = (
        f"{min(ratios):.4g}x"
        if len(set(f"{r:.4g}" for r in ratios)) == 1
        else f"{min(ratios):.4g}x to {max(ratios):.4g}x"
    )
    return f"update {span} the full-batch one, cosine >= {min(cosines):.6f} ({len(rows)} of {len(windows)} steps)"


def _verdict(windows: Sequence[WindowAudit]) -> str:
    if not windows:
        return "not measured (no optimizer step audited)"
    if any(window.inherent for window in windows):
        return "inherently not equivalent"
    return "NOT equivalent" if any(window.mismatches for window in windows) else "equivalent"


def _explained(audits: dict[str, Audit]) -> list[str]:
    """The hypotheses under which every audited step is equivalent (the judge's own verdict)."""
    return [name for name, watching in audits.items() if name != "documented" and bool(watching)]


def _upstream(loss_type: str, setting: Setting, explained: list[str], verdict: str) -> str:
    if loss_type == "bnpo" and setting.gradient_accumulation_steps > 1:
        return "by design (TRL's GRPOConfig docs: local-batch normalisation)"
    if setting.generation_steps == setting.gradient_accumulation_steps or loss_type not in ("dapo", "cispo"):
        return ""
    if verdict == "equivalent":
        return "trl #6024: its rescaling is exact here (every window holds the same number of tokens)"
    if "generation batch tokens" in explained:
        return "trl #6024 (and #5619): the rescaling released in trl 1.9.1"
    if "generation batch tokens x GA/spg" in explained:
        return (
            "trl #6024's rescaling (1.9.1 on) normalises by the expected window token count; "
            "not reported upstream that we found"
        )
    return ""


def grpo_row(loss_type: str, setting: Setting, *, seed: int = 0) -> dict[str, Any]:
    """One row: ``GRPOTrainer`` with ``loss_type`` under ``setting``, audited."""
    audits = grpo_run(loss_type, setting, seed=seed)
    windows = audits["documented"].windows
    verdict = _verdict(windows)
    explained = _explained(audits) if verdict != "equivalent" else []
    # bnpo's local batch is the window only without accumulation (GA = 1): then it is judged as it measures
    by_design = loss_type == "bnpo" and setting.gradient_accumulation_steps > 1
    if by_design:
        explained = _explained(audits)
        failure = (
            "not a full-batch objective by design; the local-batch normaliser confirmed by the judge"
            if "local tokens" in explained
            else "not a full-batch objective by design"
        )
        measured = verdict
        verdict = "by design not full-batch"
    elif verdict == "NOT equivalent":
        kinds = [HYPOTHESES[name][0] for name in explained]
        failure = "; ".join(kinds) if kinds else "unexplained by equiv's hypotheses"
        measured = verdict
    else:
        failure, measured = "", verdict
    return {
        "trainer": "GRPOTrainer",
        "loss_type": loss_type,
        "setting": setting.name,
        "objective": GRPO_LOSS_TYPES[loss_type][1],
        "verdict": verdict,
        "measured_against_window": measured,
        "kind": failure,
        "explained_by": explained,
        "magnitude": _magnitude(windows),
        **_scales(windows),
        "steps": [window.line() for window in windows],
        "upstream": _upstream(loss_type, setting, explained, verdict),
        "versions": versions(),
    }


def sft_row(loss_type: str = "nll") -> dict[str, Any]:
    windows = sft_run(loss_type).windows
    verdict = _verdict(windows)
    return {
        "trainer": "SFTTrainer",
        "loss_type": loss_type,
        "setting": "GA=2, micro-batches of 2 texts of unequal length",
        "objective": "sum over the window's next-token losses / its real next tokens"
        + (" (each weighted by its probability, detached)" if loss_type == "dft" else ""),
        "verdict": verdict,
        "measured_against_window": verdict,
        "kind": "" if verdict == "equivalent" else "unexplained",
        "explained_by": [],
        "magnitude": _magnitude(windows),
        **_scales(windows),
        "steps": [window.line() for window in windows],
        "upstream": "",
        "versions": versions(),
    }


def _settings_for(loss_type: str) -> tuple[Setting, ...]:
    """Every loss type under the default; the #6024 settings (and the GA = 1 control) for the
    token-normalised ones (their normaliser is the one num_items_in_batch feeds) and for grpo, as a control."""
    if loss_type == "bnpo":  # with equal lengths its local mean is the window's: nothing to tell apart
        return tuple(setting for setting in SETTINGS if not setting.equal_lengths)
    if loss_type in ("cispo", "grpo"):  # the one-step GA=32 run (~10 s) for dapo, the loss type #6024 measured
        return tuple(setting for setting in SETTINGS if setting is not LITE_PPO_EQUAL)
    return SETTINGS if loss_type == "dapo" else (DEFAULT,)


def results(loss_types: Sequence[str] | None = None, *, sft: bool = True) -> list[dict[str, Any]]:
    """Every row this installation of TRL gives (the loss types it has)."""
    rows: list[dict[str, Any]] = []
    for loss_type in loss_types or tuple(GRPO_LOSS_TYPES):
        rows.extend(grpo_row(loss_type, setting) for setting in _settings_for(loss_type))
    for loss_type, reason in NOT_MEASURED.items():
        rows.append(
            {
                "trainer": "GRPOTrainer",
                "loss_type": loss_type,
                "setting": "-",
                "verdict": "not measured",
                "kind": reason,
                "magnitude": "-",
                "upstream": "",
                "versions": versions(),
            }
        )
    if sft:
        rows.extend(sft_row(loss_type) for loss_type in ("nll", "dft"))
    return rows


def write_results(path: str | Path, *, include: Sequence[str | Path] = ()) -> list[dict[str, Any]]:
    """Measure the installed TRL into ``path`` (JSON rows), after the rows saved by other
    environments in ``include`` that exist (e.g. an older trl's, ``tox -e peers-trl190``)."""
    rows: list[dict[str, Any]] = []
    for saved in include:
        if Path(saved).exists():
            rows.extend(json.loads(Path(saved).read_text()))
    rows.extend(results())
    Path(path).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return rows
