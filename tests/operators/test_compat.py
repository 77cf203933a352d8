"""The reference system's names resolve through one table; kinds are checked at plan time."""

from __future__ import annotations

import textwrap

import pytest

from ktransformers.errors import RuleError
from ktransformers.operators.linear import LINEAR_OPS, KLinearTorch
from ktransformers.optimize import build_model, parse_rules, plan_model
from ktransformers.optimize.explain import alias_lines, explain_plan, format_explanation
from ktransformers.util.tiny_models import tiny_config

# written in the reference system's style: its operator paths, op names, backend, kwarg spellings
QWEN3_REF = r"""
- match:
    class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeRotaryEmbedding
  replace:
    class: ktransformers.operators.RoPE.RotaryEmbedding
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^lm_head$"
    class: torch.nn.Linear
  replace:
    class: ktransformers.operators.linear.KTransformersLinear
    kwargs: {generate_device: "cpu", prefill_device: "cpu", generate_op: "VLinearMarlin", prefill_op: "KLinearTorch"}
- match:
    name: "^model\\.layers\\..*\\.mlp$"
    class: ktransformers.models.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
  replace:
    class: ktransformers.operators.experts.KQwen3MoeSparseMoeBlockV2
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^model\\.layers\\..*\\.mlp\\.experts$"
  replace:
    class: ktransformers.operators.experts.KTransformersExpertsV2
    kwargs: {prefill_device: "cpu", prefill_op: "None", generate_device: "cpu", generate_op: "KExpertsTorch"}
  recursive: False
- match:
    name: "^model\\.layers\\..*\\.self_attn$"
  replace:
    class: ktransformers.operators.balance_serve_attention.KQwen3MoeAttention
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
- match:
    name: "^model$"
  replace:
    class: "ktransformers.operators.layer_wise_prefill.KQwen2MoeModel"
    kwargs: {per_layer_prefill_intput_threshold: 0}
- match:
    class: ktransformers.models.modeling_qwen3_moe.Qwen3MoeRMSNorm
  replace:
    class: ktransformers.operators.layernorm.KQwen3MoeRMSNorm
    kwargs: {generate_device: "cpu", prefill_device: "cpu"}
"""


def _plan(arch: str, text: str, source: str = "r.yaml"):
    model = build_model(tiny_config(arch))
    return model, plan_model(model, parse_rules(textwrap.dedent(text), source))


def test_reference_rule_file_checks_and_explains_with_one_line_per_alias():
    model, plan = _plan("qwen3_moe", QWEN3_REF)
    lines = alias_lines(plan.rules)
    assert "KQwen3MoeSparseMoeBlockV2 → KMoEBlock (MoE block: router, routed experts overlapped with shared experts)" \
        in lines
    assert any(ln.startswith("VLinearMarlin → KLinearGPUQ (GPU quantized linear") for ln in lines)
    assert any(ln.startswith("KQwen3MoeAttention → default (") for ln in lines)
    assert any(ln.startswith("per_layer_prefill_intput_threshold → prefill_threshold") for ln in lines)
    assert any(ln.startswith("prefill_op: None → prefill_op: null") for ln in lines)
    assert len(lines) == len(set(lines))
    text = format_explanation(explain_plan(model, plan))
    assert "Reference-system names:" in text and "  KTransformersExpertsV2 → KTransformersExperts (" in text
    experts = plan.placements["model.layers.0.mlp.experts"]
    assert experts.operator.__name__ == "KTransformersExperts"
    assert experts.phases.prefill_disabled and experts.prefill_op is None
    assert plan.placements["model.layers.0.self_attn"].operator is None
    assert plan.placements["model.rotary_emb"].operator.__name__ == "KRotaryEmbedding"
    assert plan.placements["model"].kwargs["prefill_threshold"] == 0


def test_marlin_maps_to_the_gpu_quantized_linear_when_it_is_registered():
    class _GPUQ(KLinearTorch):
        name = "KLinearGPUQ"

    rules = "- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear, kwargs: {generate_op: KLinearMarlin}}\n"
    shipped = LINEAR_OPS.pop("KLinearGPUQ", None)  # a build without it falls back to the dequantized linear
    try:
        assert alias_lines(parse_rules(rules))[0].startswith("KLinearMarlin → KLinearTorch (")
    finally:
        if shipped is not None:
            LINEAR_OPS["KLinearGPUQ"] = shipped
    LINEAR_OPS["KLinearGPUQ"] = _GPUQ
    try:
        (line,) = alias_lines(parse_rules(rules))
        assert line == "KLinearMarlin → KLinearGPUQ (GPU quantized linear)"
        _, plan = _plan("llama", rules)
        assert plan.placements["lm_head"].phases.generate_op is _GPUQ
    finally:
        LINEAR_OPS.pop("KLinearGPUQ")
        if shipped is not None:
            LINEAR_OPS["KLinearGPUQ"] = shipped


def test_prefill_op_none_string_is_a_null_prefill_op(tiny_model_dir):
    from ktransformers import load_model

    d = tiny_model_dir("llama")
    model = load_model(d, model_path=d, rules="- match: {name: '^lm_head$'}\n  replace:\n    class: KTransformersLinear\n"
                                             "    kwargs: {generate_op: KLinearTorch, prefill_op: None}\n")
    assert model.lm_head.prefill_op is None and model.lm_head.generate_op.name == "KLinearTorch"


def test_reference_int4_backend_names_pass_check():
    """The reference system's int4 expert backends are KExpertsCPU backends here (loaded end to
    end in test_cpu_ops.py)."""
    for b in ("AMXInt4", "AMXInt4_1"):
        rules = ("- match: {name: 'mlp[.]experts$'}\n  replace:\n    class: KTransformersExperts\n    device: cpu\n"
                 f"    kwargs: {{generate_op: KExpertsCPU, backend: {b}}}\n  recursive: false\n")
        assert parse_rules(rules)[0].kwargs["backend"] == b


def test_unknown_backend_is_still_refused_at_check():
    with pytest.raises(RuleError, match=r"\(replace.kwargs.backend\).*not a KExpertsCPU backend"):
        parse_rules("- match: {name: x}\n  replace:\n    class: KTransformersExperts\n"
                    "    kwargs: {generate_op: KExpertsCPU, backend: AMXInt3}\n")


def test_glm4_moe_module_path_resolves():
    (rule,) = parse_rules("- match: {class: ktransformers.models.modeling_glm4_moe.Glm4MoeMoE}\n  replace: {class: KMoEBlock}\n")
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    assert rule.match_class == (Glm4MoeMoE,)


@pytest.mark.parametrize("text, module, line", [
    ("- match: {name: 'input_layernorm$'}\n  replace: {class: KTransformersLinear}\n",
     "model.layers.0.input_layernorm", 2),
    ("- match: {name: '^model[.]layers[.]0[.]mlp$'}\n  replace:\n    class: KMoEBlock\n", "model.layers.0.mlp", 3),
    ("- match: {name: 'self_attn$'}\n  replace: {class: KMoEGate}\n", "model.layers.0.self_attn", 2),
])
def test_operator_on_a_module_of_another_kind_is_refused_at_plan_time(text, module, line):
    # deepseek_v3's layer 0 is dense (first_k_dense_replace=1): KMoEBlock cannot take it
    with pytest.raises(RuleError) as ei:
        _plan("deepseek_v3", text)
    msg = str(ei.value)
    assert msg.startswith(f"r.yaml:{line}: rule #0 (replace.class): ") and f"'{module}'" in msg and "\n" not in msg


@pytest.mark.parametrize("name, want, never", [
    ("KMoEGateDeepSeekV4", "KMoEGate", "MoE"),
    ("KGlm4MoeAttentio", "Attention", "MoeMoE"),
])
def test_suggestions_name_operators_of_the_same_kind(name, want, never):
    with pytest.raises(RuleError) as ei:
        parse_rules(f"- match: {{name: x}}\n  replace: {{class: {name}}}\n")
    hint = str(ei.value).split("did you mean", 1)[1]
    assert want in hint and never not in hint.replace(want, "")


def test_kinds_of_tiny_modules():
    from ktransformers.operators.kinds import EXPERTS, LINEAR, MLA_ATTENTION, MLP, MOE_BLOCK, NORM, ROUTER, kinds_of

    m = build_model(tiny_config("deepseek_v3"))
    assert kinds_of(m.get_submodule("model.layers.1.mlp")) == {MOE_BLOCK}
    assert kinds_of(m.get_submodule("model.layers.1.mlp.experts")) == {EXPERTS}
    assert kinds_of(m.get_submodule("model.layers.1.mlp.gate")) == {ROUTER}
    assert kinds_of(m.get_submodule("model.layers.0.mlp")) == {MLP}
    assert MLA_ATTENTION in kinds_of(m.get_submodule("model.layers.0.self_attn"))
    assert kinds_of(m.get_submodule("model.norm")) == {NORM}
    assert kinds_of(m.get_submodule("lm_head")) == {LINEAR}
