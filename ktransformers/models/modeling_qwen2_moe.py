"""Alias of transformers' Qwen2-MoE classes under the reference system's path.

The reference system's Qwen3-MoE rules name ``modeling_qwen2_moe.Qwen2MoeRotaryEmbedding``
for Qwen3-MoE models too; in transformers 5 the two are different classes, so the alias here
matches either (a rotary embedding of Qwen2-MoE *or* Qwen3-MoE)."""
from torch import nn
from transformers.models.qwen2_moe.modeling_qwen2_moe import (  # noqa: F401
    Qwen2MoeAttention, Qwen2MoeDecoderLayer, Qwen2MoeExperts, Qwen2MoeForCausalLM, Qwen2MoeMLP, Qwen2MoeModel,
    Qwen2MoeRMSNorm, Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRotaryEmbedding as _Q2Rope
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding as _Q3Rope


class _AnyQwenMoeRopeMeta(type(nn.Module)):
    def __instancecheck__(cls, obj):
        return isinstance(obj, (_Q2Rope, _Q3Rope))

    def __subclasscheck__(cls, sub):
        return issubclass(sub, (_Q2Rope, _Q3Rope))


class Qwen2MoeRotaryEmbedding(nn.Module, metaclass=_AnyQwenMoeRopeMeta):
    """isinstance-compatible stand-in for either Qwen-MoE rotary class (never instantiated)."""
