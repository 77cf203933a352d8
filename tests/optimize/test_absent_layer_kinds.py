"""A family's rule file may carry rules for layer kinds a given configuration lacks (the reference
system's Qwen3-MoE file has a dense-MLP rule, and released Qwen3-MoE models are sparse in every
layer): such a rule is a note, not an error; a rule that matches nothing for any other reason
(a name that misses modules of its class, a class of another family) stays an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ktransformers import load_model
from ktransformers.errors import RuleError

ROOT = Path(__file__).resolve().parents[2]
MOE = "transformers.models.qwen3_moe.modeling_qwen3_moe"
BASE = f"""
- match: {{class: {MOE}.Qwen3MoeSparseMoeBlock}}
  replace: {{class: KMoEBlock}}
- match: {{name: "^model\\\\.layers\\\\..*\\\\.mlp\\\\.experts$"}}
  replace: {{class: KTransformersExperts, kwargs: {{generate_op: KExpertsTorch}}}}
"""
DENSE_MLP_RULE = f"""
- match: {{class: {MOE}.Qwen3MoeMLP}}
  replace: {{class: KMLP}}
"""


def _explain(rules: Path, model_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ktransformers.optimize", "explain", str(rules), "--model_path",
                           str(model_dir), "--compact"], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})


def test_a_rule_for_a_layer_kind_this_config_lacks_is_a_note(tmp_path, tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")  # every layer sparse: no Qwen3MoeMLP module
    rules = tmp_path / "r.yaml"
    rules.write_text(BASE + DENSE_MLP_RULE)
    model = load_model(d, model_path=d, rules=str(rules), allow_unmatched=False)
    assert model.kt_plan.unmatched_rules() == []
    assert model.kt_plan.absent_kind_notes() == [
        f"{rules}:7: rule #2: matches nothing: this Qwen3MoeForCausalLM has no Qwen3MoeMLP module"]
    r = _explain(rules, d)
    assert r.returncode == 0, r.stderr
    assert "has no Qwen3MoeMLP module" in r.stdout


def test_the_same_rule_matches_where_the_config_has_dense_layers(tmp_path):
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path / "dense0"
    write_tiny_model("qwen3_moe", d, mlp_only_layers=[0])
    rules = tmp_path / "r.yaml"
    rules.write_text(BASE + DENSE_MLP_RULE)
    model = load_model(d, model_path=d, rules=str(rules), allow_unmatched=False)
    assert model.kt_plan.absent_kind_notes() == []
    assert model.kt_plan.matches[2] == ["model.layers.0.mlp"]


def test_a_name_that_misses_modules_of_its_class_is_still_an_error(tmp_path, tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    rules = tmp_path / "r.yaml"
    rules.write_text(BASE + f"""
- match: {{name: "^model\\\\.layers\\\\.0\\\\.mlpX$", class: {MOE}.Qwen3MoeSparseMoeBlock}}
  replace: {{class: KMoEBlock}}
""")
    with pytest.raises(RuleError, match=r"r\.yaml:7: rule #2: matches no module of Qwen3MoeForCausalLM"):
        load_model(d, model_path=d, rules=str(rules), allow_unmatched=False)
    r = _explain(rules, d)
    assert r.returncode == 2 and "rule #2: matches no module" in r.stderr


def test_a_class_of_another_family_is_still_an_error(tmp_path, tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    rules = tmp_path / "r.yaml"
    rules.write_text(BASE + """
- match: {class: transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP}
  replace: {class: KMLP}
""")
    with pytest.raises(RuleError, match="rule #2: matches no module of Qwen3MoeForCausalLM"):
        load_model(d, model_path=d, rules=str(rules), allow_unmatched=False)
