"""What is pinned and reported holds under every CPU kernel set and thread count.

torch picks its CPU kernels by the processor (``torch.backends.cpu.
get_cpu_capability()``: DEFAULT, AVX2, AVX512) and each rounds in its own
order, so the digits of a check move from one machine to the next.  Here the
pinned facts (tests/data/pinned_verdicts.json) and the report's search
sections (bug zoo, reference searched, inherent non-equivalences) are
recomputed in fresh processes (tests/portability_probe.py) under
``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` with one thread, and
under the machine's own kernels with two threads; each must give the pinned
facts and sections identical to the committed reports/equivalence.md, and
the ``ci`` profile's search of every zoo bug must find it and shrink it to the
same case under each.  A
capability the CPU lacks is skipped with the reason (forced anyway, torch dies
of an illegal instruction).  Slow (minutes): marked
``portability``; the fast loop leaves it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_pinned_verdicts import pinned_rows

pytestmark = pytest.mark.portability

HERE = Path(__file__).parent
REPORT = HERE.parent / "reports" / "equivalence.md"
#: name -> (ATEN_CPU_CAPABILITY or None for torch's own pick, OMP_NUM_THREADS)
CONFIGS: dict[str, tuple[str | None, int]] = {
    "default-kernels": ("default", 1),
    "avx2-kernels": ("avx2", 1),
    "avx512-kernels": ("avx512", 1),
    "own-kernels-2-threads": (None, 2),
}
#: Seconds one probe may take (it is a few minutes on a 2-core machine).
PROBE_TIMEOUT_S = 1800
#: torch's x86 kernel sets, each needing the CPU to have the one before's instructions too.
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


def _own_capability() -> str:
    """The kernel set torch picks on this CPU when not told (a fresh process: torch reads it once)."""
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    command = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=True).stdout.strip()


def _unsupported(capability: str | None, own: str) -> str | None:
    """Why ``capability`` cannot be forced here (None if it can).  Forcing a set the
    CPU lacks does not fall back: torch dies of an illegal instruction (SIGILL)."""
    if capability is None or capability.upper() == own:
        return None
    if own not in X86_CAPABILITIES:
        return f"{capability.upper()} kernels are x86's; torch picks {own} on this CPU"
    if X86_CAPABILITIES.index(capability.upper()) > X86_CAPABILITIES.index(own):
        return f"this CPU has no {capability.upper()} instructions (torch picks {own} on it)"
    return None


def _probe(name: str, out_dir: Path, own: str) -> dict[str, Any]:
    capability, threads = CONFIGS[name]
    skip = _unsupported(capability, own)
    if skip is not None:
        return {"skip": skip}
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    env["OMP_NUM_THREADS"] = str(threads)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = out_dir / f"{name}.json"
    command = [sys.executable, str(HERE / "portability_probe.py"), str(out)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the probe took over {PROBE_TIMEOUT_S} s"}
    if done.returncode != 0:
        how = f"was killed by signal {-done.returncode}" if done.returncode < 0 else f"exited {done.returncode}"
        return {"error": f"the probe under {name} {how}:\n{done.stderr[-3000:]}"}
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every configuration's probe, two at a time (one per core)."""
    out_dir = tmp_path_factory.mktemp("portability")
    own = _own_capability()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda name: (name, _probe(name, out_dir, own)), CONFIGS)
        return dict(results)


def _result(probes: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    result = probes[name]
    if "skip" in result:
        pytest.skip(result["skip"])
    assert "error" not in result, result.get("error")
    capability, threads = CONFIGS[name]
    if capability is not None:
        assert result["capability"].lower() == capability, (
            f"asked for {capability}, torch picked {result['capability']}"
        )
    assert result["threads"] == threads, f"OMP_NUM_THREADS={threads} gave {result['threads']} threads"
    return result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pinned_verdict_facts_hold_under(probes: dict[str, dict[str, Any]], name: str) -> None:
    result = _result(probes, name)
    pinned = {f"{row['candidate']} | {row['case_name']}": row["facts"] for row in pinned_rows()}
    differing = {
        key: (result["facts"].get(key), facts) for key, facts in pinned.items() if result["facts"].get(key) != facts
    }
    assert not differing, (
        f"{len(differing)} of {len(pinned)} pinned verdicts differ under {name} "
        f"({result['capability']}, {result['threads']} thread(s)); got / pinned:\n"
        + "\n".join(f"{key}:\n  {got}\n  {want}" for key, (got, want) in list(differing.items())[:10])
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_report_searches_reach_the_committed_outcomes_under(probes: dict[str, dict[str, Any]], name: str) -> None:
    result = _result(probes, name)
    committed = REPORT.read_text()
    for section in result["search_sections"]:
        title = section.splitlines()[0]
        assert section in committed, (
            f"{title!r} under {name} ({result['capability']}, {result['threads']} thread(s)) differs from "
            f"{REPORT.name}:\n{section}"
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_ci_profile_searches_find_and_shrink_to_the_same_cases_under(
    probes: dict[str, dict[str, Any]], name: str
) -> None:
    result = _result(probes, name)
    assert all(search["found"] for search in result["ci_searches"].values()), result["ci_searches"]
    others = [
        (other, probe)
        for other, probe in probes.items()
        if other != name and "ci_searches" in probe and "skip" not in probe
    ]
    for other, probe in others:
        differing = [bug for bug, search in result["ci_searches"].items() if probe["ci_searches"].get(bug) != search]
        assert not differing, (
            f"the ci searches of {differing} end elsewhere under {name} ({result['capability']}) than under "
            f"{other} ({probe['capability']}): "
            + "; ".join(f"{bug}: {result['ci_searches'][bug]} vs {probe['ci_searches'].get(bug)}" for bug in differing)
        )
