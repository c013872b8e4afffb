"""Every code block of README.md and docs/*.md runs, as written, or says why it cannot.

A small collector of our own rather than a plugin (pytest-markdown-docs, phmdoctest): a page's blocks must
run in order as *one script* (a later block uses what an earlier one defined), blocks that start ranks must
run from a real file whose ``__main__`` the ranks import again (so the page's ``if __name__ == "__main__":``
guards are exercised, not papered over), shell blocks run the ``equiv`` command on files the page wrote,
and a shown output must still be what the code prints.  Each page runs in a fresh folder and a fresh
interpreter (tests/docs_runner.py) with a time limit; a failure names the page and the line.

What a page may say, in an HTML comment on the line(s) right above a fence (invisible on the rendered page):

- ``<!-- not-run: REASON -->``: the block is not run (counted: see :data:`NOT_RUN`); the reason is required.
- ``<!-- file: NAME -->`` above a ```python block: it is written to NAME in the page's folder (for the shell
  blocks and imports after it) instead of run; it must compile.
- ``<!-- raises: ExceptionName -->`` above a ```python block: the block must raise that exception.
- ``<!-- exit: N -->`` above a ```bash block: the commands' exit status (default 0).
- ``<!-- output -->`` above a ```text block: every line of it (stripped; ``...`` lines skipped, numbers in
  scientific notation being the machine's rounding noise) appears in the output of the block run before it.

And once per page: ``<!-- docs-test: slow -->`` (marked slow) and ``<!-- docs-test: timeout=N -->`` (seconds
for the whole page, default 240).  Only ```python, ```bash and ```text fences are allowed, at the start of
a line, so no example can hide from the collector; a ```bash block runs only ``equiv``, ``python``,
``pytest`` or ``torchrun`` commands (anything else, ``pip install`` say, must be marked not-run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "text"}
RUNNABLE_COMMANDS = ("equiv ", "python ", "pytest ", "torchrun ")
#: How many blocks are shown but not run, page by page: adding one is a decision, made here.
NOT_RUN = {
    "README.md": 3,
    "docs/index.md": 1,
    "docs/audit.md": 1,
    "docs/distributed.md": 2,
}
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*([a-z-]+)\s*:?\s*(.*?)\s*-->$")
NOISE = re.compile(r"\d(\.\d+)?e[+-]\d+")


@dataclass
class Block:
    page: str
    line: int  # the first line of the block's body, 1-based
    language: str
    source: str
    markers: dict[str, str] = field(default_factory=dict)


@dataclass
class Page:
    path: str
    blocks: list[Block]
    settings: dict[str, str]
    source: Path


def parse(path: Path, root: Path = ROOT) -> Page:
    """The page's fenced blocks, each with the markers in the comment lines right above it."""
    name = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    settings: dict[str, str] = {}
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line.strip())
        if marker and marker.group(1) == "docs-test":
            for word in marker.group(2).split():
                key, _, value = word.partition("=")
                settings[key] = value
        opened = FENCE.match(line)
        if line.lstrip().startswith("```") and not opened:
            raise AssertionError(f"{name}:{index + 1}: a fence must start the line and name one language")
        if opened is None:
            index += 1
            continue
        language = opened.group(1)
        assert language in LANGUAGES, f"{name}:{index + 1}: fence language {language!r}: use one of {sorted(LANGUAGES)}"
        markers: dict[str, str] = {}
        above = index - 1
        while above >= 0 and (found := MARKER.match(lines[above].strip())) and found.group(1) != "docs-test":
            markers[found.group(1)] = found.group(2)
            above -= 1
        end = index + 1
        while end < len(lines) and lines[end] != "```":
            end += 1
        assert end < len(lines), f"{name}:{index + 1}: the block never closes"
        blocks.append(Block(name, index + 2, language, "\n".join(lines[index + 1 : end]) + "\n", markers))
        index = end + 1
    return Page(name, blocks, settings, path)


def commands(source: str) -> list[str]:
    """A shell block's commands, continuation lines joined, comments and blank lines left out."""
    joined = source.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def same_line(line: str) -> str:
    return NOISE.sub("<rounding>", line.strip())


def check_output(block: Block, output: str) -> None:
    produced = {same_line(line) for line in output.splitlines()}
    for offset, line in enumerate(block.source.splitlines()):
        if line.strip() and line.strip() != "..." and same_line(line) not in produced:
            raise AssertionError(
                f"{block.page}:{block.line + offset}: the page shows {line.strip()!r}, "
                f"which the code no longer prints. It printed:\n{output}"
            )


def run_page(page: Page, folder: Path) -> None:
    """Write the page's files, run its blocks in one interpreter, then compare its shown outputs."""
    plan: list[dict[str, object]] = []
    runs: list[Block] = []
    timeout = float(page.settings.get("timeout", 240))
    for block in page.blocks:
        if "not-run" in block.markers or block.language == "text":
            continue
        if "file" in block.markers:
            compile(block.source, f"{block.page}:{block.line}", "exec")
            target = folder / block.markers["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.source)
            continue
        if block.language == "bash":
            for command in commands(block.source):
                assert command.startswith(RUNNABLE_COMMANDS), (
                    f"{block.page}:{block.line}: {command!r} is not a command the docs test runs "
                    f"({', '.join(c.strip() for c in RUNNABLE_COMMANDS)}): mark the block <!-- not-run: why -->"
                )
        plan.append(
            {
                "kind": block.language,
                "page": block.page,
                "line": block.line,
                "source": block.source,
                "raises": block.markers.get("raises"),
                "exit": int(block.markers.get("exit", "0")),
                "timeout": timeout,
            }
        )
        runs.append(block)
    shutil.copy(Path(__file__).with_name("docs_runner.py"), folder / "docs_runner.py")
    # The page itself where its blocks' file name points, so a traceback shows the doc's own lines.
    (folder / page.path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(page.source, folder / page.path)
    (folder / "plan.json").write_text(json.dumps({"blocks": plan}))
    env = dict(os.environ)
    # The equiv being tested, and this interpreter's commands (equiv, pytest) first on PATH.
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    try:
        ran = subprocess.run(
            [sys.executable, "docs_runner.py"], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{page.path}: its examples took more than {timeout:.0f} s "
            f"(<!-- docs-test: timeout=N --> if that is expected)"
        ) from exc
    assert ran.returncode == 0, f"{page.path}: an example failed\n{ran.stderr[-6000:]}"
    outputs = {int(r["line"]): str(r["output"]) for r in json.loads((folder / "results.json").read_text())}
    previous: Block | None = None
    for block in page.blocks:
        if block in runs:
            previous = block
        elif "output" in block.markers:
            assert previous is not None, f"{block.page}:{block.line}: an output block with no run block before it"
            check_output(block, outputs[previous.line])


def page_params() -> list[object]:
    params = []
    for path in PAGES:
        page = parse(path)
        marks = [pytest.mark.slow] if "slow" in page.settings else []
        params.append(pytest.param(page, id=page.path, marks=marks))
    return params


@pytest.mark.docs
@pytest.mark.parametrize("page", page_params())
def test_the_page_examples_run_as_written(page: Page, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def test_every_block_is_run_or_says_why_not() -> None:
    counted: dict[str, int] = {}
    for path in PAGES:
        page = parse(path)
        for block in page.blocks:
            if "not-run" in block.markers:
                assert len(block.markers["not-run"].split()) >= 2, (
                    f"{block.page}:{block.line}: say why the block is not run, e.g. <!-- not-run: needs CUDA -->"
                )
                counted[page.path] = counted.get(page.path, 0) + 1
            if "output" in block.markers:
                assert block.language == "text", f"{block.page}:{block.line}: an output is a ```text block"
            if block.language == "python" and "file" not in block.markers and "not-run" not in block.markers:
                spawns = re.search(r"\b(check_distributed|check_pipeline|verify_distributed)\(", block.source)
                assert not spawns or '__name__ == "__main__"' in block.source, (
                    f'{block.page}:{block.line}: a block that starts ranks needs an if __name__ == "__main__": '
                    "guard (the ranks import the script again)"
                )
    assert counted == NOT_RUN, "blocks not run, by page, differ from NOT_RUN: update it with the reason in the page"


def test_the_collector_finds_the_examples_and_refuses_an_unrunnable_command(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- file: steps.py -->\n```python\nX = 1\n```\n\n```bash\npip install equiv\n```\n")
    parsed = parse(page, root=tmp_path)
    assert [(b.language, b.markers) for b in parsed.blocks] == [("python", {"file": "steps.py"}), ("bash", {})]
    with pytest.raises(AssertionError, match="mark the block <!-- not-run"):
        run_page(parsed, tmp_path)


def test_a_changed_output_is_caught() -> None:
    block = Block("docs/x.md", 10, "text", "...\nTier exact (float64): worst 1.01e+14 x allowed\nok 2.04\n")
    check_output(block, "Tier exact (float64): worst 3.3e+13 x allowed\nok 2.04\n")
    with pytest.raises(AssertionError, match=r"docs/x.md:12: the page shows 'ok 2.04'"):
        check_output(block, "Tier exact (float64): worst 3.3e+13 x allowed\nok 2.05\n")
