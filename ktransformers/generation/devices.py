"""Where a module computes, for the batched runner (``paged.py``) and its lean decode step
(``decode_step.py``)."""

from __future__ import annotations

import torch


def module_device(mod: torch.nn.Module) -> torch.device:
    """An injected operator's ``generate_device``, else the device of its first tensor off the meta
    device, else the CPU."""
    dev = getattr(mod, "generate_device", None)
    if dev is not None:
        return torch.device(dev)
    for t in list(mod.parameters()) + list(mod.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
