"""GGUFSource on llama.cpp's own files: names, config from metadata, and logits.

Measured on the shipped fixtures (HF fp32 model filled from ``GGUFSource.tensor``, 1 thread):

=================  ==========  ======================  ======================================
model / file       vs hf_dequant  vs llama.cpp logits: max / mean / median per-position max
=================  ==========  ======================  ======================================
qwen3moe Q8_0      1.7e-05     0.198 / 0.0170 / 0.063
qwen3moe Q6_K      1.2e-05     0.331 / 0.0235 / 0.085
qwen3moe Q5_K_M    1.2e-05     0.169 / 0.0207 / 0.082
qwen3moe Q4_K_M    1.5e-05     0.212 / 0.0214 / 0.079
qwen3moe Q4_0      1.0e-05     0.162 / 0.0160 / 0.060
deepseek2 Q8_0     4.4e-06     0.088 / 0.0154 / 0.068
deepseek2 Q6_K     3.9e-06     0.124 / 0.0214 / 0.093
deepseek2 Q5_K_M   4.8e-06     0.122 / 0.0219 / 0.096
deepseek2 Q4_K_M   5.4e-06     0.148 / 0.0212 / 0.085
deepseek2 Q4_0     4.2e-06     0.082 / 0.0159 / 0.067
=================  ==========  ======================  ======================================

Bars: max abs <= 1e-4 vs ``<Q>.hf_dequant_logits.npy``; vs llama.cpp mean abs <= 0.05 and
median per-position max <= 0.2 (fixtures README).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ktransformers.errors import WeightError
from ktransformers.weights import open_weights
from ktransformers.weights.gguf_names import NameMap, kv_b_from_split, permute_qk, split_kv_b, unpermute_qk
from ktransformers.weights.gguf_source import GGUFSource

from gguf_files import copy_gguf, finish

from ._util import QUANTS, TINY, fixture_dir, load_npy, tiny_tokens


def build_model(source, config=None):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ktransformers.optimize.inject import ModelWeights

    config = config or source.config()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    weights = ModelWeights(source, model)  # experts in the module's own layout (gpt-oss) too
    sd = {k: weights.parameter(k, dtype=torch.float32) for k in model.state_dict()}
    model.load_state_dict(sd, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("model_name", TINY)
@pytest.mark.parametrize("quant", QUANTS)
def test_fixture_logits(model_name, quant):
    path = fixture_dir(model_name) / f"{quant}.gguf"
    src = open_weights(path)
    assert isinstance(src, GGUFSource)
    src.validate()
    cfg = src.config()
    assert cfg.dtype == torch.float32 and cfg.tie_word_embeddings is False
    lg = logits(build_model(src), tiny_tokens(model_name))
    ref = load_npy(model_name, f"{quant}.hf_dequant_logits.npy")
    assert np.abs(lg - ref).max() <= 1e-4
    ll = load_npy(model_name, f"{quant}.logits.npy")
    d = np.abs(lg - ll)
    assert d.mean() <= 0.05
    assert np.median(d.max(1)) <= 0.2
    assert d.max() <= 0.75


def test_config_matches_hf_configs():
    for name, cls in (("qwen3moe-tiny", "Qwen3MoeConfig"), ("deepseek2-tiny", "DeepseekV3Config")):
        d = fixture_dir(name)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(d / "hf")
        cfg = GGUFSource(d / "Q8_0.gguf").config()
        assert type(cfg).__name__ == cls
        keys = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "tie_word_embeddings", "num_experts_per_tok",
                "moe_intermediate_size", "norm_topk_prob", "intermediate_size"]
        if name.startswith("deepseek"):
            keys += ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                     "routed_scaling_factor", "rope_interleave"]
        else:
            keys += ["num_experts"]
        for k in keys:
            assert getattr(cfg, k) == getattr(hf, k), k
        assert cfg.rope_parameters["rope_theta"] == hf.rope_parameters["rope_theta"]
        assert abs(cfg.rms_norm_eps - hf.rms_norm_eps) < 1e-12


def test_names_round_trip_and_expert_views():
    for name in TINY:
        src = GGUFSource(fixture_dir(name) / "Q6_K.gguf")
        nmap = NameMap(src.arch)
        for g in src.gguf_names():
            hf = nmap.gguf_to_hf(g)
            if g.endswith(("attn_k_b.weight", "attn_v_b.weight")):
                assert hf is None
                continue
            assert hf is not None, g
            assert nmap.hf_to_gguf(hf) == g
        # virtual expert names, fused gate_up and per-expert slices
        base = "model.layers.1.mlp.experts"
        gate = src.tensor(f"{base}.gate_proj")
        up = src.tensor(f"{base}.up_proj")
        assert gate.shape == (8, 256, 256) and src.shape(f"{base}.down_proj") == (8, 256, 256)
        fused = src.tensor(f"{base}.gate_up_proj", dtype=torch.bfloat16)
        assert torch.equal(fused, torch.cat([gate, up], 1).to(torch.bfloat16))
        # stacked tensors are written into their destination one expert at a time, from the bytes
        down = src.tensor(f"{base}.down_proj")
        halves = torch.empty(8, 512, 256)
        src._load_into(f"{base}.down_proj", halves[:, 256:])
        for e in (0, 5):
            assert torch.equal(halves[e, 256:], down[e])
            assert torch.equal(src.tensor(f"{base}.gate_up_proj")[e], torch.cat([gate[e], up[e]], 0))
        # by GGUF name too
        assert torch.equal(src.tensor("blk.1.ffn_gate_exps.weight"), gate)
        raw = src.raw(f"{base}.gate_proj")
        assert raw.shape == (8, 256, 256) and raw.ggml_type == gguf.GGMLQuantizationType.Q6_K
        assert raw.data.dtype == np.uint8 and raw.nbytes == 8 * 256 * 210


def test_split_mla_kv_b_exact():
    """kv_b_proj rebuilt from attn_k_b/attn_v_b equals the HF checkpoint's (F32-exact via Q8_0 path)."""
    from safetensors.torch import load_file

    d = fixture_dir("deepseek2-tiny")
    src = GGUFSource(d / "Q8_0.gguf")
    kv = src.tensor("model.layers.0.self_attn.kv_b_proj.weight")
    assert kv.shape == (4 * 128, 128)
    assert src.raw("model.layers.0.self_attn.kv_b_proj.weight") is None
    k_b = src.tensor("blk.0.attn_k_b.weight")
    v_b = src.tensor("blk.0.attn_v_b.weight")
    assert torch.equal(kv_b_from_split(k_b, v_b), kv)
    hf = load_file(d / "hf" / "model.safetensors")["model.layers.0.self_attn.kv_b_proj.weight"].float()
    assert (kv - hf).abs().max() < 0.01 * hf.abs().max()  # Q8_0 noise only; wiring errors are O(1)
    k2, v2 = split_kv_b(kv, 4, 64, 64)
    assert torch.equal(k2, k_b) and torch.equal(v2, v_b)
    assert src.has("model.layers.1.mlp.gate.e_score_correction_bias")


def test_qk_permutation_inverse():
    w = torch.randn(4 * 16, 8)
    for nkv in (4, 2):
        rows = nkv * 16
        assert torch.equal(unpermute_qk(permute_qk(w[:rows], 4, nkv), 4, nkv), w[:rows])
    assert not torch.equal(permute_qk(w, 4, 4), w)


def test_fast_reader_fields_match_gguf_py(tmp_path):
    """Our metadata fast path yields the same values as stock gguf-py on string/number arrays."""
    from ktransformers.weights.gguf_source import field_value, open_reader

    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}\u00e9" for i in range(300)] + [""])
    w.add_array("tokenizer.ggml.scores", [float(i) / 3 for i in range(301)])
    w.add_array("tokenizer.ggml.token_type", list(range(301)))
    w.add_array("empty", [])
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("token_embd.weight", np.ones((3, 4), np.float32))
    finish(w)
    stock = gguf.GGUFReader(p)
    fast = open_reader(p)
    assert list(stock.fields) == list(fast.fields)
    for k, f in stock.fields.items():
        assert f.contents() == fast.fields[k].contents(), k
        assert field_value(fast.fields[k]) == f.contents(), k
    tokens = "tokenizer.ggml.tokens"
    assert fast.fields[tokens].contents(7) == stock.fields[tokens].contents(7) == "tok7\u00e9"
    assert len(fast.fields[tokens].parts) < 8, "the string array is one packed part, not one per string"


def test_tied_output_and_lm_head_alias(tmp_path):
    """A file without output.weight -> tie_word_embeddings and lm_head served from token_embd."""
    from ktransformers.convert import convert

    from safetensors.torch import load_file, save_file
    import json
    import shutil

    d = fixture_dir("qwen3moe-tiny") / "hf"
    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (hf / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    sd.pop("lm_head.weight")
    save_file(sd, hf / "model.safetensors")
    out = convert(hf, tmp_path / "tied.gguf", "F32", "F32", "F32")
    src = GGUFSource(out)
    assert "output.weight" not in src.gguf_names()
    assert src.config().tie_word_embeddings is True
    assert torch.equal(src.tensor("lm_head.weight"), src.tensor("model.embed_tokens.weight"))
    src.validate()
    del shutil


def test_tokenizer_none_for_no_vocab():
    assert GGUFSource(fixture_dir("qwen3moe-tiny") / "Q4_0.gguf").tokenizer() is None


def test_split_shards_merge(tmp_path):
    """A model split into shards (gguf-py's writer, llama.cpp's naming) reads as one namespace."""
    src = GGUFSource(fixture_dir("qwen3moe-tiny") / "Q8_0.gguf")
    copy_gguf(src.files[0], tmp_path / "m.gguf", split_max_tensors=10)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) == 3
    for p in (tmp_path, shards[1]):
        merged = GGUFSource(p)
        assert len(merged.files) == 3 and sorted(merged.gguf_names()) == sorted(src.gguf_names())
        assert torch.equal(merged.tensor("model.layers.1.mlp.experts.up_proj"),
                           src.tensor("model.layers.1.mlp.experts.up_proj"))
    shards[2].unlink()
    with pytest.raises(WeightError, match="lacks shard"):
        GGUFSource(tmp_path)
