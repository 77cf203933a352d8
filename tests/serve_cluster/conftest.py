"""Fixtures for the cluster tests: the tiny Qwen3-MoE of the server tests, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

MODEL_NAME = "tiny-qwen3-moe"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("models") / MODEL_NAME
    write_tiny_model("qwen3_moe", d, max_position_embeddings=2048)
    return d


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from transformers import AutoTokenizer

    from ktransformers import load_model

    model = load_model(tiny_dir / "model.safetensors", tiny_dir, device="cpu")
    return model, AutoTokenizer.from_pretrained(str(tiny_dir))
