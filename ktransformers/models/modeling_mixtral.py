"""Alias of transformers' Mixtral classes under the reference system's path."""
from transformers.models.mixtral.modeling_mixtral import (  # noqa: F401
    MixtralAttention, MixtralDecoderLayer, MixtralExperts, MixtralForCausalLM, MixtralModel, MixtralRMSNorm,
    MixtralRotaryEmbedding, MixtralSparseMoeBlock, MixtralTopKRouter,
)
