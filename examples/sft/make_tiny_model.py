"""Write a tiny random Qwen3-MoE checkpoint (config, safetensors, tokenizer) to train the example on.

    python examples/sft/make_tiny_model.py /tmp/tiny-qwen3moe
"""

from __future__ import annotations

import sys

from ktransformers.util.tiny_models import write_tiny_model

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3moe"
    write_tiny_model("qwen3_moe", out, seed=0)
    print(f"wrote a tiny Qwen3-MoE to {out}")
