"""Write a tiny random Qwen3-MoE checkpoint (config, safetensors, tokenizer) to train the example on.

    python examples/sft/make_tiny_model.py .cache/tiny-qwen3moe
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from ktransformers.util.tiny_models import write_tiny_model

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-qwen3moe"
    write_tiny_model("qwen3_moe", out, seed=0)
    # the random head's logits are nearly flat; scaled up, the LoRA below it can make confident
    # predictions and the loss curve shows learning rather than the head's floor
    f = Path(out) / "model.safetensors"
    sd = load_file(str(f))
    sd["lm_head.weight"] = sd["lm_head.weight"] * 4
    save_file(sd, str(f), metadata={"format": "pt"})
    print(f"wrote a tiny Qwen3-MoE to {out}")
