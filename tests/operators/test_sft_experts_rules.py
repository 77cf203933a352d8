"""KSFTExpertsCPU in rule files and its LoRA API: names resolve, bad values are one-line errors."""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import RuleError
from ktransformers.optimize import parse_rules

from .test_sft_experts_models import sft_experts, sft_rules


def _rule(kwargs: str, cls: str = "KSFTExpertsCPU") -> str:
    return f"- match: {{name: x}}\n  replace:\n    class: {cls}\n    kwargs: {{{kwargs}}}\n"


def test_names_resolve():
    """The reference system's training op name, bare or under any ktransformers.operators module."""
    from ktransformers.operators.registry import resolve_operator
    from ktransformers.operators.sft_experts import KSFTExpertsCPU

    for cls in ("KSFTExpertsCPU", "ktransformers.operators.experts.KSFTExpertsCPU"):
        assert resolve_operator(cls).cls is KSFTExpertsCPU
        parse_rules(_rule("backend: AMXInt8", cls))
    assert parse_rules(_rule("backend: llamafile, recompute: true"))[0].kwargs["recompute"] is True


def test_rule_errors():
    with pytest.raises(RuleError, match=r"\(replace.kwargs.backend\).*'AMXint8'.*did you mean 'AMXInt8'"):
        parse_rules(_rule("backend: AMXint8"))
    with pytest.raises(RuleError, match="KSFTExpertsCPU has no op 'KExpertsTorch'"):
        parse_rules(_rule("generate_op: KExpertsTorch"))
    with pytest.raises(RuleError, match="recompute"):
        parse_rules(_rule("recompute: 3"))


@pytest.fixture(scope="module")
def experts(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    return sft_experts(load_model(d, model_path=d, rules=sft_rules("qwen3_moe")))["model.layers.0.mlp.experts"]


def test_add_lora_errors(experts):
    with pytest.raises(ValueError, match="lora_dropout 0 only"):
        experts.add_lora(4, 8, 0.1)
    with pytest.raises(ValueError, match="target 'gate_up_proj'"):
        experts.add_lora(4, 8, 0.0, ["gate_proj"])
    with pytest.raises(ValueError, match="'q_proj' is not an expert parameter"):
        experts.add_lora(4, 8, 0.0, ["q_proj"])
    with pytest.raises(ValueError, match="rank must be a positive int"):
        experts.add_lora(0, 8)
    with pytest.raises(ValueError, match="add_lora before"):
        experts.load_lora_state_dict({})


def test_lora_state_dict_round_trip_and_errors(experts):
    experts.add_lora(2, 4, 0.0, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    sd = experts.lora_state_dict()
    E, H, I = 8, 64, 32
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "base_layer.lora_A.weight": (2 * E, H), "base_layer.lora_B.weight": (2 * I, 2 * E),
        "lora_A.weight": (2 * E, I), "lora_B.weight": (H, 2 * E)}
    assert torch.all(sd["lora_B.weight"] == 0) and sd["lora_A.weight"].abs().sum() > 0  # PEFT's init
    new = {k.replace(".weight", ".default.weight"): torch.full_like(v, 0.5)  # in-memory names
           for k, v in sd.items()}
    experts.load_lora_state_dict(new)
    assert all(torch.all(v == 0.5) for v in experts.lora_state_dict().values())
    with pytest.raises(ValueError, match="unexpected expert LoRA key 'lora_C.weight'"):
        experts.load_lora_state_dict({**sd, "lora_C.weight": sd["lora_A.weight"]})
    with pytest.raises(ValueError, match=r"'lora_A.weight' has shape \[1, 2\], expected \[16, 32\]"):
        experts.load_lora_state_dict({**sd, "lora_A.weight": torch.zeros(1, 2)})
    with pytest.raises(ValueError, match="lacks base_layer.lora_B.weight"):
        experts.load_lora_state_dict({k: v for k, v in sd.items() if k != "base_layer.lora_B.weight"})
    with pytest.raises(ValueError, match="already added"):
        experts.add_lora(2, 4)
