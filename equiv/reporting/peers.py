"""reports/peers.md: what equiv finds in accumulation that people actually use.

Two views of each peer, both against the full-batch trajectory:

- one window per call (the candidate contract, :func:`equiv.check`): one
  column per configuration (a fixed case each);
- one run spanning all windows (:mod:`equiv.reporting.peer_runs`): the library
  driven as its users drive it, one DataLoader / one ``fit`` over epochs of
  several windows, so its step counter and its end-of-epoch rule run.

Each NOT cell names the kind of failure (which wrong weighting the run
reproduces exactly) and its magnitude as the update's scale and direction.
equiv's own loops are reported apart, as reference points, not as peers.
Written by ``equiv report peers`` (``tox -e peers``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from equiv.accumulator import accumulator_step
from equiv.auditing.runs import AUDIT_RUNS
from equiv.cases import strategies
from equiv.cases.case import Case
from equiv.checking.check import check
from equiv.checking.contract import CandidateError, bind
from equiv.outcomes import Outcome
from equiv.reporting.markdown import markdown_table
from equiv.reporting.peer_runs import (
    KINDS,
    PER_MICRO_BATCH_CLIPPING,
    WINDOW_BOUNDARY,
    EpochRun,
    Measure,
    TokenRun,
    classify_step,
    measure,
    measure_epochs,
)
from equiv.zoo.adapters import (
    MindSporeAccumulator,
    MindSporeAccuStepsWithLossScale,
    MindSporeGradAccumulation,
    MindSporeGradientAccumulation,
    textbook_step,
    torchtitan_step,
)
from equiv.zoo.adapters._state import UnsupportedWindow

__all__ = [
    "CONFIGURATIONS",
    "EPOCH_RUNS",
    "KNOWN",
    "TRAINER_RUNS",
    "Peer",
    "peers",
    "peers_report",
    "smallest_counterexample",
    "trainer_cells",
    "trainer_results",
    "write_trainer_results",
]

log = logging.getLogger(__name__)

_MLP = {"hidden": (8,), "activation": "tanh"}
_EVEN = Case(batch_size=12, micro_batch_sizes=(4, 4, 4), model_kwargs=_MLP, optimizer="SGD",
             optimizer_kwargs={"lr": 0.1}, steps=2)

#: column -> the fixed case that configuration runs, one window per call.
CONFIGURATIONS: dict[str, Case] = {
    "equal splits, SGD": _EVEN,
    "equal splits, Adam": _EVEN.replace(optimizer="Adam", optimizer_kwargs={"lr": 1e-2}),
    "uneven splits 1+4+7": _EVEN.replace(micro_batch_sizes=[1, 4, 7]),
    "token loss, causal LM, equal splits": Case(
        batch_size=6, micro_batch_sizes=(2, 2, 2), model="causal_lm", loss="token_cross_entropy",
        optimizer="AdamW", optimizer_kwargs={"lr": 1e-3}, steps=2),
    "clipping (active), equal splits": _EVEN.replace(max_grad_norm=0.01),
    # Dynamic loss scaling, the first micro-batch of step 1 overflowing: the whole window must be
    # skipped and the scale backed off once (step 2 runs at the halved scale).  Only a peer that
    # takes a grad_scaler can be asked; for the others the column is n/a.
    "loss scale, overflow in micro-batch 1 of 3": _EVEN.replace(loss_scale=2.0**10, overflow_at=(1, 0), steps=3),
}


def _epoch(micro_batches: int, n: int, epochs: int = 1) -> EpochRun:
    # Equal micro-batches of 2 samples: every failure left is about windows, not weighting.
    case = _EVEN.replace(batch_size=2 * micro_batches, micro_batch_sizes=(2,) * micro_batches, steps=1)
    return EpochRun(case, n, epochs)


_UNEVEN_TOKENS = ((8, 2), (3, 3), (8, 8), (5, 2), (8, 4), (2, 2), (6, 7))
_EQUAL_TOKENS = ((5, 5),) * 7

#: column -> one ``Trainer.train()`` over padded token sequences (transformers rows).
TRAINER_RUNS: dict[str, TokenRun] = {
    "uneven token counts, one window: 3 micro-batches, N=3": TokenRun(_UNEVEN_TOKENS[:3], 3),
    "uneven token counts, tail of a long epoch: 7 micro-batches, N=3": TokenRun(_UNEVEN_TOKENS, 3),
    "equal token counts, tail of a long epoch: 7 micro-batches, N=3": TokenRun(_EQUAL_TOKENS, 3),
    "equal token counts, epoch shorter than N: 2 micro-batches, N=3, 2 epochs": TokenRun(_EQUAL_TOKENS[:2], 3, 2),
}

#: column -> one run of the library over whole epochs (one DataLoader / one fit).
EPOCH_RUNS: dict[str, EpochRun] = {
    "mid-epoch windows: 9 micro-batches, N=3": _epoch(9, 3),
    "tail of a long epoch: 7 micro-batches, N=3 (Lightning #19987)": _epoch(7, 3),
    "epoch shorter than N: 2 micro-batches, N=3, 2 epochs (Lightning #21808)": _epoch(2, 3, 2),
    "epoch boundary: 7 micro-batches, N=3, 2 epochs": _epoch(7, 3, 2),
}

@dataclass(frozen=True)
class Peer:
    name: str
    #: builds the candidate; ``configured_n`` is the accumulation steps the user
    #: configured (None: the window's own count, under the contract).
    build: Callable[[int | None], Callable[..., Any]]
    drives: str
    #: the library's own driver over whole epochs (None: it has no epoch loop to drive)
    epochs: Callable[[int], Any] | None = None
    documented: str = ""
    family: str = ""
    #: kind of failure -> the upstream report it matches, named in the cell
    issues: dict[str, str] = field(default_factory=dict)


@dataclass
class _Row:
    peer: Peer
    cells: dict[str, str] = field(default_factory=dict)
    #: kinds of failure seen one window per call (what the counterexample search can reach)
    kinds: set[str] = field(default_factory=set)
    equivalent: list[str] = field(default_factory=list)
    failing: list[str] = field(default_factory=list)


def peers() -> list[Peer]:
    """The peers to report; optional frameworks only when installed."""
    out = [
        Peer("nanoGPT's loop: loss / N", lambda n: textbook_step, "nanoGPT train.py's loop", family="nanoGPT",
             documented="exact only for equal micro-batches of a sample mean (train.py: loss / gradient_accumulation_steps)"),
        Peer("MindSpore r1.3 GradientAccumulation (port)", lambda n: MindSporeGradientAccumulation(n),
             "MindSpore r1.0/r1.3 tutorial: grad_sum, TrainOptim, TrainClear, mini_steps",
             issues={"window boundary": "k restarts each epoch, grad_sum is kept"},
             epochs=lambda n: MindSporeGradientAccumulation(n), family="MindSpore tutorial ports",
             documented="the tutorial adds gradients of mean losses with no division by mini_steps"),
        Peer("MindSpore r1.3 parallel-mode loss-scale cell (port)", lambda n: MindSporeAccuStepsWithLossScale(n),
             "MindSpore r1.3 tutorial, parallel mode: TrainAccuStepsWithLossScaleCell, accu_overflow ORed, Model_ACCU",
             family="MindSpore tutorial ports",
             documented="accu_grads summed with sens = the loss scale, no division by grad_accumulation_step"),
        Peer("MindSpore 2.0 Accumulator (port)", lambda n: MindSporeAccumulator(n),
             "MindSpore 2.0 notebook: inner_grads, counter, loss / accumulate_step",
             epochs=lambda n: MindSporeAccumulator(n), family="MindSpore tutorial ports"),
        Peer("MindSpore r2.6 GradAccumulation (port)", lambda n: MindSporeGradAccumulation(n),
             "MindSpore v2.6.0: GradAccumulation(net, micro_size), Model.train (_TrainGradAccuStepCell; "
             "_TrainGradAccuWithLossScaleCell with a loss scale)",
             family="MindSpore tutorial ports",
             documented="re-slices the batch into micro_size equal slices; sens 1 / micro_size, but none under "
                        "loss scaling"),
    ]
    try:
        from equiv.zoo.adapters.accelerate import AccelerateStep, AccelerateVariableSizeStep

        version = importlib.metadata.version("accelerate")
        out += [
            Peer(f"Accelerate {version}: accumulate()", lambda n: AccelerateStep(n),
                 "Accelerator(gradient_accumulation_steps=N), accumulate(), backward()",
                 epochs=lambda n: AccelerateStep(n), family="Accelerate",
                 issues={"tail divided by N": "accelerate #1847"},
                 documented="backward() divides by N; the end of the DataLoader closes a window (accelerate #1847)"),
            Peer(f"Accelerate {version}: accumulate(), sync_with_dataloader=False",
                 lambda n: AccelerateStep(n, sync_with_dataloader=False),
                 "GradientAccumulationPlugin(num_steps=N, sync_with_dataloader=False)",
                 epochs=lambda n: AccelerateStep(n, sync_with_dataloader=False), family="Accelerate"),
            Peer(f"Accelerate {version}: variable-size recipe", lambda n: AccelerateVariableSizeStep(n),
                 "the guide's recipe: num_items_in_batch per window, loss * N, backward(), step",
                 epochs=lambda n: AccelerateVariableSizeStep(n), family="Accelerate",
                 documented="the guide's answer to mean-of-means for samples of variable size (accelerate #3193)"),
        ]
    except ImportError:
        pass
    try:
        from equiv.zoo.adapters.lightning import LightningStep

        version = importlib.metadata.version("pytorch-lightning")
        out.append(Peer(f"Lightning {version}", lambda n: LightningStep(n), "Trainer(accumulate_grad_batches=N)",
                        epochs=lambda n: LightningStep(n), family="Lightning",
                        issues={"tail divided by N": "Lightning #19987, #21808", "mean of means": "Lightning #20350"},
                        documented="mean of per-batch means (Lightning #20350); tail divided by N (#19987)"))
    except ImportError:
        pass
    return out


def _own() -> list[Peer]:
    """equiv's own loops: reference points, not peers (they call equiv's helpers)."""
    return [
        Peer("equiv.Accumulator", lambda n: accumulator_step, "equiv (this repository)"),
        Peer("equiv's loop in torchtitan's style", lambda n: torchtitan_step,
             "equiv.losses helpers, normalised by the window's item count as torchtitan does; not torchtitan's code"),
    ]


#: (repository, issue or PR, one line, how this report knows it)
KNOWN: tuple[tuple[str, str, str, str], ...] = (
    ("huggingface/accelerate", "#1847", "the GradientState follows the DataLoader by default: its end closes a "
     "window of fewer than N batches, still divided by N", "measured: tail column, Accelerate accumulate()"),
    ("huggingface/accelerate", "#1970, #3877, #3780", "under DeepSpeed, backward() leaves the division by N to "
     "DeepSpeed's engine", "quoted (needs DeepSpeed; not run here)"),
    ("huggingface/transformers", "PR #34191", "the 2024 fix: the Trainer counts the window's tokens and passes "
     "num_items_in_batch to the model's loss; before it, a mean of per-micro-batch token means",
     "measured: the transformers 4.45.2 rows (mean of means) against the 5.x forward(**kwargs) row (equivalent)"),
    ("huggingface/transformers", "#37766", "a model whose loss does not accept num_items_in_batch falls back to "
     "the mean of per-micro-batch means", "measured: the 5.x row 'model forward without **kwargs'"),
    ("huggingface/transformers", "PR #46204", "num_items_in_batch counted unshifted labels, one token per "
     "sequence too many", "measured indirectly: 5.x counts shifted labels, so its forward(**kwargs) row is exact"),
    ("Lightning-AI/pytorch-lightning", "#20350", "token losses averaged as a mean of per-batch means",
     "measured: token-loss column, Lightning"),
    ("Lightning-AI/pytorch-lightning", "#19987", "the tail of an epoch is divided by accumulate_grad_batches, "
     "not by its own length", "measured: tail-of-a-long-epoch column, Lightning"),
    ("Lightning-AI/pytorch-lightning", "#21808", "an epoch shorter than accumulate_grad_batches steps at every "
     "epoch end", "measured: epoch-shorter-than-N column, Lightning"),
    ("huggingface/trl", "#2175", "FSDP accumulating gradients in 16-bit", "quoted (needs FSDP with mixed "
     "precision; not run here)"),
)


def trainer_cells(loss_kwargs: bool) -> dict[str, str]:
    """One cell per :data:`TRAINER_RUNS` column for the installed transformers' Trainer."""
    from equiv.zoo.adapters.transformers import TrainerRun

    before_fix = tuple(int(p) for p in importlib.metadata.version("transformers").split(".")[:2]) < (4, 46)
    issues = {"mean of means": "transformers #34191" if before_fix else "transformers #37766" if not loss_kwargs else ""}
    cells = {}
    for column, template in TRAINER_RUNS.items():
        run = dataclasses.replace(template, loss_kwargs=loss_kwargs)
        result = measure(lambda model, optimizer, micro, run=run: TrainerRun(run.n).train(  # type: ignore[misc]
            model, optimizer, micro, epochs=run.epochs), run)
        cells[column] = "equivalent" if result.equivalent else _describe(result, issues)
    return cells


def _not_a_step(configured_n: int | None) -> Callable[..., Any]:
    raise TypeError("the Trainer owns its loop: it is measured over whole runs only")


#: The model's forward with ``**kwargs`` (5.x passes it ``num_items_in_batch``; 4.45.2 passes nothing), and without.
_TRAINER_VARIANTS = ((True, "model forward(**kwargs)"), (False, "model forward without **kwargs"))


def trainer_results() -> dict[str, Any]:
    """The installed transformers' Trainer measured: its version and one row of
    cells per model variant (with and without ``num_items_in_batch`` in forward)."""
    version = importlib.metadata.version("transformers")
    return {"transformers": version,
            "rows": [[f"transformers {version} Trainer: {what}", trainer_cells(loss_kwargs)]
                     for loss_kwargs, what in _TRAINER_VARIANTS]}


def write_trainer_results(path: str | Path) -> None:
    """Measure the installed Trainer into ``path`` (JSON): how an older release,
    installed in a tox env of its own (``tox -e peers-transformers445``), reaches the report."""
    Path(path).write_text(json.dumps(trainer_results(), indent=1, sort_keys=True) + "\n")


#: The optional peers and the packages each needs, in the order it imports them
#: (the transformers Trainer refuses to train without accelerate).
_OPTIONAL_PEERS: dict[str, tuple[str, ...]] = {
    "Accelerate": ("accelerate",),
    "Lightning": ("pytorch_lightning",),
    "the transformers Trainer": ("transformers", "accelerate"),
}


def not_measured() -> dict[str, str]:
    """Optional peer -> why this environment cannot run it, naming the package
    that is missing (the report says so rather than leaving its rows out silently)."""
    reasons = {}
    for peer, packages in _OPTIONAL_PEERS.items():
        missing = [package for package in packages if importlib.util.find_spec(package) is None]
        if missing:
            needs = "" if missing[0] == packages[0] else f", which {peer} needs"
            reasons[peer] = f"{missing[0]} is not installed{needs} (pip install equiv[peers])"
    return reasons


def _audit_section() -> list[str]:
    """The real runs of :mod:`equiv.auditing.runs`, audited (``equiv.audit``)."""
    rows = []
    for name, entry in AUDIT_RUNS.items():
        missing = [package for package in entry.needs if importlib.util.find_spec(package) is None]
        if missing:
            rows.append({"run": name, "what": entry.what, "audited steps": "-", "not equivalent": "-",
                         "first flagged": f"not run: {missing[0]} is not installed (pip install equiv[peers])",
                         "reproduces": entry.reproduces, "command": f"`pytest {entry.test}`"})
            continue
        watched = entry.run()
        failures = watched.failures
        rows.append({
            "run": name, "what": entry.what, "audited steps": str(len(watched.windows)),
            "not equivalent": ", ".join(str(w.step) for w in failures) or "none",
            "first flagged": failures[0].line() if failures else "-",
            "reproduces": entry.reproduces if failures else "-", "command": f"`pytest {entry.test}`",
        })
    return [
        "## Auditing runs as users write them",
        "`equiv.audit(model, optimizer, loss=...)` (or its transformers / Lightning callback) watches an "
        "unmodified run through hooks and judges each optimizer step against the full-batch step of the same "
        "window, replayed in float64 from the window's start with the named sum + count loss, with the same "
        "derived allowances as `equiv.check` (noise tier: the user's update exists in float32 only). The runs "
        "are in `equiv/auditing/runs.py`; each row's test asserts its verdicts.",
        markdown_table(pd.DataFrame(rows)),
    ]


def _trainer_rows(saved: Path) -> list[_Row]:
    """The installed transformers' Trainer, then releases measured in their own
    env (``peers-trainer-*.json`` in ``saved``), oldest first."""
    results = []
    if "the transformers Trainer" not in not_measured():
        results.append(trainer_results())
    results += [json.loads(path.read_text()) for path in sorted(saved.glob("peers-trainer-*.json"))]
    rows = []
    for result in sorted(results, key=lambda r: tuple(int(p) for p in r["transformers"].split(".")[:3])):
        for name, cells in result["rows"]:
            row = _Row(Peer(name, _not_a_step, "Trainer(args=TrainingArguments(gradient_accumulation_steps=N)).train()",
                            family="transformers"))
            for column in TRAINER_RUNS:
                row.cells[column] = cells.get(column, "not measured")
                _tally(row, column, row.cells[column])
            rows.append(row)
    return rows


def _describe(measure: Measure, issues: dict[str, str]) -> str:
    """A NOT cell: the kind(s) of failure, the upstream report each matches, the magnitude."""
    matched = [issues[kind] for kind in measure.kind_name().split(" + ") if issues.get(kind)]
    upstream = f" ({'; '.join(matched)})" if matched else ""
    return f"NOT equivalent: {measure.describe()}{upstream}"


def _window_cell(peer: Peer, column: str, case: Case) -> tuple[str, str | None]:
    """(the cell, the kind of failure or None) for one window per call."""
    candidate = peer.build(None)
    verdict = check(candidate, case)
    if verdict:
        return "equivalent", None
    if verdict.status is Outcome.NOT_APPLICABLE:
        return f"n/a: {'; '.join(verdict.not_applicable)}", None
    measure = classify_step(peer.build(None), case)
    if measure.gap is None:
        # The float64 runs agree: the mismatch is in the float32 tier (rounding beyond the noise floor).
        first = verdict.first_mismatch
        assert first is not None
        return f"NOT equivalent: float32 only, step {first.step}, {first.label}", "float32 rounding"
    return _describe(measure, peer.issues), measure.kind_name()


def _epoch_cell(peer: Peer, run: EpochRun) -> str:
    if peer.epochs is None:
        return "n/a (no epoch loop)"
    measure = measure_epochs(peer.epochs(run.n), run)
    return "equivalent" if measure.equivalent else _describe(measure, peer.issues)


def _search_space(candidate: Callable[..., Any]) -> Any:
    # Only cases the candidate can take: no clipping case for a step that cannot clip.
    clipping = strategies.CLIPPING if bind(candidate).takes("max_grad_norm") else ("none",)
    return strategies.cases(max_batch_size=8, families=["mlp"], optimizer_names=["SGD", "Adam"],
                            loss_names=["mse"], dtypes=["float32"], max_steps=2, clipping=clipping)


def smallest_counterexample(candidate: Callable[..., Any], *, kind: str | None = None,
                            max_examples: int = 40) -> tuple[Case | None, int]:
    """(the shrunk failing case or None, cases tried) over sample-mean MLP cases
    the candidate can take; with ``kind``, only failures of that kind.  Cases
    the ported framework refuses (:class:`UnsupportedWindow`) are not counted."""
    tried = 0

    def fails(case: Case) -> bool:
        nonlocal tried
        try:
            verdict = check(candidate, case)
        except CandidateError as exc:
            if isinstance(exc.__cause__, UnsupportedWindow):
                return False  # the framework refuses this window (not counted): no counterexample
            raise
        tried += 1
        if verdict:
            return False
        if kind is None:
            return True
        measure = classify_step(candidate, case)
        return measure.gap is not None and measure.kind_name() == kind

    try:
        found = find(_search_space(candidate), fails, settings=settings(
            max_examples=max_examples, derandomize=True, database=None, deadline=None,
            phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None, tried
    return found, tried


#: Kinds a sample-mean MLP search can reach (tails and token counts are not in its space).
_SEARCHABLE = ("mean of means", "sum without division", "per-micro-batch clipping", "window boundary")


def _evaluate(peer: Peer) -> _Row:
    row = _Row(peer)
    for column, case in CONFIGURATIONS.items():
        cell, kind = _window_cell(peer, column, case)
        row.cells[column] = cell
        if _tally(row, column, cell) and kind is not None:
            row.kinds.update(kind.split(" + "))
    for column, run in EPOCH_RUNS.items():
        row.cells[column] = _epoch_cell(peer, run)
        _tally(row, column, row.cells[column])
    return row


def _tally(row: _Row, column: str, cell: str) -> bool:
    """Count the cell; True when it is a failure."""
    if cell == "equivalent":
        row.equivalent.append(column)
    elif cell.startswith("NOT"):
        row.failing.append(column)
        return True
    return False


def _counterexamples(row: _Row) -> list[dict[str, str]]:
    out = []
    candidate = row.peer.build(None)
    kinds: list[str | None] = [k for k in _SEARCHABLE if k in row.kinds]
    for kind in kinds or [None]:
        found, tried = smallest_counterexample(candidate, kind=kind)
        log.info("%s, %s: %d search cases", row.peer.name, kind or "any failure", tried)
        out.append({
            "implementation": row.peer.name,
            "kind of failure": kind or "any",
            "smallest counterexample (Hypothesis, shrunk)": f"`{found!r}`" if found else f"none in {tried} cases",
        })
    return out


_ALL_KINDS = (*KINDS, PER_MICRO_BATCH_CLIPPING, WINDOW_BOUNDARY)


def _short(column: str) -> str:
    return column.split(":")[0].split(" (")[0]


def _summary(rows: list[_Row]) -> list[str]:
    """Three lines: who is equivalent everywhere measured, who only in some
    configurations (named), who nowhere."""
    everywhere = [r.peer.name for r in rows if not r.failing]
    partly = [f"{r.peer.name} ({' / '.join(_short(c) for c in r.equivalent)})" for r in rows if r.failing and r.equivalent]
    nowhere = [r.peer.name for r in rows if r.failing and not r.equivalent]
    return [
        f"- **Equivalent in every configuration measured:** {'; '.join(everywhere) or 'none'}.",
        f"- **Equivalent only in:** {'; '.join(partly) or 'none'}.",
        f"- **Equivalent in none:** {'; '.join(nowhere) or 'none'}.",
    ]


def _versions() -> dict[str, str]:
    versions = {name: importlib.metadata.version(name) for name in ("torch", "hypothesis")}
    for optional in ("accelerate", "pytorch-lightning", "transformers"):
        try:
            versions[optional] = importlib.metadata.version(optional)
        except importlib.metadata.PackageNotFoundError:
            versions[optional] = "not installed (install the extras: pip install equiv[peers])"
    return versions


def _table(rows: list[_Row], columns: list[str]) -> str:
    return markdown_table(pd.DataFrame([{"implementation": r.peer.name, **{c: r.cells[c] for c in columns}}
                                        for r in rows]))


def peers_report(saved: Path = Path("reports")) -> str:
    """The markdown of reports/peers.md; ``saved`` holds results measured in
    other environments (an older transformers release)."""
    rows = [_evaluate(peer) for peer in peers()]
    trainer = _trainer_rows(saved)
    own = [_evaluate(peer) for peer in _own()]
    searches = [entry for row in rows + own for entry in _counterexamples(row)]
    drives = [{"implementation": r.peer.name, "drives": r.peer.drives, "documented limitation": r.peer.documented or "-"}
              for r in rows + trainer + own]
    known = [{"repository": repo, "issue": number, "what": what, "here": how} for repo, number, what, how in KNOWN]
    return "\n\n".join([
        "# Peers report",
        "\n".join(_summary(rows + trainer)),
        "Generated by `tox -e peers` (`equiv report peers`); do not edit by hand. Each implementation runs "
        "through an adapter in `equiv/zoo/adapters/` and is checked against full-batch training.",
        "Versions: " + ", ".join(f"{name} {version}" for name, version in _versions().items()) + ".",
        *(["Not measured here: " + "; ".join(f"{peer} ({why})" for peer, why in not_measured().items()) + "."]
          if not_measured() else []),
        "## How to read a cell",
        "A NOT cell names the kind of failure: the wrong weighting of the micro-batches' mean gradients whose "
        "float64 trajectory the implementation reproduces exactly (mean of means: each micro-batch weighted "
        "1/len(window); tail divided by N: a short window still divided by the configured N; sum without "
        "division; per-micro-batch clipping; window boundary: a step missing or taken at the wrong micro-batch). "
        "Its magnitude is the first differing update against the full-batch update from the same weights: "
        "`update 0.75x` is three quarters of the step; `cos` is the cosine between the two updates, and "
        "`sign flipped` says Adam's first step (about lr * sign(g)) went the other way; `off by` is "
        "|update - full-batch update| / |full-batch update| (a sign flip is off by 2, Adam absorbing a 3x "
        "gradient is off by only eps's share).",
        markdown_table(pd.DataFrame([{"kind of failure": kind.name, "what it is": kind.means} for kind in _ALL_KINDS])),
        "## One window per call",
        "The candidate contract (`equiv.check`): each window is handed to the implementation on its own, "
        "N = the window's micro-batch count; both tiers (float64 exact, float32 noise floor). The loss-scale "
        "column runs a torch GradScaler: the full-batch step skips the overflowing step 1 and halves the scale "
        "once; it applies only to implementations that take a grad scaler (n/a, with the reason, for the rest).",
        _table(rows, list(CONFIGURATIONS)),
        "Cases: " + "; ".join(f"{name}: `{case!r}`" for name, case in CONFIGURATIONS.items()),
        "## One run spanning all windows",
        "Each library driven as its users drive it: one DataLoader (Accelerate), one `Trainer.fit` "
        "(Lightning), one `train_process` / training loop (MindSpore ports) over every micro-batch of an epoch, "
        "with N configured; each optimizer step it takes is compared (float64) with the full-batch step on the "
        "same window: the epoch's micro-batches N at a time, the last window shorter, windows restarting with "
        "each epoch. Micro-batches of 2 samples each, so only window handling can fail here.",
        _table([r for r in rows if r.peer.epochs is not None], list(EPOCH_RUNS)),
        "Data: " + "; ".join(f"{name}: {run.describe()}, `{run.case!r}`" for name, run in EPOCH_RUNS.items()),
        "## transformers Trainer: one train() per run",
        "A one-layer Llama built from a config (nothing downloaded), float64, SGD lr 0.5 with a constant "
        "schedule, clipping off, sequential order; right-padded sequences of 8 tokens, 2 per micro-batch, "
        "labels -100 on padding. Each optimizer step is compared with the full-batch step over the same window "
        "(cross-entropy over every real next-token target of the window, computed independently of the model's "
        "own loss). The model's RMSNorm computes in float32, so steps count as equal within 1e-5 of the update. "
        "transformers 4.45.2 is the last release before the 2024 fix (transformers #34191); it is measured in "
        "`tox -e peers-transformers445` (its results in reports/peers-trainer-4.45.2.json).",
        _table(trainer, list(TRAINER_RUNS)) if trainer else
        f"The transformers Trainer: not measured ({not_measured().get('the transformers Trainer')}).",
        "Data: " + "; ".join(f"{name}: {run.describe()}" for name, run in TRAINER_RUNS.items()),
        "## equiv's own loops (reference points, not peers)",
        "These call equiv's helpers (`equiv.losses`); the torchtitan-style loop is equiv's code written in "
        "torchtitan's manner (loss sum / the window's valid-token count), not torchtitan's.",
        _table(own, list(CONFIGURATIONS)),
        "## What each row drives",
        markdown_table(pd.DataFrame(drives)),
        "## Smallest counterexamples, one per kind of failure",
        "A derandomized Hypothesis search over MLP cases (MSE, SGD or Adam, batches up to 8, any split, "
        "clipping none/inactive/active only for implementations that clip), shrunk to the smallest case that "
        "fails with that kind of failure. Tails and token counts are outside this space: the tables above "
        "measure them.",
        markdown_table(pd.DataFrame(searches)),
        *_audit_section(),
        "## Known non-equivalences",
        "Reported upstream; measured where equiv runs the configuration, quoted otherwise.",
        markdown_table(pd.DataFrame(known)),
    ]) + "\n"
