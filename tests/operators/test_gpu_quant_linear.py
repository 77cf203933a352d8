"""``KLinearGPUQ`` (quantized GGUF weights resident, dequantized per call) against ``KLinearTorch``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "ktransformers" / "optimize_rules" / "Qwen3Moe-cpu.yaml"


def _rules(op: str, device: str = "cpu") -> str:
    """The shipped -cpu rules with ``op`` for the attention projections and the head, on ``device``."""
    text = RULES.read_text().replace("generate_op: KLinearCPU", f"generate_op: {op}")
    return text.replace(f"    device: cpu\n    kwargs:\n      generate_op: {op}",
                        f"    device: {device}\n    kwargs:\n      generate_op: {op}")


def _quantized_gguf(tmp_path, tiny_model_dir, fixtures_root):
    """The llama.cpp Q4_K_M fixture when present (256-wide rows: real K-quants), else our own
    converter's Q4_K_M of the tiny model (64-wide rows: the Q5_0 / Q8_0 fallbacks)."""
    shared = fixtures_root / "qwen3moe-tiny" / "Q4_K_M.gguf"
    if shared.is_file():
        return shared
    from ktransformers.convert import convert

    return convert(tiny_model_dir("qwen3_moe"), tmp_path / "q.gguf", preset="Q4_K_M")


@pytest.fixture
def quantized(tmp_path, tiny_model_dir):
    return _quantized_gguf(tmp_path, tiny_model_dir, ROOT.parent / "shared" / "fixtures")


def test_gpuq_linear_equals_torch_linear(quantized, tiny_model_dir, tmp_path, one_torch_thread):
    from ktransformers import load_model
    from ktransformers.convert import convert

    own = convert(tiny_model_dir("qwen3_moe"), tmp_path / "own.gguf", preset="Q4_K_M")
    for path in {quantized, own}:
        ref = load_model(path, rules=_rules("KLinearTorch"), device="cpu", allow_unmatched=False)
        got = load_model(path, rules=_rules("KLinearGPUQ"), device="cpu", allow_unmatched=False)
        q = got.get_submodule("model.layers.0.self_attn.q_proj")
        assert q.generate_op.name == "KLinearGPUQ" and q.generate_op.qweight is not None
        assert q.generate_op.qweight.dtype == torch.uint8
        dense = ref.get_submodule("model.layers.0.self_attn.q_proj").generate_op.weight
        assert q.generate_op.nbytes() < dense.numel() * dense.element_size() / 2  # stays quantized
        assert torch.equal(q.generate_op.dense_weight(), dense)
        ids = torch.tensor([[3, 17, 99, 250, 7, 61]])
        with torch.no_grad():
            a, b = got(ids).logits, ref(ids).logits
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_gpuq_keeps_float_weights_dense(tiny_model_dir):
    """safetensors weights have no quantized form: the op holds them dense and still matches."""
    from ktransformers import load_model

    d = tiny_model_dir("qwen3_moe")
    got = load_model(d, rules=_rules("KLinearGPUQ"), device="cpu", allow_unmatched=False)
    ref = load_model(d, rules=_rules("KLinearTorch"), device="cpu", allow_unmatched=False)
    op = got.get_submodule("lm_head").generate_op
    assert op.qweight is None and op.weight_dense is not None
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(got(ids).logits, ref(ids).logits, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpuq_on_cuda(quantized, tiny_model_dir):
    from ktransformers import load_model

    ref = load_model(quantized, rules=_rules("KLinearTorch"), device="cpu", allow_unmatched=False)
    got = load_model(quantized, rules=_rules("KLinearGPUQ", device="cuda:0"), device="cuda:0",
                     allow_unmatched=False)
    assert got.get_submodule("model.layers.0.self_attn.q_proj").generate_op.qweight.device.type == "cuda"
    ids = torch.tensor([[3, 17, 99, 250, 7, 61]])
    with torch.no_grad():
        a, b = got(ids.cuda()).logits.cpu(), ref(ids).logits
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
