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

from ._util import losses_of, write_config, write_trainable_tiny_model

FAMILIES = {"Qwen3Moe": "qwen3_moe", "Qwen2Moe": "qwen2_moe", "DeepSeek-V3": "deepseek_v3"}
MLA_LINEARS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FILES = sorted(SFT_RULES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_training_rules_place_the_family(path):
    from ktransformers.operators.registry import operators

    if KERNEL_OPERATOR in path.read_text() and KERNEL_OPERATOR not in operators():
        pytest.skip(f"{KERNEL_OPERATOR} is not in this build")
    arch = FAMILIES[path.stem.split("-sft")[0]]
    model = build_model(tiny_config(arch))
    plan = plan_model(model, path)
    assert not plan.unmatched_rules()
    experts = [p for n, p in plan.placements.items() if n.endswith("mlp.experts")]
    assert experts and all(p.operator is not None and "SFT" in p.operator.__name__ for p in experts)
    attn = [p for n, p in plan.placements.items() if ".self_attn." in n and n.endswith("_proj")]
    assert attn and all(p.operator is None for p in attn)  # plain nn.Linear (MLA's too): PEFT wraps them


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


def test_default_training_rules_by_architecture():
    """Without kt_optimize_rule: the family's shipped file, the CPU-only one without CUDA; DeepSeek-V3's
    serve Kimi-K2 and Moonlight too (their checkpoints name the same DeepseekV3ForCausalLM)."""
    from ktransformers.errors import ConfigError
    from ktransformers.sft.model import training_rule_file

    for stem, arch in FAMILIES.items():
        cfg = tiny_config(arch)
        assert training_rule_file(cfg, cuda=False) == SFT_RULES_DIR / f"{stem}-sft-cpu.yaml"
        assert training_rule_file(cfg, cuda=True) == SFT_RULES_DIR / f"{stem}-sft.yaml"
    with pytest.raises(ConfigError, match="kt_optimize_rule: no shipped training rules for MixtralForCausalLM"):
        training_rule_file(tiny_config("mixtral"), cuda=False)


def test_deepseek_v3_trains_end_to_end_and_peft_loads_the_adapter(tmp_path):
    """``python -m ktransformers.sft`` on a tiny DeepSeek-V3 with the rules it picks itself (CPU
    kernels): the loss halves, the adapter (MLA linears + routed experts) loaded by PEFT into the
    unmodified transformers model gives our logits with the adapter."""
    import json
    import subprocess
    import sys

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ktransformers.operators.registry import operators
    from ktransformers.loading import load_for_generation

    if KERNEL_OPERATOR not in operators():
        pytest.skip(f"{KERNEL_OPERATOR} is not in this build")
    model_dir = write_trainable_tiny_model(tmp_path / "tiny-ds3", "deepseek_v3")
    out = tmp_path / "o"
    cfg = write_config(tmp_path, model_dir, out, max_steps=30, learning_rate=5e-3, save_steps=100,
                       kt_optimize_rule=None)
    r = subprocess.run([sys.executable, "-m", "ktransformers.sft", str(cfg)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DeepSeek-V3-sft-cpu.yaml" in r.stdout + r.stderr
    losses = losses_of(out)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 <= losses[0] / 2, losses
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(acfg["target_modules"]) == sorted(MLA_LINEARS)
    assert acfg["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                                   str(out)).eval()
    loaded = load_for_generation(model_dir, model_dir, SFT_RULES_DIR / "DeepSeek-V3-sft-cpu.yaml", device="cpu",
                                 lora=out)
    assert hasattr(loaded.model.model.layers[1].self_attn.kv_b_proj, "lora_A")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, pm(ids).logits, atol=1e-4, rtol=1e-4)


def test_names_peft_reads_as_experts_are_refused(tmp_path, tiny_model_dir, capsys):
    """On DeepSeek-V3 PEFT takes gate_proj/up_proj/down_proj for the routed experts' old names (and
    retargets them when it loads an adapter), so the dense and shared-expert linears of those names
    cannot carry an adapter: 'all' leaves them out, naming one is a one-line error, exit 2."""
    from ktransformers.sft.__main__ import main as sft_main

    model_dir = tiny_model_dir("deepseek_v3")
    cfg = write_config(tmp_path, model_dir, tmp_path / "o", lora_target="q_a_proj,gate_proj", max_steps=1,
                       kt_optimize_rule=str(SFT_RULES_DIR / "DeepSeek-V3-sft-torch-cpu.yaml"))
    assert sft_main([str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: lora_target: 'gate_proj': PEFT reads this name on deepseek_v3 models as the "
                              "routed experts'"), err[-1]
