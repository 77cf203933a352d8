"""Alias of transformers' DeepSeek-V3 classes under the reference system's path."""
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: F401
    DeepseekV3Attention, DeepseekV3DecoderLayer, DeepseekV3Experts, DeepseekV3ForCausalLM, DeepseekV3MLP,
    DeepseekV3Model, DeepseekV3MoE, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding, DeepseekV3TopkRouter,
)

MoEGate = DeepseekV3TopkRouter
DeepseekV3YarnRotaryEmbedding = DeepseekV3RotaryEmbedding
