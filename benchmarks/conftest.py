"""Settings every benchmark shares, read once from the environment.

EQUIV_BENCH_DEVICE   cpu (default) or cuda[:index]; cuda skips cleanly where there is none
EQUIV_BENCH_THREADS  torch.set_num_threads for the run (default 1, as tox's OMP_NUM_THREADS: on a
                     shared 2-core machine, 2 OpenMP threads next to any other busy process
                     spin at barriers and single steps take 10-20x longer; measured here)
EQUIV_BENCH_QUICK    1: few rounds, for CI (the report is regenerated on every run)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    device: torch.device
    threads: int
    quick: bool
    #: Timed rounds per (workload, N, implementation); each round is one fresh model's second step.
    rounds: int
    #: Native/Accumulator step pairs timed alternately for the paired overhead ratio.
    overhead_pairs: int

    def extra_info(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "threads": self.threads,
            "quick": self.quick,
            "torch_version": torch.__version__,
            # Other processes on a shared machine move CPU timings; the report shows this.
            "load_average_1min": round(os.getloadavg()[0], 2),
        }


def _settings() -> BenchSettings:
    device = torch.device(os.environ.get("EQUIV_BENCH_DEVICE", "cpu"))
    threads_text = os.environ.get("EQUIV_BENCH_THREADS", "1")
    if not threads_text.isdigit() or int(threads_text) < 1:
        raise pytest.UsageError(f"EQUIV_BENCH_THREADS must be a positive integer, got {threads_text!r}")
    quick = os.environ.get("EQUIV_BENCH_QUICK", "0") not in ("", "0")
    return BenchSettings(
        device=device,
        threads=int(threads_text),
        quick=quick,
        rounds=3 if quick else 15,
        overhead_pairs=6 if quick else 30,
    )


@pytest.fixture(scope="session")
def bench_settings() -> BenchSettings:
    settings = _settings()
    if settings.device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"EQUIV_BENCH_DEVICE={settings.device} but torch.cuda.is_available() is False")
    if settings.device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"EQUIV_BENCH_DEVICE must be cpu or cuda[:index], got {settings.device}")
    # Deliberate, and recorded: CPU throughput depends on it more than on anything else.
    torch.set_num_threads(settings.threads)
    return settings
