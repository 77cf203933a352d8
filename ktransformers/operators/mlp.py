"""Dense MLP placement operator (forward is the original's)."""

from __future__ import annotations

from .base import BaseInjectedModule
from .kinds import MLP
from .registry import register


@register("KMLP")
class KMLP(BaseInjectedModule):
    """Places a dense MLP (its linears can be injected by their own rules).  kwargs: devices."""

    REPLACES = (MLP,)
