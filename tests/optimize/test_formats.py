"""Weight formats: decided once by the plan from each tensor's stored type and the op (backend),
shown by ``explain``, and the ones the loaded operators hold (``operators/formats.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.operators import formats as F
from ktransformers.operators.cpu_experts import KExpertsCPU
from ktransformers.operators.cpu_linear import KLinearCPU
from ktransformers.optimize.__main__ import main as optimize_main
from ktransformers.optimize.explain import explain_plan, format_label
from ktransformers.optimize.inject import ModelWeights, build_model, inject
from ktransformers.optimize.plan import plan_model
from ktransformers.optimize_rules import default_rule_file
from ktransformers.loading import check_memory_plan, load_config
from ktransformers.util.tiny_models import write_tiny_model
from ktransformers.weights import open_weights
from ktransformers.weights.ggml_types import BY_NAME

EXPERTS = "model.layers.0.mlp.experts"
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE whose rows hold whole Q4_K superblocks (256), as safetensors and as a GGUF
    with Q4_K experts, F16 attention and Q8_0 elsewhere."""
    from ktransformers.convert import convert

    d = tmp_path_factory.mktemp("formats")
    write_tiny_model("qwen3_moe", d / "hf", seed=0, hidden_size=256, moe_intermediate_size=256)
    convert(d / "hf", d / "m.gguf", "Q4_K", "F16", "Q8_0", tokenizer=False)
    return d / "hf", d / "m.gguf"


def _rules(source, backend="llamafile", linear="KLinearCPU"):
    text = Path(default_rule_file(load_config(None, source), cuda=False)).read_text()
    return text.replace("backend: llamafile", f"backend: {backend}").replace("KLinearCPU", linear)


def _explained(path, rules):
    source = open_weights(path)
    model = build_model(load_config(None, source))
    plan = plan_model(model, rules, "cpu")
    return {r.module: r.format for r in explain_plan(model, plan, source).rows}


@pytest.mark.parametrize("backend, label", [("llamafile", "raw Q4_K"), ("AMXInt8", "AMXInt8 packed from raw Q4_K")])
def test_expert_format_explained_is_the_one_loaded(tiny, backend, label, tmp_path, monkeypatch):
    monkeypatch.setenv("KT_PACKED_CACHE", str(tmp_path / "cache"))
    gguf = tiny[1]
    rules = _rules(open_weights(gguf), backend)
    assert _explained(gguf, rules)[EXPERTS] == label
    op = load_model(gguf, rules=rules).get_submodule(EXPERTS).generate_op
    assert {f.label for f in op.formats.values()} == {label}
    assert op.kernel.types == ("Q4_K",) * 3
    if backend == "llamafile":  # the stored blocks, read in place
        assert op.kernel.packed_bytes == 0
        assert all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in op._arrays.values())
    else:
        assert op.kernel.packed_bytes > 0 and op._arrays == {}


@pytest.mark.parametrize("linear, q_label", [("KLinearCPU", "raw F16"), ("KLinearTorch", "float F32")])
def test_linear_formats_explained_are_the_ones_loaded(tiny, linear, q_label):
    gguf = tiny[1]
    rules = _rules(open_weights(gguf), linear=linear)
    shown = _explained(gguf, rules)
    assert shown[Q_PROJ] == q_label
    assert shown["model.embed_tokens"] == "raw Q8_0"
    model = load_model(gguf, rules=rules)
    op = model.get_submodule(Q_PROJ).generate_op
    assert op.formats[f"{Q_PROJ}.weight"].label == q_label
    if linear == "KLinearCPU":
        assert op.kernel.type == "F16" and op._weight_array.dtype == np.uint8  # raw F16, in place
    else:
        assert op.weight.dtype == torch.float32
    emb = model.get_submodule("model.embed_tokens").generate_op
    assert emb.ggml_type.name == "Q8_0" and emb.weight is None


def test_a_float_checkpoint_is_a_float_copy_for_the_kernels(tiny):
    hf = tiny[0]
    rules = _rules(open_weights(hf))
    shown = _explained(hf, rules)
    assert shown[EXPERTS] == "float F32" and shown[Q_PROJ] == "float F32"  # an fp32 model: F32 copies
    op = load_model(hf, rules=rules).get_submodule(EXPERTS).generate_op
    assert op.kernel.types == ("F32",) * 3


def test_the_op_loads_the_format_it_is_handed(tiny):
    """An op follows the plan's format instead of deciding again; built without one, it decides the
    plan's way."""
    gguf = tiny[1]
    source = open_weights(gguf)
    model = build_model(load_config(None, source))
    weights = ModelWeights(source, model)
    module = model.get_submodule(Q_PROJ)
    name = f"{Q_PROJ}.weight"

    alone = KLinearCPU(Q_PROJ, model.config, module, "cpu")
    alone.load(weights, torch.float32)
    assert alone.kernel.type == "F16"
    assert alone.weight_format(weights, name, torch.float32) == KLinearCPU.decide_format(weights, name, torch.float32, {})

    handed = KLinearCPU(Q_PROJ, model.config, module, "cpu")
    handed.formats = {name: F.float_format(torch.bfloat16)}
    handed.load(weights, torch.float32)
    assert handed.kernel.type == "BF16" and handed._weight_array.dtype == torch.bfloat16
    x = torch.randn(3, module.in_features)
    assert torch.allclose(handed.forward(x), alone.forward(x), atol=0.05, rtol=0.05)


def test_a_format_the_file_does_not_hold_is_one_line_naming_the_tensor(tiny):
    gguf = tiny[1]
    source = open_weights(gguf)
    model = build_model(load_config(None, source))
    op = KLinearCPU(Q_PROJ, model.config, model.get_submodule(Q_PROJ), "cpu")
    op.formats = {f"{Q_PROJ}.weight": F.raw_format(BY_NAME["Q8_0"])}
    with pytest.raises(WeightError) as e:
        op.load(ModelWeights(source, model), torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and f"'{Q_PROJ}.weight'" in msg
    assert "stored as F16, but the plan holds it as raw Q8_0" in msg


def test_formats_are_decided_once_per_load(tiny, monkeypatch):
    """The memory plan's explain decides them, the injection reuses them."""
    gguf = tiny[1]
    source = open_weights(gguf)
    model = build_model(load_config(None, source))
    rules = _rules(source)
    plan = plan_model(model, rules, "cpu")
    calls = []
    real = KExpertsCPU.decide_format.__func__
    monkeypatch.setattr(KExpertsCPU, "decide_format",
                        classmethod(lambda cls, *a: calls.append(a[1]) or real(cls, *a)))
    check_memory_plan(model, plan, source)
    inject(model, rules, source, plan=plan)
    layers = model.config.num_hidden_layers
    assert len(calls) == len(set(calls)) == 3 * layers


def test_explain_prints_the_format_column(tiny, capsys):
    gguf = tiny[1]
    rules = Path(default_rule_file(load_config(None, open_weights(gguf)), cuda=False))
    assert optimize_main(["explain", str(rules), "--gguf_path", str(gguf), "--compact"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("module "))
    assert "weight format" in header
    row = next(line for line in out.splitlines() if line.startswith("model.layers.*.mlp.experts "))
    assert "raw Q4_K" in row


def test_format_label_names_each_weight_where_they_differ():
    q4, q6 = F.raw_format(BY_NAME["Q4_K"]), F.raw_format(BY_NAME["Q6_K"])
    key = "m.experts"
    same = {"generate": {f"{key}.gate_proj": q4, f"{key}.up_proj": q4, f"{key}.down_proj": q4}}
    assert format_label(same, key) == "raw Q4_K"
    mixed = {"generate": {f"{key}.gate_proj": q4, f"{key}.up_proj": q4, f"{key}.down_proj": q6}}
    assert format_label(mixed, key) == "gate_proj,up_proj raw Q4_K; down_proj raw Q6_K"
    two = {"generate": {f"{key}.gate_proj": q4}, "prefill": {f"{key}.gate_proj": F.float_format(torch.bfloat16)}}
    assert format_label(two, key) == "raw Q4_K | prefill: float BF16"
    assert format_label({}, key) == ""
    packed = F.kernel_format(None, torch.float32, "AMXInt4")
    assert packed.label == "AMXInt4 packed from float F32" and packed.read.torch_dtype == torch.float32


def test_deciding_a_format_reads_no_tensor_data(tmp_path):
    """The plan decides formats from the file's header: a GGUF source's ``ggml_type`` agrees with its
    ``raw()`` on every tensor, and deciding does not call ``raw()``."""
    from ktransformers.operators.formats import stored_type
    from ktransformers.util.tiny_models import write_tiny_model
    from ktransformers.weights import open_weights
    from ktransformers.convert import convert

    d = tmp_path / "m"
    write_tiny_model("qwen3_moe", d, seed=1)
    gguf = tmp_path / "m.gguf"
    convert(d, gguf)
    src = open_weights(str(gguf))
    for name in src.names():
        raw = src.raw(name)
        assert stored_type(src, name) == (raw.type if raw is not None else None), name

    class NoRead:
        def __init__(self, inner):
            self.inner = inner

        def ggml_type(self, name):
            return self.inner.ggml_type(name)

        def raw(self, name):
            raise AssertionError("a format decision read the tensor")

    name = next(n for n in src.names() if "experts" in n)
    assert stored_type(NoRead(src), name) is not None
