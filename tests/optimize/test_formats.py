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


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny Qwen3-MoE GGUF of mixed types: Q4_K gate/up experts, Q6_K down experts, BF16 attention,
    F32 norms and router, Q8_0 elsewhere."""
    from ktransformers.convert import convert, policy

    d = tmp_path_factory.mktemp("mixed")
    write_tiny_model("qwen3_moe", d / "hf", seed=0, hidden_size=256, moe_intermediate_size=256)
    real = policy.TypePolicy.choose

    def choose(self, gguf_name, shape):
        return "Q6_K" if ".ffn_down_exps." in gguf_name else real(self, gguf_name, shape)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy.TypePolicy, "choose", choose)
        return convert(d / "hf", d / "mixed.gguf", "Q4_K", "BF16", "Q8_0", tokenizer=False)


def _tensor_section(out: str) -> dict[str, tuple[str, ...]]:
    """The rows of explain's per-tensor table: tensor -> (stored, format, held on)."""
    import re

    lines = out.splitlines()
    start = lines.index("Weight format per tensor:")
    assert re.split(r"\s{2,}", lines[start + 1].strip()) == ["tensor", "stored", "format", "held on"]
    rows = {}
    for line in lines[start + 3:]:
        if not line.strip():
            break
        tensor, *rest = re.split(r"\s{2,}", line.strip())
        assert tensor not in rows, tensor
        rows[tensor] = tuple(rest)
    return rows


def test_explain_of_a_gpu_rule_file_on_a_cpu_machine_shows_each_tensors_format(mixed, capsys, monkeypatch):
    """``explain`` of the shipped GPU file, on a machine without CUDA, lists every tensor of the file
    once with its stored type (checked against gguf-py's reader), the format the plan chose and where
    it is held."""
    import gguf

    from ktransformers.optimize_rules import RULES_DIR

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert optimize_main(["explain", str(RULES_DIR / "Qwen3Moe.yaml"), "--gguf_path", str(mixed)]) == 0
    rows = _tensor_section(capsys.readouterr().out)

    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(mixed).tensors}
    assert (stored["blk.0.ffn_gate_exps.weight"], stored["blk.0.ffn_down_exps.weight"], stored["blk.0.attn_q.weight"],
            stored["blk.0.attn_norm.weight"], stored["token_embd.weight"]) == ("Q4_K", "Q6_K", "BF16", "F32", "Q8_0")
    source = open_weights(mixed)
    assert sorted(source.gguf_name(t) for t in rows) == sorted(stored)  # every tensor of the file, once
    for tensor, (kind, *_) in rows.items():
        assert kind == stored[source.gguf_name(tensor)], tensor

    model_dtype = next(build_model(load_config(None, source)).parameters()).dtype
    copy = F.float_format(model_dtype).label  # the torch ops' float copy in the model's dtype
    for layer in range(2):
        experts = f"model.layers.{layer}.mlp.experts"
        assert rows[f"{experts}.gate_proj"] == rows[f"{experts}.up_proj"] == ("Q4_K", "raw Q4_K", "cpu")
        assert rows[f"{experts}.down_proj"] == ("Q6_K", "raw Q6_K", "cpu")
        assert rows[f"model.layers.{layer}.self_attn.q_proj.weight"] == ("BF16", copy, "cuda:0")
        assert rows[f"model.layers.{layer}.input_layernorm.weight"] == ("F32", copy, "cuda:0")
        assert rows[f"model.layers.{layer}.mlp.gate.weight"] == ("F32", copy, "cuda:0")
    assert rows["model.embed_tokens.weight"] == ("Q8_0", copy, "cpu")
    assert rows["model.norm.weight"] == ("F32", copy, "cuda:0")


def test_each_tensor_is_loaded_in_the_format_explained(mixed, tmp_path, monkeypatch):
    """The plan ``explain`` reads is the plan the load applies: every tensor's explained format is
    the one its op holds, or the dtype the loader read a plain module's tensor in."""
    from ktransformers.loading import load_planned, plan_load
    from ktransformers.operators.base import BaseInjectedModule
    from ktransformers.optimize_rules import RULES_DIR

    monkeypatch.setenv("KT_PACKED_CACHE", str(tmp_path / "cache"))
    rules = Path(RULES_DIR / "Qwen3Moe.yaml").read_text().replace("backend: llamafile", "backend: AMXInt8")
    planned = plan_load(mixed, None, rules, device="cpu", device_map="cuda=cpu")
    ex = explain_plan(planned.model, planned.plan, planned.source)
    by_name = {r.tensor: r for r in ex.tensors}
    assert by_name["model.layers.1.mlp.experts.down_proj"].format == "AMXInt8 packed from raw Q6_K"
    model = load_planned(planned)
    plain = 0
    for r in ex.tensors:
        module = model.get_submodule(r.module)
        if isinstance(module, BaseInjectedModule) and module.generate_op is not None:
            assert module.generate_op.formats[r.tensor].label == r.format, r.tensor
        else:
            plain += 1
            assert F.float_format(model.get_parameter(r.tensor).dtype).label == r.format, r.tensor
    assert plain > 0
    experts = model.get_submodule("model.layers.1.mlp.experts").generate_op
    assert experts.kernel.types == ("Q4_K", "Q4_K", "Q6_K") and experts.kernel.backend == "AMXInt8"


def test_explain_decides_each_format_once_from_the_header(mixed, monkeypatch, capsys, tmp_path):
    """One decision per expert weight per explain, and none of them reads tensor data (``raw()``)."""
    from ktransformers.weights.gguf_source import GGUFSource

    calls = []
    real = KExpertsCPU.decide_format.__func__
    monkeypatch.setattr(KExpertsCPU, "decide_format", classmethod(lambda cls, *a: calls.append(a[1]) or real(cls, *a)))

    def no_read(self, name):
        raise AssertionError(f"deciding a format read tensor {name}")

    monkeypatch.setattr(GGUFSource, "raw", no_read)
    rules = tmp_path / "gpuq.yaml"
    rules.write_text(_rules(open_weights(mixed), linear="KLinearGPUQ"))
    assert optimize_main(["explain", str(rules), "--gguf_path", str(mixed)]) == 0
    assert len(calls) == len(set(calls)) == 3 * 2
    rows = _tensor_section(capsys.readouterr().out)
    assert rows["model.layers.0.self_attn.q_proj.weight"][1:] == ("float F32", "cpu")  # BF16 is not quantized: dense
    assert rows["lm_head.weight"] == ("Q8_0", "raw Q8_0", "cpu")  # kept in its blocks, dequantized per call
    assert rows["model.embed_tokens.weight"] == ("Q8_0", "raw Q8_0", "cpu")  # rows gathered from the blocks


def test_mxfp4_experts_say_their_type_from_the_header(tmp_path):
    """A gpt-oss MXFP4 checkpoint's stacked experts say MXFP4, its other tensors what their source
    says, as ``raw()`` does, without a tensor read or converted: the plan and explain's per-tensor
    table ask every tensor of a load."""
    from safetensors.torch import save_file

    from ktransformers.weights.mxfp4 import Mxfp4ExpertsSource

    E, H, I = 2, 64, 32
    key = "model.layers.0.mlp.experts"
    save_file({f"{key}.gate_up_proj_blocks": torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8),
               f"{key}.gate_up_proj_scales": torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8),
               f"{key}.down_proj_blocks": torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8),
               f"{key}.down_proj_scales": torch.full((E, H, I // 32), 126, dtype=torch.uint8),
               "model.norm.weight": torch.ones(H)}, tmp_path / "model.safetensors")
    src = open_weights(tmp_path)
    assert isinstance(src, Mxfp4ExpertsSource)
    names = src.names()
    assert {f"{key}.gate_proj", f"{key}.up_proj", f"{key}.down_proj", "model.norm.weight"} <= set(names)
    expected = {}
    for name in names:
        raw = src.raw(name)
        expected[name] = raw.type if raw is not None else None
    assert expected[f"{key}.down_proj"] == BY_NAME["MXFP4"] and expected["model.norm.weight"] is None

    def no_read(*a, **k):
        raise AssertionError("a format decision read a tensor")

    src.raw = no_read
    src.inner.tensor = no_read
    for name in names:
        assert F.stored_type(src, name) == expected[name], name


def test_a_prefill_copy_in_another_format_is_shown_beside_the_generate_one(mixed):
    """Experts computed on the CPU kernels and prefilled by torch on a GPU: each tensor row names both
    formats and both devices (explained on any machine: the plan is made to be read)."""
    from ktransformers.loading import plan_load

    rules = """
- match: {name: "experts$"}
  replace: {class: KTransformersExperts, kwargs: {generate_device: cpu, generate_op: KExpertsCPU,
            prefill_device: "cuda:0", prefill_op: KExpertsTorch}}
  recursive: false
"""
    planned = plan_load(mixed, None, rules, device="cpu", plan_only=True)
    ex = explain_plan(planned.model, planned.plan, planned.source)
    row = next(r for r in ex.tensors if r.tensor == "model.layers.1.mlp.experts.down_proj")
    copy = F.float_format(next(planned.model.parameters()).dtype).label
    assert (row.stored, row.format, row.devices) == ("Q6_K", f"raw Q6_K | prefill: {copy}", "cpu+cuda:0")
