"""The shared deepseek2-tiny fixture (DeepSeek-V3 architecture, MLA with rope_interleave,
grouped sigmoid router): the HF checkpoint through the -cpu rules against transformers'
logits, and the llama.cpp GGUFs through the same rules against llama.cpp's logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ktransformers
from ktransformers.operators.attention import KDeepseekV2Attention

FIX = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "deepseek2-tiny"
RULES = Path(ktransformers.__file__).parent / "optimize_rules"
RULE = RULES / "DeepSeek-V3-Chat-cpu.yaml"


pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not (FIX / "hf" / "config.json").is_file(),
                                reason=f"fixture {FIX} not present")]


def _tokens():
    return torch.tensor(json.loads((FIX / "tokens.json").read_text())["token_ids"])[None]


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(_tokens()).logits[0].float().numpy()


def test_hf_checkpoint_matches_transformers():
    model = ktransformers.load_model(FIX / "hf", model_path=FIX / "hf", rules=RULE, allow_unmatched=False)
    assert isinstance(model.model.layers[1].self_attn, KDeepseekV2Attention)
    want = np.load(FIX / "hf_logits.npy")
    got = _logits(model)
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
    # decode through the latent cache reproduces the teacher-forced rows
    from transformers import DynamicCache

    ids = _tokens()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        rows = [model(ids[:, :8], cache=cache).logits[0]]
        for t in range(8, ids.shape[1]):
            rows.append(model(ids[:, t:t + 1], cache=cache).logits[0])
    step = torch.cat(rows).numpy()
    assert np.abs(step - want).max() <= 1e-4


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_gguf_matches_llama_cpp(quant):
    """Shipped -cpu rules (experts on the C++ kernels, which quantize activations like llama.cpp)."""
    model = ktransformers.load_model(FIX / f"{quant}.gguf", model_path=FIX / "hf", rules=RULE, allow_unmatched=False)
    assert isinstance(model.model.layers[0].self_attn, KDeepseekV2Attention)
    got = _logits(model)
    ref = np.load(FIX / f"{quant}.logits.npy")
    d = np.abs(got - ref)
    mean_abs, med_pos_max = float(d.mean()), float(np.median(d.max(axis=1)))
    print(f"{quant}: mean abs {mean_abs:.4f}, median per-position max {med_pos_max:.4f}, max {d.max():.4f}")
    assert mean_abs <= 0.05 and med_pos_max <= 0.2  # the fixture README's bar


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_gguf_exact_with_torch_experts(quant):
    """The sharp check: GGUF dequantization (split attn_k_b/attn_v_b rebuilt into kv_b_proj) +
    absorbed MLA, all in fp32, against transformers on gguf-py-dequantized weights."""
    text = RULE.read_text()
    text = text[:text.index("generate_op: KExpertsCPU")] + "generate_op: KExpertsTorch\n  recursive: false\n" + \
        text[text.index("- match:", text.index("generate_op: KExpertsCPU")):]
    # the linears dequantized into fp32 too (the shipped KLinearCPU quantizes activations to int8)
    text = text.replace("generate_op: KLinearCPU", "generate_op: KLinearTorch")
    model = ktransformers.load_model(FIX / f"{quant}.gguf", model_path=FIX / "hf", rules=text, allow_unmatched=False)
    assert model.model.layers[1].mlp.experts.generate_op.name == "KExpertsTorch"
    got = _logits(model)
    hf_dq = np.load(FIX / f"{quant}.hf_dequant_logits.npy")
    assert np.abs(got - hf_dq).max() <= 1e-4, np.abs(got - hf_dq).max()


def test_local_chat_runs_the_fixture_end_to_end(tmp_path):
    """The llama.cpp-made GGUF (no vocabulary) with a byte tokenizer from --model_path, through
    the shipped rules that local_chat picks for DeepseekV3ForCausalLM."""
    import subprocess
    import sys

    from ktransformers.util.tiny_models import make_tiny_tokenizer

    make_tiny_tokenizer().save_pretrained(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "ktransformers.local_chat", "--model_path", str(tmp_path), "--gguf_path",
         str(FIX / "Q4_K_M.gguf"), "--prompt", "Hello", "--max_new_tokens", "8", "--stats"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "DeepSeek-V3-Chat-cpu.yaml" in r.stderr
    import re

    assert re.search(r"prompt eval count: \d+ token\(s\).*\| eval count: [1-8] token\(s\), duration: [\d.]+s, "
                     r"rate: [\d.]+ tokens/s", r.stderr)
