"""LoRA adapters in PEFT's format: save, load onto an injected model, merge into the weights.

Files (what ``peft.PeftModel.from_pretrained(unmodified_hf_model, folder)`` reads):

* ``adapter_config.json`` — a ``peft.LoraConfig``: ``target_modules`` for the attention/dense
  linears, ``target_parameters`` (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``) for
  the routed experts' fused parameters;
* ``adapter_model.safetensors`` — ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``
  per linear (PEFT's own keys); per experts module the keys its operator's ``lora_state_dict``
  gives (PEFT's ``ParamWrapper`` layout, see ``torch_experts.py``) under the same prefix.

Reading an adapter folder and applying it for inference (``read_adapter``, ``apply_adapter``,
``wrap_linears``) live in ``util/peft_adapter.py``, below the rule engine that applies ``lora=``;
they are importable from here as before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..loading import load_model, load_tokenizer
from ..util.peft_adapter import (  # noqa: F401 - public here too
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, apply_adapter, expert_modules, read_adapter, wrap_linears,
)
from ..weights import open_weights


def expert_target_parameters(model: nn.Module, params) -> list[str]:
    """PEFT ``target_parameters`` entries (``mlp.experts.gate_up_proj``) for ``params`` on every experts module."""
    out = []
    for name in expert_modules(model):
        rel = name.split(".layers.", 1)[1].split(".", 1)[1] if ".layers." in name else name
        out += [f"{rel}.{p}" for p in params]
    return sorted(dict.fromkeys(out))


def lora_state_dict(model: nn.Module, peft_model=None) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of ``model`` under the adapter file's keys."""
    sd: dict[str, torch.Tensor] = {}
    if peft_model is not None:
        from peft import get_peft_model_state_dict

        sd.update(get_peft_model_state_dict(peft_model))
    for name, mod in expert_modules(model).items():
        for k, v in mod.lora_state_dict().items():
            sd[f"{PREFIX}{name}.{k}"] = v
    return sd


def save_adapter(folder: str | Path, model: nn.Module, peft_model, *, r: int, alpha: float, dropout: float,
                 target_modules: list[str], expert_params: list[str], base_model: str) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``folder``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    targets = expert_target_parameters(model, expert_params) if expert_params else None
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules or None,
                     target_parameters=targets, bias="none", task_type="CAUSAL_LM",
                     base_model_name_or_path=base_model)
    cfg.save_pretrained(str(folder))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in lora_state_dict(model, peft_model).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def merge_adapter(weights, model_path, adapter: str | Path, export_dir: str | Path, dtype=None) -> Path:
    """The base model with the adapter merged into its weights, saved as a transformers folder.

    The base weights are read with this project's loader (GGUF dequantized to ``dtype``), the
    merge is PEFT's ``merge_and_unload`` on the unmodified transformers model."""
    from peft import PeftModel

    source = open_weights(weights)
    model = load_model(source, model_path, [], device="cpu", dtype=dtype)  # no rules: the plain modules
    for h in getattr(model, "kt_hook_handles", []):
        h.remove()
    read_adapter(adapter)  # one-line errors before PEFT sees the folder
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    for attr in ("kt_plan", "kt_load_report", "kt_weights", "kt_hook_handles"):
        merged.__dict__.pop(attr, None)
    merged.save_pretrained(str(out))
    load_tokenizer(model_path, source).save_pretrained(str(out))
    return out
