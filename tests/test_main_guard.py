"""A spawning front door called at the top level of a script, without
``if __name__ == "__main__":``: every rank imports the script again and calls
equiv again there.  The script must end with one clear error naming the guard
(non-zero exit), never multiprocessing's bootstrapping tracebacks per rank, never
a STEP_ERROR verdict and exit 0; with the guard the same call runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PIPELINE = """
import equiv
verdict = equiv.check_pipeline(equiv.PipelineSetting(schedule="GPipe", scale_grads=True, loss="mean", steps=1))
print("returned", verdict.status.value)
"""
TENSOR_PARALLEL = """
import equiv
case = equiv.Case(batch_size=1, micro_batch_sizes=(1,), model_kwargs={"hidden": (8,), "activation": "tanh"})
dcase = equiv.DistributedCase.of(case, [[1, 2]], tensor_parallel=2)
verdict = equiv.check_distributed(equiv.accumulator_step, dcase, engine="tp")
print("returned", verdict.status.value)
"""


def run_script(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("source", [PIPELINE, TENSOR_PARALLEL], ids=["check_pipeline", "check_distributed tp"])
def test_a_spawning_call_without_a_main_guard_is_one_clear_error(tmp_path: Path, source: str) -> None:
    done = run_script(tmp_path, source)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "returned" not in done.stdout  # no verdict: the step was never run
    error = done.stderr.strip().splitlines()
    assert error[-1].startswith("equiv.distributed.launcher.UnguardedMainError: "), done.stderr
    assert 'put that call under `if __name__ == "__main__":`' in error[-1] and "train.py" in error[-1]
    assert "bootstrapping phase" not in done.stderr and len(error) < 25, done.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_the_same_call_under_the_guard_runs(tmp_path: Path) -> None:
    guarded = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in PIPELINE.strip().splitlines())
    done = run_script(tmp_path, guarded)
    assert done.returncode == 0, done.stderr
    assert "returned equivalent" in done.stdout or "returned not_equivalent" in done.stdout, done.stdout
