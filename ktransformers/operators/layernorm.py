"""RMSNorm placement operator (forward is the original's; exists for rule compatibility)."""

from __future__ import annotations

from .base import BaseInjectedModule


class KRMSNorm(BaseInjectedModule):
    """Places an RMSNorm module.  kwargs: devices."""


RMSNorm = KQwen2MoeRMSNorm = KQwen3MoeRMSNorm = KGlm4MoeRMSNorm = DeepseekV3RMSNormTorch = KRMSNorm
