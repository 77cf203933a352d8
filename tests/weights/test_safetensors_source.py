"""Safetensors weight source: every checkpoint layout, and clear errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ktransformers.errors import WeightError
from ktransformers.weights import open_weights


def _experts(E=3, I=4, H=5):
    g = torch.randn(E, I, H)
    u = torch.randn(E, I, H)
    d = torch.randn(E, H, I)
    return g, u, d


def _save_per_expert(path, g, u, d):
    """A checkpoint with per-expert keys, as save_pretrained writes them."""
    sd = {}
    for e in range(g.shape[0]):
        sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = g[e]
        sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = u[e]
        sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = d[e]
    save_file(sd, path)


def test_per_expert_keys_stack(tmp_path):
    g, u, d = _experts()
    _save_per_expert(tmp_path / "m.safetensors", g, u, d)
    src = open_weights(tmp_path)
    b = "model.layers.0.mlp.experts"
    assert torch.equal(src.tensor(f"{b}.gate_up_proj"), torch.cat([g, u], dim=1))
    assert torch.equal(src.tensor(f"{b}.down_proj"), d)
    assert src.shape(f"{b}.gate_up_proj") == (3, 8, 5)
    assert torch.equal(src.tensor(f"{b}.up_proj")[2], u[2])


def test_per_expert_bf16_read_into_place(tmp_path):
    """Stacked per-expert tensors are read straight into the stack (bf16 as stored, or converted),
    equal to what was saved."""
    g, u, d = (t.to(torch.bfloat16) for t in _experts(E=4, I=32, H=64))
    _save_per_expert(tmp_path / "m.safetensors", g, u, d)
    src = open_weights(tmp_path)
    b = "model.layers.0.mlp.experts"
    gu = src.tensor(f"{b}.gate_up_proj")
    assert gu.dtype == torch.bfloat16 and torch.equal(gu, torch.cat([g, u], dim=1))
    assert torch.equal(src.tensor(f"{b}.down_proj", dtype=torch.float32), d.float())
    assert torch.equal(src.tensor(f"{b}.gate_proj"), g)
    src.close()
    # a file cut short is refused at open, naming the file and the tensor past its end
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(WeightError, match=r"m\.safetensors.*(tensor '.*' has data offsets|not a readable)"):
        open_weights(tmp_path / "cut")


def test_fused_layout_splits(tmp_path):
    g, u, d = _experts()
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.cat([g, u], 1).contiguous(),
               "model.layers.0.mlp.experts.down_proj": d}, tmp_path / "m.safetensors")
    src = open_weights(tmp_path / "m.safetensors")
    assert torch.equal(src.tensor("model.layers.0.mlp.experts.gate_proj"), g)
    assert torch.equal(src.tensor("model.layers.0.mlp.experts.up_proj"), u)
    assert src.shape("model.layers.0.mlp.experts.up_proj") == (3, 4, 5)


def test_mixtral_names(tmp_path):
    g, u, d = _experts()
    sd = {"model.layers.0.block_sparse_moe.gate.weight": torch.randn(3, 5)}
    for e in range(3):
        sd[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] = g[e]
        sd[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"] = u[e]
        sd[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] = d[e]
    save_file(sd, tmp_path / "m.safetensors")
    src = open_weights(tmp_path)
    assert src.has("model.layers.0.mlp.gate.weight")
    assert torch.equal(src.tensor("model.layers.0.mlp.experts.gate_up_proj"), torch.cat([g, u], 1))


def test_shards_and_dtype_conversion(tmp_path):
    save_file({"a.weight": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b.weight": torch.ones(3)}, tmp_path / "model-00002-of-00002.safetensors")
    src = open_weights(tmp_path)
    assert src.tensor("a.weight", dtype=torch.float32).dtype == torch.float32
    assert src.has("b.weight")


def test_errors_name_the_thing(tmp_path):
    save_file({"model.norm.weight": torch.ones(3)}, tmp_path / "m.safetensors")
    src = open_weights(tmp_path)
    with pytest.raises(WeightError, match=r"the_thing0: tensor 'model\.norm\.weihgt' not found.*model\.norm\.weight"):
        src.tensor("model.norm.weihgt")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(WeightError, match="x.safetensors: not a readable safetensors file"):
        open_weights(tmp_path / "bad")
    with pytest.raises(WeightError, match="no such file"):
        open_weights(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightError, match="no .gguf or .safetensors"):
        open_weights(tmp_path / "empty")


def test_incomplete_experts(tmp_path):
    g, u, d = _experts()
    sd = {f"m.experts.{e}.gate_proj.weight": g[e] for e in (0, 2)}
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(WeightError, match=r"experts of 'm.experts' are incomplete.*\[1\]"):
        open_weights(tmp_path)


def test_shape_mismatch_names_tensor(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from ktransformers import load_model

    d = tiny_model_dir("llama")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:, :10].contiguous()
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match=r"'model.layers.0.self_attn.q_proj.weight' has shape \[64, 10\]"):
        load_model(tmp_path, model_path=d)
