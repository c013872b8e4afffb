"""Judge what an audit recorded of one window: its targets read and checked against the loss
before any replay, the window replayed as a run source of the one engine
(:class:`~equiv.auditing.replay.WindowReplay`, :func:`~equiv.auditing.replay.judge_window`), and the
verdict completed with what the hooks saw (the clip calls the audit was not told of, the LR schedule's
advances, the averaged model, a NaN or inf in the run).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from equiv.auditing.averaged import AveragedWeights
from equiv.auditing.ranks import Ranks
from equiv.auditing.recording import CLIPS, OutputSpec, WindowRecord, first_not_finite
from equiv.auditing.replay import Call, RecordedWindow, WindowReplay, judge_window, model_at
from equiv.auditing.schedules import schedule_verdict
from equiv.auditing.settings import AuditSettings, _where_targets_were_found, default_targets
from equiv.auditing.witnessing import window_witness
from equiv.judging.inherent import SEED_DEPENDENT
from equiv.results.audit import WindowAudit

__all__ = ["WindowJudge"]


@dataclass(kw_only=True, slots=True)
class WindowJudge:
    """How one audit judges its windows: what stays the same from window to window of the run (the
    settings, the model's window-start copy, the run's model and optimizer, its ranks, its average)."""

    settings: AuditSettings
    #: a copy of the audited model, made on entering (the replay's structure)
    template: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ranks: Ranks | None
    averaged: AveragedWeights | None
    #: the ``torch.nn.functional`` losses whose calls the hooks saw (named when pairing them fails)
    functional: frozenset[Callable[..., Tensor]]
    #: the accumulation steps an engine divides every micro-batch's loss by itself (DeepSpeed's; None: none)
    engine_steps: int | None = None
    #: the windows judged, by their micro-batch count (the run's usual window: the commonest)
    sizes: Counter[int] = field(default_factory=Counter)
    #: whether the forward's random numbers reach its output, asked once per audit (the first window that drew
    #: one): how far it moves with the seed where they do, None where they do not (a layer-drop draw of p=0)
    seed_moved: float | None = None
    probed: bool = False

    def window_verdict(
        self, window: WindowRecord, step: int, *, hyperparameters: tuple[dict[str, Any], ...], position: str | None
    ) -> WindowAudit:
        """The verdict on the step the run just took at the end of ``window`` (read before the run goes on)."""
        if not window.calls:
            raise RuntimeError(
                f"optimizer step {step} of the audit saw no training-mode forward call of the audited model since "
                "the step before: is the model the audit watches the one the loop calls (not a copy of it), and in train mode "
                "with gradients enabled? (calls through model(...), model.forward(...), torch.compile and Accelerate "
                "are all recorded)"
            )
        targets_of = self.targets_of(window, step)
        self.sizes[len(window.calls)] += 1
        usual = self.sizes.most_common(1)[0][0]
        recorded = window.recorded(step, hyperparameters)
        if self.ranks is not None:  # the step a meeting's failure names, from the window's first collective on
            self.ranks.step = step
        settings = self.settings
        replay = WindowReplay(
            template=self.template,
            model=self.model,
            optimizer=self.optimizer,
            loss=settings.loss,
            output_of=settings.output,
            targets_of=targets_of,
            call_model=settings.call_model,
            max_grad_norm=settings.max_grad_norm,
            max_grad_value=settings.max_grad_value,
            ranks=self.ranks,
        )
        verdict = judge_window(
            recorded, replay, usual_micro_batches=usual, random_forward=self._random_forward(recorded, replay)
        )
        verdict = dataclasses.replace(
            verdict, position=position, hint=clipping_hint(settings, window) if verdict.mismatches else verdict.hint
        )
        schedule, note = schedule_verdict(window.schedule)
        if schedule is not None or note is not None:
            verdict = dataclasses.replace(verdict, schedule=schedule, note=note)
        if window.averaged is not None and verdict.judged:
            verdict = self._judge_averaged(verdict, window.averaged, recorded)
        verdict = self._finite(verdict, window.not_finite)
        # Only now, on a window already failed by its gradient's step (the same decision on every rank: ranks_off
        # is gathered), the witness: a passing window, a schedule's or a NaN's failure pays nothing for it.
        if verdict.judged and verdict.not_finite is None and (verdict.mismatches or verdict.ranks_off):
            clips = tuple((name, after) for (name, _), after in zip(window.clips, window.clipped_after, strict=True))
            verdict = self._witnessed(verdict, recorded, replay, usual, clips, self.engine_steps)
        return verdict

    def _random_forward(self, recorded: RecordedWindow, replay: WindowReplay) -> float | None:
        """How far the window's forward moves with torch's random seed where its random numbers reach
        its output, else None.  Asked only of a window whose recorded forward drew one (read from the
        generators' states, at no cost), once per audit: a replay would draw other numbers than the run,
        and the floor samples' own draws would widen the allowance past a weighting bug.  Every rank
        decides together (an empty micro-batch draws nothing; an FSDP2 replica's forward all-gathers)."""
        # The window's first meeting of the ranks: a rank that never comes is named in the full-batch replay.
        meeting = "the full-batch replay"
        drew = recorded.drew_random if self.ranks is None else self.ranks.any_of(recorded.drew_random, meeting)
        if not drew:
            return None
        if not self.probed:
            moved = replay.seed_dependence(recorded)
            reaches = moved is not None and moved > SEED_DEPENDENT
            if self.ranks is not None:
                reaches = self.ranks.any_of(reaches, meeting)
            self.seed_moved = (moved if moved is not None else math.nan) if reaches else None
            self.probed = True
        return self.seed_moved

    @staticmethod
    def _witnessed(
        verdict: WindowAudit,
        recorded: RecordedWindow,
        replay: WindowReplay,
        usual: int | None,
        clips: tuple[tuple[str, int], ...],
        engine_steps: int | None,
    ) -> WindowAudit:
        """``verdict`` with its witness.  In one process a witness that cannot be made (an error in the user's
        loss replayed per micro-batch, say) is said in the window's note and never replaces the verdict; under
        DDP every rank must reach the witness's collectives together, so an error there stays an error."""
        if replay.ranks is not None:
            found = window_witness(recorded, replay, configured_n=usual, clips=clips, engine_steps=engine_steps)
            return dataclasses.replace(verdict, witness=found)
        try:
            found = window_witness(recorded, replay, configured_n=usual, clips=clips, engine_steps=engine_steps)
            return dataclasses.replace(verdict, witness=found)
        except Exception as error:  # the verdict stands; what the witness could not do is said, not hidden
            said = f"no witness of the weights ({type(error).__name__}: {error})"
            return dataclasses.replace(verdict, note=said if verdict.note is None else f"{verdict.note}; {said}")

    def _judge_averaged(self, verdict: WindowAudit, start: dict[str, Tensor], recorded: RecordedWindow) -> WindowAudit:
        """``verdict`` with the averaged model's rows: moved once, by its rule, towards the window-start weights."""
        assert self.averaged is not None
        template = self.template
        rows, moved = self.averaged.rows_and_move(start, lambda dtype: model_at(template, recorded, dtype))
        worst = max(
            [*rows, *([verdict.worst] if verdict.worst is not None else [])], key=lambda row: row.ratio, default=None
        )
        failing = tuple(row for row in rows if not row.ok)
        hint = "; ".join(part for part in (verdict.hint, moved) if part) or None
        return dataclasses.replace(verdict, mismatches=(*verdict.mismatches, *failing), worst=worst, hint=hint)

    def _finite(self, verdict: WindowAudit, gradient: str | None) -> WindowAudit:
        """``verdict`` with a NaN or inf named: the run's gradient (``gradient``, seen before the
        step), else its parameters or optimizer state after it; when the run's are finite and
        the engine's rows still hold a non-finite value, the full-batch step's own."""
        step = verdict.step
        named = gradient or first_not_finite(self.model.named_parameters(), "parameter after the step", step=step)
        if named is None:
            names = {id(param): name for name, param in self.model.named_parameters()}
            named = first_not_finite(
                (
                    (f"{names.get(id(param), '?')}'s {key}", value)
                    for param, values in self.optimizer.state.items()
                    for key, value in values.items()
                    if isinstance(value, Tensor)
                ),
                "optimizer state",
                step=step,
            )
        if named is not None:
            return dataclasses.replace(verdict, not_finite=named)
        rows = [*verdict.mismatches, *([verdict.worst] if verdict.worst is not None else [])]
        full_batch = next(
            (row for row in rows if row.nan_count or row.inf_count or not math.isfinite(row.allowed)), None
        )
        if full_batch is None:
            return verdict
        where = f", first at index {full_batch.first_not_finite}" if full_batch.first_not_finite else ""
        text = (
            f"{full_batch.label} of the full-batch step is not finite{where}, while the run's step "
            f"(step {step}) is: the window's own data makes the loss over its {sum(verdict.items)} items not finite "
            "(NaN or inf inputs or targets, or no item to count); not judged"
        )
        return dataclasses.replace(verdict, not_finite=text, full_batch_not_finite=True, mismatches=())

    def targets_of(self, window: WindowRecord, step: int) -> Callable[[Call], Tensor]:
        """How the window's calls map to their targets: what a criterion / wrapped loss received
        (one per call, in order), else ``targets``; checked against the loss before any replay."""
        calls, seen, functional = window.calls, window.seen_targets, window.functional_targets
        received = "the target the criterion (or wrapped loss) received"
        outputs = window.outputs
        # The loop's functional loss calls fill in where the forward calls carry no targets that fit
        # (model(x), a diffusion model's timestep): a forward's own labels= stay what they were.
        if (
            not seen
            and functional
            and self.settings.targets is default_targets
            and not _defaults_fit(self.settings.loss, calls, outputs)
        ):
            names = sorted(f"F.{function.__name__}" for function in self.functional)
            seen = _functional_pairing(functional, calls, step, names)
            received = f"the target the loop's {' / '.join(names)} received"
        if seen and len(seen) != len(calls):
            raise ValueError(
                f"optimizer step {step} of the audit: the criterion (or wrapped loss) was called {len(seen)} times for "
                f"{len(calls)} forward call{'s' if len(calls) != 1 else ''} of the model in the window; the audit pairs "
                "one loss call with each forward call. Pass targets=lambda call: ... instead, or record each "
                "micro-batch with Audit.record (record_forward=False)"
            )
        targets_of = self.settings.targets
        where = "targets=" if targets_of is not default_targets else ""
        if seen:
            by_call = {id(call): target for call, target in zip(calls, seen, strict=True)}

            def seen_target(call: Call) -> Tensor:
                return by_call[id(call)]

            targets_of, where = seen_target, received
        checked: set[Any] = set()
        for call, output in zip(calls, outputs, strict=False):
            target = _target_or_none(targets_of, call)
            if output is None or target is None or (output, target.shape, target.dtype) in checked:
                continue
            checked.add((output, target.shape, target.dtype))
            _check_fits(self.settings.loss, output, target, where or _where_targets_were_found(call))
        return targets_of


def clipping_hint(settings: AuditSettings, window: WindowRecord) -> str | None:
    """What a failing window's run clipped to when the audit was not told (``max_grad_norm``,
    ``max_grad_value``): the clip calls it saw in the window, and the setting that replays them."""
    hints = []
    for name, (_, setting, did) in CLIPS.items():
        limits = [limit for seen, limit in window.clips if seen == name]
        if not limits or getattr(settings, setting) is not None:
            continue
        values = sorted(set(limits))
        calls = f"{len(limits)} {name} call{'s' if len(limits) != 1 else ''} in the window"
        if len(values) == 1:
            hints.append(
                f"the run {did}{values[0]:g} ({calls}) and the audit was not told: audit with {setting}={values[0]:g}"
            )
        else:
            hints.append(f"the run {did}{', '.join(f'{v:g}' for v in values)} ({calls}); the audit was not told")
    return "; ".join(hints) or None


def _functional_pairing(functional: list[Tensor], calls: list[Call], step: int, names: list[str]) -> list[Tensor]:
    """The functional loss calls' targets, one per forward call, or one line saying what was seen."""
    if len(functional) == len(calls):
        return functional
    raise ValueError(
        f"optimizer step {step} of the audit: the loop called {' / '.join(names)} {len(functional)} time"
        f"{'s' if len(functional) != 1 else ''} with gradients for {len(calls)} forward call"
        f"{'s' if len(calls) != 1 else ''} of the model in the window; the audit pairs one loss call with each "
        "forward call: call the training loss through audit.wrap(loss_fn), or pass targets=lambda call: ..."
    )


def _defaults_fit(loss: Any, calls: list[Call], outputs: list[OutputSpec | None]) -> bool:
    """Every forward call carries targets (a ``labels=`` keyword, a second positional tensor) that fit ``loss``."""
    targets = [_target_or_none(default_targets, call) for call in calls]
    if any(target is None for target in targets):
        return False
    for target, output in zip(targets, outputs, strict=False):
        if output is not None and target is not None:
            try:
                _check_fits(loss, output, target, "")
            except ValueError:
                return False
    return True


def _target_or_none(targets_of: Callable[[Call], Tensor], call: Call) -> Tensor | None:
    try:
        return targets_of(call)
    except (ValueError, KeyError, IndexError, TypeError):  # named where the replay asks for them
        return None


def _described(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"shape {tuple(shape)} {str(dtype).removeprefix('torch.')}"


#: Outputs up to this many elements are probed with real zeros, larger ones on the meta device.
_PROBE_ELEMENTS = 1 << 22


def _check_fits(loss: Any, output: OutputSpec, target: Tensor, where: str) -> None:
    """The loss takes an output of the recorded call's shape and dtype with ``target``, or a
    clear error saying what was found and how to tell the audit (never a crash in the replay)."""
    shape, dtype = output
    # Zeros of the output's shape on the CPU (a value out of range is caught: a class index), or on the
    # meta device past a size (a large vocabulary's logits: shapes only); in float32 as the replay
    # lifts a half-precision output, and a loss's warning (a broadcast target) taken as a failure.
    device = "cpu" if math.prod(shape) <= _PROBE_ELEMENTS else "meta"
    probe = torch.zeros(shape, dtype=torch.float32 if dtype.is_floating_point else dtype, device=device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss.sum(probe, target.detach().to(device))
            loss.count(target.detach())
    except NotImplementedError:  # the meta device cannot run this loss: the shapes go unchecked
        return
    except Exception as error:  # any failure of the loss on these is the same mistake
        raise ValueError(
            f"the targets the audit took ({where}: a tensor of {_described(tuple(target.shape), target.dtype)}) do "
            f"not fit the loss: {loss!r} on the model's output of {_described(shape, dtype)} raised "
            f"{type(error).__name__}: {str(error).rstrip('.')}. Tell the audit where the targets are: criterion=<the nn.Module loss "
            "the loop calls>, audit.wrap(loss_fn) for a loss function, targets=lambda call: ... (call = (args, "
            "kwargs) of the model's forward), or record each micro-batch with Audit.record (record_forward=False)"
        ) from error
