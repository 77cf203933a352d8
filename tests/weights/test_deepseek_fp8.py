"""FP8 block-quantized checkpoints (DeepSeek-V3 format): helpers, KLinearFP8, load-time expert
dequantization, and a tiny model saved in FP8 that must match its own dequantized reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ktransformers
from ktransformers.operators.fp8_linear import KLinearFP8
from ktransformers.weights import open_weights
from ktransformers.weights.fp8 import SCALE_SUFFIX, FP8DequantSource, block_dequant, block_quant, is_fp8
from ktransformers.util.tiny_models import write_tiny_model

from ._util import write_fp8_release

RULES = Path(ktransformers.__file__).parent / "optimize_rules"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dequant_if_fp8(tensor, key, read):
    """An FP8 ``tensor`` stored under ``key`` dequantized with ``read(key + "_scale_inv")``."""
    if not is_fp8(tensor):
        return tensor
    scale = read(key + SCALE_SUFFIX)
    if scale is None:
        raise ValueError(f"tensor '{key}' is {tensor.dtype} but '{key}{SCALE_SUFFIX}' is missing")
    return block_dequant(tensor, scale)


def naive_dequant(w, s, b=128):
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * b:(i + 1) * b, j * b:(j + 1) * b] = w[i * b:(i + 1) * b, j * b:(j + 1) * b].float() * s[i, j]
    return out


def test_block_dequant_matches_definition():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=g) + 0.01  # partial edge blocks on both axes
    assert torch.equal(block_dequant(w, s), naive_dequant(w, s))
    stacked = block_dequant(torch.stack([w, w]), torch.stack([s, 2 * s]))  # experts [E, out, in]
    assert torch.equal(stacked[1], 2 * naive_dequant(w, s))
    with pytest.raises(Exception, match="does not fit"):
        block_dequant(w, s[:2])


def test_block_quant_roundtrip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 330, generator=g)
    q, s = block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, 3) and s.dtype == torch.float32
    back = block_dequant(q, s)
    assert (back - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


def test_dequant_hook():
    q, s = block_quant(torch.randn(10, 12))
    store = {"a.weight_scale_inv": s}
    assert torch.equal(dequant_if_fp8(q, "a.weight", store.get), block_dequant(q, s))
    plain = torch.randn(3, 3)
    assert dequant_if_fp8(plain, "b.weight", store.get) is plain
    with pytest.raises(Exception, match="_scale_inv"):
        dequant_if_fp8(q, "c.weight", store.get)


FP8_OVERRIDES = dict(hidden_size=160, intermediate_size=288, moe_intermediate_size=144, q_lora_rank=136)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src, fp8, deq = root / "bf", root / "fp8", root / "deq"
    write_tiny_model("deepseek_v3", src, seed=7, with_tokenizer=False, **FP8_OVERRIDES)
    qsd = write_fp8_release(src, fp8, deq)
    n_fp8 = sum(1 for k in qsd if k.endswith("_scale_inv"))
    assert any(".experts.0.gate_proj.weight_scale_inv" in k for k in qsd) and n_fp8 > 20
    return fp8, deq


def test_fp8_model_matches_dequantized_reference(fp8_dirs):
    from transformers import AutoModelForCausalLM

    fp8, deq = fp8_dirs
    ref = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32).eval()
    src = open_weights(fp8)
    assert isinstance(src, FP8DequantSource)
    model = ktransformers.load_model(src, model_path=fp8, rules=RULES / "DeepSeek-V3-Chat-fp8-linear-cpu.yaml")
    o_proj = model.model.layers[1].self_attn.o_proj
    assert isinstance(o_proj.generate_op, KLinearFP8)
    assert o_proj.generate_op.weight_fp8.dtype == torch.float8_e4m3fn  # kept in FP8
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    assert kv_b.generate_op.name == "KLinearTorch" and kv_b.weight.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert (want - got).abs().max() <= 1e-4 * want.abs().max()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ref.generate(ids[:1], **kw), model.generate(ids[:1], **kw))


def test_fp8_source_serves_experts_dequantized(fp8_dirs):
    fp8, deq = fp8_dirs
    src, plain = FP8DequantSource(open_weights(fp8)), open_weights(deq)
    base = "model.layers.1.mlp.experts"
    for name in (f"{base}.gate_up_proj", f"{base}.down_proj", f"{base}.gate_proj",
                 "model.layers.1.self_attn.kv_b_proj.weight"):
        assert src.has(name)
        assert torch.equal(src.tensor(name), plain.tensor(name)), name
    assert torch.equal(src.tensor(f"{base}.down_proj")[3], plain.tensor(f"{base}.down_proj")[3])
    assert not any(n.endswith("_scale_inv") for n in src.names())
    raw = src.raw("model.layers.1.self_attn.o_proj.weight")
    w, s = raw.data, raw.scale_inv
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert src.raw("model.norm.weight") is None


def test_klinear_fp8_quantizes_plain_weights(tmp_path):
    """A non-FP8 checkpoint under the FP8 rule: weights are block-quantized at load."""
    d = tmp_path / "m"
    ref = write_tiny_model("deepseek_v3", d, seed=8, with_tokenizer=False)
    model = ktransformers.load_model(d, model_path=d, rules=RULES / "DeepSeek-V3-Chat-fp8-linear-cpu.yaml")
    op = model.model.layers[0].mlp.gate_proj.generate_op
    assert isinstance(op, KLinearFP8) and op.weight_fp8.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert (want - got).abs().max() <= 0.1 * want.abs().max()  # FP8 quantization error only
