"""The fine-tuning config: a LLaMA-Factory-style YAML file, checked key by key before any work.

Every key is declared once, in :data:`KEYS` (type, default, meaning).  An unknown key, a value of
the wrong type or out of range is a one-line :class:`~ktransformers.errors.ConfigError` that names
the file, the line and the key (with a did-you-mean for unknown keys).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")


@dataclass(frozen=True)
class Key:
    types: tuple[type, ...]
    default: Any
    help: str
    choices: tuple | None = None
    minimum: float | None = None  # inclusive
    positive: bool = False  # > 0


_S, _I, _F, _B, _N = (str,), (int,), (float, int), (bool,), (type(None),)

#: every key the config may hold (LLaMA-Factory's names)
KEYS: dict[str, Key] = {
    # what to do
    "stage": Key(_S, "sft", "training stage; only supervised fine-tuning", choices=("sft",)),
    "do_train": Key(_B, True, "train (false: only export/chat with adapter_name_or_path)"),
    "finetuning_type": Key(_S, "lora", "only LoRA adapters", choices=("lora",)),
    # model
    "model_name_or_path": Key(_S, None, "folder with config.json + tokenizer (+ safetensors weights)"),
    "gguf_path": Key(_S + _N, None, "GGUF weights (file or folder); default: the weights in model_name_or_path"),
    "use_kt": Key(_B, True, "place modules with ktransformers rules (routed experts on the CPU kernels)"),
    "kt_optimize_rule": Key(_S + _N, None, "rule file placing modules for training (default: the shipped "
                                           "training rules of the architecture)"),
    "cpu_infer": Key(_I + _N, None, "CPU threads for torch and the CPU kernels (default: physical cores)",
                     positive=True),
    "chunk_size": Key(_I, 8192, "prompt tokens per prefill step when chatting with the adapter", positive=True),
    "bf16": Key(_B, False, "base weights in bf16 and bf16 autocast (LoRA weights stay fp32)"),
    "gradient_checkpointing": Key(_B + _N, None, "recompute each decoder layer in the backward instead of keeping "
                                                 "its activations (default: off)"),
    "disable_gradient_checkpointing": Key(_B + _N, None, "LLaMA-Factory's name: false turns gradient checkpointing "
                                                         "on, true off (default: off)"),
    # LoRA
    "lora_rank": Key(_I, 8, "LoRA rank r", positive=True),
    "lora_alpha": Key(_F + _N, None, "LoRA alpha (default: 2 * lora_rank)", positive=True),
    "lora_dropout": Key(_F, 0.0, "dropout on the LoRA input (attention/dense only; 0 with expert LoRA)",
                        minimum=0.0),
    "lora_target": Key(_S + (list,), "all", "comma-separated module names (q_proj,v_proj,...), 'experts' or "
                                            "'experts.gate_up_proj'/'experts.down_proj', or 'all'"),
    "adapter_name_or_path": Key(_S + _N, None, "an existing adapter: continue training it, chat or export with it"),
    # data
    "dataset": Key(_S + (list,), None, "JSON/JSONL files (alpaca or sharegpt), comma-separated, or names in "
                                       "dataset_dir/dataset_info.json"),
    "dataset_dir": Key(_S, ".", "folder that relative dataset paths and dataset_info.json are read from"),
    "template": Key(_S + _N, None, "prompt template name (default: the tokenizer's chat template)"),
    "chat_template": Key(_S + _N, None, "Jinja chat template file or name (chatml, gemma, llama3, a GGUF's "
                                        "tokenizer.chat_template.NAME) replacing the tokenizer's, for training "
                                        "and chat"),
    "cutoff_len": Key(_I, 1024, "tokens per example; longer examples are cut", positive=True),
    "max_samples": Key(_I + _N, None, "use at most this many examples per dataset", positive=True),
    # optimisation
    "per_device_train_batch_size": Key(_I, 1, "examples per micro-batch", positive=True),
    "gradient_accumulation_steps": Key(_I, 1, "micro-batches per optimizer step", positive=True),
    "learning_rate": Key(_F, 1e-4, "peak learning rate (AdamW)", positive=True),
    "weight_decay": Key(_F, 0.0, "AdamW weight decay", minimum=0.0),
    "max_grad_norm": Key(_F, 1.0, "clip the gradient norm to this (0: no clipping)", minimum=0.0),
    "lr_scheduler_type": Key(_S, "cosine", "learning-rate schedule", choices=SCHEDULERS),
    "warmup_ratio": Key(_F, 0.0, "fraction of the steps spent warming up", minimum=0.0),
    "warmup_steps": Key(_I, 0, "warm-up steps (wins over warmup_ratio when > 0)", minimum=0),
    "num_train_epochs": Key(_F, 3.0, "passes over the data (max_steps wins when > 0)", positive=True),
    "max_steps": Key(_I, -1, "optimizer steps; -1: from num_train_epochs"),
    "seed": Key(_I, 42, "seed of the data order, LoRA init and dropout"),
    # output
    "output_dir": Key(_S, None, "where the adapter, checkpoints, loss log and plot go"),
    "overwrite_output_dir": Key(_B, False, "train even if output_dir already holds an adapter"),
    "logging_steps": Key(_I, 10, "log the loss every this many steps", positive=True),
    "save_steps": Key(_I, 500, "write a checkpoint every this many steps", positive=True),
    "plot_loss": Key(_B, True, "write training_loss.png"),
    "resume_from_checkpoint": Key(_S + _B + _N, None, "checkpoint folder to resume from (true: the latest in "
                                                      "output_dir)"),
    "report_to": Key(_S + _N, "none", "only 'none' (the loss log is written to output_dir)", choices=("none",)),
    # inference / export with the adapter
    "infer_backend": Key(_S, "ktransformers", "engine for chat with the adapter", choices=("ktransformers",)),
    "export_dir": Key(_S + _N, None, "write the model with the adapter merged into its weights here"),
}


@dataclass
class SFTConfig:
    """The checked config: ``values`` holds every key of :data:`KEYS` (defaults filled in)."""

    values: dict[str, Any]
    path: str = "<config>"
    lines: dict[str, int] = field(default_factory=dict)
    #: where keys given outside the file came from (``key=value`` on the command line)
    origins: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, name):
        values = self.__dict__.get("values")
        if values is not None and name in values:
            return values[name]
        raise AttributeError(name)

    def where(self, key: str) -> str:
        if key in self.origins:
            return f"{self.origins[key]}: {key}"
        line = self.lines.get(key)
        return f"{self.path}:{line}: {key}" if line else f"{self.path}: {key}"

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where(key)}: {message}")

    def resolve(self, key: str) -> Path | None:
        """A path value (relative paths from the working directory, as LLaMA-Factory reads them)."""
        v = self.values.get(key)
        return None if v is None else Path(v).expanduser()

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def checkpointing(self) -> bool:
        """Gradient checkpointing on?  ``gradient_checkpointing`` or LLaMA-Factory's inverse
        ``disable_gradient_checkpointing``; off when neither is given (see docs/sft.md)."""
        if self.gradient_checkpointing is not None:
            return bool(self.gradient_checkpointing)
        if self.disable_gradient_checkpointing is not None:
            return not self.disable_gradient_checkpointing
        return False

    def targets(self) -> list[str]:
        t = self.lora_target
        items = t if isinstance(t, list) else str(t).split(",")
        return [str(s).strip() for s in items if str(s).strip()]

    def datasets(self) -> list[str]:
        d = self.dataset
        items = d if isinstance(d, list) else str(d).split(",")
        return [str(s).strip() for s in items if str(s).strip()]


def _type_name(types: tuple[type, ...]) -> str:
    if float in types:
        types = tuple(t for t in types if t is not int)
    names = {str: "text", int: "an integer", float: "a number", bool: "true/false", list: "a list",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def check_value(key: str, value: Any) -> str | None:
    """None when ``value`` fits ``key``; else what is wrong (without the key)."""
    spec = KEYS[key]
    ok = isinstance(value, spec.types) and not (isinstance(value, bool) and bool not in spec.types)
    if not ok:
        return f"must be {_type_name(spec.types)}, not {value!r}"
    if spec.choices is not None and isinstance(value, str) and value not in spec.choices:
        near = difflib.get_close_matches(value, spec.choices, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        return f"'{value}' is not one of {', '.join(spec.choices)}{hint}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if spec.positive and value <= 0:
            return f"must be greater than 0, not {value}"
        if spec.minimum is not None and value < spec.minimum:
            return f"must be at least {spec.minimum}, not {value}"
    return None


def _number_text(key: str, value: Any) -> Any:
    """``1e-4`` is text to YAML 1.1 (no dot): read it as the number it spells for number keys."""
    if isinstance(value, str) and float in KEYS[key].types and str not in KEYS[key].types:
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_config(text: str, source: str = "<config>", line_origins: dict[int, str] | None = None) -> SFTConfig:
    """Check ``text`` (YAML mapping of :data:`KEYS`) and fill in the defaults.  ``line_origins``
    names lines that did not come from ``source`` (command-line overrides appended to its text),
    so an error points at what the user typed."""
    origins = line_origins or {}

    def at(line: int | None) -> str:
        before = [n for n in origins if line is not None and n <= line]  # appended lines: the one it is in
        return origins[max(before)] if before else (f"{source}:{line}" if line else source)

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        pos = getattr(e, "position", None)  # the reader's errors (a control character) carry an offset
        line = mark.line + 1 if mark else (text.count("\n", 0, pos) + 1 if isinstance(pos, int) else None)
        if isinstance(e, yaml.reader.ReaderError):
            problem = f"{e.reason}: {e.character!r} is not allowed in YAML"
        raise ConfigError(f"{at(line)}: not valid YAML: {problem}") from None
    if root is None:
        raise ConfigError(f"{source}: the config is empty")
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{at(root.start_mark.line + 1)}: the config must be a mapping of keys to values")
    loader = yaml.SafeLoader("")
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    try:
        for knode, vnode in root.value:
            line = knode.start_mark.line + 1
            key = knode.value if isinstance(knode, yaml.ScalarNode) else None
            if not isinstance(key, str) or knode.tag != "tag:yaml.org,2002:str":
                raise ConfigError(f"{at(line)}: keys must be text")
            if key not in KEYS:
                near = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6)
                hint = f"; did you mean '{near[0]}'?" if near else " (see docs/sft.md for the keys)"
                raise ConfigError(f"{at(line)}: unknown key {key!r}{hint}")
            if key in values:
                first = origins.get(lines[key]) or f"on line {lines[key]}"
                raise ConfigError(f"{at(line)}: {key}: given twice (first {first})")
            try:
                value = loader.construct_object(vnode, deep=True)
            except (yaml.YAMLError, ValueError, TypeError) as e:
                raise ConfigError(f"{at(line)}: {key}: cannot read the value ({e})") from None
            value = _number_text(key, value)
            problem = check_value(key, value)
            if problem:
                raise ConfigError(f"{at(line)}: {key}: {problem}")
            values[key] = value
            lines[key] = line
    finally:
        loader.dispose()
    full = {k: spec.default for k, spec in KEYS.items()}
    full.update(values)
    cfg = SFTConfig(full, source, lines, {k: origins[n] for k, n in lines.items() if n in origins})
    _check_together(cfg)
    return cfg


def _check_together(cfg: SFTConfig) -> None:
    """Rules between keys, named by the key that has to change."""
    if not cfg.model_name_or_path:
        raise cfg.error("model_name_or_path", "required (the model folder with config.json and tokenizer)")
    if not cfg.use_kt:
        raise cfg.error("use_kt", "only true is supported (training runs on the injected model)")
    if cfg.do_train:
        for key in ("dataset", "output_dir"):
            if not cfg.values.get(key):
                raise cfg.error(key, "required for training")
    if isinstance(cfg.lora_target, list) and not all(isinstance(t, str) for t in cfg.lora_target):
        raise cfg.error("lora_target", "list items must be module names")
    if not cfg.targets():
        raise cfg.error("lora_target", "names no module")
    if cfg.warmup_ratio >= 1.0:
        raise cfg.error("warmup_ratio", f"must be below 1, not {cfg.warmup_ratio}")
    if cfg.lora_dropout >= 1.0:
        raise cfg.error("lora_dropout", f"must be below 1, not {cfg.lora_dropout}")
    gc, dgc = cfg.gradient_checkpointing, cfg.disable_gradient_checkpointing
    if gc is not None and dgc is not None and gc == dgc:
        raise cfg.error("disable_gradient_checkpointing", f"{str(dgc).lower()} contradicts gradient_checkpointing: "
                                                          f"{str(gc).lower()} (it is its inverse); give one of them")
    if cfg.template is not None and cfg.chat_template is not None:
        raise cfg.error("chat_template", f"and template: {cfg.template} both name the prompt format; give one")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise cfg.error("max_steps", f"must be positive, or -1 to use num_train_epochs (not {cfg.max_steps})")


def read_text(path: str | Path, what: str) -> str:
    """A UTF-8 file's text; a one-line ConfigError naming the file (``what``: "config", "dataset")."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such {what} file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read the {what} ({getattr(e, 'strerror', None) or e})") from None


def load_config(path: str | Path) -> SFTConfig:
    return parse_config(read_text(path, "config"), str(path))
