"""GGUF weights through the project's injection path (``ktransformers.load_model``), config from
GGUF metadata only (no model_path).  The default CPU rules run the experts on quantized kernels,
so the bar is llama.cpp's own (fixtures README): measured mean abs 0.016-0.023, median
per-position max 0.067-0.091, max 0.09-0.26 on Q8_0 / Q4_K_M of both tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._util import fixture_dir, load_npy, tiny_tokens


@pytest.mark.parametrize("model_name", ["qwen3moe-tiny", "deepseek2-tiny"])
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_load_model_from_gguf_matches_llama_cpp(model_name, quant):
    import ktransformers

    path = fixture_dir(model_name) / f"{quant}.gguf"
    model = ktransformers.load_model(path)
    with torch.no_grad():
        lg = model(torch.tensor([tiny_tokens(model_name)])).logits[0].float().numpy()
    d = np.abs(lg - load_npy(model_name, f"{quant}.logits.npy"))
    assert d.mean() <= 0.05
    assert np.median(d.max(1)) <= 0.2
    assert d.max() <= 0.75
