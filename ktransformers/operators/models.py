"""The model backbone operator.  Device hops between layers are driven by the per-module
placement of the rules themselves, so ``transfer_map`` is not needed; when a rule file gives
one (reference-system files do), it is checked against the placement instead of silently
disagreeing with it."""

from __future__ import annotations

from .base import BaseInjectedModule, KwargSpec
from .kinds import BACKBONE
from .registry import register


@register("KTransformersModel")
class KTransformersModel(BaseInjectedModule):
    """Places the decoder backbone.  kwargs: devices, ``transfer_map`` (checked, see above)."""

    REPLACES = (BACKBONE,)
    KWARGS = {
        "transfer_map": KwargSpec((dict,), None, "layer index -> device; must agree with the layers' rules"),
        "prefill_threshold": KwargSpec((int,), None, "accepted for compatibility; ignored (the backbone has no ops)"),
        "device": KwargSpec((str,), None, "both phases' device"),
    }

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, prefill_device=None,
                 generate_device=None, transfer_map=None, device=None, **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device or device,
                         generate_device or device, **kwargs)
        object.__setattr__(self, "transfer_map", dict(transfer_map or {}))
