"""gpt-oss from GGUF: llama.cpp's names (``gpt-oss`` arch: experts split into gate / up / down with
per-projection biases, attention sinks, router with a bias), the config from the metadata alone, and
MXFP4 experts (ggml type 39) on the CPU kernels.

The fixture files are written here with gguf-py's writer, the experts split the way llama.cpp's
converter splits them (``conversion/gpt_oss.py``); with ``KT_LLAMA_CPP_DIR`` set, a file written by
llama.cpp's own converter is loaded too.  Measured on the tiny model (relative to max |logit|):
F32 file 1.2e-6 (ours and llama.cpp's, 16 greedy tokens identical); MXFP4 experts (13.5 % away
from the fp32 weights' logits) vs transformers on the dequantized weights: KExpertsTorch 7.8e-7,
KExpertsCPU 8.4e-3 (the kernels quantize activations to 8 bits: held to 2e-2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import add_text_model_keys, finish

from ktransformers import load_model
from ktransformers.optimize_rules import RULES_DIR
from ktransformers.weights.gguf_names import gpt_oss_metadata, name_map
from ktransformers.weights.gguf_source import GGUFSource

from .family_checks import EXPERTS_CPU, assert_greedy_equal, prompt_ids, rel_err

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP_DIR", "/nonexistent"))  # a llama.cpp source tree
ARCH = "gpt_oss"
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
               "rope_parameters", "sliding_window", "layer_types", "num_local_experts", "num_experts_per_tok",
               "intermediate_size", "attention_bias", "vocab_size")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hf: the shared fixture (conftest.py)


def _split_experts(ex) -> dict[str, torch.Tensor]:
    """llama.cpp's split of GptOssExperts (as conversion/gpt_oss.py): gate / up rows alternate in the
    transposed gate_up_proj; the biases alternate alike."""
    gu = ex.gate_up_proj.detach().transpose(-1, -2)  # [E, 2I, H]
    b = ex.gate_up_proj_bias.detach()
    return {
        "ffn_gate_exps.weight": gu[:, ::2], "ffn_up_exps.weight": gu[:, 1::2],
        "ffn_down_exps.weight": ex.down_proj.detach().transpose(-1, -2),
        "ffn_gate_exps.bias": b[..., ::2], "ffn_up_exps.bias": b[..., 1::2],
        "ffn_down_exps.bias": ex.down_proj_bias.detach(),
    }


def write_gpt_oss_gguf(model, path: Path, expert_type=gguf.GGMLQuantizationType.F32) -> Path:
    """A gpt-oss GGUF of ``model`` with gguf-py's writer: F32 tensors, expert weights in ``expert_type``."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_text_model_keys(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    for key, (kind, value) in gpt_oss_metadata(c, c.head_dim).items():
        getattr(w, f"add_{kind}" if kind != "u32" else "add_uint32")(key, value)
    w.add_tokenizer_model("none")
    nm = name_map("gpt-oss")
    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            w.add_tensor(nm.hf_to_gguf(name), t.float().contiguous().numpy())
    for i, layer in enumerate(model.model.layers):
        for leaf, t in _split_experts(layer.mlp.experts).items():
            a = t.float().contiguous().numpy()
            if leaf.endswith(".weight") and expert_type != gguf.GGMLQuantizationType.F32:
                w.add_tensor(f"blk.{i}.{leaf}", gguf.quants.quantize(a, expert_type), raw_dtype=expert_type)
            else:
                w.add_tensor(f"blk.{i}.{leaf}", a)
    return finish(w, path)


def _hf_on_dequantized(hf, path: Path):
    """The unmodified model with its experts replaced by the file's, dequantized by gguf-py."""
    import copy

    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    ref = copy.deepcopy(hf)
    for i, layer in enumerate(ref.model.layers):
        deq = {p: torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(stored[f"blk.{i}.ffn_{p}_exps.weight"].data,
                                                                             stored[f"blk.{i}.ffn_{p}_exps.weight"].tensor_type)))
               for p in ("gate", "up", "down")}
        E, I, H = deq["gate"].shape
        gu = torch.stack((deq["gate"], deq["up"]), dim=2).reshape(E, 2 * I, H)  # gate/up rows alternate
        with torch.no_grad():
            layer.mlp.experts.gate_up_proj.copy_(gu.transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(deq["down"].transpose(1, 2))
    return ref


def test_f32_gguf_config_from_metadata_and_logits(hf, tmp_path):
    f = write_gpt_oss_gguf(hf, tmp_path / "f32.gguf")
    src = GGUFSource(f)
    src.validate()
    cfg = src.config()
    assert cfg.architectures == ["GptOssForCausalLM"]
    for key in CONFIG_KEYS:
        assert getattr(cfg, key) == getattr(hf.config, key), key
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # stored as f32
    assert tuple(src.shape("model.layers.0.mlp.experts.gate_proj_bias")) == (8, 96)
    assert tuple(src.shape("model.layers.1.self_attn.sinks")) == (4,)
    model = load_model(f, allow_unmatched=False)
    assert model.model.layers[0].mlp.experts.generate_op.name == "KExpertsCPU"
    ids = prompt_ids()
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4
    assert_greedy_equal(model, hf, ids)


@pytest.mark.parametrize("op,tol", [("KExpertsCPU", 2e-2), ("KExpertsTorch", 1e-4)])
def test_mxfp4_experts_match_hf_on_the_dequantized_weights(op, tol, hf, tmp_path):
    """MXFP4 expert bytes read in place by the CPU kernels (or dequantized for KExpertsTorch) against
    transformers with gguf-py's dequantization of the same bytes."""
    f = write_gpt_oss_gguf(hf, tmp_path / "mxfp4.gguf", gguf.GGMLQuantizationType.MXFP4)
    src = GGUFSource(f)
    raw = src.raw("model.layers.0.mlp.experts.gate_proj")
    assert raw.type.name == "MXFP4" and raw.type.kernel
    rules = (RULES_DIR / "GptOss-cpu.yaml").read_text()
    if op == "KExpertsTorch":
        rules = rules.replace(EXPERTS_CPU, "generate_op: KExpertsTorch")
    model = load_model(f, rules=rules, allow_unmatched=False)
    ref = _hf_on_dequantized(hf, f)
    ids = prompt_ids(24, seed=2)
    with torch.no_grad():
        want = ref(ids).logits
        assert rel_err(want, hf(ids).logits) > 1e-3  # the quantization is visible
        assert rel_err(model(ids).logits, want) <= tol


def test_mxfp4_dequantize_bit_exact_with_gguf_py():
    from ktransformers import kernels
    from ktransformers.weights.dequant import dequantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 256)) * np.exp2(rng.integers(-20, 8, size=(6, 1)))).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    raw[0, 0] = 0  # subnormal scales: exponents 0 and 1
    raw[0, 17] = 1
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    ours = dequantize(raw, "MXFP4", (6, 256)).numpy()
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    k = kernels.dequantize(np.ascontiguousarray(raw), "MXFP4", raw.size // 17 * 32).reshape(6, 256)
    assert np.array_equal(np.asarray(k).view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason=f"llama.cpp's converter not found at {LLAMA_CPP} (set KT_LLAMA_CPP_DIR)")
def test_gguf_from_llama_cpp_converter(tiny_model_dir, hf, tmp_path):
    """llama.cpp's own names, metadata and expert split (F32 experts: its non-MXFP4 path)."""
    d = tiny_model_dir(ARCH)
    out = tmp_path / "lcpp.gguf"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "llama_cpp_convert.py"), str(LLAMA_CPP), str(d), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = GGUFSource(out).config()
    for key in CONFIG_KEYS:
        assert getattr(cfg, key) == getattr(hf.config, key), key
    model = load_model(out, allow_unmatched=False)
    ids = prompt_ids()
    with torch.no_grad():
        assert rel_err(model(ids).logits, hf(ids).logits) <= 1e-4


def _openai_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published checkpoints' MXFP4 of ``rows [E, R, C]``: (blocks [E, R, C/32, 16] with elements
    2j / 2j+1 in the low / high nibble of byte j, E8M0 scales [E, R, C/32]); codes from gguf-py."""
    E, R, C = rows.shape
    blk = gguf.quants.quantize(rows.float().numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(E, R, C // 32, 17)
    qs = blk[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: low nibbles are elements 0..15
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(np.ascontiguousarray(blk[..., 0]))


@pytest.mark.parametrize("op,tol", [("KExpertsCPU", 2e-2), ("KExpertsTorch", 1e-4)])
def test_published_mxfp4_checkpoint(op, tol, tiny_model_dir, hf, tmp_path):
    """gpt-oss safetensors as published (``*_blocks`` / ``*_scales``, ``quant_method: mxfp4``): the
    experts reach the CPU kernels as ggml MXFP4; the reference is transformers with its own
    dequantization of the same blocks (``integrations.mxfp4.convert_moe_packed_tensors``)."""
    import copy
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = tiny_model_dir(ARCH)
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                    "model.layers.*.mlp.router",
                                                                                    "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()
          if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    ref = copy.deepcopy(hf)
    for i, layer in enumerate(ref.model.layers):
        ex, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
        for leaf in ("gate_up_proj", "down_proj"):
            blocks, scales = _openai_mxfp4(getattr(ex, leaf).detach().transpose(1, 2))  # rows [out, in]
            sd[f"{p}.{leaf}_blocks"], sd[f"{p}.{leaf}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(ex, leaf).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(sd, tmp_path / "model.safetensors")
    rules = (RULES_DIR / "GptOss-cpu.yaml").read_text()
    if op == "KExpertsTorch":
        rules = rules.replace(EXPERTS_CPU, "generate_op: KExpertsTorch")
    model = load_model(tmp_path, model_path=tmp_path, rules=rules, allow_unmatched=False)
    if op == "KExpertsCPU":
        assert model.kt_weights.raw("model.layers.0.mlp.experts.down_proj").type.name == "MXFP4"
    ids = prompt_ids(24, seed=2)
    with torch.no_grad():
        want = ref(ids).logits
        assert rel_err(want, hf(ids).logits) > 1e-3  # the quantization is visible
        assert rel_err(model(ids).logits, want) <= tol


def test_our_converter_refuses_gpt_oss_by_name(tiny_model_dir, tmp_path):
    """Not written by this project's converter yet: a one-line refusal, not a file in the wrong layout."""
    from ktransformers.convert import convert
    from ktransformers.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot convert model_type 'gpt_oss'"):
        convert(tiny_model_dir(ARCH), tmp_path / "x.gguf", "F32", "F32", "F32")
    assert not (tmp_path / "x.gguf").exists()
