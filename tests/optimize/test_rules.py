"""Rule files: each kind of bad input gives its one-line error; matching semantics as documented."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ktransformers.errors import RuleError
from ktransformers.optimize import build_model, load_rules, parse_rules, plan_model
from ktransformers.util.tiny_models import tiny_config


def rules_error(text: str) -> str:
    with pytest.raises(RuleError) as ei:
        parse_rules(textwrap.dedent(text), "r.yaml")
    msg = str(ei.value)
    assert "\n" not in msg, "errors are one line"
    return msg


@pytest.mark.parametrize(
    "text, expect",
    [
        ("- match: {name: x}\n  replace: {class: default}\n  recurse: false\n",
         ["r.yaml:3:", "rule #0", "(recurse)", "did you mean 'recursive'"]),
        ("- replace: {class: default}\n", ["r.yaml:1:", "rule #0", "missing 'match'"]),
        ("- match: {name: x}\n", ["r.yaml:1:", "missing 'replace'"]),
        ("- match: {name: x}\n  replace: {class: default}\n- match: {name: '(unclosed'}\n  replace: {}\n",
         ["r.yaml:3:", "rule #1", "(match.name)", "does not compile"]),
        ("- match: {class: torch.nn.Linearr}\n  replace: {}\n",
         ["r.yaml:1:", "(match.class)", "cannot be imported", "did you mean 'torch.nn.Linear'"]),
        ("- match: {class: torch.nn.Parameter}\n  replace: {}\n", ["(match.class)", "not a torch.nn.Module"]),
        ("- match: {class: torch.Tensor}\n  replace: {}\n", ["(match.class)", "module 'torch' is outside what rule"]),
        ("- match: {class: builtins.dict}\n  replace: {}\n",
         ["r.yaml:1:", "(match.class)", "module 'builtins' is outside", "KT_RULE_IMPORTS=builtins"]),
        ("- match: {name: x}\n  replace: {class: KTransformersLinearr}\n",
         ["(replace.class)", "did you mean 'KTransformersLinear'"]),
        ("- match: {name: x}\n  replace: {class: ktransformers.operators.linear.KLinearMarlin}\n",
         ["(replace.class)", "not provided by this project", "KLinearGPUQ"]),
        ("- match: {name: x}\n  replace:\n    class: KTransformersLinear\n    kwargs: {generate_op: KLinearIPEXLLM}\n",
         ["r.yaml:4:", "(replace.kwargs.generate_op)", "does not provide it", "KLinearTorch"]),
        ("- match: {name: x}\n  replace:\n    class: KTransformersLinear\n    kwargs:\n      generate_device: cpu\n"
         "      bogus: 3\n", ["r.yaml:6:", "(replace.kwargs.bogus)", "does not accept"]),
        ("- match: {name: x}\n  replace:\n    class: KTransformersLinear\n    kwargs: {prefill_threshold: many}\n",
         ["(replace.kwargs.prefill_threshold)", "must be int"]),
        ("- match: {name: x}\n  replace: {class: default, device: gpu0}\n", ["(replace.device)", "not a device"]),
        ("- match: {name: x}\n  replace: {class: default, kwargs: {generate_op: KLinearTorch}}\n",
         ["(replace.kwargs.generate_op)", "takes only devices"]),
        ("- match: {name: x}\n  replace: {class: default, kwargs: {generate_device: cpu, prefill_device: cuda}}\n",
         ["(replace.kwargs.prefill_device)", "one device"]),
        ("- match: {}\n  replace: {}\n", ["(match)", "at least one of"]),
        ("- match: {name: x, klass: y}\n  replace: {}\n", ["(match.klass)", "did you mean 'class'"]),
        ("- match: {name: x}\n  replace: {class: default, devise: cpu}\n", ["(replace.devise)", "did you mean 'device'"]),
        ("- match: {name: x}\n  replace: {}\n  recursive: maybe\n", ["r.yaml:3:", "(recursive)", "true or false"]),
        ("match: {name: x}\n", ["r.yaml:1:", "YAML list"]),
        ("- match: {name: x\n", ["r.yaml:", "not valid YAML"]),
        ("", ["r.yaml", "empty"]),
    ],
)
def test_bad_rule_gives_specific_one_line_error(text, expect):
    msg = rules_error(text)
    for part in expect:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_unsafe_yaml_is_refused():
    msg = rules_error("- match: !!python/object/apply:os.system ['true']\n  replace: {}\n")
    assert "r.yaml" in msg


def test_reference_system_paths_resolve():
    rules = parse_rules(textwrap.dedent("""
        - match:
            class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE
          replace:
            class: ktransformers.operators.experts.KDeepseekV3MoE
            kwargs: {generate_device: cpu, prefill_device: cpu}
        - match:
            name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"
          replace:
            class: ktransformers.operators.experts.KTransformersExperts
            kwargs: {generate_device: cpu, generate_op: KExpertsTorch, prefill_op: KExpertsTorch, out_device: cpu}
          recursive: False
        - match: {class: ktransformers.models.modeling_deepseek_v3.MoEGate}
          replace: {class: ktransformers.operators.gate.KMoEGate}
        - match: {class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeRotaryEmbedding}
          replace: {class: ktransformers.operators.RoPE.RotaryEmbedding}
        - match: {name: "^model$"}
          replace:
            class: ktransformers.operators.models.KDeepseekV2Model
            kwargs: {per_layer_prefill_intput_threshold: 0}
        - match: {name: "^lm_head$", class: torch.nn.Linear}
          replace:
            class: ktransformers.operators.linear.KTransformersLinear
            kwargs: {generate_device: cpu, prefill_device: cpu, generate_op: KLinearTorch, prefill_op: KLinearTorch}
    """), "upstream.yaml")
    assert [r.replace_class.__name__ for r in rules] == [
        "KMoEBlock", "KTransformersExperts", "KMoEGate", "KRotaryEmbedding", "KTransformersModel",
        "KTransformersLinear"]
    model = build_model(tiny_config("deepseek_v3"))
    plan = plan_model(model, rules)
    assert plan.matches[0] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert plan.unmatched_rules() == [rules[3]]  # a Qwen rotary rule on a DeepSeek model


def _plan(arch, text, **kw):
    return plan_model(build_model(tiny_config(arch)), parse_rules(textwrap.dedent(text)), **kw)


def test_first_match_wins_and_inheritance():
    plan = _plan("qwen3_moe", """
        - match: {name: "^model\\\\.layers\\\\.0\\\\.self_attn\\\\.q_proj$"}
          replace: {class: KTransformersLinear, device: "cuda:1"}
        - match: {class: torch.nn.Linear}
          replace: {class: KTransformersLinear, device: cpu}
        - match: {name: "^model\\\\.layers\\\\.1$"}
          replace: {class: default, device: "cuda:1"}
    """)
    p = plan.placements
    assert p["model.layers.0.self_attn.q_proj"].rule.index == 0
    assert p["model.layers.0.self_attn.q_proj"].generate_device == torch.device("cuda:1")
    assert p["model.layers.0.self_attn.k_proj"].rule.index == 1
    # a layer placed on cuda:1: its unmatched children inherit, matched ones follow their own rule
    assert p["model.layers.1.input_layernorm"].rule is None
    assert p["model.layers.1.input_layernorm"].generate_device == torch.device("cuda:1")
    assert p["model.layers.1.input_layernorm"].from_ancestor == "model.layers.1"
    assert p["model.layers.1.self_attn.q_proj"].generate_device == torch.device("cpu")
    # no catch-all needed: unmatched top-level modules get the default device
    assert p["model.embed_tokens"].generate_device == torch.device("cpu")
    assert p["model.embed_tokens"].operator is None


def test_default_device_for_unmatched_root():
    plan = _plan("llama", """
        - match: {name: "^lm_head$"}
          replace: {class: default, device: cpu}
    """, default_device="meta")
    assert plan.placements["model.layers.0.mlp.up_proj"].generate_device == torch.device("meta")
    assert plan.placements["lm_head"].generate_device == torch.device("cpu")


def test_recursive_false_stops_matching_below():
    text = """
        - match: {name: "^model\\\\.layers\\\\.0\\\\.self_attn$"}
          replace: {class: default, device: cpu}
          recursive: {rec}
        - match: {class: torch.nn.Linear}
          replace: {class: KTransformersLinear}
    """
    plan = _plan("llama", text.replace("{rec}", "false"))
    assert plan.placements["model.layers.0.self_attn.q_proj"].operator is None
    assert plan.placements["model.layers.1.self_attn.q_proj"].operator.__name__ == "KTransformersLinear"
    plan = _plan("llama", text.replace("{rec}", "true"))
    assert plan.placements["model.layers.0.self_attn.q_proj"].operator.__name__ == "KTransformersLinear"


def test_name_and_class_must_both_hold():
    plan = _plan("qwen3_moe", """
        - match: {name: "mlp", class: torch.nn.Linear}
          replace: {class: KTransformersLinear}
    """)
    assert plan.unmatched_rules() and not plan.matches[0]
    plan = _plan("qwen3_moe", """
        - match: {name: "mlp\\\\.experts$", class: Qwen3MoeExperts}
          replace: {class: KTransformersExperts}
          recursive: false
    """)
    assert plan.matches[0] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_ops_and_devices_per_phase_in_plan():
    plan = _plan("qwen3_moe", """
        - match: {name: "experts$"}
          replace:
            class: KTransformersExperts
            kwargs: {generate_device: cpu, prefill_device: "cuda:1", prefill_op: KExpertsTorch}
          recursive: false
    """)
    p = plan.placements["model.layers.0.mlp.experts"]
    assert (p.generate_device, p.prefill_device) == (torch.device("cpu"), torch.device("cuda:1"))
    assert (p.generate_op, p.prefill_op) == ("KExpertsTorch", "KExpertsTorch")


def test_operator_with_one_device_refuses_two():
    with pytest.raises(RuleError, match="one device"):
        _plan("qwen3_moe", """
            - match: {name: "mlp$"}
              replace: {class: KMoEBlock, kwargs: {generate_device: cpu, prefill_device: "cuda:1"}}
        """)


def test_unavailable_device_names_the_rule(tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from ktransformers import load_model

    rules = "- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear, device: 'cuda:0'}\n"
    d = tiny_model_dir("llama")
    with pytest.raises(RuleError, match=r"<string>:1: rule #0.*'lm_head' on cuda:0.*no CUDA device; run the rule file "
                                        r"with --device_map cuda=cpu \(device_map='cuda=cpu' in Python\)"):
        load_model(d, model_path=d, rules=rules)
    # the fix it names works
    model = load_model(d, model_path=d, rules=rules, device_map="cuda=cpu")
    assert model.kt_plan.placements["lm_head"].generate_device == torch.device("cpu")


def test_rules_from_list_of_dicts():
    rules = load_rules([{"match": {"name": "^lm_head$"}, "replace": {"class": "KTransformersLinear"}}])
    assert rules[0].replace_class.__name__ == "KTransformersLinear"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ktransformers.optimize", *args], capture_output=True, text=True)


def test_cli_check_ok_and_error(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear}\n")
    r = _cli("check", str(good))
    assert r.returncode == 0 and "1 rule(s), all valid" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear, kwargs: {generate_op: Nope}}\n")
    r = _cli("check", str(bad))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {bad}:2: rule #0 (replace.kwargs.generate_op)")
    assert "Traceback" not in r.stderr


def test_cli_explain_fails_on_rule_matching_nothing(tmp_path, tiny_model_dir):
    rules = tmp_path / "r.yaml"
    rules.write_text("- match: {name: '^lm_head$'}\n  replace: {class: KTransformersLinear}\n"
                     "- match: {name: 'shared_expert'}\n  replace: {class: default}\n")
    d = tiny_model_dir("qwen3_moe")
    r = _cli("explain", str(rules), "--model_path", str(d))
    assert r.returncode == 2
    assert "rule #1: matches no module of Qwen3MoeForCausalLM" in r.stderr
    assert "<-- matches nothing" in r.stdout
    r = _cli("explain", str(rules), "--model_path", str(d), "--allow-unmatched")
    assert r.returncode == 0, r.stderr


def test_transfer_map_is_checked_against_placement(tiny_model_dir):
    from ktransformers import load_model

    d = tiny_model_dir("llama")
    rules = """
- match: {name: "^model$"}
  replace:
    class: KTransformersModel
    kwargs: {generate_device: cpu, transfer_map: {1: "cuda:0"}}
"""
    with pytest.raises(RuleError, match=r"transfer_map puts layer 1 on cuda:0, but the rules place 'model.layers.1' on cpu"):
        load_model(d, model_path=d, rules=rules)
    agreeing = rules.replace('{1: "cuda:0"}', "{1: cpu}")
    assert load_model(d, model_path=d, rules=agreeing).kt_plan


def test_op_device_and_op_kwargs_checked_at_parse_time():
    msg = rules_error("- match: {name: x}\n  replace:\n    class: KTransformersExperts\n"
                      "    kwargs: {generate_op: KExpertsCPU, generate_device: 'cuda:0'}\n")
    assert "(replace.kwargs.generate_op)" in msg and "KExpertsCPU runs only on cpu, not cuda:0" in msg
    msg = rules_error("- match: {name: x}\n  replace:\n    class: KTransformersExperts\n"
                      "    device: cuda\n    kwargs: {generate_op: KExpertsCPU}\n")
    assert "runs only on cpu" in msg
    msg = rules_error("- match: {name: x}\n  replace:\n    class: KTransformersExperts\n"
                      "    kwargs: {generate_op: KExpertsTorch, backend: AMXInt8}\n")
    assert "(replace.kwargs.backend)" in msg and "only KExpertsCPU take(s) 'backend'" in msg
    assert "this rule's ops are KExpertsTorch" in msg
