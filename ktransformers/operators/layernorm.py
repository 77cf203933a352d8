"""RMSNorm placement operator (forward is the original's)."""

from __future__ import annotations

from .base import BaseInjectedModule
from .kinds import NORM
from .registry import register


@register("KRMSNorm")
class KRMSNorm(BaseInjectedModule):
    """Places an RMSNorm module.  kwargs: devices."""

    REPLACES = (NORM,)
