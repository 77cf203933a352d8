"""The shipped training rules: they place every family module, the experts on a training operator,
and (torch variant, runnable here) train and serve with an adapter that PEFT reads the same way."""

from __future__ import annotations

import pytest
import torch

from ktransformers.optimize import build_model, plan_model
from ktransformers.sft import torch_experts  # noqa: F401 - registers KSFTExpertsTorch
from ktransformers.sft.__main__ import main
from ktransformers.sft.model import KERNEL_OPERATOR, SFT_RULES_DIR
from ktransformers.util.tiny_models import tiny_config

from ._util import write_config

FAMILIES = {"Qwen3Moe": "qwen3_moe", "Qwen2Moe": "qwen2_moe"}
FILES = sorted(SFT_RULES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_training_rules_place_the_family(path):
    from ktransformers.operators.registry import operators

    if KERNEL_OPERATOR in path.read_text() and KERNEL_OPERATOR not in operators():
        pytest.skip(f"{KERNEL_OPERATOR} is not in this build")
    arch = FAMILIES[path.stem.split("-")[0]]
    model = build_model(tiny_config(arch))
    plan = plan_model(model, path)
    assert not plan.unmatched_rules()
    experts = [p for n, p in plan.placements.items() if n.endswith("mlp.experts")]
    assert experts and all(p.operator is not None and "SFT" in p.operator.__name__ for p in experts)
    attn = plan.placements["model.layers.0.self_attn.q_proj"]
    assert attn.operator is None  # a plain nn.Linear: PEFT wraps it


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_qwen2_moe_trains_and_serves_with_the_adapter(tmp_path, tiny_model_dir):
    """Qwen2-MoE (gated shared expert): a few steps, then our inference with the adapter (the server's
    load path) against PEFT on the unmodified model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ktransformers.generation import SamplingParams
    from ktransformers.server.main import build_engine, parse_settings

    model_dir = tiny_model_dir("qwen2_moe")
    rules = SFT_RULES_DIR / "Qwen2Moe-sft-torch-cpu.yaml"
    out = tmp_path / "o"
    assert main([str(write_config(tmp_path, model_dir, out, max_steps=4, learning_rate=2e-2, save_steps=100,
                                  kt_optimize_rule=str(rules)))]) == 0
    engine = build_engine(parse_settings(["--model_path", str(model_dir), "--lora_path", str(out),
                                          "--optimize_config_path", str(rules), "--cpu_infer", "1"]))
    model = engine.generator.model
    assert hasattr(model.model.layers[0].mlp.experts, "lora_A_gate_up_proj")
    ids = torch.randint(0, 300, (1, 12))
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, pm(ids).logits, atol=1e-4, rtol=1e-4)
        ref = pm.generate(input_ids=ids, max_new_tokens=5, do_sample=False)[0, 12:].tolist()
    _, got, _ = engine.generator.generate(ids[0].tolist(), SamplingParams(max_new_tokens=5))
    assert got == ref[:len(got)] and got  # (the answer may stop early at EOS)
