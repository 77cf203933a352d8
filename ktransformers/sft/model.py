"""The model to train: loaded by the project's loader with training rules, LoRA added.

Training rules (``optimize_rules/sft/<Family>-sft[-cpu].yaml``) put the routed experts on an
operator with a backward (``KSFTExpertsCPU``: the CPU kernels; ``KSFTExpertsTorch``: torch) and
keep attention, dense layers, norms, router and head as the unmodified transformers modules
(weights dequantized) — modules autograd and PEFT work on as on any transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError, RuleError
from . import torch_experts  # noqa: F401 - registers KSFTExpertsTorch
from .adapter import expert_modules, read_adapter, wrap_linears
from .torch_experts import EXPERT_PARAMS

SFT_RULES_DIR = Path(__file__).resolve().parents[1] / "optimize_rules" / "sft"
#: the name of the CPU-kernel training operator the shipped training rules use
KERNEL_OPERATOR = "KSFTExpertsCPU"
#: training-rule family stems that differ from the inference family stem (DEFAULT_RULES); Kimi-K2 and
#: Moonlight are ``DeepseekV3ForCausalLM`` too and share these rules
SFT_FAMILIES = {"DeepseekV3ForCausalLM": "DeepSeek-V3"}


def training_rule_file(config, cuda: bool | None = None) -> Path:
    """The shipped training rules for this config's architecture (CPU-only variant without CUDA)."""
    from ..optimize_rules import DEFAULT_RULES, architecture

    arch = architecture(config)
    stem = SFT_FAMILIES.get(arch, DEFAULT_RULES.get(arch))
    if cuda is None:
        cuda = torch.cuda.is_available()
    path = SFT_RULES_DIR / f"{stem}-sft{'' if cuda else '-cpu'}.yaml" if stem else None
    if path is None or not path.is_file():
        have = ", ".join(sorted(p.stem for p in SFT_RULES_DIR.glob("*.yaml")))
        raise ConfigError(f"kt_optimize_rule: no shipped training rules for {arch}; write one (shipped: {have})")
    return path


@dataclass
class TrainModel:
    model: nn.Module  # the injected transformers model (LoRA layers in place)
    peft_model: object | None  # PEFT's wrapper when linears carry LoRA
    tokenizer: object
    rules: object
    target_modules: list[str] = field(default_factory=list)
    expert_params: list[str] = field(default_factory=list)

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]


def split_targets(names: list[str], model: nn.Module, experts_trainable: bool) -> tuple[list[str], list[str]]:
    """(linear module names for PEFT, expert parameters) of ``lora_target``; ConfigError naming the key."""
    linear_leaves = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                            if _is_linear(m) and n != "lm_head" and ".layers." in f".{n}"})
    modules: list[str] = []
    params: list[str] = []
    renamed = peft_expert_aliases(model, linear_leaves)
    for name in names:
        if name == "all":
            modules += [n for n in linear_leaves if n not in renamed]
            if experts_trainable:
                params += list(EXPERT_PARAMS)
        elif name in ("experts", "mlp.experts"):
            params += list(EXPERT_PARAMS)
        elif name.rpartition(".")[2] in EXPERT_PARAMS and (name.startswith(("experts.", "mlp.experts."))
                                                          or name == "gate_up_proj"):
            params.append(name.rpartition(".")[2])
        elif name.rpartition(".")[2] in renamed:
            raise ConfigError(f"lora_target: '{name}': PEFT reads this name on {model.config.model_type} models as the "
                              "routed experts' (it retargets it to their fused parameters when it loads an adapter), "
                              "so no adapter can put LoRA on the dense or shared-expert linears of that name; "
                              "use 'experts' for the routed experts")
        elif name in linear_leaves or any(n == name or n.endswith("." + name) for n, m in model.named_modules()
                                          if _is_linear(m)):
            modules.append(name)
        else:
            import difflib

            near = difflib.get_close_matches(name, linear_leaves + ["experts", "all"], n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"lora_target: '{name}' names no linear module of this model{hint} "
                              f"(linears: {', '.join(linear_leaves)}; 'experts'; 'all')")
    params = [p for p in EXPERT_PARAMS if p in params]
    if params and not experts_trainable:
        kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".experts")})
        raise ConfigError(f"lora_target: LoRA on experts needs a training experts operator ({KERNEL_OPERATOR} or "
                          f"KSFTExpertsTorch as the rule's class; generate_op: {KERNEL_OPERATOR} names the "
                          f"inference op); the rules put {', '.join(kinds) or 'no experts'} there")
    return sorted(dict.fromkeys(modules)), params


def peft_expert_aliases(model: nn.Module, names) -> set[str]:
    """Those of ``names`` that PEFT, for this model type, takes for the routed experts' names before
    transformers 5 fused them (``gate_proj`` / ``up_proj`` / ``down_proj`` on DeepSeek-V3 and Qwen3-MoE)
    and retargets to the fused expert parameters — on our model and on the unmodified one alike."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    out = set()
    for name in names:
        cfg = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(cfg, model, None)
        except ValueError:  # half of a fused pair: PEFT refuses it, i.e. it is an expert name there
            out.add(name)
            continue
        if name not in (cfg.target_modules or ()):
            out.add(name)
    return out


def _native_bf16_cpu() -> bool:
    """Does torch have bf16 matmul instructions on this CPU (else it emulates them, slowly for some layouts)?"""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def _is_linear(m: nn.Module) -> bool:
    from ..operators.linear import KTransformersLinear

    return isinstance(m, (nn.Linear, KTransformersLinear))


def load_training_model(cfg, log=print) -> TrainModel:
    """Load ``cfg``'s model with its training rules, freeze it, add LoRA (seeded by ``cfg.seed``)."""
    from ..operators.registry import operators
    from ..loading import load_config, load_model, load_tokenizer
    from ..weights import open_weights

    model_path = cfg.resolve("model_name_or_path")
    if not model_path.exists():
        raise cfg.error("model_name_or_path", f"{model_path}: no such folder")
    weights = cfg.resolve("gguf_path") or model_path
    if not Path(weights).exists():
        raise cfg.error("gguf_path", f"{weights}: no such file or folder")
    source = open_weights(weights)
    config = load_config(model_path, source)
    if cfg.kt_optimize_rule:
        rules = cfg.resolve("kt_optimize_rule")
        if not rules.is_file():
            raise cfg.error("kt_optimize_rule", f"{rules}: no such rule file")
    else:
        rules = training_rule_file(config)
        if KERNEL_OPERATOR in rules.read_text() and KERNEL_OPERATOR not in operators():
            raise cfg.error("kt_optimize_rule", f"the shipped training rules {rules.name} use {KERNEL_OPERATOR}, "
                                                "which this build lacks; name rules with KSFTExpertsTorch "
                                                f"(e.g. {SFT_RULES_DIR / rules.name.replace('-sft', '-sft-torch')})")
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    if cfg.bf16 and not _native_bf16_cpu():
        log("note: bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX); torch's bf16 matmuls of the backward "
            "(grad @ weight) run ~100x slower than fp32 here; leave bf16 off on it (the experts keep their type)")
    log(f"loading {weights} with rules {rules} ...")
    try:
        model = load_model(source, model_path, rules, dtype=dtype, device="cpu", config=config)
    except RuleError as e:
        raise ConfigError(f"kt_optimize_rule: {e}") from None
    tokenizer = load_tokenizer(model_path, source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.requires_grad_(False)
    # the inference experts operator applies an adapter's expert LoRA but has no backward for it
    experts = {n: m for n, m in expert_modules(model).items() if m.TRAINS_LORA}
    modules, params = split_targets(cfg.targets(), model, bool(experts))
    if params and cfg.lora_dropout:
        raise cfg.error("lora_dropout", "PEFT's LoRA on expert parameters takes no dropout; set 0, or leave the "
                                        "experts out of lora_target")
    torch.manual_seed(cfg.seed)
    peft_model = None
    if cfg.adapter_name_or_path:
        lcfg, sd = read_adapter(cfg.resolve("adapter_name_or_path"))
        if lcfg.r != cfg.lora_rank:
            raise cfg.error("lora_rank", f"{cfg.lora_rank} differs from the adapter's r={lcfg.r}")
    if modules:
        from peft import LoraConfig

        peft_model = wrap_linears(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.alpha,
                                                    lora_dropout=cfg.lora_dropout, target_modules=modules,
                                                    bias="none"))
    for name, mod in experts.items():
        if params:
            try:
                mod.add_lora(cfg.lora_rank, cfg.alpha, 0.0, params)
            except ValueError as e:  # the operator's own check, one line
                raise cfg.error("lora_target", f"{name}: {e}") from None
    if cfg.adapter_name_or_path:
        _load_for_training(model, peft_model, cfg.resolve("adapter_name_or_path"))
    tm = TrainModel(model, peft_model, tokenizer, rules, modules, params)
    if not tm.trainable():
        raise cfg.error("lora_target", "leaves nothing to train")
    if cfg.checkpointing:
        # transformers 5's name of gradient_checkpointing_enable; non-reentrant, so the recomputed forward
        # runs under autograd again, KSFTExpertsCPU's Function included
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    return tm


def _load_for_training(model, peft_model, folder) -> None:
    """Continue training an existing adapter: its tensors into the freshly made LoRA parameters."""
    from .adapter import PREFIX, lora_state_dict

    _, sd = read_adapter(folder)
    mine = lora_state_dict(model, peft_model)
    if set(sd) != set(mine):
        extra = sorted(set(sd) ^ set(mine))[0]
        raise ConfigError(f"adapter_name_or_path: {folder} targets other modules than lora_target ({extra})")
    if peft_model is not None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(peft_model, {k: v for k, v in sd.items()
                                               if not any(k.startswith(f"{PREFIX}{n}.") for n in expert_modules(model))})
    for name, mod in expert_modules(model).items():
        if mod.lora_state_dict():
            mod.load_lora_state_dict({k[len(PREFIX) + len(name) + 1:]: v for k, v in sd.items()
                                      if k.startswith(f"{PREFIX}{name}.")})
