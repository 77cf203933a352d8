"""Alias of transformers' DeepSeek-V2 classes (same as ``modeling_deepseek``)."""
from .modeling_deepseek import *  # noqa: F401,F403
from .modeling_deepseek import DeepseekV2MoE, DeepseekV2YarnRotaryEmbedding, MoEGate  # noqa: F401
