"""Alias of transformers' Qwen3-MoE classes under the reference system's path."""
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: F401
    Qwen3MoeAttention, Qwen3MoeDecoderLayer, Qwen3MoeExperts, Qwen3MoeForCausalLM, Qwen3MoeMLP, Qwen3MoeModel,
    Qwen3MoeRMSNorm, Qwen3MoeRotaryEmbedding, Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter,
)
