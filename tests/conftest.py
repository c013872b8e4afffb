import pytest
import torch

# Small models: one thread is fastest and keeps a 2-core machine responsive.
torch.set_num_threads(1)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)
