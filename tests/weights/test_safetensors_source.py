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


def test_ernie_vl_release_layout_reads_as_transformers_loads_it(tiny_model_dir):
    """ERNIE-4.5-VL-MoE as the release (and save_pretrained) stores it: one list of 2E experts per layer,
    the routers transposed, both correction biases in one tensor, ``vision_model`` / ``spatial_linear.N``
    names.  Every tensor of the model equals, bitwise, what transformers' own converters load."""
    from transformers import AutoModelForImageTextToText

    folder = tiny_model_dir("ernie4_5_vl_moe")
    ref = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).state_dict()
    w = open_weights(folder)
    assert any(n.endswith("mlp.gate.weight_1") for n in w._handles[0].keys())  # the release layout indeed
    fused = {n for n in ref if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(fused) == 4  # gate_up_proj and down_proj of text_moe's and vision_moe's experts
    for name, t in ref.items():
        if name.endswith("experts.gate_up_proj"):  # stored per expert: gate and up stacked
            base = name[: -len(".gate_up_proj")]
            got = torch.cat([w.tensor(f"{base}.gate_proj"), w.tensor(f"{base}.up_proj")], dim=1)
        else:
            got = w.tensor(name)
        assert got.shape == t.shape and torch.equal(got.to(t.dtype), t), name


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

#: the tensors of the tiny ERNIE-4.5-VL-MoE's sparse layer that the layout's conversion reads
_ERNIE_MOE = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.weight_1",
              "model.layers.1.mlp.moe_statics.e_score_correction_bias", "model.layers.1.mlp.experts.0.gate_proj.weight",
              "model.layers.1.mlp.experts.9.down_proj.weight", "model.layers.1.mlp.experts.15.up_proj.weight"]


@fuzz_settings(25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(_ERNIE_MOE), st.sampled_from(["drop", "transpose", "flatten", "row"])),
                      min_size=1, max_size=3))
def test_fuzz_ernie_vl_layout_loads_or_names_the_tensor(tiny_model_dir, tmp_path_factory, edits):
    """The ERNIE-4.5-VL layout with tensors dropped or reshaped: the model loads, or a one-line
    WeightError / ConfigError names the checkpoint, never a traceback from elsewhere."""
    import shutil

    from safetensors.torch import load_file

    from ktransformers import load_model
    from ktransformers.errors import ConfigError

    src = tiny_model_dir("ernie4_5_vl_moe")
    out = tmp_path_factory.mktemp("ernie-fuzz")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    sd = load_file(src / "model.safetensors")
    for key, op in edits:
        if key not in sd:
            continue
        t = sd[key]
        if op == "drop":
            del sd[key]
        elif op == "transpose":
            sd[key] = t.t().contiguous()
        elif op == "flatten":
            sd[key] = t.reshape(-1).contiguous()
        else:
            sd[key] = t[:1].contiguous()
    save_file(sd, out / "model.safetensors")
    try:
        load_model(out, model_path=out, allow_unmatched=False)
    except (WeightError, ConfigError) as e:
        assert "\n" not in str(e) and str(out) in str(e), str(e)
