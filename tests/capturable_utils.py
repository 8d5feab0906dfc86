"""``capturable=True`` on the CPU, for the tests of its numerics ([Note: capturable steps]).

torch.optim refuses ``capturable=True`` on the CPU (no CUDA graphs there), and so do
our optimizers. The math of a capturable step is device code all the same, so the tests
run it on CPU tensors with the CPU added to torch's list of capturable devices, which
torch's Adam(W) and our checks both read; on a GPU the same steps run unpatched
(tools/_gpu_capture.py captures them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.optim.adam as torch_adam
import torch.optim.optimizer as torch_optimizer

_MODULES = (torch_optimizer, torch_adam)


@contextlib.contextmanager
def capturable_on_cpu() -> Iterator[None]:
    """Within: ``capturable=True`` accepted on CPU tensors, by torch's Adam(W) and ours."""
    originals = [m._get_capturable_supported_devices for m in _MODULES]

    def devices(supports_xla: bool = True) -> list[str]:
        return [*originals[0](supports_xla), "cpu"]

    for m in _MODULES:
        m._get_capturable_supported_devices = devices
    try:
        yield
    finally:
        for m, f in zip(_MODULES, originals, strict=True):
            m._get_capturable_supported_devices = f
