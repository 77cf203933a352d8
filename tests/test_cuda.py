"""Checks that need a CUDA device; they skip elsewhere.  Run them in one go on a GPU machine:
``bash scripts/gpu_checks.sh`` (also runs the CUDA cases of generation/test_parity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("quant", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0"])
def test_dequant_on_cuda_is_bit_exact(quant, fixtures_dir):
    """The torch dequantizers give the same bits on the GPU as gguf-py on the CPU."""
    import gguf

    from ktransformers.weights.dequant import dequantize
    from ktransformers.weights.gguf_source import GGUFSource

    src = GGUFSource(fixtures_dir / "qwen3moe-tiny" / f"{quant}.gguf")
    reader = gguf.GGUFReader(fixtures_dir / "qwen3moe-tiny" / f"{quant}.gguf")
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        got = dequantize(np.asarray(t.data), int(t.tensor_type), device="cuda").reshape(-1).cpu().numpy()
        assert np.array_equal(got, ref.astype(np.float32)), t.name
    src.close()


def test_deepseek_attention_on_cuda_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ktransformers import load_model
    from ktransformers.optimize_rules import RULES_DIR

    from tests.operators.family_checks import assert_greedy_equal

    d = tiny_model_dir("deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, model_path=d, rules=RULES_DIR / "DeepSeek-V3-Chat.yaml", allow_unmatched=False)
    assert model.model.layers[0].self_attn.generate_device.type == "cuda"
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids).logits.cpu()
    assert (got - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert_greedy_equal(model, hf, ids)


def test_generator_on_cuda_rules(tiny_model_dir):
    from ktransformers import load_model
    from ktransformers.generation import Generator, SamplingParams
    from ktransformers.util.tiny_models import make_tiny_tokenizer

    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d)  # CUDA variant: experts on the CPU, rest on cuda:0
    g = Generator(model, make_tiny_tokenizer())
    text, ids, reason = g.generate(g.encode("hello"), SamplingParams(max_new_tokens=8))
    assert reason in ("stop", "length") and g.last_stats.generated_tokens >= 1
