"""LoRA supervised fine-tuning of (MoE) models on the injected model: ``python -m ktransformers.sft CONFIG.yaml``.

``config`` (the LLaMA-Factory-style keys), ``data`` (alpaca / sharegpt files), ``templates``
(prompt formats, response-only labels), ``model`` (training rules + LoRA), ``trainer`` (the
loop, checkpoints), ``adapter`` (PEFT-format files, loading for inference, merging).
"""
