import os
import sys

# Test helpers (dist_utils) import by plain name in the test process and in the
# spawned rank processes, which inherit this sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402 - after the path and thread setup above


@pytest.fixture
def device() -> str:
    """The device of the tests that take it: ``VEFSDP_TEST_DEVICE`` (default ``cpu``;
    ``make gpu-check`` sets ``cuda``). Tests without this fixture run on the CPU."""
    name = os.environ.get("VEFSDP_TEST_DEVICE", "cpu")
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(f"VEFSDP_TEST_DEVICE={name} but no CUDA device is available")
    return name
