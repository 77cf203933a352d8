"""Alias of transformers' Llama classes under the reference system's path."""
from transformers.models.llama.modeling_llama import (  # noqa: F401
    LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel, LlamaRMSNorm, LlamaRotaryEmbedding,
)
