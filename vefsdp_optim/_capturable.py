"""``capturable=True``: what a step must be for a CUDA graph to capture it, and the
checks of a param group that asks for it ([Note: capturable steps])."""

from __future__ import annotations

from typing import Any

import torch

from ._torch_compat import capturable_devices, tree_flatten

__all__ = ["check_capturable"]


# [Note: capturable steps]
# capturable=True (torch.optim's flag, a param group key) makes a step a fixed sequence of
# device work that a CUDA graph can capture and replay:
#   - step counts are float32 0-d tensors on the parameters' device, incremented there,
#     and every coefficient read from them or from a Tensor lr (bias corrections, step
#     sizes) is computed there: a replay advances them and reads the lr tensor a
#     scheduler changed in place;
#   - nothing in the step reads a device value on the host (no .item(), no branch on a
#     tensor), and no host tensor enters a device op (its value would be the one read at
#     capture): Tensor hyperparameters must live on the parameters' device;
#   - the host work a step does once (its plan, the batching probes, code tables) is done
#     by the eager steps before a capture, which torch requires anyway (warm-up).
# The results are the same at every world size as on one device with capturable=True,
# and differ from capturable=False in the last bits, as torch's capturable Adam does
# (coefficients rounded on the device). torch refuses capturable=True on the CPU, which
# has no graphs; so do we, here (AdamW leaves it to torch's own error).
# A graph replays the kind of step it captured. SOAP and Shampoo decide on the host when to
# refresh their preconditioners, from their count of step() calls: the steps in between are
# capturable; the refreshes (and SOAP's first step) call eigh (which reads its error code back
# to the host on CUDA) or QR and run eagerly, as step() calls; count_replays(n) counts replays.
def check_capturable(name: str, group: dict[str, Any], device: torch.device) -> None:
    """The checks of ``capturable=True`` ([Note: capturable steps]): the parameter's
    device is one torch.optim accepts for it, and every Tensor hyperparameter lives there
    (a host value would be read once, when the step is captured)."""
    devices = capturable_devices()
    if device.type not in devices:
        raise ValueError(
            f"{name}(capturable=True) needs its parameters on a device whose steps CUDA graphs "
            f"can capture ({', '.join(devices)}), got a parameter on {device}; use capturable=False "
            f"on {device.type}")
    for key, value in group.items():
        if key == "params":
            continue
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.device != device:
                raise ValueError(
                    f"{name}(capturable=True) needs Tensor hyperparameters on the parameters' device "
                    f"{device}, got {key!r} on {t.device}: a captured step would keep the value it "
                    f"read when captured; pass {key} as a float or as a tensor on {device}")
