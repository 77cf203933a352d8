"""Dense MLP placement operator (forward is the original's; rule compatibility)."""

from __future__ import annotations

from .base import BaseInjectedModule


class KMLP(BaseInjectedModule):
    """Places a dense MLP (its linears can be injected by their own rules).  kwargs: devices."""


kDeepseekV3MLP = KDeepseekV3MLP = KQwen2MoeMLP = KGlm4MoeMLP = KMLP
