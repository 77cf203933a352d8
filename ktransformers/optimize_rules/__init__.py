"""Shipped rule files, one per model family: ``<Family>.yaml`` for CPU+GPU (experts on the
CPU, the rest on ``cuda:0``) and ``<Family>-cpu.yaml`` for CPU-only machines."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError

RULES_DIR = Path(__file__).resolve().parent

# architecture (config.architectures[0]) -> family file stem
DEFAULT_RULES = {
    "Qwen3MoeForCausalLM": "Qwen3Moe",
    "Qwen2MoeForCausalLM": "Qwen2Moe",
    "MixtralForCausalLM": "Mixtral",
    "DeepseekV3ForCausalLM": "DeepSeek-V3-Chat",
    "DeepseekV2ForCausalLM": "DeepSeek-V2-Chat",
    "Glm4MoeForCausalLM": "Glm4Moe",
    "DeepseekV32ForCausalLM": "DeepseekV32",
    "GlmMoeDsaForCausalLM": "GlmMoeDsa",
    "Qwen3_5MoeForCausalLM": "Qwen3_5Moe",
    "Qwen3NextForCausalLM": "Qwen3Next",
    "DeepseekV4ForCausalLM": "DeepSeek-V4",
    "MiniMaxM2ForCausalLM": "MiniMaxM2",
    "GptOssForCausalLM": "GptOss",
    "LlamaForCausalLM": "Dense",
    "MistralForCausalLM": "Dense",
    "Qwen2ForCausalLM": "Dense",
    "Qwen3ForCausalLM": "Dense",
    "Gemma3ForCausalLM": "Dense",
    "Gemma3ForConditionalGeneration": "Dense",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3VLMoe",
    "Glm4vMoeForConditionalGeneration": "Glm4vMoe",
    "Ernie4_5_VLMoeForConditionalGeneration": "Ernie4_5_VLMoe",
}


def auto_model_class(config):
    """The transformers auto class that builds ``config``'s model: the causal LM, or for a
    vision-language config (no causal-LM class) its image-text-to-text class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText


def architecture(config) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    try:
        return auto_model_class(config)._model_mapping[type(config)].__name__
    except KeyError:
        raise ConfigError(f"model type '{config.model_type}' is not a causal LM transformers knows") from None


def default_rule_file(config, cuda: bool | None = None) -> Path:
    """The shipped rule file for this config's architecture (CPU variant without CUDA)."""
    arch = architecture(config)
    stem = DEFAULT_RULES.get(arch)
    if stem is None:
        known = ", ".join(sorted(DEFAULT_RULES))
        raise ConfigError(f"no shipped rule file for {arch}; pass --optimize_config_path (known: {known})")
    qc = getattr(config, "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = getattr(qc, "to_dict", lambda: {})()
    if stem == "DeepSeek-V3-Chat" and qc.get("quant_method") == "fp8":
        stem = "DeepSeek-V3-Chat-fp8-linear"  # keep the published FP8 linears as FP8
    if cuda is None:
        cuda = torch.cuda.is_available()
    return RULES_DIR / (f"{stem}.yaml" if cuda else f"{stem}-cpu.yaml")


def shipped_rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yaml"))
