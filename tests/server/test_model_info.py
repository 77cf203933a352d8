"""The parameter count the model routes report is the model's as stored, not what the module tree
holds after injection (operators keep quantized weights in buffers: Gemma-3-270M read "0.1M")."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from .conftest import MODEL_NAME

GEMMA = Path(__file__).resolve().parents[2] / ".cache" / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.mark.parametrize("n, text", [(268_098_176, "268.10M"), (7_615_616_512, "7.6B"), (30_000_000_000, "30B"),
                                     (1_000_000, "1M"), (165_248, "165K"), (999, "999"), (0, "0")])
def test_parameter_size_is_written_as_ollama_writes_it(n, text):
    from ktransformers.server.model_info import parameter_size

    assert parameter_size(n) == text


def test_show_reports_the_stored_parameter_count_after_injection(tiny_dir, tmp_path):
    from safetensors import safe_open

    from ktransformers.server import Settings, create_app
    from ktransformers.server.main import _model_info, build_engine

    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        stored = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    settings = Settings(model_path=str(tiny_dir), data_dir=str(tmp_path / "data"), model_name=MODEL_NAME,
                        backend_type="ktransformers", cpu_infer=1)
    engine = build_engine(settings)
    model = engine.generator.model
    assert sum(p.numel() for p in model.parameters()) < stored  # the injected operators hold buffers
    assert engine.model_info["parameter_count"] == stored
    with TestClient(create_app(engine, settings), base_url="http://127.0.0.1") as c:
        show = c.post("/api/show", json={"model": MODEL_NAME}).json()
        tags = c.get("/api/tags").json()["models"][0]
    assert show["model_info"]["general.parameter_count"] == stored
    from ktransformers.server.model_info import parameter_size

    assert show["details"]["parameter_size"] == tags["details"]["parameter_size"] == parameter_size(stored)
    assert _model_info(settings, model, None, 0.0)["parameter_count"] == sum(p.numel() for p in model.parameters())


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.skipif(not GEMMA.is_file(), reason="the real Gemma-3-270M GGUF is not in .cache/models")
def test_gemma_gguf_counts_268m_parameters():
    from ktransformers.server.model_info import parameter_size, stored_parameter_count
    from ktransformers.weights.gguf_source import GGUFSource

    n = stored_parameter_count(GGUFSource(str(GEMMA)))
    assert n == 268_098_176 and parameter_size(n) == "268.10M"  # the tied embedding counted once
