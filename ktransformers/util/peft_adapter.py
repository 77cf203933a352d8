"""LoRA adapters in PEFT's format, for inference: read an adapter folder, apply it onto an injected model.

Below the rule engine: ``optimize.inject(..., lora=folder)`` and the load sequence
(``loading``) apply / check adapters through this module, and fine-tuning (``sft.adapter``:
saving, merging; ``sft.model``: training) builds on it.  The file layout is described in
``sft/adapter.py``.

Linears are adapted by PEFT itself: plain ``nn.Linear`` as PEFT does for any model, the
injected ``KTransformersLinear`` (weights in the CPU kernels) through PEFT's custom-module hook
with PEFT's own LoRA ``Linear`` layer (base output + ``B(A(x)) * scaling``).  Experts are adapted
by their operator (``add_lora`` / ``load_lora_state_dict``): the inference operator
(``KTransformersExperts``) applies the factors beside its kernels, the quantized weights untouched;
the training operators (``KSFTExpertsCPU`` / ``KSFTExpertsTorch``) also train them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..operators.linear import KTransformersLinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Experts modules of ``model`` (by name) whose operator can carry LoRA."""
    return {n: m for n, m in model.named_modules() if callable(getattr(m, "add_lora", None))}


def read_adapter(folder: str | Path):
    """(LoraConfig, state dict) of an adapter folder; ConfigError naming what is missing or wrong."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{folder}: not a LoRA adapter (no {ADAPTER_CONFIG})")
    try:
        raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{folder / ADAPTER_CONFIG}: cannot read it ({e})") from None
    if raw.get("peft_type") != "LORA":
        raise ConfigError(f"{folder / ADAPTER_CONFIG}: peft_type is {raw.get('peft_type')!r}; only LORA adapters")
    cfg = LoraConfig.from_pretrained(str(folder))
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{folder}: no {ADAPTER_WEIGHTS}")
    try:
        sd = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types
        raise ConfigError(f"{weights}: cannot read it ({str(e).splitlines()[0]})") from None
    return cfg, sd


def _klinear_lora_layer():
    """PEFT's LoRA ``Linear`` over an injected ``KTransformersLinear`` (features read from the module)."""
    from peft.tuners.lora.layer import Linear

    class KLinearLora(Linear):
        def _get_in_out_features(self, module):
            return int(module.in_features), int(module.out_features)

    return KLinearLora


def wrap_linears(model: nn.Module, lora_config):
    """PEFT on ``model``'s linears named by ``lora_config.target_modules`` (in place); the PeftModel."""
    from peft import PeftModel

    layer = _klinear_lora_layer()
    lora_config._register_custom_module({KTransformersLinear: layer})
    try:
        peft_model = PeftModel(model, lora_config)
    except ValueError as e:
        raise ConfigError(f"lora_target: {str(e).splitlines()[0]}") from None
    for mod in model.modules():
        if isinstance(mod, layer):
            _materialize(mod, lora_config)
    return peft_model


def _materialize(layer, lora_config) -> None:
    """PEFT places a new LoRA layer where its base layer's ``weight`` is; an injected linear whose op
    computes on raw kernel weights shows the original (meta) tensor there.  Put the LoRA tensors on the
    op's device and initialise them as PEFT does."""
    device = layer.get_base_layer().generate_device
    for name in list(layer.lora_A):
        if any(p.device.type == "meta" for p in layer.lora_A[name].parameters()):
            layer.lora_A[name].to_empty(device=device)
            layer.lora_B[name].to_empty(device=device)
            layer.reset_lora_parameters(name, lora_config.init_lora_weights)


def apply_adapter(model: nn.Module, folder: str | Path) -> nn.Module:
    """Load the adapter in ``folder`` onto an injected ``model`` (in place) for inference; returns ``model``.

    Linears get PEFT's LoRA layers; experts their operator's LoRA.  An adapter with expert LoRA
    needs an experts operator that carries it (``KTransformersExperts`` on a backend with a LoRA
    path, or a training operator); otherwise the error says what to use or how to merge it."""
    from peft import set_peft_model_state_dict

    cfg, sd = read_adapter(folder)
    experts = expert_modules(model)
    expert_sd: dict[str, dict[str, torch.Tensor]] = {}
    linear_sd: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        owner = next((n for n in experts if k.startswith(f"{PREFIX}{n}.")), None)
        if owner is not None:
            expert_sd.setdefault(owner, {})[k[len(PREFIX) + len(owner) + 1:]] = v
        else:
            linear_sd[k] = v
    targets = sorted(cfg.target_parameters or [])
    if expert_sd and not targets:  # else those tensors would be dropped without a word
        owner, keys = next(iter(expert_sd.items()))
        raise ConfigError(f"{folder}: tensor {PREFIX}{owner}.{next(iter(keys))} is expert LoRA, but "
                          f"{ADAPTER_CONFIG} names no target_parameters")
    if targets:
        params = sorted({t.rpartition(".")[2] for t in targets})
        if not experts:
            kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".experts")})
            raise ConfigError(f"{folder}: the adapter has LoRA on experts ({', '.join(targets)}), which the "
                              f"experts module here ({', '.join(kinds) or 'none'}) cannot apply; replace it with "
                              "KTransformersExperts in the rules, or merge the adapter (python -m ktransformers.sft "
                              "export CONFIG.yaml)")
        rslora = {"use_rslora": True} if cfg.use_rslora else {}
        for name, mod in experts.items():
            try:
                mod.add_lora(cfg.r, cfg.lora_alpha, 0.0, params, **rslora)
                mod.load_lora_state_dict(expert_sd.get(name, {}))
            except ValueError as e:  # the operator's own check, one line
                raise ConfigError(f"{folder}: {e}") from None
    if cfg.target_modules:
        linear_cfg = copy.deepcopy(cfg)
        linear_cfg.target_parameters = None
        linear_cfg.inference_mode = True
        peft_model = wrap_linears(model, linear_cfg)
        try:
            result = set_peft_model_state_dict(peft_model, linear_sd)
        except RuntimeError as e:  # torch's load_state_dict: "size mismatch for <tensor>: ..." lines
            detail = next((ln.strip() for ln in str(e).splitlines() if "mismatch for" in ln), str(e).splitlines()[0])
            raise ConfigError(f"{folder}: adapter does not fit this model ({detail})") from None
        missing = [k for k in result.missing_keys if (".lora_A." in k or ".lora_B." in k)
                   and not any(k.startswith(f"{PREFIX}{n}.") for n in experts)]  # experts: loaded above
        if missing or result.unexpected_keys:
            bad = (missing or result.unexpected_keys)[0]
            raise ConfigError(f"{folder}: adapter does not fit this model (tensor {bad})")
        object.__setattr__(model, "kt_peft_model", peft_model)  # keeps the wrapper; not a submodule
    elif linear_sd:
        raise ConfigError(f"{folder}: tensors {next(iter(linear_sd))} match no experts module and no target_modules")
    model.requires_grad_(False)
    model.eval()
    return model
