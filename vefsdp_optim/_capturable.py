"""``capturable=True``: what a step must be for a CUDA graph to capture it, and the
checks of a param group that asks for it ([Note: capturable steps])."""

from __future__ import annotations

from typing import Any

import torch

from ._torch_compat import capturable_devices, tree_flatten

__all__ = ["check_capturable"]


# [Note: capturable steps]
# capturable=True is torch.optim's flag, a param group key. It makes a step a fixed
# sequence of device work that a CUDA graph can capture and replay. Three rules follow.
#   - Step counts are float32 0-d tensors on the parameters' device, incremented there.
#     Every coefficient read from them or from a Tensor lr is computed there too, such as
#     bias corrections and step sizes. A replay then advances them and reads the lr
#     tensor that a scheduler changed in place.
#   - Nothing in the step reads a device value on the host: no .item(), no branch on a
#     tensor. No host tensor enters a device op, since its value would be the one read at
#     capture. So Tensor hyperparameters must live on the parameters' device.
#   - The host work a step does once is done by the eager steps before a capture: its
#     plan, the batching probes, the code tables. torch requires such warm-up anyway.
# The results are the same at every world size as on one device with capturable=True.
# They differ from capturable=False in the last bits, as torch's capturable Adam does,
# because the coefficients are rounded on the device. torch refuses capturable=True on
# the CPU, which has no graphs, and so does this check. AdamW leaves it to torch's own
# error. A graph replays the kind of step it captured. SOAP and Shampoo decide on the
# host when to refresh their preconditioners, from their count of step() calls. The
# steps in between are capturable. The refreshes, and SOAP's first step, run eagerly as
# step() calls: they call eigh, which reads its error code back to the host on CUDA, or
# QR. count_replays(n) counts replays.
def check_capturable(name: str, group: dict[str, Any], device: torch.device) -> None:
    """The checks of ``capturable=True`` ([Note: capturable steps]): the parameter's
    device is one torch.optim accepts for it, and every Tensor hyperparameter lives there
    (a host value would be read once, when the step is captured)."""
    devices = capturable_devices()
    if device.type not in devices:
        raise ValueError(
            f"{name}(capturable=True) needs its parameters on a device whose steps CUDA graphs "
            f"can capture ({', '.join(devices)}), got a parameter on {device}; use "
            f"capturable=False on {device.type}")
    for key, value in group.items():
        if key == "params":
            continue
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.device != device:
                raise ValueError(
                    f"{name}(capturable=True) needs Tensor hyperparameters on the "
                    f"parameters' device {device}, got {key!r} on {t.device}: a captured step "
                    f"would keep the value it read when captured; pass {key} as a float or as a "
                    f"tensor on {device}")
