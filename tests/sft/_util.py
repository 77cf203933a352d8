"""Helpers of the fine-tuning tests: a trainable tiny model, a tiny dataset, configs."""

from __future__ import annotations

import json

from ktransformers.optimize_rules import RULES_DIR

TORCH_RULES = RULES_DIR / "sft" / "Qwen3Moe-sft-torch-cpu.yaml"
KERNEL_RULES = RULES_DIR / "sft" / "Qwen3Moe-sft-cpu.yaml"
STEPS = 50
SAVE = 25

DATA = [
    {"instruction": "Peru?", "output": "Lima."},
    {"instruction": "Cuba?", "output": "Havana."},
    {"instruction": "Fiji?", "output": "Suva."},
    {"instruction": "Togo?", "output": "Lome."},
]


def write_config(folder, model, out, **extra):
    keys = dict(model_name_or_path=str(model), stage="sft", finetuning_type="lora", lora_target="all",
                lora_rank=8, lora_alpha=16, dataset=str(folder / "data.json"), template="qwen3", cutoff_len=64,
                per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=5e-3,
                lr_scheduler_type="cosine", warmup_ratio=0.1, max_steps=STEPS, logging_steps=1, save_steps=SAVE,
                output_dir=str(out), seed=7, cpu_infer=1, kt_optimize_rule=str(TORCH_RULES), plot_loss=True)
    keys.update(extra)
    (folder / "data.json").write_text(json.dumps(DATA))
    path = folder / f"{out.name}.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    return path


def losses_of(out):
    return [json.loads(line)["loss"] for line in (out / "trainer_log.jsonl").read_text().splitlines()]


def write_trainable_tiny_model(folder, arch="qwen3_moe"):
    """The tiny random model (Qwen3-MoE by default) with its (frozen) head scaled up 4x: the random
    head's logits are so flat that no LoRA below it can make a confident prediction (the loss floor
    would be ~2.6 nats)."""
    from safetensors.torch import load_file, save_file

    from ktransformers.util.tiny_models import write_tiny_model

    write_tiny_model(arch, folder, seed=0)
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 4
    save_file(sd, str(f), metadata={"format": "pt"})
    return folder
