"""Bad GGUF files give one WeightError line naming the file (and the tensor), never a crash."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktransformers.errors import WeightError
from ktransformers.weights.gguf_source import GGUFSource

from gguf_files import copy_gguf

from ._util import fixture_dir


def one_line(e: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.fixture
def q8(tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copy(fixture_dir("qwen3moe-tiny") / "Q8_0.gguf", p)
    return p


def test_wrong_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(WeightError) as e:
        GGUFSource(p)
    one_line(e, str(p), "not a GGUF file")


def test_truncated_header(q8):
    data = q8.read_bytes()
    q8.write_bytes(data[:300])
    with pytest.raises(WeightError) as e:
        GGUFSource(q8)
    one_line(e, str(q8))


def test_truncated_tensor_data(q8):
    data = q8.read_bytes()
    q8.write_bytes(data[: len(data) - 5000])
    with pytest.raises(WeightError) as e:
        GGUFSource(q8)
    one_line(e, str(q8), "tensor '", "past the end")


def test_missing_tensor(q8):
    src = GGUFSource(q8)
    with pytest.raises(WeightError) as e:
        src.tensor("model.layers.7.self_attn.q_proj.weight")
    one_line(e, str(q8), "model.layers.7.self_attn.q_proj.weight", "not found")


def test_shape_disagrees_with_config(tmp_path):
    p = copy_gguf(fixture_dir("qwen3moe-tiny") / "Q8_0.gguf", tmp_path / "m.gguf",
                  keys={"qwen3moe.expert_feed_forward_length": 128})
    src = GGUFSource(p)
    with pytest.raises(WeightError) as e:
        src.validate()
    one_line(e, str(p), "ffn_", "shape", "config expects")


# llama.cpp's qwen35moe (2 key heads, 4 value heads), committed with the tests
QWEN35 = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "qwen3_5_moe_text.gguf"


@pytest.mark.parametrize("key,value,needles,when", [
    ("qwen35moe.ssm.time_step_rank", 3, ("'qwen35moe.ssm.*'", "time_step_rank 3", "whole heads"), "open"),
    ("qwen35moe.ssm.group_count", 1 << 21, ("'qwen35moe.ssm.group_count'", "2097152"), "open"),
    ("qwen35moe.rope.dimension_sections", [5, 3], ("'qwen35moe.rope.dimension_sections'", "3 (time, height, width)"),
     "config"),
    ("qwen35moe.rope.dimension_sections", [11, -1, 10, 0], ("'qwen35moe.rope.dimension_sections'", "-1"), "open"),
])
def test_qwen35moe_bad_linear_attention_metadata(tmp_path, key, value, needles, when):
    """DeltaNet sizes and MRoPE sections that describe no model: one line naming the key."""
    p = copy_gguf(QWEN35, tmp_path / "m.gguf", keys={key: value})
    with pytest.raises(WeightError) as e:
        GGUFSource(p).config() if when == "config" else GGUFSource(p)
    one_line(e, str(p), *needles)


def test_qwen35moe_reordered_tensor_of_the_wrong_width(tmp_path):
    """``ssm_out`` (its columns reordered by V head) narrower than the ssm.* sizes: the check and the
    load both name it."""
    def edit(name, data, qt):
        return (data[:, :32].copy(), qt) if name == "blk.0.ssm_out.weight" else (data, qt)

    p = copy_gguf(QWEN35, tmp_path / "m.gguf", tensor=edit)
    src = GGUFSource(p)
    with pytest.raises(WeightError) as e:
        src.validate()
    one_line(e, str(p), "'blk.0.ssm_out.weight'", "[64, 32]", "config expects [64, 64]")
    with pytest.raises(WeightError) as e:
        src.tensor("model.layers.0.linear_attn.out_proj.weight")
    one_line(e, str(p), "'blk.0.ssm_out.weight'", "64 columns", "ssm.*")


def test_unsupported_type(tmp_path):
    # give one tensor a type gguf-py knows but nobody can dequantize (Q8_1: same block elems as Q8_0)
    def edit(name, data, qt):
        if name == "blk.0.attn_q.weight":
            rows = data.shape[0]
            return np.zeros((rows, 256 // 32 * 40), np.uint8), gguf.GGMLQuantizationType.Q8_1
        return data, qt

    p = copy_gguf(fixture_dir("qwen3moe-tiny") / "Q8_0.gguf", tmp_path / "m.gguf", tensor=edit)
    src = GGUFSource(p)
    with pytest.raises(WeightError) as e:
        src.tensor("model.layers.0.self_attn.q_proj.weight")
    one_line(e, str(p), "blk.0.attn_q.weight", "Q8_1")


def test_unknown_type_id(q8):
    # patch the ggml type id of the first tensor info to an id that does not exist
    r = gguf.GGUFReader(q8)
    off = r.tensors[0].field.offset
    parts = r.tensors[0].field.parts
    type_off = off + sum(int(p.nbytes) for p in parts[:4])
    data = bytearray(q8.read_bytes())
    data[type_off : type_off + 4] = (77).to_bytes(4, "little")
    q8.write_bytes(bytes(data))
    with pytest.raises(WeightError) as e:
        GGUFSource(q8)
    one_line(e, str(q8), f"tensor '{r.tensors[0].name}'", "77")


def test_unsupported_arch(tmp_path):
    p = copy_gguf(fixture_dir("qwen3moe-tiny") / "Q8_0.gguf", tmp_path / "m.gguf",
                  keys={"general.architecture": "rwkv9"})
    src = GGUFSource(p)
    with pytest.raises(WeightError) as e:
        src.config()
    one_line(e, str(p), "rwkv9", "not supported")


def test_empty_and_missing_paths(tmp_path):
    with pytest.raises(WeightError):
        GGUFSource(tmp_path / "nope.gguf")
    with pytest.raises(WeightError, match="no .gguf"):
        GGUFSource(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(WeightError, match="not a GGUF file"):
        GGUFSource(tmp_path / "a.gguf")


def test_zero_copy_tensor_is_writable_without_touching_file(q8):
    before = q8.read_bytes()
    src = GGUFSource(q8)
    t = src.tensor("model.norm.weight")  # F32: a view of the (copy-on-write) mapping
    t.add_(1.0)
    assert q8.read_bytes() == before
    assert isinstance(t, torch.Tensor)
