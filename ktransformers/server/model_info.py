"""What the model API routes report about the served model, counted from the weights as stored.

An injected model holds quantized weights in its operators' buffers and packed copies, not as
``nn.Parameter``s, so ``model.parameters()`` after injection counts almost nothing (a 270M model
read as "0.1M"); the weight file counts every stored parameter once (a tied embedding too).
"""

from __future__ import annotations

import math


def stored_parameter_count(source, model=None) -> int:
    """Parameters the weight source stores; the model's own parameters when it has no source."""
    names = getattr(source, "names", None)
    if callable(names):
        try:
            return sum(math.prod(source.shape(n)) for n in names())
        except Exception:  # a source that cannot size a name: fall back to the module tree
            pass
    try:
        return sum(p.numel() for p in model.parameters()) if model is not None else 0
    except Exception:
        return 0


def parameter_size(n: int) -> str:
    """A parameter count as Ollama writes it (``format.HumanNumber``): 268.10M, 7.6B, 30B, 512K."""
    for unit, scale, digits in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.{digits}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1e3 else str(n)
