"""DeepSeek-V4 from GGUF: llama.cpp's ``deepseek4`` names (hyper-connection, compressor, indexer and
hash-router tensors), its metadata keys -> DeepseekV4Config, the I32 hash table and MXFP4 experts;
our converter writes the same file.

``tests/fixtures/llamacpp/deepseek_v4.gguf`` (llama.cpp's converter, F32 with its always-MXFP4
routed experts, from a release-layout checkpoint of the tiny model: scripts/make_llamacpp_fixtures.py)
is the reference; tests/weights/test_llamacpp_fixtures.py checks its HF logits through the reader
and the shipped rules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.optimize_rules import RULES_DIR
from ktransformers.weights.gguf_config import config_from_metadata
from ktransformers.weights.gguf_source import GGUFSource

from .family_checks import gguf_model_keys, gguf_tensors, hf_on_gguf, rel_err

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llamacpp" / "deepseek_v4.gguf"
REF = json.loads(FIXTURE.with_suffix(".json").read_text())


def test_config_from_llama_cpps_metadata():
    """Layer kinds from ``compress_ratios`` and the indexer tensors, hash layers from the tables."""
    cfg = GGUFSource(FIXTURE).config()
    assert cfg.layer_types == ["heavily_compressed_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention"]
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert (cfg.hc_mult, cfg.o_groups, cfg.o_lora_rank, cfg.swiglu_limit, cfg.qk_rope_head_dim) == (2, 2, 32, 0.5, 4)
    assert cfg.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert cfg.scoring_func == "sqrtsoftplus" and cfg.num_nextn_predict_layers == 0


def test_hash_table_and_mxfp4_experts():
    src = GGUFSource(FIXTURE)
    tid = src.tensor("model.layers.0.mlp.gate.tid2eid")
    assert tid.dtype == torch.int64 and tid.shape == (320, 2) and 0 <= int(tid.min()) and int(tid.max()) < 8
    assert src.raw("model.layers.1.mlp.experts.gate_proj").type.name == "MXFP4"


def test_experts_dequantized_through_load_model():
    """The shipped rules with the routed experts on KExpertsTorch (dequantized MXFP4): the HF logits
    within 1e-4 (KExpertsCPU's 8-bit activations are the fixture test's looser bound)."""
    rules = (RULES_DIR / "DeepSeek-V4-cpu.yaml").read_text()
    rules, n = re.subn(r"generate_op: KExpertsCPU\n\s*backend: [^\n]*", "generate_op: KExpertsTorch", rules)
    assert n == 1
    model = load_model(FIXTURE, rules=rules, device="cpu")
    with torch.no_grad():
        got = model(torch.tensor([REF["token_ids"]])).logits[0].float()
    assert rel_err(got, torch.tensor(REF["hf_logits"])) <= 1e-4


def _meta_and_shapes():
    r = gguf.GGUFReader(FIXTURE)
    meta = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    return meta, shapes


@pytest.mark.parametrize("key,value,message", [
    ("deepseek4.hash_layer_count", 2, "'deepseek4.hash_layer_count' is 2"),
    ("deepseek4.attention.compress_ratios", [8, 4], "needs an entry for each of 3 layers"),
    ("deepseek4.attention.compress_ratios", [8, 4, 16], "ratios 8 and 16"),
    ("deepseek4.swiglu_clamp_exp", [0.5, 0.5, 7.0], "several values"),
    ("deepseek4.expert_gating_func", 2, "routes with sqrtsoftplus"),
])
def test_bad_metadata_is_named(key, value, message):
    meta, shapes = _meta_and_shapes()
    meta[key] = value
    with pytest.raises(WeightError, match=re.escape(message)):
        config_from_metadata(meta, shapes, where="f.gguf")


def test_converter_writes_llama_cpps_file(tmp_path):
    """The HF model read back from llama.cpp's file, converted by ours (experts MXFP4, the rest F32):
    the same tensor names, types, shapes, model metadata (ours adds ``vocab_size``) and values (MXFP4
    compared dequantized: one value has several scale / code spellings)."""
    from ktransformers.convert import convert
    from ktransformers.weights.dequant import dequantize

    model = hf_on_gguf(GGUFSource(FIXTURE))
    model.save_pretrained(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ours.gguf", "MXFP4", "F32", "F32", tokenizer=False)
    assert gguf_tensors(out) == gguf_tensors(FIXTURE)
    mine, ref = gguf_model_keys(out), gguf_model_keys(FIXTURE)
    assert set(mine) - set(ref) == {"deepseek4.vocab_size"} and set(ref) <= set(mine)
    types = {p: {f.name: [t.name for t in f.types] for f in gguf.GGUFReader(p).fields.values()} for p in (out, FIXTURE)}
    for k, v in ref.items():
        assert mine[k] == pytest.approx(v), k
        assert types[out][k] == types[FIXTURE][k], k  # value types too (llama.cpp's loader reads u32 / f32 arrays)
    theirs = {t.name: t for t in gguf.GGUFReader(FIXTURE).tensors}
    for t in gguf.GGUFReader(out).tensors:
        r = theirs[t.name]
        if t.tensor_type.name == "MXFP4":
            shape = tuple(int(d) for d in reversed(t.shape))
            a, b = (dequantize(np.array(x.data).reshape(-1), "MXFP4", shape) for x in (t, r))
            assert torch.equal(a, b), t.name
        else:
            np.testing.assert_array_equal(np.array(t.data), np.array(r.data), err_msg=t.name)


#: what a deepseek4 file must give back
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
               "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "layer_types", "compress_rates",
               "mlp_layer_types", "rope_parameters", "qk_rope_head_dim", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
               "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
               "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
               "swiglu_limit", "scoring_func", "vocab_size", "tie_word_embeddings")


def test_round_trip_with_sliding_layers_and_yarn(tmp_path):
    """A config beyond the fixture's (a sliding-window layer, two hash layers, yarn on the compressed
    layers): our file gives the same config back and the HF logits within 1e-4."""
    from ktransformers.convert import convert
    from ktransformers.util.tiny_models import write_tiny_model

    hf = write_tiny_model("deepseek_v4", tmp_path / "hf", seed=5, num_hidden_layers=4,
                          layer_types=["sliding_attention", "heavily_compressed_attention",
                                       "compressed_sparse_attention", "heavily_compressed_attention"],
                          mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    out = convert(tmp_path / "hf", tmp_path / "f32.gguf", "F32", "F32", "F32", tokenizer=False)
    src = GGUFSource(out)
    got = src.config()
    for k in CONFIG_KEYS:
        want = getattr(hf.config, k)
        assert getattr(got, k) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), k
    ids = torch.tensor([list(range(3, 60, 3))])
    with torch.no_grad():
        assert rel_err(hf_on_gguf(src)(ids).logits, hf.eval()(ids).logits) <= 1e-4
