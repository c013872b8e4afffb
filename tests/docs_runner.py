"""Run one documentation page's examples in order, as one script pasted from the page would run
(tests/test_docs_examples.py copies this file, with the page's plan.json beside it, into a fresh folder).

Every ```python block runs in this module's own namespace, in page order, so a later block sees what an
earlier one defined, and a function it defines lives in ``__main__`` as in a user's script: the ranks that
``equiv.check_distributed`` / ``equiv.check_pipeline`` start import this file again (as ``__mp_main__``),
which re-runs the python blocks and nothing else.  That is why such calls sit under
``if __name__ == "__main__":`` in the docs, exactly as a user must write them.  Each block is compiled
with the page's path and its own line numbers, so a traceback names the page and line of the doc.

```bash blocks run in the same folder (after every python block before them) with the environment's
``equiv``, ``python`` and ``pytest``; only in the main process.

Everything lives inside :func:`_run_page` so that the only global a doc block could accidentally lean on
is that function's name.
"""


def _run_page() -> None:
    import contextlib
    import io
    import json
    import subprocess
    import sys
    import traceback
    from pathlib import Path

    here = Path(__file__).resolve().parent
    plan = json.loads((here / "plan.json").read_text())
    main = __name__ == "__main__"
    results: list[dict[str, object]] = []

    def fail(block: dict[str, object], what: str) -> None:
        print(f"{block['page']}:{block['line']}: {what}", file=sys.stderr)
        (here / "results.json").write_text(json.dumps(results))
        raise SystemExit(1)

    for block in plan["blocks"]:
        if block["kind"] == "python":
            code = compile("\n" * (int(block["line"]) - 1) + str(block["source"]), str(block["page"]), "exec")
            captured = io.StringIO()
            expected = block.get("raises")
            error: BaseException | None = None
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                try:
                    exec(code, globals())
                except BaseException as exc:  # judged below: an expected exception is the block's output
                    error = exc
            if not main:
                continue
            output = captured.getvalue()
            if error is not None and (expected is None or type(error).__name__ != expected):
                detail = "".join(traceback.format_exception(error))
                fail(
                    block,
                    f"the block raised {type(error).__name__}"
                    + (f" (expected {expected})" if expected else "")
                    + f":\n{output}{detail}",
                )
            if error is None and expected is not None:
                fail(block, f"the block was expected to raise {expected} and did not:\n{output}")
            if error is not None:
                output += f"{type(error).__module__}.{type(error).__qualname__}: {error}\n"
            sys.stdout.write(output)
            results.append({"line": block["line"], "output": output})
        elif block["kind"] == "bash" and main:
            ran = subprocess.run(
                ["bash", "-o", "pipefail", "-c", str(block["source"])],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=float(block["timeout"]),
            )
            output = ran.stdout + ran.stderr
            sys.stdout.write(output)
            if ran.returncode != int(block["exit"]):
                fail(block, f"the commands exited {ran.returncode}, the page says {block['exit']}:\n{output}")
            results.append({"line": block["line"], "output": output})
    if main:
        (here / "results.json").write_text(json.dumps(results))


_run_page()
