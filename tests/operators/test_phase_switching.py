"""Prefill and generate ops really run (not dormant) and agree."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.operators.experts import EXPERTS_OPS, KExpertsTorch
from ktransformers.operators.linear import LINEAR_OPS, KLinearTorch

CALLS: list[tuple[str, str, int]] = []


class _RecordingLinear(KLinearTorch):
    name = "TestRecordingLinear"

    def forward(self, x):
        CALLS.append((self.name, self.key, x.numel() // x.shape[-1]))
        return super().forward(x)


class _RecordingExperts(KExpertsTorch):
    name = "TestRecordingExperts"

    def forward(self, x, idx, w):
        CALLS.append((self.name, self.key, x.shape[0]))
        return super().forward(x, idx, w)


RULES = """
- match: {name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp$"}
  replace: {class: KMoEBlock, device: cpu}
- match: {name: "^model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\.experts$"}
  replace:
    class: KTransformersExperts
    kwargs: {generate_op: KExpertsTorch, prefill_op: TestRecordingExperts, prefill_threshold: 4}
  recursive: false
- match: {name: "^lm_head$"}
  replace:
    class: KTransformersLinear
    kwargs: {generate_op: KLinearTorch, prefill_op: TestRecordingLinear, prefill_threshold: 4}
"""


def test_prefill_op_runs_for_long_calls_and_generate_op_for_decode(tiny_model_dir):
    LINEAR_OPS[_RecordingLinear.name] = _RecordingLinear
    EXPERTS_OPS[_RecordingExperts.name] = _RecordingExperts
    try:
        d = tiny_model_dir("qwen3_moe")
        model = load_model(d, model_path=d, rules=RULES, allow_unmatched=False)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        experts = model.model.layers[0].mlp.experts
        assert experts.prefill_op is not experts.generate_op  # two ops, two weight copies
        ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
        CALLS.clear()
        with torch.no_grad():
            out = model(ids).logits
        assert experts.last_phase == "prefill" and model.lm_head.last_phase == "prefill"
        assert {c[1] for c in CALLS} == {"lm_head", "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
        assert all(n == 10 for _, _, n in CALLS)
        with torch.no_grad():
            assert torch.allclose(out, hf(ids).logits, atol=1e-5)
        CALLS.clear()
        gen = model.generate(ids, max_new_tokens=6, do_sample=False)
        # the prompt went through the experts' prefill op once per layer, the 5 decode steps through
        # the generate op; generate() keeps only the last position's logits, so lm_head sees 1 token
        assert sorted(CALLS) == [("TestRecordingExperts", f"model.layers.{i}.mlp.experts", 10) for i in (0, 1)]
        assert experts.last_phase == "generate" and model.lm_head.last_phase == "generate"
        assert torch.equal(gen, hf.generate(ids, max_new_tokens=6, do_sample=False))
    finally:
        LINEAR_OPS.pop(_RecordingLinear.name, None)
        EXPERTS_OPS.pop(_RecordingExperts.name, None)


def test_prefill_op_null_uses_generate_op(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    rules = RULES.replace("prefill_op: TestRecordingExperts", "prefill_op: null")
    rules = rules.replace("prefill_op: TestRecordingLinear", "prefill_op: null")
    model = load_model(d, model_path=d, rules=rules)
    assert model.lm_head.prefill_op is None
    with torch.no_grad():
        model(torch.zeros(1, 10, dtype=torch.long))
    assert model.lm_head.last_phase == "generate"


def test_same_op_same_device_shares_weights(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d)
    e = model.model.layers[0].mlp.experts
    assert e.prefill_op is e.generate_op
