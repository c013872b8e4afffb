"""reports/peers.md: what equiv finds in accumulation that people actually use.

Renders :class:`equiv.peers.results.PeersResults` (measured by
:func:`equiv.peers.survey.survey`): first a table read at a glance (✓ / ✗ and
the kind of failure, one line per peer, one column per situation), then the
details (magnitude, the checker's allowance, counterexamples, upstream
issues) and a chart of measured numbers.  Nothing here measures.
Written by ``equiv report peers`` (``tox -e peers``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from equiv.peers.results import EQUIVALENT, NOT_APPLICABLE, NOT_EQUIVALENT, Cell, Chart, PeerRow, PeersResults
from equiv.reporting.markdown import markdown_table

__all__ = ["render_peers"]

_GROUPS = {
    "window": "One window per call",
    "run": "One run spanning all windows",
    "trainer": "transformers Trainer: one train() per run",
}


def _detail(cell: Cell) -> str:
    """A cell of the detail tables: the verdict with everything that explains it."""
    if cell.outcome == EQUIVALENT:
        return "equivalent (precision note below)" if cell.note else "equivalent"
    if cell.outcome == NOT_APPLICABLE:
        return f"n/a: {cell.detail}"
    if cell.outcome != NOT_EQUIVALENT:
        return f"- ({cell.detail})" if cell.detail else "-"
    parts = [cell.failure, cell.detail] if cell.detail else [cell.failure]
    upstream = f" ({cell.upstream})" if cell.upstream else ""
    checker = f" [checker: {cell.checker}]" if cell.checker and cell.checker != "-" else ""
    return f"NOT equivalent: {'; '.join(parts)}{upstream}{checker}"


def _glance(results: PeersResults) -> str:
    """One line per peer, one column per situation: ✓, ✗ (kind), n/a or -."""
    columns = [s for s in results.situations if any(s.name in r.cells for r in results.rows)]
    return markdown_table(
        pd.DataFrame(
            [
                {
                    "implementation": row.name,
                    **{s.short: row.cells[s.name].mark() if s.name in row.cells else "-" for s in columns},
                }
                for row in results.rows
            ]
        )
    )


def _summary(rows: list[PeerRow]) -> list[str]:
    """Three lines: who is equivalent everywhere measured, who only in some
    situations (named), who nowhere."""
    everywhere = [r.name for r in rows if not r.failing_in()]
    partly = [
        f"{r.name} ({' / '.join(_short(c) for c in r.equivalent_in())})"
        for r in rows
        if r.failing_in() and r.equivalent_in()
    ]
    nowhere = [r.name for r in rows if r.failing_in() and not r.equivalent_in()]
    return [
        f"- **Equivalent in every situation measured:** {'; '.join(everywhere) or 'none'}.",
        f"- **Equivalent only in:** {'; '.join(partly) or 'none'}.",
        f"- **Equivalent in none:** {'; '.join(nowhere) or 'none'}.",
    ]


def _short(column: str) -> str:
    return column.split(":")[0].split(" (")[0]


def _table(rows: list[PeerRow], columns: list[str]) -> str:
    return markdown_table(
        pd.DataFrame([{"implementation": r.name, **{c: _detail(r.cells[c]) for c in columns}} for r in rows])
    )


def _mermaid(chart: Chart) -> list[str]:
    """An xychart-beta block (GitHub renders it) and the caption naming its series."""
    top = max(1.0, *(value for _, values in chart.series for value in values))
    categories = ", ".join(f'"{x}"' for x in chart.x)
    lines = [
        "```mermaid",
        "xychart-beta",
        f'    title "{chart.title}"',
        f'    x-axis "{chart.x_label}" [{categories}]',
        f'    y-axis "{chart.y_label}" 0 --> {round(top * 1.2, 1):g}',
    ]
    for position, (_, values) in enumerate(chart.series):
        lines.append(f"    {'bar' if position == 0 else 'line'} [{', '.join(f'{v:.3g}' for v in values)}]")
    lines.append("```")
    caption = "; ".join(
        f"{'bars' if position == 0 else 'line'}: {name} ({', '.join(f'{v:.3g}' for v in values)})"
        for position, (name, values) in enumerate(chart.series)
    )
    return ["\n".join(lines), f"Measured, one run each: {caption}."]


def _precision_notes(results: PeersResults) -> list[str]:
    """Equivalent cells whose float64 run differs by float32 rounding only: per
    row, each situation's size, then the cause and effect once (the same words)."""
    lines = []
    for row in results.rows:
        noted = [(name, cell.note) for name, cell in row.cells.items() if cell.note]
        if not noted:
            continue
        sizes = "; ".join(f"{_short(name)}: {note.split('. Cause:')[0]}" for name, note in noted)
        causes = dict.fromkeys("Cause:" + note.split(". Cause:", 1)[1] for _, note in noted if ". Cause:" in note)
        lines.append(f"- **{row.name}**: {sizes}. {' '.join(causes)}")
    return lines


def render_peers(results: PeersResults, *, trainer_sections: Sequence[str] = ()) -> str:
    """The markdown of reports/peers.md; ``trainer_sections``: the RL and fine-tuning trainers'
    sections (:mod:`equiv.reporting.trl`), placed after the transformers Trainer's."""
    peer_rows = [r for r in results.rows if r.group == "peer"]
    trainer = [r for r in results.rows if r.group == "trainer"]
    own = [r for r in results.rows if r.group == "own"]
    return (
        "\n\n".join(
            [
                *_head(results, peer_rows + trainer),
                *_how_a_verdict_is_reached(results),
                *_situation_sections(results, peer_rows, trainer),
                *(section.strip() for section in trainer_sections),
                *_reference_sections(results, own),
            ]
        )
        + "\n"
    )


def _situations(results: PeersResults, group: str) -> list[str]:
    """The names of the situations of one group (a column each), in the order measured."""
    return [s.name for s in results.situations if s.group == group]


def _head(results: PeersResults, measured: list[PeerRow]) -> list[str]:
    """The title, the versions, what was not measured, the table at a glance and who is equivalent where."""
    return [
        "# Peers report",
        "Generated by `tox -e peers` (`equiv report peers`); do not edit by hand. Each implementation runs "
        "through an adapter in `equiv/adapters/` and every verdict, one window or whole epochs, comes from "
        "the checker of `equiv.check`: both tiers, derived allowances (see *How a verdict is reached*).",
        "Versions: " + ", ".join(f"{name} {version}" for name, version in results.versions.items()) + ".",
        *(
            ["Not measured here: " + "; ".join(f"{peer} ({why})" for peer, why in results.not_measured.items()) + "."]
            if results.not_measured
            else []
        ),
        "## At a glance",
        "✓ equivalent to full-batch training; ✗ not, with the kind of failure; n/a: the situation does not apply "
        "to the implementation (the reason is in the details); -: not measured for it. Columns: one window per "
        "call (equal, Adam, ..., loss scale), one run of the library over whole epochs (`run:`), one "
        "`Trainer.train()` (`train():`); each is described below. TRL's trainers and torchtune's recipe, "
        "measured in settings of their own, have a table like this at the head of their sections.",
        _glance(results),
        "\n".join(_summary(measured)),
    ]


def _how_a_verdict_is_reached(results: PeersResults) -> list[str]:
    """The checker, the kinds of failure and the charts of measured numbers."""
    return [
        "## How a verdict is reached",
        "One checker for every cell, `equiv.check`'s: the implementation's run is compared, tensor by tensor "
        "after every optimizer step, with a float64 full-batch run from the same weights (each window's "
        "micro-batches as one batch, the mean over all its items) in two tiers: *exact*, the implementation in "
        "float64, and *noise*, the implementation in float32. Each tensor may differ by `32 x floor + 16 x steps "
        "x unit roundoff x scale`, the floor being how far the full-batch run itself lands from the truth when "
        "rounded other ways, in float32 and float64 (one window per call: the batch shuffled, or normalised after "
        "backward; whole runs: each window's micro-batches reversed, or rotated). Whole runs are judged the same "
        "way, each step against the full-batch step of its window (`equiv.judging.trajectories`). A difference inside the "
        "float64 run only, float32-sized, where the float32 run matches, is a precision finding, as `equiv.check` "
        "calls it: the cell stays equivalent, with a note (below).",
        "A NOT cell names the kind of failure: the wrong weighting of the micro-batches' mean gradients whose "
        "run the same checker finds the implementation equivalent to; window boundary: a step missing or taken "
        "at the wrong micro-batch. Its magnitude is the first failing step against the full-batch step from the "
        "same weights: `update 0.75x` is three quarters of the step; `cos` is the cosine between the two "
        "updates, and `sign flipped` says Adam's first step (about lr * sign(g)) went the other way; `off by` is "
        "|update - full-batch update| / |full-batch update|. `checker:` names the first tensor past its "
        "allowance and by how many times.",
        markdown_table(pd.DataFrame([{"kind of failure": name, "what it is": means} for name, means in results.kinds])),
        *(line for chart in results.charts for line in (f"## {chart.heading}", *_mermaid(chart))),
    ]


def _situation_sections(results: PeersResults, peer_rows: list[PeerRow], trainer: list[PeerRow]) -> list[str]:
    """The detail tables: one window per call, one run over whole epochs, one transformers ``Trainer.train()``."""
    by_group = {group: _situations(results, group) for group in _GROUPS}
    trainer_missing = results.not_measured.get("the transformers Trainer")
    return [
        f"## {_GROUPS['window']}",
        "The candidate contract (`equiv.check`): each window is handed to the implementation on its own, "
        "N = the window's micro-batch count. The loss-scale column runs a torch GradScaler: the full-batch step "
        "skips the overflowing step 1 and halves the scale once; it applies only to implementations that take a "
        "grad scaler (n/a, with the reason, for the rest).",
        _table(peer_rows, by_group["window"]),
        "Cases: " + "; ".join(f"{s.name}: {s.data}" for s in results.situations if s.group == "window"),
        f"## {_GROUPS['run']}",
        "Each library driven as its users drive it: one DataLoader (Accelerate), one `Trainer.fit` "
        "(Lightning), one `train_process` / training loop (MindSpore ports) over every micro-batch of an epoch, "
        "with N configured, once in float64 and once in float32; each optimizer step it takes is judged against "
        "the full-batch step on the same window: the epoch's micro-batches N at a time, the last window shorter, "
        "windows restarting with each epoch. Micro-batches of 2 samples each, so only window handling can fail here.",
        _table(
            [r for r in peer_rows if any(r.cells[c].outcome != "not run" for c in by_group["run"])],
            by_group["run"],
        ),
        "Data: " + "; ".join(f"{s.name}: {s.data}" for s in results.situations if s.group == "run"),
        f"## {_GROUPS['trainer']}",
        "A one-layer Llama built from a config (nothing downloaded), SGD lr 0.5 with a constant schedule, "
        "clipping off, sequential order; right-padded sequences of 8 tokens, 2 per micro-batch, labels -100 on "
        "padding; trained in float32 (noise tier) and float64 (exact tier). Each optimizer step is judged against "
        "the full-batch step over the same window (cross-entropy over every real next-token target of the window, "
        "computed independently of the model's own loss). The model computes its RMSNorm, and transformers its "
        "loss, in float32 even in the float64 run: the precision notes below say how large that is. "
        "transformers 4.45.2 is the last release before the 2024 fix (transformers #34191); it is measured in "
        "`tox -e peers-transformers445` (its results in reports/peers-trainer-4.45.2.json).",
        _table(trainer, by_group["trainer"])
        if trainer
        else f"The transformers Trainer: not measured ({trainer_missing}).",
        "Data: " + "; ".join(f"{s.name}: {s.data}" for s in results.situations if s.group == "trainer"),
    ]


def _reference_sections(results: PeersResults, own: list[PeerRow]) -> list[str]:
    """equiv's own loops, the precision notes, what each row drives, the smallest counterexamples, the audited
    runs and the known non-equivalences."""
    notes = _precision_notes(results)
    drives = [
        {"implementation": r.name, "drives": r.drives, "documented limitation": r.documented or "-"}
        for r in results.rows
    ]
    known = [
        {"repository": repo, "issue": number, "what": what, "here": how} for repo, number, what, how in results.known
    ]
    return [
        "## equiv's own loops (reference points, not peers)",
        "These call equiv's helpers (`equiv.losses`); the torchtitan-style loop is equiv's code written in "
        "torchtitan's manner (loss sum / the window's valid-token count), not torchtitan's.",
        _table(own, _situations(results, "window")),
        "## Precision notes",
        "\n".join(notes) if notes else "None: no equivalent cell differs inside its float64 run.",
        "## What each row drives",
        markdown_table(pd.DataFrame(drives)),
        "## Smallest counterexamples, one per kind of failure",
        "A derandomized Hypothesis search over MLP cases (MSE, SGD or Adam, batches up to 8, any split, "
        "clipping none/inactive/active only for implementations that clip), shrunk to the smallest case that "
        "fails with that kind of failure. Tails and token counts are outside this space: the tables above "
        "measure them.",
        markdown_table(pd.DataFrame(results.searches)),
        "## Auditing runs as users write them",
        "`equiv.audit(model, optimizer, loss=...)` (or its transformers / Lightning callback) watches an "
        "unmodified run through hooks and judges each optimizer step against the full-batch step of the same "
        "window, replayed in float64 from the window's start with the named sum + count loss, with the same "
        "derived allowances as `equiv.check` (noise tier: the user's update exists in float32 only). The runs "
        "are in `equiv/auditing/runs.py`; each row's test asserts its verdicts.",
        markdown_table(pd.DataFrame(results.audits)),
        "## Known non-equivalences",
        "Reported upstream; measured where equiv runs the configuration, quoted otherwise.",
        markdown_table(pd.DataFrame(known)),
    ]
