"""Rotary embeddings.  transformers computes them correctly already; the operator exists so
rules can place them (their cos/sin follow the attention's device)."""

from __future__ import annotations

from .base import BaseInjectedModule
from .kinds import ROTARY
from .registry import register


@register("KRotaryEmbedding")
class KRotaryEmbedding(BaseInjectedModule):
    """Places a rotary-embedding module; forward is the original's.  kwargs: devices."""

    REPLACES = (ROTARY,)
