"""The ``equiv`` command's argparse parser: one builder per subcommand, and the option groups several
subcommands share written once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from equiv.cases import strategies as eqst
from equiv.checking.distributed_search import (
    DATA_PARALLEL_ENGINES,
    ENGINES,
    MODELS,
)
from equiv.checking.search_space import AUTOCAST_DTYPES
from equiv.checking.threads import SMALL_MODEL_PARAMETERS
from equiv.cli.checks import _cmd_check, _cmd_verify
from equiv.cli.common import FORMATS, _version
from equiv.cli.distributed import _cmd_check_distributed, _cmd_verify_distributed
from equiv.cli.inputs import _names, _positive_int, _positive_seconds, _split, parse_bytes
from equiv.cli.planning import _cmd_plan
from equiv.cli.reports import _cmd_report_benchmarks, _cmd_report_equivalence, _cmd_report_peers
from equiv.cli.sweeps import _cmd_sweep
from equiv.cost.workloads import WORKLOADS
from equiv.distributed.engines import DEFAULT_ENGINE
from equiv.judging.deadline import DEFAULT_TIMEOUT_S


def _format_flag(parser: argparse.ArgumentParser) -> None:
    """``--format``: how the result is shown on stdout."""
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default); github: the text, then a GitHub Actions ::error annotation per "
        "failing case on the step's definition line (a ::notice when it passes); json: the "
        "result's JSON (equiv/results/schema.json) alone on stdout, progress on stderr",
    )


def _threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads during the check (the rule: :mod:`equiv.checking.threads`)."""
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch CPU threads while checking (default: 1 on small models such as every standard "
        "and drawn case, where more threads only wait on each other, many times slower on a "
        "busy machine; torch's own count if OMP_NUM_THREADS is set or a model has over "
        f"{SMALL_MODEL_PARAMETERS:,} parameters); restored afterwards",
    )


def _precision_flags(parser: argparse.ArgumentParser) -> None:
    """When a float32-sized difference inside the float64 run fails (it passes with a note otherwise)."""
    parser.add_argument(
        "--train-dtype",
        choices=["float64", "float32", "bfloat16", "float16"],
        default=None,
        help="the dtype you train in (default: float32 or lower); with float64, float32-sized "
        "differences inside the float64 run fail as a precision finding; with bfloat16 or "
        "float16, a step computing its gradient in bfloat16 (an accumulation buffer) passes "
        "with a note",
    )
    parser.add_argument(
        "--strict-precision",
        action="store_true",
        help="fail float32-sized differences inside the float64 run whatever you train in",
    )


def _autocast_flag(parser: argparse._ActionsContainer) -> None:
    """``--autocast``: every case's forward under ``torch.autocast`` to that dtype (``Case.autocast``)."""
    parser.add_argument(
        "--autocast",
        choices=AUTOCAST_DTYPES,
        default=None,
        help="run every case's forward under torch.autocast to this dtype, as AMP does, and judge "
        "it in that precision (default: none, unless the step enters torch.autocast itself: "
        "then each case is judged in the step's own autocast dtype)",
    )


#: What a step target is, in every subcommand that checks one.
_CONTRACT = "MODULE:FUNC or path/to/file.py:FUNC following the candidate contract"


def _target_arg(parser: argparse.ArgumentParser) -> None:
    """The step to check, ``MODULE:FUNC`` (check, verify and their distributed forms)."""
    parser.add_argument("target", help=_CONTRACT)


def _json_flag(parser: argparse.ArgumentParser, what: str, where: str = "") -> None:
    """``--json PATH``: ``what`` (the verdicts, the result) also written there as JSON (by ``where``)."""
    parser.add_argument("--json", help=f"also write {what} as JSON to this path{where}")


def _tb_flag(parser: argparse.ArgumentParser) -> None:
    """``--tb``: the step's own traceback too, where it raised (check, verify)."""
    parser.add_argument("--tb", action="store_true", help="where the step raised, also print its own traceback")


def _seed_flag(parser: argparse.ArgumentParser) -> None:
    """``--seed``: the search fixed (verify, verify-distributed)."""
    parser.add_argument("--seed", type=int, default=None, help="fix the search (default: drawn and printed)")


def _case_timeout_flag(parser: argparse.ArgumentParser, then: str) -> None:
    """``--timeout`` of one case's check in this process (check, verify); ``then``: what a step still running does."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one case's check may take (default {DEFAULT_TIMEOUT_S:g}; 0: no limit); "
        f"a step still running then {then} (exit 3)",
    )


def _allow_import_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--allow-import MODULE``: a module a ``--case`` may import its factories from (repeatable)."""
    parser.add_argument("--allow-import", action="append", default=[], metavar="MODULE", help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The ``equiv`` command's parser: every subcommand, each with its handler as ``handler``.

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="equiv",
        description="Is your gradient accumulation full-batch training?",
        epilog="exit codes: 0 equivalent, 1 counterexample, 2 usage error, 3 the step raised or hung, 4 equiv failed, "
        "130 interrupted (Ctrl-C)",
    )
    parser.add_argument("--version", action="version", version=f"equiv {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # In this order in ``equiv --help``.
    _add_check(commands)
    _add_verify(commands)
    _add_check_distributed(commands)
    _add_verify_distributed(commands)
    _add_plan(commands)
    _add_report(commands)
    _add_sweep(commands)
    return parser


def _add_check(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check_parser = commands.add_parser("check", help="check a step on the standard cases (or one --case)")
    _target_arg(check_parser)
    check_parser.add_argument("--case", help="one case as JSON (Case.to_dict()), or @file.json")
    _json_flag(check_parser, "the verdicts")
    _allow_import_flag(
        check_parser,
        "a module the --case may import its model, loss or data from, besides the step's "
        "own (repeatable; a case pasted from a log imports nothing else)",
    )
    _tb_flag(check_parser)
    _case_timeout_flag(check_parser, then="is reported as hung")
    _precision_flags(check_parser)
    _autocast_flag(check_parser)
    _threads_flag(check_parser)
    _format_flag(check_parser)
    check_parser.set_defaults(handler=_cmd_check)


def _add_verify(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    verify_parser = commands.add_parser(
        "verify",
        help="search drawn cases for a counterexample to a step (Hypothesis, shrunk)",
        description="Hypothesis draws cases (models x splits x optimizers), checks the step on each and shrinks "
        "the first mismatch to the smallest case that still shows it.",
    )
    _target_arg(verify_parser)
    verify_parser.add_argument(
        "--max-examples", type=_positive_int, default=None, help="cases to draw (default: the profile's)"
    )
    _seed_flag(verify_parser)
    verify_parser.add_argument(
        "--profile",
        default=None,
        help="Hypothesis profile: equiv's dev, ci or thorough (shipped in the package), or one you registered",
    )
    _json_flag(verify_parser, "the result")
    _tb_flag(verify_parser)
    _case_timeout_flag(verify_parser, then="ends the search")
    _search_space_flags(verify_parser)
    verify_parser.add_argument("--reproduce", metavar="BLOB", help="replay the shrunk draw an earlier search printed")
    verify_parser.add_argument("--progress-every", type=float, default=2.0, help=argparse.SUPPRESS)
    _precision_flags(verify_parser)
    _threads_flag(verify_parser)
    _format_flag(verify_parser)
    verify_parser.set_defaults(handler=_cmd_verify)


def _search_space_flags(verify_parser: argparse.ArgumentParser) -> None:
    """What ``verify`` draws cases from: a flag per field of :class:`~equiv.checking.search_space.SearchSpace`,
    named after it (the handler builds the space from those names)."""
    space = verify_parser.add_argument_group("what cases are drawn from (equiv.checking.search_space.SearchSpace)")
    space.add_argument(
        "--families", type=_names, default=(), help=f"comma-separated model families ({','.join(eqst.MODEL_FAMILIES)})"
    )
    space.add_argument(
        "--optimizers", type=_names, default=(), help=f"comma-separated optimizers ({','.join(eqst.OPTIMIZERS)})"
    )
    space.add_argument(
        "--losses",
        type=_names,
        default=(),
        help="comma-separated losses ("
        + ",".join((*eqst.SAMPLE_LOSSES, *eqst.ITEM_WEIGHTED_LOSSES, *eqst.SEQUENCE_LOSS_FAMILIES))
        + "; the packed_* and policy_* ones only when named)",
    )
    space.add_argument("--item-weighted", action="store_true", help="also search the token-level loss")
    space.add_argument("--allow-inherent", action="store_true", help="also draw BatchNorm and dropout models")
    space.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=None,
        help="largest batch drawn (default: its micro-batch count plus up to 8 samples)",
    )
    space.add_argument(
        "--max-micro-batches", type=_positive_int, default=None, help="most micro-batches per window drawn (default 32)"
    )
    space.add_argument("--device", default="cpu", help="where to run the cases (default cpu; e.g. cuda)")
    _autocast_flag(space)


def _add_check_distributed(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ddp_parser = commands.add_parser(
        "check-distributed",
        help="check a step on W ranks: spawned here, or the ranks torchrun started",
        description="Runs the step on W data-parallel ranks (DDP or FSDP2; gloo on CPU, NCCL on GPU) and compares "
        "every rank with the single-process full-batch step in both tiers. Under torchrun (torchrun --standalone "
        "--nproc-per-node 2 -m equiv check-distributed MODULE:FUNC) every rank reads torchrun's environment, rank 0 "
        "checks and prints the verdict; without torchrun, --nproc ranks are spawned here. With no --split or --case, "
        "standard splits are checked (ranks holding different samples, micro-batch counts and real tokens).",
    )
    _target_arg(ddp_parser)
    ddp_parser.add_argument(
        "--split",
        type=_split,
        default=None,
        help="each rank's micro-batch sizes, ranks separated by ';' (e.g. \"1,2;3\"): one entry per rank",
    )
    ddp_parser.add_argument(
        "--case",
        help="the case as JSON (Case.to_dict()), or @file.json; its batch and "
        "micro-batch sizes come from --split (default: its split on every rank)",
    )
    # The standard splits are data-parallel ones: tensor-parallel engines are for equiv.check_distributed
    # with DistributedCase.of(..., tensor_parallel=T), and for verify-distributed.
    ddp_parser.add_argument(
        "--engine", choices=DATA_PARALLEL_ENGINES, default=DEFAULT_ENGINE, help="DDP (default) or FSDP2 (fully_shard)"
    )
    ddp_parser.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="ranks to spawn without torchrun (default 2); under torchrun, its world size",
    )
    _ranks_timeout_flag(ddp_parser, 120.0, "the ranks may take per case once started (default 120)")
    _json_flag(ddp_parser, "the verdicts", where=" (rank 0)")
    _allow_import_flag(ddp_parser, "a module the --case may name factories from (besides the step's own)")
    _precision_flags(ddp_parser)
    _format_flag(ddp_parser)
    ddp_parser.set_defaults(handler=_cmd_check_distributed)


def _ranks_timeout_flag(parser: argparse.ArgumentParser, default_s: float, what: str) -> None:
    """``--timeout`` of spawned or torchrun ranks: finite and above zero (the ranks' own deadline)."""
    parser.add_argument("--timeout", type=_positive_seconds, default=default_s, help=f"seconds {what}")


def _add_verify_distributed(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    search_parser = commands.add_parser(
        "verify-distributed",
        help="search rank splits for a distributed counterexample (spawned gloo/NCCL ranks, shrunk)",
        description="Hypothesis draws world sizes, each rank's micro-batches, sample or token models (ranks with "
        "different real-token counts), optimizers and clipping, checks the step on spawned ranks and shrinks the "
        "first mismatch to the smallest split. The step must be importable by name (MODULE:FUNC): the ranks import it.",
    )
    _target_arg(search_parser)
    search_parser.add_argument(
        "--engines", type=_names, default=(), help=f"comma-separated engines to draw ({','.join(ENGINES)}; default ddp)"
    )
    search_parser.add_argument(
        "--models", type=_names, default=(), help=f"comma-separated models to draw ({','.join(MODELS)}; default both)"
    )
    search_parser.add_argument(
        "--max-examples", type=_positive_int, default=25, help="distributed cases to draw (default 25)"
    )
    search_parser.add_argument("--max-world-size", type=int, default=3, help="most ranks drawn (default 3)")
    _seed_flag(search_parser)
    _ranks_timeout_flag(search_parser, 20.0, "one case's ranks may take (default 20); a hung rank ends the search")
    _json_flag(search_parser, "the result")
    _precision_flags(search_parser)
    _format_flag(search_parser)
    search_parser.set_defaults(handler=_cmd_verify_distributed)


def _add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan_parser = commands.add_parser(
        "plan",
        help="recommend the number of micro-batches N for a memory budget",
        description="Measure a few micro-batch sizes, fit memory and time, and recommend the "
        "fastest N whose step fits the budget (no trial beyond the budget's reach).",
    )
    plan_parser.add_argument(
        "target",
        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or MODULE:FUNC "
        "returning (model, (inputs, targets)[, loss_sum])",
    )
    plan_parser.add_argument("--budget", type=parse_bytes, required=True, help="memory budget, e.g. 256MiB or 8GB")
    plan_parser.add_argument(
        "--global-batch-size",
        type=_positive_int,
        default=None,
        help="samples per optimizer step (default: the workload's, or the example batch's size)",
    )
    plan_parser.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default: cpu)")
    plan_parser.add_argument(
        "--candidates",
        type=lambda text: [_positive_int(x) for x in text.split(",")],
        default=None,
        help="comma-separated N to consider (default: powers of two up to the batch)",
    )
    plan_parser.add_argument("--repeats", type=_positive_int, default=3, help="timed steps per measured N (default: 3)")
    plan_parser.add_argument(
        "--threads", type=_positive_int, default=None, help="torch.set_num_threads for the measurement"
    )
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.set_defaults(handler=_cmd_plan)


def _add_report(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report_parser = commands.add_parser("report", help="write a markdown report (equivalence, peers, benchmarks)")
    reports = report_parser.add_subparsers(dest="report", required=True, metavar="REPORT")
    _add_report_equivalence(reports)
    _add_report_peers(reports)
    _add_report_benchmarks(reports)


def _add_report_equivalence(reports: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    equivalence = reports.add_parser(
        "equivalence", help="standard cases, searches, distributed and loss-scale sections (tox -e equivalence)"
    )
    equivalence.add_argument("--out", type=Path, default=Path("reports/equivalence.md"))
    equivalence.add_argument(
        "--no-search", action="store_true", help="only the fixed cases (skip the seeded searches and spawned ranks)"
    )
    equivalence.set_defaults(handler=_cmd_report_equivalence)


def _add_report_peers(reports: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    peers = reports.add_parser("peers", help="Accelerate, Lightning and hand-written loops under equiv (tox -e peers)")
    peers.add_argument("--out", type=Path, default=Path("reports/peers.md"))
    peers.set_defaults(handler=_cmd_report_peers)


def _add_report_benchmarks(reports: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    benchmarks = reports.add_parser("benchmarks", help="pytest --benchmark-json output as markdown (tox -e bench)")
    benchmarks.add_argument("--json", type=Path, required=True, help="pytest --benchmark-json output")
    benchmarks.add_argument("--out", type=Path, default=Path("reports/benchmarks.md"), help="markdown file to write")
    benchmarks.add_argument(
        "--full-run",
        "--scaling-full",
        dest="scaling_full",
        type=Path,
        action="append",
        default=None,
        help="a committed full run of a benchmark too long for CI (benchmarks/"
        "test_check_scaling.py, benchmarks/test_audit_false_alarms.py) to show beside this "
        "one (repeat it for several, e.g. a CPU and a GPU run)",
    )
    benchmarks.set_defaults(handler=_cmd_report_benchmarks)


def _add_sweep(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sweep_parser = commands.add_parser(
        "sweep",
        help="audit every subject of a library through its own trainer (transformers' heads, TRL's trainers)",
    )
    sweeps = sweep_parser.add_subparsers(dest="sweep", required=True, metavar="LIBRARY")
    _add_sweep_transformers(sweeps)
    _add_sweep_trl(sweeps)


def _add_sweep_transformers(sweeps: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    transformers = sweeps.add_parser(
        "transformers",
        help="every loss-computing head of the installed transformers, built tiny, trained by its Trainer with "
        "gradient accumulation, audited (tox -e sweep-transformers)",
    )
    transformers.add_argument(
        "--sample",
        action="store_true",
        help="the CI sample (a few classes, both verdicts), rendered with only what every CPU computes alike",
    )
    _sweep_flags(transformers)
    transformers.set_defaults(handler=_cmd_sweep)


def _add_sweep_trl(sweeps: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trl = sweeps.add_parser(
        "trl",
        help="TRL's trainers (SFT, DPO, KTO, Reward, GRPO, GKD, distillation, async GRPO), needs trl",
        description="Each of TRL's accumulating trainers (per loss_type) on a tiny model, gradient accumulation over "
        "uneven item counts, audited against its documented full-batch objective; one row each.",
    )
    _sweep_flags(trl)
    trl.set_defaults(handler=_cmd_sweep)


def _sweep_flags(parser: argparse.ArgumentParser) -> None:
    """What every sweep takes: the subjects, the output, saved rows to render again."""
    parser.add_argument("--only", type=_names, default=None, metavar="A,B", help="these subjects alone")
    parser.add_argument(
        "--format",
        choices=("markdown", "json"),
        default="markdown",
        help="markdown (default): the report; json: the rows (subject, family, the audit's to_dict() or the reason)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write here (default: stdout)")
    parser.add_argument(
        "--rows", type=Path, default=None, help="render the rows a --format json run saved instead of running the sweep"
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const=None,
        default=False,
        metavar="ADDRESS",
        help="fan the subjects out as Ray tasks: on a local Ray without ADDRESS, else the cluster there (extra ray); "
        "the same rows and report as in process",
    )
    parser.add_argument(
        "--workers", type=_positive_int, default=None, help="Ray workers of a local Ray (default: the CPUs)"
    )
