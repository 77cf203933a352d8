"""``python -m ktransformers.sft [train|chat|export] CONFIG.yaml [key=value ...]``.

``train`` (the default) fine-tunes and writes the adapter to ``output_dir``; ``chat`` talks to
the model with ``adapter_name_or_path`` (default: the adapter in ``output_dir``) through
``local_chat``; ``export`` merges that adapter into the weights and writes ``export_dir``.
``key=value`` arguments override the file's keys (values read as YAML).  Errors print one
``error:`` line and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# PEFT asks transformers a question transformers has renamed; not the user's concern
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

from ..errors import ConfigError, run_command  # noqa: E402

COMMANDS = ("train", "chat", "export")
USAGE = "usage: python -m ktransformers.sft [train|chat|export] CONFIG.yaml [key=value ...]  (--keys lists the keys)"


def keys_table() -> str:
    """Every config key with its default and meaning (from :data:`config.KEYS`)."""
    from .config import KEYS

    rows = []
    width = max(map(len, KEYS))
    for k, spec in KEYS.items():
        default = "-" if spec.default is None else repr(spec.default)
        choices = f" [{'|'.join(spec.choices)}]" if spec.choices else ""
        rows.append(f"{k:<{width}} {default:<14} {spec.help}{choices}")
    return "\n".join(rows)


def _with_overrides(path: str, overrides: list[str]):
    """The config file's text with ``key=value`` lines appended (checked like the file's own; an
    error in one names the override, not a line past the file's end)."""
    from .config import parse_config, read_text

    text = read_text(path, "config")
    import yaml

    try:
        base = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError:
        base = None  # parse_config reports it with its line
    added: list[str] = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"command-line override {o!r}: overrides are key=value")
        if any(c in o for c in "\n\r\x85\u2028\u2029"):  # YAML line breaks
            raise ConfigError(f"command-line override {o!r}: must be one line")
        if isinstance(base, dict) and key.strip() in base:  # the override replaces the file's line
            text = _drop_key(text, key.strip())
        added.append(f"{key.strip()}: {value}")
    first = text.count("\n") + 2  # the overrides' lines follow the file's
    origins = {first + i: f"command-line override {o!r}" for i, o in enumerate(overrides)}
    return parse_config("\n".join([text, *added]) + "\n", path, origins)


def _drop_key(text: str, key: str) -> str:
    """``text`` without ``key``'s line (left blank, so the other keys keep their line numbers)."""
    return "\n".join("" if ln.startswith(f"{key}:") else ln for ln in text.split("\n"))


def train(cfg, log) -> int:
    from .data import load_examples
    from .model import load_training_model
    from .templates import check_template, encode
    from .trainer import Trainer, has_adapter, latest_checkpoint
    from ..util.chat_templates import precheck_chat_template, use_chat_template

    out = cfg.resolve("output_dir")
    resume = cfg.resume_from_checkpoint
    checkpoint = None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("true", "last", "latest")):
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise cfg.error("resume_from_checkpoint", f"no checkpoint in {out}")
    elif isinstance(resume, str):
        checkpoint = cfg.resolve("resume_from_checkpoint")
        if not checkpoint.is_dir():
            raise cfg.error("resume_from_checkpoint", f"{checkpoint}: no such folder")
    if checkpoint is None and has_adapter(out) and not cfg.overwrite_output_dir:
        raise cfg.error("output_dir", f"{out} already holds an adapter; set overwrite_output_dir: true or "
                                      "resume_from_checkpoint")
    examples = load_examples(cfg.datasets(), cfg.resolve("dataset_dir"), cfg.max_samples)
    precheck_chat_template(cfg.chat_template, cfg.where("chat_template"))  # before the model loads
    tm = load_training_model(cfg, log)
    use_chat_template(tm.tokenizer, cfg.chat_template, getattr(getattr(tm.model, "kt_weights", None), "metadata", None),
                      option=cfg.where("chat_template"))
    check_template(cfg.template, tm.tokenizer)
    origin = getattr(tm.tokenizer, "kt_template_origin", "the tokenizer's chat template")
    rows, dropped = [], 0
    for ex in examples:
        ids, labels = encode(ex.messages, tm.tokenizer, cfg.template, cfg.cutoff_len, origin)
        if all(v == -100 for v in labels[1:]):
            dropped += 1
            continue
        rows.append((ids, labels))
    if dropped:
        log(f"note: {dropped} example(s) have no response token within cutoff_len={cfg.cutoff_len}; skipped")
    if not rows:
        raise cfg.error("cutoff_len", "no example keeps a response token; raise it")
    trainer = Trainer(cfg, tm, rows, log)
    n_train = sum(p.numel() for _, p in tm.trainable())
    log(f"{len(rows)} examples, {trainer.total_steps} steps; LoRA on {', '.join(tm.target_modules) or '-'}"
        f"{' + experts (' + ', '.join(tm.expert_params) + ')' if tm.expert_params else ''}: "
        f"{n_train:,} trainable parameters")
    if checkpoint is not None:
        trainer.resume(checkpoint)
    losses = trainer.run()
    log(f"trained {trainer.step} steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}; adapter in {out}")
    if cfg.export_dir:
        export(cfg, log, adapter=out)
    return 0


def _adapter(cfg):
    from .trainer import has_adapter

    if cfg.adapter_name_or_path:
        return cfg.resolve("adapter_name_or_path")
    out = cfg.resolve("output_dir")
    if out is not None and has_adapter(out):
        return out
    raise cfg.error("adapter_name_or_path", "required (or an output_dir that holds a trained adapter)")


def export(cfg, log, adapter=None) -> int:
    import torch

    from .adapter import merge_adapter

    if not cfg.export_dir:
        raise cfg.error("export_dir", "required to export the merged model")
    adapter = adapter or _adapter(cfg)
    weights = cfg.resolve("gguf_path") or cfg.resolve("model_name_or_path")
    out = merge_adapter(weights, cfg.resolve("model_name_or_path"), adapter, cfg.resolve("export_dir"),
                        dtype=torch.bfloat16 if cfg.bf16 else None)
    log(f"merged {adapter} into the weights: {out}")
    return 0


def chat(cfg, log, extra: list[str]) -> int:
    from ..local_chat import main as chat_main

    argv = ["--model_path", str(cfg.resolve("model_name_or_path")), "--lora_path", str(_adapter(cfg)),
            "--chunk_size", str(cfg.chunk_size)]
    if cfg.gguf_path:
        argv += ["--gguf_path", str(cfg.resolve("gguf_path"))]
    if cfg.kt_optimize_rule:  # the training rules serve too (and carry expert LoRA)
        argv += ["--optimize_config_path", str(cfg.resolve("kt_optimize_rule"))]
    if cfg.cpu_infer:
        argv += ["--cpu_infer", str(cfg.cpu_infer)]
    if cfg.chat_template:  # the template the adapter was trained with
        argv += ["--chat_template", cfg.chat_template]
    return chat_main(argv + extra)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args[:1] == ["--keys"]:
        print(keys_table())
        return 0
    command = args.pop(0) if args and args[0] in COMMANDS else "train"
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    path, rest = args[0], args[1:]
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    extra = [a for a in rest if a not in overrides]  # chat: local_chat's own flags
    if extra and command != "chat":
        print(f"error: '{extra[0]}': only key=value overrides follow the config ({USAGE})", file=sys.stderr)
        return 2

    def body() -> int:
        cfg = _with_overrides(path, overrides)
        from ..operators.cpu_threads import use_threads

        use_threads(cfg.cpu_infer)
        if command == "chat":
            return chat(cfg, log, extra)
        if command == "export" or not cfg.do_train:
            return export(cfg, log)
        return train(cfg, log)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
