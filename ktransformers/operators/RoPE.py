"""Rotary embeddings.  transformers computes them correctly already; the operator exists so
rules can place them (their cos/sin follow the attention's device) and so the reference
system's rule files (``RoPE.YarnRotaryEmbeddingV3`` …) keep loading."""

from __future__ import annotations

from .base import BaseInjectedModule


class KRotaryEmbedding(BaseInjectedModule):
    """Places a rotary-embedding module; forward is the original's.  kwargs: devices."""


# names used by the reference system's rule files
RotaryEmbedding = RotaryEmbeddingV2 = RotaryEmbeddingV3 = RotaryEmbeddingV4 = KRotaryEmbedding
YarnRotaryEmbedding = YarnRotaryEmbeddingV3 = DynamicNTKScalingRotaryEmbedding = KRotaryEmbedding
DeepSeekV3YarnRotaryEmbedding = KQwen3MoeRotaryEmbedding = KGlm4MoeRotaryEmbedding = KRotaryEmbedding
