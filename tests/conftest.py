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


# [The suite's own cost] What CI prints at the end, so that a change that leaks process
# groups or threads again, or makes the suite slow, shows in its log: the wall time, the
# most threads one distributed worker held after a job, this process's and the machine's
# thread counts, and the highest 1-minute load seen between tests. pytest's own
# --durations (the Makefile's targets) lists the slowest cases.
import time  # noqa: E402

_START = time.monotonic()
_MAX_LOAD = [0.0]


def _machine_threads() -> int:
    total = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                total += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:  # the process ended while we listed
                pass
    return total


def pytest_runtest_logfinish(nodeid, location):
    _MAX_LOAD[0] = max(_MAX_LOAD[0], os.getloadavg()[0])


def pytest_terminal_summary(terminalreporter):
    if not os.path.isdir("/proc/self/task"):
        return
    from dist_utils import stats

    wall = time.monotonic() - _START
    tr = terminalreporter
    tr.section("the suite's own cost")
    tr.write_line(f"wall time {wall / 60:.1f} min; highest 1-minute load between tests "
                  f"{_MAX_LOAD[0]:.1f} on {os.cpu_count()} CPUs")
    tr.write_line(stats.summary())
    tr.write_line(f"threads now: this process {len(os.listdir('/proc/self/task'))}, "
                  f"the machine {_machine_threads()}")
