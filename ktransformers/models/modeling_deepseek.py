"""Alias of transformers' DeepSeek-V2 classes under the reference system's path."""
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (  # noqa: F401
    DeepseekV2Attention, DeepseekV2DecoderLayer, DeepseekV2Experts, DeepseekV2ForCausalLM, DeepseekV2MLP,
    DeepseekV2Model, DeepseekV2Moe, DeepseekV2RMSNorm, DeepseekV2RotaryEmbedding, DeepseekV2TopkRouter,
)

DeepseekV2MoE = DeepseekV2Moe
MoEGate = DeepseekV2TopkRouter
DeepseekV2YarnRotaryEmbedding = DeepseekV2RotaryEmbedding
